"""The query sets of the Spark benchmark, and their truth computed with numpy from a trace
generator's own arrays (bench/traces.py), independently of flowsieve's capture and engine.

- ``backbone_sql``: 50 Gigascope-like queries over the backbone trace: shared protocol
  predicates, specific port, prefix, host and DNS predicates, GROUP BY time/60 with different
  keys (source, destination, pair, port, protocol), top-N and HAVING. The 1- and 10-query sets
  are its first 1 and 10.
- ``peer_sql``: the 50 filters of ``../shared/bench/peer-queries.json`` (kept with every tool's
  form in ``bench/peers/queries.json``) as flowsieve queries (a packet count per minute each),
  for the uniform trace and the peers.
"""

from __future__ import annotations

import operator

import numpy as np

from capture.fields import ip_text
from planner.ir import Query

PROTOCOLS = {"tcp": 6, "udp": 17, "icmp": 1}
CMP = {"=": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le,
       ">": operator.gt, ">=": operator.ge}


def _top(values: np.ndarray, k: int) -> list:
    u, c = np.unique(values, return_counts=True, axis=0)
    return [u[i] for i in np.argsort(-c, kind="stable")[:k]]


def backbone_sql(p: dict) -> str:
    """50 queries whose constants come from the trace (its busiest hosts and networks)."""
    v4 = p["ipv"] == 4
    hosts = [ip_text(bytes(h)) for h in _top(p["src"][v4], 12)]
    nets = [".".join(h.split(".")[:2]) + ".0.0/16" for h in hosts]
    q = []

    def add(name, sql):
        q.append(f"-- name: {name}\n{sql};")
    add("proto_mix", "SELECT time/60 AS t, protocol, count(*) AS pkts, sum(wirelen) AS bytes "
        "FROM packets GROUP BY time/60, protocol")
    add("tcp_ports_top", "SELECT time/60 AS t, dst_port, count(*) AS pkts, sum(wirelen) AS "
        "bytes FROM packets WHERE protocol = 6 AND dst_port < 1024 GROUP BY time/60, dst_port "
        "ORDER BY bytes DESC LIMIT 5")
    add("v6_mix", "SELECT time/60 AS t, protocol, count(*) AS pkts, max(wirelen) AS big "
        "FROM packets WHERE ip_version = 6 GROUP BY time/60, protocol")
    add("dns_req_src", "SELECT time/60 AS t, src_ip, count(*) AS n FROM packets WHERE "
        "protocol = 17 AND dst_port = 53 AND dns_qr = 0 GROUP BY time/60, src_ip "
        "HAVING n >= 20")
    add("icmp_src", "SELECT time/60 AS t, src_ip, icmp_type, count(*) AS n FROM packets "
        f"WHERE protocol = 1 AND in_prefix(src_ip, '{nets[0]}') GROUP BY time/60, src_ip, "
        "icmp_type")
    add("ssh_pairs", "SELECT time/60 AS t, src_ip, dst_ip, count(*) AS n, sum(wirelen) AS "
        f"bytes FROM packets WHERE protocol = 6 AND dst_port = 22 AND in_prefix(dst_ip, "
        f"'{nets[1]}') GROUP BY time/60, src_ip, dst_ip")
    add("syn_dst", "SELECT time/60 AS t, dst_ip, count(*) AS syns FROM packets WHERE "
        f"protocol = 6 AND tcp_flags = 2 AND in_prefix(dst_ip, '{nets[0]}') "
        "GROUP BY time/60, dst_ip ORDER BY syns DESC LIMIT 10")
    add("udp_big", "SELECT time/60 AS t, dst_port, count(*) AS n, avg(wirelen) AS mean "
        "FROM packets WHERE protocol = 17 AND wirelen > 1000 AND dst_port < 1024 "
        "GROUP BY time/60, dst_port HAVING n > 5")
    add("host0_ports", "SELECT time/60 AS t, protocol, dst_port, count(*) AS pkts FROM packets "
        f"WHERE src_ip = '{hosts[0]}' AND dst_port < 10000 GROUP BY time/60, protocol, "
        "dst_port")
    add("web_top_src", "SELECT time/60 AS t, src_ip, sum(wirelen) AS bytes FROM packets "
        f"WHERE protocol = 6 AND dst_port IN (80, 443, 8080, 8443) AND in_prefix(src_ip, "
        f"'{nets[2]}') GROUP BY time/60, src_ip ORDER BY bytes DESC LIMIT 10")
    for i, port in enumerate((443, 80, 22, 25, 8080, 8443, 993, 3389, 5432, 6379)):
        add(f"svc{port}_src", "SELECT time/60 AS t, src_ip, count(*) AS pkts, sum(wirelen) "
            f"AS bytes FROM packets WHERE protocol = 6 AND dst_port = {port} AND "
            f"in_prefix(src_ip, '{nets[i % len(nets)]}') GROUP BY time/60, src_ip")
    for i, h in enumerate(hosts[:10]):
        add(f"host{i}_peers", "SELECT time/60 AS t, dst_ip, count(*) AS pkts, sum(wirelen) "
            f"AS bytes FROM packets WHERE src_ip = '{h}' GROUP BY time/60, dst_ip "
            "ORDER BY bytes DESC LIMIT 5")
    for i, net in enumerate(nets[:10]):
        add(f"net{i}_proto", "SELECT time/60 AS t, protocol, dst_port, count(*) AS pkts, "
            f"sum(wirelen) AS bytes FROM packets WHERE in_prefix(dst_ip, '{net}') AND "
            "dst_port IN (22, 25, 53, 80, 443) GROUP BY time/60, protocol, dst_port")
    for i, (qr, key) in enumerate(((0, "src_ip"), (1, "dst_ip")) * 2):
        net = nets[3 + i]
        add(f"dns{i}_{key}", f"SELECT time/60 AS t, {key}, count(*) AS n, sum(wirelen) AS bytes "
            f"FROM packets WHERE protocol = 17 AND dns_qr = {qr} AND in_prefix({key}, '{net}') "
            f"GROUP BY time/60, {key}")
    for i, ttl in enumerate((64, 128, 255, 57, 64, 128)):
        proto = (6, 17)[i % 2]
        add(f"ttl{i}", "SELECT time/60 AS t, ip_version, count(*) AS pkts, min(wirelen) AS lo, "
            f"max(wirelen) AS hi FROM packets WHERE ttl = {ttl} AND protocol = {proto} "
            "GROUP BY time/60, ip_version")
    assert len(q) == 50, len(q)
    return "\n".join(q) + "\n"


