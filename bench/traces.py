"""Seeded packet traces for the Spark benchmarks, written by numpy (no per-packet Python):

- ``backbone``: shaped like a backbone link. Flows with Pareto sizes (shape 1.2) between hosts
  drawn by Zipf popularity (IPv4 and 15 % IPv6), TCP to a Zipf-chosen service, DNS over UDP
  (query and response), other UDP, ICMP/ICMPv6; packets spread over each flow's life, both
  directions; at least five one-minute windows; 128 bytes captured per packet (the wire length
  is the frame's).
- ``uniform``: FACTS' peer-bench trace: 2,000 hosts in 10.0.0.0/21 uniformly, TCP to the
  services of ``../shared/bench/peer-queries.json``, DNS, ICMP; whole frames (about 430 bytes on
  average, 1.3 GB for 3M packets).

Each writes a pcap and keeps its generator's own arrays (``.npz`` beside it): the benchmark's
truth is computed from them, never from what flowsieve read.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

T0 = 1_700_000_040  # a minute boundary
VERSION = 2  # of the generators: cached traces of another version are made again
ETH_SRC_DST = bytes.fromhex("001b213a4f10000c299d5e01")
DNS_NAMES = ["example.com", "www.google.com", "api.github.com", "cdn.jsdelivr.net",
             "mail.example.org", "ntp.ubuntu.com", "update.microsoft.com",
             "s3.amazonaws.com", "login.live.com", "time.apple.com", "a.root-servers.net",
             "pool.ntp.org"]
SERVICES = np.array([443, 80, 22, 25, 8080, 8443, 993, 3389, 5432, 6379])
TCP_FLAGS = np.array([0x10, 0x18, 0x02, 0x12, 0x11, 0x04])


def _dns_payload(name: str, qid: int, response: bool) -> bytes:
    q = b"".join(bytes([len(lab)]) + lab.encode() for lab in name.split(".")) + b"\0"
    flags = 0x8180 if response else 0x0100
    body = struct.pack(">HHHHHH", qid, flags, 1, 1 if response else 0, 0, 0) + q + b"\0\x01\0\x01"
    if response:
        body += b"\xc0\x0c\0\x01\0\x01\0\0\x0e\x10\0\x04\x5d\xb8\xd8\x22"
    return body


def _put(m: np.ndarray, rows: np.ndarray, at, values, width: int) -> None:
    """Big-endian ``values`` into bytes ``at…at+width`` of ``rows`` (``at`` per row or one)."""
    v = np.broadcast_to(np.asarray(values), rows.shape).astype(f">u{width}")
    b = v.view(np.uint8).reshape(-1, width)
    if np.isscalar(at) or np.ndim(at) == 0:
        m[rows, at:at + width] = b
    else:
        m[rows[:, None], np.asarray(at)[:, None] + np.arange(width)] = b


def frames(p: dict, rows: np.ndarray, snap: int) -> tuple[np.ndarray, np.ndarray]:
    """The first bytes of the frames of packets ``rows`` of arrays ``p`` (a byte matrix; the
    rest of each frame is zeros) and each one's captured length."""
    n = len(rows)
    wire = p["wirelen"][rows].astype(np.int64)
    width = 14 + 40 + 20 + 96  # every header and DNS payload; the rest of a frame is zeros
    m = np.zeros((n, width), np.uint8)
    m[:, :12] = np.frombuffer(ETH_SRC_DST, np.uint8)
    v6 = p["ipv"][rows] == 6
    proto = p["proto"][rows]
    _put(m, np.arange(n), 12, np.where(v6, 0x86DD, 0x0800), 2)
    src, dst = p["src"][rows], p["dst"][rows]
    r4, r6 = np.flatnonzero(~v6), np.flatnonzero(v6)
    # IPv4: version/IHL, TOS, total length, id, DF, TTL, protocol, checksum 0, addresses
    m[r4, 14] = 0x45
    _put(m, r4, 16, wire[r4] - 14, 2)
    _put(m, r4, 18, rows[r4] & 0xFFFF, 2)
    _put(m, r4, 20, 0x4000, 2)
    m[r4, 22] = p["ttl"][rows][r4]
    m[r4, 23] = proto[r4]
    m[r4, 26:30] = src[r4, 12:]
    m[r4, 30:34] = dst[r4, 12:]
    # IPv6: version, payload length, next header, hop limit, addresses
    m[r6, 14] = 0x60
    _put(m, r6, 18, wire[r6] - 54, 2)
    m[r6, 20] = proto[r6]
    m[r6, 21] = p["ttl"][rows][r6]
    m[r6, 22:38] = src[r6]
    m[r6, 38:54] = dst[r6]
    l4 = np.where(v6, 54, 34)
    sport, dport = p["sport"][rows], p["dport"][rows]
    tcp = np.flatnonzero(proto == 6)
    _put(m, tcp, l4[tcp], sport[tcp], 2)
    _put(m, tcp, l4[tcp] + 2, dport[tcp], 2)
    _put(m, tcp, l4[tcp] + 4, rows[tcp] * 1448, 4)
    m[tcp, l4[tcp] + 12] = 0x50
    m[tcp, l4[tcp] + 13] = p["flags"][rows][tcp]
    _put(m, tcp, l4[tcp] + 14, 65535, 2)
    udp = np.flatnonzero(proto == 17)
    _put(m, udp, l4[udp], sport[udp], 2)
    _put(m, udp, l4[udp] + 2, dport[udp], 2)
    _put(m, udp, l4[udp] + 4, wire[udp] - l4[udp], 2)
    icmp = np.flatnonzero((proto == 1) | (proto == 58))
    m[icmp, l4[icmp]] = p["icmp_type"][rows][icmp]
    _put(m, icmp, l4[icmp] + 4, rows[icmp] & 0xFFFF, 2)
    dns = np.flatnonzero(p["qname"][rows] >= 0)
    if len(dns):
        table, lens = dns_table()
        key = p["qname"][rows][dns] * 2 + p["dns_qr"][rows][dns]
        at = l4[dns] + 8
        body = table[key]
        cols = at[:, None] + np.arange(table.shape[1])
        ok = cols < width
        m[np.repeat(dns, ok.sum(axis=1)), cols[ok]] = body[ok]
    return m, np.minimum(wire, snap)


