"""User predicates by name (issue 15): a function named in the configuration or offered by an
installed package's entry point runs as a residual predicate; its outcome on real captures equals
the same Python function applied to dpkt's fields (plain, negated, with constant arguments,
cached by value); bad references, unknown names and raising functions get one-line errors or
are counted; replay answers a query that calls one."""

from __future__ import annotations

import ipaddress

import numpy as np
import pytest

from capture.pcap import open_capture
from capture.unpack import unpack
from collector.config import Settings
from collector.pipeline import user_predicates as functions
from collector.pipeline.residual import Residual, ValueCache, eval_predicate
from planner.ir import QueryError
from planner.plan import build_plan
from planner.query import parse_single
from tests.collector.pipeline import user_predicates as up
from tests.helpers import capture
from tests.reference import packets

REFS = {"is_private": "tests.collector.pipeline.user_predicates:is_private",
        "suffix": "tests.collector.pipeline.user_predicates:suffix",
        "port_in": "tests.collector.pipeline.user_predicates:port_in",
        "broken": "tests.collector.pipeline.user_predicates:broken"}
FILES = ("ok.pcap", "wikipedia.pcap", "icmp6.pcap", "ipv6-fragmented-dns.pcap")
CASES = [  # (WHERE, the same test on dpkt's fields)
    ("is_private(src_ip)",
     lambda r: r["src_ip"] is not None and ipaddress.ip_address(r["src_ip"]).is_private),
    ("NOT is_private(dst_ip)",
     lambda r: r["dst_ip"] is not None and not ipaddress.ip_address(r["dst_ip"]).is_private),
    ("suffix(dns_qname, 'wikimedia.org')",
     lambda r: r["dns_qname"] is not None and (r["dns_qname"] == "wikimedia.org" or
                                               r["dns_qname"].endswith(".wikimedia.org"))),
    ("port_in(dst_port, 1, 1023)",
     lambda r: r["dst_port"] is not None and 1 <= r["dst_port"] <= 1023),
]


@pytest.fixture(autouse=True)
def _configured():
    functions.configure(REFS)
    yield
    functions.configure({})


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize(("where", "python"), CASES)
def test_outcomes_equal_python_on_dpkt_fields(where, python, cached):
    (p,) = parse_single(f"SELECT ts FROM packets WHERE {where}", "q").predicates
    cache = ValueCache(1024) if cached else None
    hits = total = 0
    for name in FILES:
        want = [python(r) for r in packets(capture(name))]
        got = []
        for raw in open_capture(capture(name), batch_size=50):
            tb = unpack(raw)
            got.extend(eval_predicate(p, tb, np.arange(len(tb)), cache).tolist())
        assert got == want, name
        hits += sum(want)
        total += len(want)
    assert 0 < hits < total
    if cached:  # a call per distinct value over all the captures, then hits
        field = p.atoms[0].field
        distinct = {r[field] for name in FILES for r in packets(capture(name))} - {None}
        assert cache.misses == len(distinct) and cache.hits > 0


def test_the_value_cache_calls_once_per_value():
    (p,) = parse_single("SELECT ts FROM packets WHERE is_private(src_ip)", "q").predicates
    tb = unpack(next(iter(open_capture(capture("ok.pcap"), batch_size=1 << 20))))
    up.CALLS.clear()
    eval_predicate(p, tb, np.arange(len(tb)), ValueCache(1 << 16))
    distinct = {r["src_ip"] for r in packets(capture("ok.pcap")) if r["src_ip"]}
    assert len(up.CALLS) == len(distinct) < len(tb)


def test_residual_runs_them_only_under_their_query_bits():
    """A user predicate is never a prefilter bit; the residual stage (A-Greedy, profiling)
    leaves exactly the queries whose whole WHERE holds on dpkt's fields."""
    queries = [parse_single("SELECT ts FROM packets WHERE protocol = 17 AND "
                            "suffix(dns_qname, 'org')", "a"),
               parse_single("SELECT ts FROM packets WHERE is_private(src_ip) AND "
                            "port_in(dst_port, 1, 1023)", "b")]
    plan = build_plan(queries, cheap_cost=1000)
    calls = {i.predicate.text: i for i in plan.predicates}
    assert not calls["suffix(dns_qname, 'org')"].cheap and calls["protocol = 17"].cheap
    from collector.pipeline.compiled_prefilter import compile_prefilter
    from collector.pipeline.prefilter import run_prefilter
    cp = compile_prefilter(plan, "packets")
    res = Residual(plan, "packets", p=1.0, window=20, cache=ValueCache(256), timed=False)
    got, want = [], []
    for name in FILES:
        for raw in open_capture(capture(name), batch_size=40):
            tb = unpack(raw)
            _, Q = run_prefilter(cp, tb)
            res.apply(tb, Q)
            got += [(int(q[0]) & 1, int(q[0]) >> 1 & 1) for q in Q]
        for r in packets(capture(name)):
            a = r["protocol"] == 17 and r["dns_qname"] is not None and \
                (r["dns_qname"] == "org" or r["dns_qname"].endswith(".org"))
            b = r["src_ip"] is not None and ipaddress.ip_address(r["src_ip"]).is_private \
                and r["dst_port"] is not None and 1 <= r["dst_port"] <= 1023
            want.append((int(a), int(b)))
    assert got == want and any(a for a, _ in want) and any(b for _, b in want)


