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

import numpy as np

from capture.fields import NULL_INT, PACKET_INT_FIELDS, PACKET_INT_INDEX
from capture.unpack import TupleBatch

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