def dns_table() -> tuple[np.ndarray, np.ndarray]:
    """DNS payloads per (name, qr): a query (qr 0) and a response (qr 1), padded."""
    bodies = [_dns_payload(name, 0x1234, bool(qr)) for name in DNS_NAMES for qr in (0, 1)]
    w = max(map(len, bodies))
    table = np.zeros((len(bodies), w), np.uint8)
    for i, b in enumerate(bodies):
        table[i, :len(b)] = np.frombuffer(b, np.uint8)
    return table, np.array([len(b) for b in bodies])


PCAP_HEADER = struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 1 << 16, 1)


def records(p: dict, rows: np.ndarray, ts_us: np.ndarray, snap: int, patch=None) -> bytes:
    """pcap records (16-byte headers and frames) of packets ``rows`` of ``p`` stamped
    ``ts_us``; ``patch(m, rows)`` may rewrite their frame bytes first."""
    m, cap = frames(p, rows, snap)
    if patch is not None:
        patch(m, rows)
    k = len(rows)
    head = np.empty((k, 4), "<u4")
    head[:, 0] = ts_us // 1_000_000
    head[:, 1] = ts_us % 1_000_000
    head[:, 2] = cap
    head[:, 3] = p["wirelen"][rows]
    size = 16 + cap
    off = np.zeros(k + 1, np.int64)
    np.cumsum(size, out=off[1:])
    out = np.zeros(int(off[-1]), np.uint8)
    out[(off[:-1, None] + np.arange(16)).reshape(-1)] = head.view(np.uint8).reshape(-1)
    mask = np.arange(m.shape[1]) < cap[:, None]
    pos = off[:-1, None] + 16 + np.arange(m.shape[1])
    out[pos[mask]] = m[mask]
    return out.tobytes()