def test_bad_references_unknown_names_and_raising_functions(caplog):
    for ref, why in (("nocolon", "is not 'package.module:function'"),
                     ("/no/such/file.py:f", "cannot import '/no/such/file.py'"),
                     ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
                     ("tests.collector.pipeline.user_predicates:nope", "has no 'nope'"),
                     ("tests.collector.pipeline.user_predicates:NOT_CALLABLE", "is not callable")):
        with pytest.raises(ValueError, match=f"user predicate x: .*{why}"):
            functions.configure({"x": ref})
    functions.configure(REFS)
    q = parse_single("SELECT ts FROM packets\nWHERE protocol = 6 AND is_bogus(src_ip)", "q")
    with pytest.raises(QueryError) as e:
        functions.check(q)
    assert (e.value.line, e.value.col) == (2, 24) and "unknown function is_bogus()" in str(e.value)
    with pytest.raises(QueryError, match="takes a field, then quoted strings or whole numbers"):
        parse_single("SELECT ts FROM packets WHERE port_in(dst_port, 1.5, 3)", "q")
    (p,) = parse_single("SELECT ts FROM packets WHERE broken(src_port)", "q").predicates
    tb = unpack(next(iter(open_capture(capture("ok.pcap"), batch_size=1 << 20))))
    functions.take_errors()
    assert not eval_predicate(p, tb, np.arange(len(tb))).any()
    ports = tb.column("src_port")
    assert functions.take_errors()["broken"] == len(set(ports[ports >= 0].tolist()))
    assert "raised RuntimeError" in caplog.text


def test_an_entry_point_offers_a_predicate(tmp_path, monkeypatch):
    """A package installed with ``[project.entry-points."flowsieve.predicates"]``."""
    dist = tmp_path / "acme_preds-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-preds\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[flowsieve.predicates]\nacme_https = acme_preds:https\n")
    (tmp_path / "acme_preds.py").write_text("def https(port):\n    return port == 443\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    functions.configure({})
    assert "acme_https" in functions.names()
    q = parse_single("SELECT ts FROM packets WHERE acme_https(dst_port)", "q")
    functions.check(q)
    tb = unpack(next(iter(open_capture(capture("wikipedia.pcap"), batch_size=1 << 20))))
    got = eval_predicate(q.predicates[0], tb, np.arange(len(tb)))
    assert got.tolist() == [r["dst_port"] == 443 for r in packets(capture("wikipedia.pcap"))]


def test_a_file_offers_a_predicate(tmp_path):
    (tmp_path / "preds.py").write_text("def dns(port):\n    return port == 53\n")
    functions.configure({"dns_port": f"{tmp_path / 'preds.py'}:dns"})
    q = parse_single("SELECT ts FROM packets WHERE dns_port(src_port)", "q")
    tb = unpack(next(iter(open_capture(capture("ok.pcap"), batch_size=1 << 20))))
    got = eval_predicate(q.predicates[0], tb, np.arange(len(tb)))
    want = [r["src_port"] == 53 for r in packets(capture("ok.pcap"))]
    assert got.tolist() == want and any(want)


def test_replay_answers_a_query_calling_one(tmp_path, spark):
    from api.replay import replay
    from tests.reference import rows_of
    q = parse_single("SELECT time/60 AS t, count(*) AS n FROM packets WHERE "
                     "is_private(src_ip) GROUP BY time/60", "private_sources")
    res = replay(capture("ok.pcap"), [q], tmp_path / "work", spark,
                 settings=Settings(initial_queries=None, predicates=REFS))
    assert res.error is None
    got = {r["t"]: r["n"] for r in rows_of(*res.answers[0])}
    want: dict[int, int] = {}
    for r in packets(capture("ok.pcap")):
        if r["src_ip"] and ipaddress.ip_address(r["src_ip"]).is_private:
            want[r["time"] // 60] = want.get(r["time"] // 60, 0) + 1
    assert got == want and sum(want.values()) > 0
