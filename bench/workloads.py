"""Seeded workloads and traces for the planner benchmark (fixed before any figure was taken).

- ``gigascope_matrix``: a predicates × queries matrix shaped like Figure 6 of the prefilter
  paper: 50 queries (LFTAs) of which 4 have no cheap predicate, 14 shared predicates used by
  families of queries (one family uses 6), 33 predicates used by one query each; sparse.
- ``gigascope_sql``: that matrix as flowsieve queries over real packet fields.
- ``random_matrix``: uniform random sparse matrices.
- ``trace``: a TupleBatch of synthetic packets with a realistic mix (TCP/UDP/ICMP, IPv4/IPv6,
  Zipf-distributed hosts and ports, VLANs, fragments).
"""

from __future__ import annotations

import struct

import numpy as np

from capture.batch import TupleBatch
from capture.fields import NULL_INT, PACKET_INT_FIELDS, PACKET_INT_INDEX

SEED = 20261121

# Shared predicates, most popular first (row i of the matrix is SHARED[i]).
SHARED = [
    "protocol = 6", "ip_version = 4", "frag_offset = 0", "in_prefix(dst_ip, '10.0.0.0/8')",
    "dont_fragment = 1", "tos = 0", "in_prefix(src_ip, '10.0.0.0/8')", "ttl >= 32",
    "tcp_flags = 16", "more_fragments = 0", "eth_type = 2048", "vlan = 10", "wirelen > 100",
    "dst_port < 1024",
]
WELL_KNOWN = [80, 443, 53, 22, 25, 123, 8080, 110, 143, 993, 3306, 5432, 6379, 389, 445, 21,
              23, 161, 179, 500, 514, 853, 1194, 1812, 3389]
SPECIFIC = ([f"dst_port = {p}" for p in WELL_KNOWN[:15]]
            + [f"src_port = {p}" for p in WELL_KNOWN[:8]]
            + [f"in_prefix(dst_ip, '10.1.{k}.0/24')" for k in range(5)]
            + [f"vlan = {v}" for v in (20, 30, 40, 50, 100)])


def _attr(row: int) -> str:
    text = (SHARED + SPECIFIC)[row]
    return text.split("(")[1].split(",")[0] if text.startswith("in_prefix") else text.split()[0]


def _conflict(a: int, b: int) -> bool:
    """Two predicates on one attribute that cannot hold together (only the 10/8 prefix and a
    10.1.k.0/24 prefix, and dst_port < 1024 with a port below 1024, can)."""
    if _attr(a) != _attr(b):
        return False
    texts = sorted([(SHARED + SPECIFIC)[a], (SHARED + SPECIFIC)[b]])
    if texts[0].startswith("dst_port <") or texts[1].startswith("dst_port <"):
        port = int([t for t in texts if "=" in t][0].split("=")[1])
        return port >= 1024
    return not ("10.0.0.0/8" in texts[0] or "10.0.0.0/8" in texts[1])


def gigascope_matrix(seed: int = SEED) -> dict[int, set[int]]:
    """Row (predicate index: 0-13 shared, 14-46 specific) -> queries (0-49) using it."""
    rng = np.random.default_rng(seed)
    queries = list(range(50))
    empty = set(rng.choice(50, 4, replace=False).tolist())
    live = [q for q in queries if q not in empty]
    rng.shuffle(live)
    families, i = [], 0
    while i < len(live):
        size = int(rng.choice([1, 2, 2, 3, 4]))
        families.append(live[i:i + size])
        i += size
    weights = 1.0 / np.arange(1, 15)
    weights /= weights.sum()
    rows: dict[int, set[int]] = {r: set() for r in range(47)}
    for k, fam in enumerate(families):
        n_shared = 6 if k == 0 else int(min(6, 1 + rng.binomial(4, 0.3)))
        for r in rng.choice(14, n_shared, replace=False, p=weights):
            rows[int(r)].update(fam)
    for r in range(14):  # every shared row is shared
        while len(rows[r]) < 2:
            rows[r].update(families[int(rng.integers(len(families)))])
    # each specific predicate occurs in one query; a query may hold several (e.g. a port and a
    # prefix), never two on one attribute or one that contradicts its shared predicates
    for r in range(14, 47):
        for _ in range(1000):
            q = int(rng.choice(live))
            if not any(q in rows[o] and _conflict(r, o) for o in range(47) if o != r):
                rows[r].add(q)
                break
        else:
            raise RuntimeError("no query can take specific predicate {r}")
    return rows