def write_pcap(path: Path, p: dict, snap: int, chunk: int = 500_000, patch=None) -> None:
    """The packets of ``p`` (in time order) as a pcap with snap length ``snap``; ``patch(m,
    rows)`` may rewrite a chunk's frame bytes before they are written."""
    n = len(p["ts_us"])
    with open(path, "wb") as fh:
        fh.write(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, snap, 1))
        for lo in range(0, n, chunk):
            rows = np.arange(lo, min(n, lo + chunk))
            fh.write(records(p, rows, p["ts_us"][rows], snap, patch))


def _v4(ints: np.ndarray) -> np.ndarray:
    """IPv4 addresses as 16-byte IPv4-mapped rows."""
    out = np.zeros((len(ints), 16), np.uint8)
    out[:, 10:12] = 0xFF
    out[:, 12:] = ints.astype(">u4").view(np.uint8).reshape(-1, 4)
    return out


def _packets_of_flows(rng, flows: dict, n_target: int, span_s: int) -> dict:
    """Expand flows (one row each) into packets spread over each flow's life, both ways."""
    # random ports never hit DNS's (53, mDNS 5353): flowsieve, like tshark, decodes those as
    # DNS, and only the DNS flows carry DNS payloads
    for k in ("sport", "dport"):
        flows[k] = np.where(np.isin(flows[k], (53, 5353)) & (flows["qname"] < 0), flows[k] + 1,
                            flows[k])
    keep = np.searchsorted(np.cumsum(flows["size"]), n_target * 1.02) + 1
    flows = {k: v[:keep] for k, v in flows.items()}  # enough flows for n_target packets
    size = flows["size"]
    total = int(size.sum())
    f = np.repeat(np.arange(len(size)), size)
    life = np.minimum(rng.exponential(8.0, len(size)), span_s - 1)
    start = rng.uniform(0, span_s - life)
    t = start[f] + rng.uniform(0, 1, total) * life[f]
    back = (rng.random(total) < 0.4) & flows["two_way"][f]
    p = {"ts_us": (T0 * 1_000_000 + (t * 1e6).astype(np.int64))}
    for k in ("ipv", "proto", "ttl", "qname", "icmp_type"):
        p[k] = flows[k][f]
    p["src"] = np.where(back[:, None], flows["dst"][f], flows["src"][f])
    p["dst"] = np.where(back[:, None], flows["src"][f], flows["dst"][f])
    p["sport"] = np.where(back, flows["dport"][f], flows["sport"][f])
    p["dport"] = np.where(back, flows["sport"][f], flows["dport"][f])
    p["dns_qr"] = np.where(p["qname"] >= 0, back.astype(np.int64), -1)
    p["flags"] = np.where(p["proto"] == 6, rng.choice(TCP_FLAGS, total,
                                                      p=[.5, .3, .06, .06, .05, .03]), 0)
    _, lens = dns_table()
    hdr = np.where(p["ipv"] == 6, 54, 34)
    tcp_len = np.where(rng.random(total) < 0.45, 0, rng.integers(1, 1461, total))
    wire = np.where(p["proto"] == 6, hdr + 20 + tcp_len,
                    np.where(p["proto"] == 17, hdr + 8 + rng.integers(20, 1200, total),
                             hdr + 8 + 56))
    dns = p["qname"] >= 0
    wire[dns] = hdr[dns] + 8 + lens[p["qname"][dns] * 2 + p["dns_qr"][dns]]
    p["wirelen"] = np.maximum(wire, 60)
    order = np.argsort(p["ts_us"], kind="stable")[:n_target]  # the first n_target in time
    return {k: v[order] for k, v in p.items()}