def paper_sql() -> str:
    """Seed 002's setting: aggregations of one stream on overlapping sets of attributes, no
    filters (every query sees every tuple)."""
    keys = [("src_ip", "dst_ip"), ("src_ip", "dst_port"), ("dst_ip", "dst_port"),
            ("src_ip",), ("dst_ip",), ("dst_port", "protocol")]
    return "\n".join(
        f"-- name: agg{i}\nSELECT time/60 AS t, {', '.join(k)}, count(*) AS n, sum(wirelen) AS "
        f"bytes FROM packets GROUP BY time/60, {', '.join(k)};" for i, k in enumerate(keys)) + "\n"


def peer_sql() -> str:
    """The peers' 50 filters as flowsieve count queries (``bench/peers/queries.json``)."""
    from bench.peers.queries import sql
    return sql()


def pairs_sql() -> str:
    """The peers' 50 filters grouping by (minute, source, destination): an answer row per
    host pair and filter (the CSV export benchmark: answers as many as the packets)."""
    return peer_sql().replace("SELECT time/60 AS t, count(*) AS pkts",
                              "SELECT time/60 AS t, src_ip, dst_ip, count(*) AS pkts") \
        .replace("GROUP BY time/60;", "GROUP BY time/60, src_ip, dst_ip;")


def bpf_to_sql(bpf: str) -> str:
    """The BPF forms of peer-queries.json (a small, fixed vocabulary) as a WHERE clause."""
    words = bpf.split()
    out, i = [], 0
    while i < len(words):
        w = words[i]
        if w == "and":
            i += 1
            continue
        if w in ("tcp", "udp", "icmp"):
            out.append(f"protocol = {PROTOCOLS[w]}")
            i += 1
        elif w in ("src", "dst") and words[i + 1] == "port":
            out.append(f"{w}_port = {words[i + 2]}")
            i += 3
        elif w in ("src", "dst") and words[i + 1] == "host":
            out.append(f"{w}_ip = '{words[i + 2]}'")
            i += 3
        elif w in ("src", "dst") and words[i + 1] == "net":
            out.append(f"in_prefix({w}_ip, '{words[i + 2]}')")
            i += 3
        elif w == "host":
            out.append(f"(src_ip = '{words[i + 1]}' OR dst_ip = '{words[i + 1]}')")
            i += 2
        else:
            raise ValueError(f"BPF word {w!r} in {bpf!r}")
    return " AND ".join(out)