def gigascope_sql(seed: int = SEED) -> str:
    """The Gigascope-shaped matrix as 50 selection queries over packet fields."""
    rows = gigascope_matrix(seed)
    texts = SHARED + SPECIFIC
    stmts = []
    for q in range(50):
        preds = [texts[r] for r in sorted(rows) if q in rows[r]]
        where = f" WHERE {' AND '.join(preds)}" if preds else ""
        stmts.append(f"-- name: q{q:02d}\nSELECT ts FROM packets{where};")
    return "\n".join(stmts)


def random_matrix(p: int, n: int, density: float, seed: int) -> dict[int, set[int]]:
    rng = np.random.default_rng(seed)
    m = rng.random((p, n)) < density
    return {i: set(np.flatnonzero(m[i]).tolist()) for i in range(p) if m[i].any()}


def _zipf_choice(rng, values, n, a=1.2):
    ranks = np.arange(1, len(values) + 1, dtype=np.float64)
    w = ranks ** -a
    return np.asarray(values)[rng.choice(len(values), n, p=w / w.sum())]


def trace(n: int = 1_000_000, seed: int = SEED, drift: bool = False) -> TupleBatch:
    """Synthetic packet tuples; with ``drift`` the second half shifts its protocol and port
    mix (for adaptive ordering)."""
    rng = np.random.default_rng(seed)
    ints = np.full((len(PACKET_INT_FIELDS), n), NULL_INT, dtype=np.int32)

    def col(name, values):
        ints[PACKET_INT_INDEX[name]] = values

    v6 = rng.random(n) < 0.1
    proto = rng.choice([6, 17, 1, 47], n, p=[0.6, 0.3, 0.05, 0.05])
    if drift:
        half = n // 2
        proto[half:] = rng.choice([6, 17, 1, 47], n - half, p=[0.2, 0.7, 0.05, 0.05])
    proto[v6 & (proto == 1)] = 58
    col("iface", np.zeros(n, np.int32))
    wirelen = np.where(rng.random(n) < 0.5, rng.integers(60, 120, n),
                       rng.integers(120, 1515, n)).astype(np.int32)
    col("caplen", wirelen)
    col("wirelen", wirelen)
    col("eth_type", np.where(v6, 0x86DD, 0x0800))
    vlan = np.where(rng.random(n) < 0.3, rng.choice([10, 20, 30, 40, 50, 100], n), NULL_INT)
    col("vlan", vlan)
    col("ip_version", np.where(v6, 6, 4))
    col("protocol", proto)
    col("ttl", rng.choice([64, 128, 255, 32, 30, 1], n, p=[0.45, 0.3, 0.1, 0.05, 0.05, 0.05]))
    col("tos", np.where(rng.random(n) < 0.8, 0, rng.integers(1, 256, n)))
    col("ip_id", rng.integers(0, 65536, n))
    frag = rng.random(n) < 0.01
    col("frag_offset", np.where(frag, rng.integers(1, 100, n) * 8, 0))
    col("more_fragments", (rng.random(n) < 0.01).astype(np.int32))
    col("dont_fragment", (rng.random(n) < 0.7).astype(np.int32))
    l4 = np.isin(proto, [6, 17]) & ~frag
    server = _zipf_choice(rng, WELL_KNOWN, n)
    if drift:
        server[n // 2:] = _zipf_choice(rng, WELL_KNOWN[::-1], n - n // 2)
    ephemeral = rng.integers(1024, 65536, n)
    to_server = rng.random(n) < 0.55
    col("dst_port", np.where(l4, np.where(to_server, server, ephemeral), NULL_INT))
    col("src_port", np.where(l4, np.where(to_server, ephemeral, server), NULL_INT))
    flags = rng.choice([16, 24, 2, 18, 17, 4], n, p=[0.5, 0.3, 0.05, 0.05, 0.05, 0.05])
    col("tcp_flags", np.where((proto == 6) & ~frag, flags, NULL_INT))
    icmp = np.isin(proto, [1, 58])
    col("icmp_type", np.where(icmp, rng.choice([0, 8, 3, 11], n), NULL_INT))
    col("icmp_code", np.where(icmp, 0, NULL_INT))
    hosts_local = [(10 << 24) | (1 << 16) | (k % 5 << 8) | (k % 250 + 1) for k in range(500)]
    hosts_local += [(10 << 24) | int(x) for x in rng.integers(0, 1 << 24, 1500)]
    hosts_remote = [int(x) for x in rng.integers(1 << 24, 223 << 24, 3000)]
    src, dst = np.zeros((n, 16), np.uint8), np.zeros((n, 16), np.uint8)
    for arr in (src, dst):
        local = rng.random(n) < 0.4
        addr = np.where(local, _zipf_choice(rng, hosts_local, n),
                        _zipf_choice(rng, hosts_remote, n)).astype(np.uint32)
        arr[:, 10] = arr[:, 11] = 0xFF
        arr[:, 12:16] = addr.astype(">u4").view(np.uint8).reshape(n, 4)
        six = np.flatnonzero(v6)
        arr[six, :] = 0
        arr[six, 0], arr[six, 1] = 0x20, 0x01
        arr[six, 8:16] = rng.integers(0, 256, (len(six), 8), dtype=np.uint8)
    ts = 1_700_000_000 * 10**9 + np.arange(n, dtype=np.int64) * 10_000
    return TupleBatch("packets", ts, ints, {"src_ip": src, "dst_ip": dst})


# ------------------------------------------------------------------ packet bytes (capture bench)
DNS_NAMES = ["www.google.com", "en.wikipedia.org", "api.github.com", "cdn.example.net",
             "mail.example.org", "time.apple.com", "ocsp.digicert.com", "a.root-servers.net",
             "update.microsoft.com", "s3.amazonaws.com", "xn--bcher-kva.example",
             "very.long.subdomain.chain.of.labels.example.com"]


def _dns_query(name: str, qid: int, response: bool) -> bytes:
    q = b"".join(bytes([len(lab)]) + lab.encode() for lab in name.split(".")) + b"\0"
    flags = 0x8180 if response else 0x0100
    return struct.pack(">HHHHHH", qid, flags, 1, 1 if response else 0, 0, 0) + q + \
        b"\0\x01\0\x01" + (b"\xc0\x0c\0\x01\0\x01\0\0\x0e\x10\0\x04\x5d\xb8\xd8\x22"
                           if response else b"")


def packet_trace(path, n: int = 1_000_000, seed: int = SEED) -> None:
    """A pcap of ``n`` whole Ethernet frames, a realistic mix: 45 % TCP web over IPv4, 20 %
    DNS over UDP/IPv4, 12 % IPv6 (TCP, UDP DNS, ICMPv6), 10 % 802.1Q-tagged TCP, 2 % QinQ,
    4 % ICMP, 1 % IPv4 fragments, 3 % other UDP, 3 % ARP; Zipf-distributed hosts and ports;
    frame sizes from 60 to 1514 bytes (whole frames, as a NIC captures them)."""
    rng = np.random.default_rng(seed)
    kinds = rng.choice(10, n, p=[0.45, 0.20, 0.12, 0.10, 0.02, 0.04, 0.01, 0.03, 0.03, 0.0])
    hosts4 = [int(x) for x in rng.integers(1 << 24, 223 << 24, 4000)]
    src4 = _zipf_choice(rng, hosts4, n)
    dst4 = _zipf_choice(rng, hosts4, n)
    server = _zipf_choice(rng, [443, 80, 8080, 8443, 22, 25, 993], n)
    eph = rng.integers(1024, 65536, n)
    size = np.where(rng.random(n) < 0.45, rng.integers(60, 100, n), rng.integers(100, 1515, n))
    flags = rng.choice([16, 24, 2, 18, 17, 4], n, p=[0.5, 0.3, 0.05, 0.05, 0.05, 0.05])
    names = rng.integers(0, len(DNS_NAMES), n)
    ttl = rng.choice([64, 128, 255, 57], n)
    six = [bytes(rng.integers(0, 256, 16, dtype=np.uint8)) for _ in range(500)]
    mac = b"\x00\x1b\x21\x3a\x4f\x10\x00\x0c\x29\x9d\x5e\x01"
    ts0 = 1_700_000_000
    with open(path, "wb") as fh:
        fh.write(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1))
        out = bytearray()
        for i in range(n):
            k = int(kinds[i])
            s4 = struct.pack(">I", int(src4[i]))
            d4 = struct.pack(">I", int(dst4[i]))
            up = i % 2 == 0
            sp, dp = (int(eph[i]), int(server[i])) if up else (int(server[i]), int(eph[i]))
            eth = mac + b"\x08\x00"
            if k in (0, 3, 4):  # TCP web, plain, 802.1Q, QinQ
                if k == 3:
                    eth = mac + b"\x81\x00" + struct.pack(">H", 100 + i % 8) + b"\x08\x00"
                elif k == 4:
                    eth = mac + b"\x88\xa8\x00\xc8\x81\x00" + struct.pack(">H", 2000 + i % 4) \
                        + b"\x08\x00"
                l4 = struct.pack(">HHIIBBHHH", sp, dp, i, i * 7, 0x50, int(flags[i]), 65535, 0,
                                 0)
                proto, payload = 6, b""
            elif k == 1 or k == 7:  # DNS or other UDP
                if k == 1:
                    resp = i % 2 == 1
                    sp, dp = (53, int(eph[i])) if resp else (int(eph[i]), 53)
                    payload = _dns_query(DNS_NAMES[int(names[i])], i & 0xFFFF, resp)
                else:
                    sp, dp = int(eph[i]), int(rng.integers(1024, 65536))
                    payload = b""
                l4 = struct.pack(">HHHH", sp, dp, 8 + len(payload), 0)
                proto = 17
            elif k == 5:  # ICMP echo
                l4, proto, payload = struct.pack(">BBHHH", 8, 0, 0, i & 0xFFFF, 1), 1, b""
            elif k == 6:  # IPv4 non-first fragment
                l4, proto, payload = b"", 17, b""
            elif k == 8:  # ARP
                frame = mac[:6] + b"\xff" * 0 + mac[6:] + b"\x08\x06" + struct.pack(
                    ">HHBBH", 1, 0x0800, 6, 4, 1) + mac[6:] + s4 + b"\0" * 6 + d4
                frame += b"\0" * (60 - len(frame))
                out += struct.pack("<IIII", ts0 + i // 10000, (i % 10000) * 100, len(frame),
                                   len(frame)) + frame
                continue
            if k == 2:  # IPv6: TCP, DNS over UDP or ICMPv6
                sub = i % 3
                if sub == 0:
                    l4 = struct.pack(">HHIIBBHHH", sp, dp, i, 0, 0x50, int(flags[i]), 65535, 0,
                                     0)
                    nh, payload = 6, b""
                elif sub == 1:
                    payload = _dns_query(DNS_NAMES[int(names[i])], i & 0xFFFF, False)
                    l4 = struct.pack(">HHHH", int(eph[i]), 53, 8 + len(payload), 0)
                    nh = 17
                else:
                    l4, nh, payload = struct.pack(">BBHHH", 128, 0, 0, 1, i & 0xFFFF), 58, b""
                body = l4 + payload
                pad = max(0, int(size[i]) - 14 - 40 - len(body))
                body += b"\0" * pad
                if nh == 17:
                    body = body[:4] + struct.pack(">H", len(body)) + body[6:]
                ip = struct.pack(">IHBB", 0x60000000, len(body), nh, 64) + \
                    six[int(src4[i]) % 500] + six[int(dst4[i]) % 500]
                frame = mac + b"\x86\xdd" + ip + body
            else:
                body = l4 + payload
                hdr_len = len(eth) + 20
                pad = max(0, int(size[i]) - hdr_len - len(body))
                body += b"\0" * pad
                if proto == 17 and k != 6:
                    body = body[:4] + struct.pack(">H", len(body)) + body[6:]
                frag = (0x2000 | 185) if k == 6 else 0x4000
                ip = struct.pack(">BBHHHBBH4s4s", 0x45, 0, 20 + len(body), i & 0xFFFF, frag,
                                 int(ttl[i]), proto, 0, s4, d4)
                frame = eth + ip + body
            out += struct.pack("<IIII", ts0 + i // 10000, (i % 10000) * 100, len(frame),
                               len(frame)) + frame
            if len(out) > 1 << 24:
                fh.write(out)
                out = bytearray()
        fh.write(out)
