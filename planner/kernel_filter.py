"""The kernel filter of live capture: what the packet queries can accept, as a BPF expression.

The expression (libpcap syntax; ``capture/bpf.py`` compiles and attaches it) is the disjunction,
over the queries on ``packets``, of the conjunction of each query's predicates that BPF can
state. A predicate BPF cannot state (DNS fields, MPLS labels, negations, ...) is left out, which
only widens the filter, so a packet any query can accept always passes; the prefilter decides
exactly in user space. BPF reads fixed offsets of untagged IPv4/IPv6 frames, where flowsieve's
decoder walks VLAN tags, MPLS labels and the IPv6 extension-header chain: the filter therefore
also passes every IPv6 packet whose first next header is an extension header, and ``capture/``
adds a clause passing tagged frames for the link type it compiles for.

An empty expression means no filter: some query accepts packets no BPF clause can describe.
"""

from __future__ import annotations

from capture.fields import prefix_network
from planner.ir import Atom, Predicate, Query

IPV6_EXTENSION_HEADERS = (0, 43, 44, 51, 60)  # hop-by-hop, routing, fragment, AH, dst options
_CMP = {"=": "=", "!=": "!=", "<": "<", "<=": "<=", ">": ">", ">=": ">="}
# byte fields: (IPv4 expression, IPv6 expression)
_BYTES = {
    "ttl": ("ip[8]", "ip6[7]"),
    "tos": ("ip[1]", "(ip6[0:2] >> 4) & 0xff"),
}


def _net(value: int, length: int) -> tuple[str, str]:
    """(qualifier, network) of a 128-bit prefix: IPv4-mapped prefixes become IPv4 nets."""
    net = prefix_network(value, length)
    return ("ip" if net.version == 4 else "ip6"), f"{net.network_address}/{net.prefixlen}"


def _range(op: str, values: tuple) -> tuple[int, int] | None:
    """The closed interval an integer comparison accepts (None: not an interval)."""
    lo, hi = 0, 65535
    v = values[0] if values else 0
    if op == "=":
        return v, v
    if op == "between":
        return values[0], values[1]
    return {"<": (lo, v - 1), "<=": (lo, v), ">": (v + 1, hi), ">=": (v, hi)}.get(op)


def atom_bpf(atom: Atom) -> str | None:
    """The atom in libpcap syntax, or None when BPF cannot state it exactly or wider."""
    f, op, vals = atom.field, atom.op, atom.values
    if (atom.negated and op != "mask") or op in ("regexp", "table", "call", "!="):
        return None
    if op == "in":
        parts = [atom_bpf(Atom(f, "=", (v,))) for v in vals]
        return None if None in parts else "(" + " or ".join(parts) + ")"
    if f in ("src_ip", "dst_ip"):
        if op == "prefix":
            fam, net = _net(*vals)
        elif op == "=":
            fam, net = _net(vals[0], 128)
        else:
            return None
        return f"{fam} {f[:3]} net {net}"
    if f in ("src_port", "dst_port"):
        r = _range(op, vals)
        if r is None or r[0] > r[1]:
            return None if r is None else "len < 0"  # an empty range: never true
        d = f[:3]
        return f"{d} port {r[0]}" if r[0] == r[1] else f"{d} portrange {r[0]}-{r[1]}"
    if f == "protocol" and op == "=":
        return f"(ip proto {vals[0]} or ip6 proto {vals[0]})"
    if f == "ip_version" and op == "=":
        return {4: "ip", 6: "ip6"}.get(vals[0], "(ip and ip6)")
    if f in _BYTES and op in _CMP:
        v4, v6 = _BYTES[f]
        return f"((ip and {v4} {_CMP[op]} {vals[0]}) or (ip6 and {v6} {_CMP[op]} {vals[0]}))"
    if f == "tcp_flags" and (op in _CMP or op == "mask"):
        # libpcap's tcp[] reads IPv4 only: IPv6 TCP (no extension header) at ip6[40 + 13]
        test = f"& {vals[0]} {'!=' if atom.negated else '='} {vals[1]}" if op == "mask" \
            else f"{_CMP[op]} {vals[0]}"
        return f"((tcp and tcp[13] {test}) or (ip6[6] = 6 and ip6[53] {test}))"
    if f in ("icmp_type", "icmp_code") and op in _CMP:
        k = 0 if f == "icmp_type" else 1
        return f"((icmp and icmp[{k}] {_CMP[op]} {vals[0]}) or ip6 proto 58)"
    return None


def predicate_bpf(p: Predicate) -> str | None:
    parts = [atom_bpf(a) for a in p.atoms]
    if None in parts:
        return None
    return parts[0] if len(parts) == 1 else "(" + " or ".join(parts) + ")"


def query_bpf(q: Query) -> str | None:
    """The conjunction of what BPF can state of one query; None when it states nothing."""
    parts = [s for s in (predicate_bpf(p) for p in q.predicates) if s is not None]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else " and ".join(parts)


def bpf_expression(queries: list[Query]) -> str:
    """The plan's kernel filter for the ``packets`` stream ('' = no filter)."""
    exprs: list[str] = []
    qs = [q for q in queries if q.stream == "packets"]
    if not qs:
        return ""
    for q in qs:
        e = query_bpf(q)
        if e is None:
            return ""
        if e not in exprs:
            exprs.append(e)
    ext = " or ".join(f"ip6[6] = {h}" for h in IPV6_EXTENSION_HEADERS)
    body = " or ".join(f"({e})" for e in exprs)
    return f"{body} or (ip6 and ({ext}))"