# ------------------------------------------------------------------------------------ truth
def columns(p: dict) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Catalogue fields of the generator's packets: (values, valid) per field."""
    proto = p["proto"]
    every = np.ones(len(proto), bool)
    icmp = (proto == 1) | (proto == 58)
    dns = p["qname"] >= 0

    def ip(a):
        words = np.ascontiguousarray(a).view(">u8").reshape(-1, 2)
        return words.astype(np.uint64), every
    return {
        "time": (p["ts_us"] // 1_000_000, every), "protocol": (proto, every),
        "ip_version": (p["ipv"], every), "ttl": (p["ttl"], every),
        "src_port": (p["sport"], ~icmp), "dst_port": (p["dport"], ~icmp),
        "tcp_flags": (p["flags"], proto == 6), "icmp_type": (p["icmp_type"], icmp),
        "dns_qr": (p["dns_qr"], dns), "wirelen": (p["wirelen"], every),
        "src_ip": ip(p["src"]), "dst_ip": ip(p["dst"]),
    }


def _atom(a, cols) -> np.ndarray:
    v, valid = cols[a.field]
    if v.ndim == 2:  # an address as two 64-bit words
        if a.op == "prefix":
            value, length = a.values
            mask = ((1 << 128) - 1) ^ ((1 << (128 - length)) - 1)
            hi_m, lo_m = np.uint64(mask >> 64), np.uint64(mask & (2**64 - 1))
            out = ((v[:, 0] & hi_m) == np.uint64(value >> 64)) & (
                (v[:, 1] & lo_m) == np.uint64(value & (2**64 - 1)))
        else:
            assert a.op in ("=", "in"), a.op
            out = np.zeros(len(v), bool)
            for c in a.values:
                out |= (v[:, 0] == np.uint64(c >> 64)) & (v[:, 1] == np.uint64(c & (2**64 - 1)))
    elif a.op == "in":
        out = np.isin(v, list(a.values))
    elif a.op == "between":
        out = (v >= a.values[0]) & (v <= a.values[1])
    else:
        out = CMP[a.op](v, a.values[0])
    return valid & (~out if a.negated else out)


def truth(q: Query, p: dict, cols: dict | None = None) -> list[dict]:
    """Query ``q``'s answer rows over the generator's packets (numpy; per window HAVING and
    ORDER BY … LIMIT applied as DESIGN's language says)."""
    cols = cols or columns(p)
    keep = np.ones(len(p["proto"]), bool)
    for pred in q.predicates:
        any_ = np.zeros(len(keep), bool)
        for a in pred.atoms:
            any_ |= _atom(a, cols)
        keep &= any_
    rows = np.flatnonzero(keep)
    if not len(rows):
        return []
    bucket = cols["time"][0][rows] // q.period
    parts = [bucket.astype(np.int64).reshape(-1, 1)]
    for k in q.keys:
        v, valid = cols[k]
        v = v[rows].reshape(len(rows), -1).astype(np.int64)
        parts.append(np.where(valid[rows][:, None], v, -1))
        parts.append(valid[rows].astype(np.int64).reshape(-1, 1))
    key = np.hstack(parts) if parts else np.zeros((len(rows), 0), np.int64)
    uniq, inv = np.unique(key, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    n = np.bincount(inv, minlength=len(uniq))
    out_rows = []
    meas = {}
    for o in q.outputs:
        if o.kind == "agg" and o.field:
            m = cols[o.field][0][rows].astype(np.int64)
            s = np.bincount(inv, weights=m, minlength=len(uniq)).astype(np.int64)
            lo = np.full(len(uniq), np.iinfo(np.int64).max)
            hi = np.full(len(uniq), np.iinfo(np.int64).min)
            np.minimum.at(lo, inv, m)
            np.maximum.at(hi, inv, m)
            meas[o.field] = {"sum": s, "min": lo, "max": hi, "avg": s / n}
    for g in range(len(uniq)):
        r, c = {}, 1
        vals = {}
        for k in q.keys:
            v, _ = cols[k]
            width = 2 if v.ndim == 2 else 1
            w = uniq[g, c:c + width]
            valid = uniq[g, c + width]
            if not valid:
                vals[k] = None
            elif width == 2:
                vals[k] = ip_text((int(w[0]) % 2**64 << 64 | int(w[1]) % 2**64)
                                  .to_bytes(16, "big"))
            else:
                vals[k] = int(w[0])
            c += width + 1
        for o in q.outputs:
            if o.kind == "bucket":
                r[o.name] = int(uniq[g, 0])
            elif o.kind == "key":
                r[o.name] = vals[o.field]
            elif o.func == "count":
                r[o.name] = int(n[g])
            else:
                x = meas[o.field][o.func][g]
                r[o.name] = float(x) if o.func == "avg" else int(x)
        out_rows.append(r)
    return _having_order_limit(q, out_rows)


def _having_order_limit(q: Query, rows: list[dict]) -> list[dict]:
    rows = [r for r in rows if all(CMP[c.op](r[c.column], c.value) for c in q.having)]
    if q.limit is None:
        return rows
    bucket = next(o.name for o in q.outputs if o.kind == "bucket")
    out = []
    for t in sorted({r[bucket] for r in rows}):
        win = [r for r in rows if r[bucket] == t]
        for col, desc in reversed(q.order):
            win.sort(key=lambda r, col=col: r[col], reverse=desc)
        out += win[:q.limit]
    return out


def canonical(q: Query, rows: list[dict]) -> list:
    """Rows as comparable values: sorted tuples; for top-N, each window's ORDER BY values
    (ties at the cut may keep different keys, never different values)."""
    names = [o.name for o in q.outputs]
    if q.limit is not None:
        bucket = next(o.name for o in q.outputs if o.kind == "bucket")
        cols = [c for c, _ in q.order]
        return sorted((r[bucket], tuple(_norm(r[c]) for c in cols)) for r in rows)
    return sorted(tuple(_norm(r.get(n)) for n in names) for r in rows)


def _norm(v):
    if isinstance(v, float):
        return round(v, 6)
    if v is None:
        return ""
    return v

