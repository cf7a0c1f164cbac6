"""The plan's kernel filter never drops a packet a query accepts: compiled by libpcap and run by
libpcap's interpreter on real frames, against a pure-Python evaluation of every WHERE clause on
the dpkt-decoded packets (the captures include VLAN, QinQ, MPLS and IPv6 extension headers)."""

from __future__ import annotations

from functools import cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capture.bpf import Filter, compile_filter
from capture.errors import FilterError
from capture.pcap import open_capture
from planner.kernel_filter import bpf_expression
from planner.plan import build_plan
from planner.query import parse_queries
from tests.helpers import capture
from tests.pipelines import ATOMS, FILES
from tests.reference import packets

FILES_ALL = (*FILES, "q-in-q.pcap", "ipv6-http-atomic-frag.pcap", "fragmented-3.pcap",
             "dns_tcp.pcap", "icmp_dot1q.pcap")


@cache
def frames():
    """(bytes, wire length, dpkt dict) of every Ethernet frame of the captures."""
    out = []
    for name in FILES_ALL:
        path = capture(name)
        recs = [r for raw in open_capture(path) for r in raw.records()]
        out.extend((r[4], r[1], p) for r, p in zip(recs, packets(path), strict=True))
    return out


def sql_of(workload):
    return ";\n".join("SELECT ts FROM packets" + (" WHERE " + " AND ".join(
        ATOMS[a][0] for a in atoms) if atoms else "") for atoms in workload)


# atoms BPF can state (the others only widen the filter): drawn more often
STATABLE = [i for i, (text, _) in enumerate(ATOMS)
            if bpf_expression(parse_queries(f"SELECT ts FROM packets WHERE {text}"))]
atom = st.one_of(st.sampled_from(STATABLE), st.integers(0, len(ATOMS) - 1))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(atom, min_size=1, max_size=3), min_size=1, max_size=12))
def test_filter_passes_every_packet_a_query_accepts(workload):
    queries = parse_queries(sql_of(workload))
    expr = bpf_expression(queries)
    f = compile_filter(expr)
    if f is None:  # some query has nothing BPF can state: no filter at all
        assert any(all(a not in STATABLE for a in atoms) for atoms in workload)
        return
    for data, wirelen, p in frames():
        wanted = any(all(ATOMS[a][1](p) for a in atoms) for atoms in workload)
        if wanted:
            assert f.matches(data, wirelen), (expr, p)


def test_filter_drops_what_no_query_wants():
    """Not just sound: on traffic without tags or extension headers it keeps only what the
    queries state (ports, protocols, addresses)."""
    plan = build_plan(parse_queries("SELECT ts FROM packets WHERE protocol = 17 AND "
                                    "dst_port = 53; SELECT ts FROM packets WHERE "
                                    "dst_ip = '8.8.8.8'"))
    f = compile_filter(plan.bpf)
    kept = [p for data, wl, p in frames() if f.matches(data, wl)]
    plain = [p for data, wl, p in frames() if f.matches(data, wl) and p["vlan"] is None
             and p["mpls_label"] is None and p["ip_version"] == 4]
    assert plain and all((p["protocol"] == 17 and p["dst_port"] == 53)
                         or p["dst_ip"] == "8.8.8.8" for p in plain)
    assert len(kept) < len(frames()) / 2


def test_unstatable_query_means_no_filter():
    assert bpf_expression(parse_queries(
        "SELECT ts FROM packets WHERE regexp(dns_qname, 'wiki')")) == ""
    assert compile_filter("") is None


def test_bad_expression_is_refused_with_libpcap_reason():
    with pytest.raises(FilterError, match="bad filter expression"):
        Filter("port eighty")


def test_bit_tests_pass_ipv6_tcp():
    """libpcap's tcp[13] reads IPv4 only: a TCP flag test also reads ip6[53] (found with the
    bit tests; an IPv6 SYN was dropped by the kernel filter of ``tcp_flags = 2`` before)."""
    path = capture("test.pcap")  # GPL sample with an IPv6 HTTP flow (tcpreplay)
    recs = [r for raw in open_capture(path) for r in raw.records()]
    pkts = packets(path)
    v6 = [p for p in pkts if p["ip_version"] == 6 and p["tcp_flags"] is not None]
    assert v6, "test.pcap holds an IPv6 TCP flow"
    for text, test in [("tcp_flags = 2", lambda x: x == 2),
                       ("(tcp_flags & 18) = 18", lambda x: x & 18 == 18),
                       ("tcp_flags & 1 != 0", lambda x: x & 1 != 0),
                       ("(tcp_flags & 18) != 16", lambda x: x & 18 != 16)]:
        f = compile_filter(bpf_expression(parse_queries(f"SELECT ts FROM packets WHERE {text}")))
        want = [p["tcp_flags"] is not None and test(p["tcp_flags"]) for p in pkts]
        got = [f.matches(r[4], r[1]) for r in recs]
        assert any(w and p["ip_version"] == 6 for w, p in zip(want, pkts, strict=True)), text
        assert all(g for g, w in zip(got, want, strict=True) if w), text
        # exact on plain IPv4/IPv6 TCP: what the filter passes there, the test accepts
        plain = [g == w for g, w, p in zip(got, want, pkts, strict=True)
                 if p["tcp_flags"] is not None and p["vlan"] is None and p["mpls_label"] is None]
        assert plain and all(plain), text