def backbone(n: int = 6_000_000, seed: int = 20261123, span_s: int = 300) -> dict:
    """The backbone-shaped trace's packet arrays (see the module docstring)."""
    rng = np.random.default_rng(seed)
    sizes = []
    got = 0
    while got < n * 1.02:  # Pareto flow sizes (heavy tail) until enough packets
        s = np.minimum((rng.pareto(1.2, 200_000) + 1).astype(np.int64), 200_000)
        sizes.append(s)
        got += int(s.sum())
    size = np.concatenate(sizes)
    nf = len(size)
    hosts4 = rng.integers(0x0B000000, 0xDF000000, 200_000)
    hosts6 = rng.integers(0, 256, (20_000, 16), dtype=np.uint8)
    hosts6[:, :2] = (0x20, 0x01)

    def pick(count):  # Zipf popularity over the host pools
        return (rng.zipf(1.15, count) - 1) % len(hosts4)
    kind = rng.choice(4, nf, p=[0.70, 0.12, 0.14, 0.04])  # TCP, DNS, other UDP, ICMP
    v6 = rng.random(nf) < 0.15
    src = np.where(v6[:, None], hosts6[pick(nf) % len(hosts6)], _v4(hosts4[pick(nf)]))
    dst = np.where(v6[:, None], hosts6[pick(nf) % len(hosts6)], _v4(hosts4[pick(nf)]))
    service = SERVICES[np.minimum(rng.zipf(1.6, nf) - 1, len(SERVICES) - 1)]
    flows = {
        "size": np.where(kind == 1, rng.integers(1, 3, nf), size),
        "ipv": np.where(v6, 6, 4), "src": src, "dst": dst,
        "proto": np.choose(kind, [6, 17, 17, np.where(v6, 58, 1)]),
        "sport": np.where(kind == 3, 0, rng.integers(1024, 65536, nf)),
        "dport": np.choose(kind, [service, 53, rng.integers(1024, 65536, nf), 0]),
        "ttl": rng.choice([64, 128, 255, 57], nf),
        "qname": np.where(kind == 1, rng.zipf(1.4, nf) % len(DNS_NAMES), -1),
        "icmp_type": np.where(kind == 3, np.where(v6, 128, 8), 0),
        "two_way": kind != 3,
    }
    # DNS flows are a query and (when two packets) its response
    return _packets_of_flows(rng, flows, n, span_s)


def uniform(n: int = 3_000_000, seed: int = 20261124, span_s: int = 300) -> dict:
    """FACTS' peer-bench trace's packet arrays: 2,000 hosts of 10.0.0.0/21, uniform."""
    rng = np.random.default_rng(seed)
    hosts = 0x0A000000 + rng.choice(2048, 2000, replace=False)
    nf = n // 3
    kind = rng.choice(4, nf, p=[0.78, 0.12, 0.06, 0.04])  # TCP, DNS, other UDP, ICMP
    svc = np.array([80, 443, 22, 25, 8080])
    flows = {
        "size": np.where(kind == 1, 2, rng.integers(1, 12, nf)),
        "ipv": np.full(nf, 4), "src": _v4(hosts[rng.integers(0, 2000, nf)]),
        "dst": _v4(hosts[rng.integers(0, 2000, nf)]),
        "proto": np.choose(kind, [6, 17, 17, 1]),
        "sport": np.where(kind == 3, 0, rng.integers(1024, 65536, nf)),
        "dport": np.choose(kind, [svc[rng.integers(0, 5, nf)], 53,
                                  rng.integers(1024, 65536, nf), 0]),
        "ttl": np.full(nf, 64), "qname": np.where(kind == 1, rng.integers(0, len(DNS_NAMES),
                                                                          nf), -1),
        "icmp_type": np.where(kind == 3, 8, 0), "two_way": kind != 3,
    }
    return _packets_of_flows(rng, flows, n, span_s)


def trace(kind: str, n: int, cache: Path) -> tuple[Path, dict]:
    """The pcap of a trace (generated once into ``cache``) and its generator's arrays."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"{kind}-{n}-{VERSION}.pcap"
    arrays = cache / f"{kind}-{n}-{VERSION}.npz"
    if path.exists() and arrays.exists():
        with np.load(arrays) as z:
            return path, {k: z[k] for k in z.files}
    p = backbone(n) if kind == "backbone" else uniform(n)
    snap = 128 if kind == "backbone" else 65535
    tmp = path.with_suffix(".tmp")
    write_pcap(tmp, p, snap)
    np.savez(arrays.with_suffix(".tmp.npz"), **p)
    arrays.with_suffix(".tmp.npz").replace(arrays)
    tmp.replace(path)
    return path, p
