"""The numba prefilter + residual against a pure-Python evaluation of every WHERE clause on
packets decoded by dpkt (an independent decoder and an independent evaluator)."""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capture.pcap import open_capture
from capture.unpack import unpack
from collector.pipeline.asc_runtime import AscRuntime
from collector.pipeline.compiled_prefilter import compile_prefilter, region_table
from collector.pipeline.prefilter import CHUNK, run_prefilter
from collector.pipeline.residual import Residual, ValueCache
from planner.asc import ASC
from planner.plan import build_plan
from planner.query import parse_queries
from tests.helpers import capture
from tests.pipelines import ATOMS, FILES
from tests.reference import packets

EXPENSIVE = ("dns_qname", "dns_an_", "payload")  # residual only: never prefilter bits


@cache
def corpus():
    """(TupleBatch, dpkt dicts) of the test captures, concatenated."""
    tbs, refs = [], []
    for name in FILES:
        path = capture(name)
        for raw in open_capture(path, batch_size=100):  # many batches: many ASC periods
            tbs.append(unpack(raw))
        refs.extend(packets(path))
    return tbs, refs


def invoked(queries_sql, budget, strategy="fixed", min_constants=3):
    plan = build_plan(parse_queries(queries_sql), bit_budget=budget,
                      asc_min_constants=min_constants)
    cp = compile_prefilter(plan, "packets")
    # a short period and mu = 0 re-choose the sequence many times along the corpus
    asc = AscRuntime(cp, strategy, period=150, mu=0.0, sample=256)
    res = Residual(plan, "packets")
    qs = []
    for tb in corpus()[0]:
        _, Q = run_prefilter(cp, tb, asc)
        res.apply(tb, Q)
        qs.append(Q)
    return plan, np.concatenate(qs)


workloads = st.lists(st.lists(st.integers(0, len(ATOMS) - 1), min_size=0, max_size=4),
                     min_size=1, max_size=90)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads, st.one_of(st.none(), st.integers(0, 8)),
       st.sampled_from(["fixed", "macro", "hybrid"]), st.sampled_from([None, 2, 3]))
def test_invoked_queries_equal_where_clauses(workload, budget, strategy, min_constants):
    """Each query bit is set exactly when the query's whole WHERE holds: with more than 64
    queries (several mask words), under any bit budget, with or without ASCs, and whatever
    ASC sequence (plan order, adaptive macro, adaptive hybrid) is running."""
    sql = ";\n".join("SELECT ts FROM packets" + (" WHERE " + " AND ".join(ATOMS[a][0]
                                                                        for a in atoms)
                                                  if atoms else "")
                     for atoms in workload)
    plan, Q = invoked(sql, budget, strategy, min_constants)
    refs = corpus()[1]
    assert Q.shape == (len(refs), (len(workload) + 63) // 64)
    for slot, atoms in enumerate(workload):
        got = (Q[:, slot >> 6] >> np.uint64(slot & 63)) & np.uint64(1)
        want = np.array([all(ATOMS[a][1](p) for a in atoms) for p in refs])
        assert np.array_equal(got.astype(bool), want), f"query {slot}: {workload[slot]}"


def test_prefilter_alone_is_a_superset():
    """Before the residual step the prefilter never drops a tuple a query could match."""
    sql = "SELECT ts FROM packets WHERE dst_port = 53 AND regexp(dns_qname, 'wiki')"
    plan = build_plan(parse_queries(sql))
    cp = compile_prefilter(plan, "packets")
    refs = corpus()[1]
    Q = np.concatenate([run_prefilter(cp, tb)[1] for tb in corpus()[0]])[:, 0]
    want = np.array([p["dst_port"] == 53 for p in refs])
    assert np.array_equal(Q.astype(bool), want)
    assert want.sum() > 0


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads, st.one_of(st.none(), st.integers(0, 8)))
def test_prefilter_alone_superset_and_exact_when_all_fit(workload, budget):
    """Before the residual step: the invoked set is a superset of the queries whose cheap
    predicates all hold, and equals it when every candidate fits (no budget)."""
    sql = ";\n".join("SELECT ts FROM packets" + (" WHERE " + " AND ".join(ATOMS[a][0]
                                                                        for a in atoms)
                                                  if atoms else "")
                     for atoms in workload)
    plan = build_plan(parse_queries(sql), bit_budget=budget)
    cp = compile_prefilter(plan, "packets")
    Q = np.concatenate([run_prefilter(cp, tb)[1] for tb in corpus()[0]])
    refs = corpus()[1]
    for slot, atoms in enumerate(workload):
        cheap = [a for a in atoms if not any(f in ATOMS[a][0] for f in EXPENSIVE)]
        got = ((Q[:, slot >> 6] >> np.uint64(slot & 63)) & np.uint64(1)).astype(bool)
        want = np.array([all(ATOMS[a][1](p) for a in cheap) for p in refs])
        assert not (want & ~got).any(), "the prefilter dropped a tuple the query accepts"
        if budget is None:
            assert np.array_equal(got, want)


def test_bit_vector_b_when_asked():
    """B (packed only on request) has bit b set exactly where all of the bit's predicates hold
    (numpy evaluation), composite bits included."""
    from collector.pipeline.residual import eval_predicate
    plan = build_plan(parse_queries(";".join(
        "SELECT ts FROM packets WHERE " + w for w in [
            "protocol = 17 AND dst_port = 53 AND dns_qr = 0",
            "protocol = 17 AND src_port = 53 AND dns_qr = 1", "protocol = 17",
            "protocol = 6 AND (dst_port = 80 OR src_port = 80)"])), asc_min_constants=None)
    assert any(len(b) > 1 for b in plan.bits)
    cp = compile_prefilter(plan, "packets")
    for tb in corpus()[0]:
        B, _ = run_prefilter(cp, tb, want_b=True)
        rows = np.arange(len(tb))
        for k, bit in enumerate(plan.bits):
            want = np.logical_and.reduce([eval_predicate(plan.predicates[p].predicate, tb, rows)
                                          for p in bit])
            got = (B[:, k >> 6] >> np.uint64(k & 63)) & np.uint64(1)
            assert np.array_equal(got.astype(bool), want)


def test_a_batch_of_several_chunks_gets_what_each_tuple_gets_alone():
    """The kernel evaluates a batch a chunk of rows at a time (``CHUNK``): a batch of two
    chunks and a ragged tail gets, for every tuple, the WHERE clauses' truth (dpkt) and B's
    bits. 70 queries (two mask words), among them queries that share a signature, a query
    without one, an IN of more constants than the kernel compares one by one, and NOT IN."""
    from collector.pipeline.residual import eval_predicate
    ports = [53, 80, 443, *range(1000, 1040, 2)]
    tests = {w: t for w, t in ATOMS if not any(f in w for f in EXPENSIVE)}
    tests[f"dst_port IN ({', '.join(map(str, ports))})"] = lambda p: p["dst_port"] in ports
    tests[f"src_port NOT IN ({', '.join(map(str, ports))})"] = \
        lambda p: p["src_port"] is not None and p["src_port"] not in ports
    atoms = list(tests)
    where = [(a,) for a in atoms] + list(zip(atoms, atoms[1:] + atoms[:1], strict=True)) + [()]
    where += [("protocol = 17",)] * (70 - len(where))
    plan = build_plan(parse_queries(";".join(
        "SELECT ts FROM packets" + (f" WHERE {' AND '.join(w)}" if w else "") for w in where)),
        asc_min_constants=None)
    path = capture("wikipedia.pcap")
    tb = unpack(next(iter(open_capture(path, batch_size=1 << 20))))
    refs = packets(path)
    rows = np.arange(2 * CHUNK + 37) % len(tb)  # the capture, again and again
    big = tb.take(rows)
    B, Q = run_prefilter(compile_prefilter(plan, "packets"), big, want_b=True)
    assert Q.shape == (len(rows), 2)
    for slot, w in enumerate(where):
        want = np.array([all(tests[a](refs[i]) for a in w) for i in rows])
        got = (Q[:, slot >> 6] >> np.uint64(slot & 63)) & np.uint64(1)
        assert np.array_equal(got.astype(bool), want), f"query {slot}: {w}"
    for k, bit in enumerate(plan.bits):
        want = np.logical_and.reduce([eval_predicate(plan.predicates[p].predicate, big,
                                                     np.arange(len(big))) for p in bit])
        assert np.array_equal(((B[:, k >> 6] >> np.uint64(k & 63)) & np.uint64(1)).astype(bool),
                              want)


def test_shared_expensive_predicate_is_evaluated_once_per_tuple():
    """Two queries share regexp(dns_qname, 'wiki'): the residual step evaluates it once per
    tuple that either query's bits let through, not once per query."""
    sql = ("SELECT ts FROM packets WHERE protocol = 17 AND regexp(dns_qname, 'wiki');"
           "SELECT ts FROM packets WHERE dst_port = 53 AND regexp(dns_qname, 'wiki')")
    plan = build_plan(parse_queries(sql))
    cp = compile_prefilter(plan, "packets")
    res = Residual(plan, "packets")
    need = 0
    for tb in corpus()[0]:
        _, Q = run_prefilter(cp, tb)
        need += int(Q.any(axis=1).sum())
        res.apply(tb, Q)
    refs = corpus()[1]
    assert need == sum(p["protocol"] == 17 or p["dst_port"] == 53 for p in refs)
    assert res.evaluated == need


@pytest.mark.parametrize("ordering", ["a-greedy", "sweep", "independent", "localswaps"])
def test_residual_order_adapts_and_answers_the_same(ordering):
    """Expensive residual predicates in a poor first order (equal catalogue cost, the one that
    drops little first): whatever order the variant runs, every query bit equals the fixed
    order's and the value cache changes no outcome; A-Greedy learns to run the one that drops
    every DNS name first, and so evaluates fewer predicates (the variants' own behaviour is
    tested in tests/planner/test_ordering.py)."""
    sql = ("SELECT ts FROM packets WHERE regexp(dns_qname, '[a-z]') AND "
           "regexp(dns_qname, '^no-such-name$');"
           "SELECT ts FROM packets WHERE regexp(dns_qname, 'wiki')")
    plan = build_plan(parse_queries(sql))
    cp = compile_prefilter(plan, "packets")
    batches = corpus()[0] * 6
    fixed = Residual(plan, "packets", "cost")
    # times from the catalogue, not the clock: the order must not depend on the machine
    adaptive = Residual(plan, "packets", ordering, p=0.5, window=60, stage=60,
                        cache=ValueCache(1024, adaptive=False), timed=False, per_batch=1000,
                        adapt=False)
    assert fixed.order() == adaptive.order()  # cost order: the non-selective regexp first
    for tb in batches:
        _, Q1 = run_prefilter(cp, tb)
        Q2 = Q1.copy()
        fixed.apply(tb, Q1)
        adaptive.apply(tb, Q2)
        assert np.array_equal(Q1, Q2)
    assert adaptive.cache.hits > adaptive.cache.misses > 0
    if ordering != "a-greedy":
        return
    texts = [plan.predicates[pid].predicate.text for pid in adaptive.order()]
    assert texts.index("regexp(dns_qname, '^no-such-name$')") < \
        texts.index("regexp(dns_qname, '[a-z]')")
    assert adaptive.adaptive.reorders >= 1
    assert adaptive.evaluated - adaptive.profile_evaluated < fixed.evaluated


def test_address_validity_is_per_field_in_flow_records():
    """A flow record may carry its source and destination but no next hop (templates differ):
    the kernels test each address field against that field's own validity, as the residual's
    evaluator does, so `next_hop = '0.0.0.0'` never holds for a record without a next hop."""
    from capture.netflow import DEFAULT_FLOW_PORTS, Decoder, FlowBatch, capture_flows
    from collector.pipeline.residual import eval_predicate
    from tests.helpers import flow_data
    path = flow_data("softflowd-generated/softflowd-ok-v5-export.pcap")
    fb = FlowBatch.concat(list(capture_flows(path, DEFAULT_FLOW_PORTS, Decoder())))
    assert len(fb) > 20
    ipset = fb.ipset.copy()
    ipset[3, ::2] = False  # every other record without a next hop (field 3 of exporter, src,
    fb = FlowBatch(fb.ints, fb.ips, ipset)  # dst, next hop)
    assert fb.ip_valid("src_ip").all() and not fb.ip_valid("next_hop").all()
    wheres = ["next_hop = '0.0.0.0'", "in_prefix(next_hop, '0.0.0.0/0')",
              "next_hop != '10.9.9.9'", "in_prefix(src_ip, '0.0.0.0/0')"]
    for min_constants in (None, 1):  # bits, then ASCs
        plan = build_plan(parse_queries(";".join(
            f"SELECT src_ip FROM flows WHERE {w}" for w in wheres)),
            asc_min_constants=min_constants)
        _, Q = run_prefilter(compile_prefilter(plan, "flows"), fb)
        rows = np.arange(len(fb))
        for qp in plan.queries:
            want = np.logical_and.reduce([eval_predicate(p, fb, rows)
                                          for p in qp.query.predicates])
            got = (Q[:, qp.slot >> 6] >> np.uint64(qp.slot & 63)) & np.uint64(1)
            assert np.array_equal(got.astype(bool), want), (qp.query.text, min_constants)
            if "next_hop" in qp.query.text:  # NULL makes every test false
                assert not got[::2].any() and got[1::2].any()


def test_invocations_avoided_and_matched_add_up_to_the_tuples():
    """Per query, the engine counts the tuples the prefilter kept from it and the tuples that
    matched; with every predicate in the prefilter (no residual) they add up to the tuples read,
    and the matches equal dpkt's count of the WHERE clause."""
    import tempfile

    from collector.metrics import Metrics
    from collector.pipeline.engine import Engine
    from collector.pipeline.spool import Spool
    sql = {"udp": "protocol = 17", "dns": "protocol = 17 AND dst_port = 53",
           "web": "protocol = 6 AND dst_port IN (80, 443)"}
    with tempfile.TemporaryDirectory() as d:
        plan = build_plan(parse_queries("\n".join(
            f"-- name: {n}\nSELECT time/60 AS t, count(*) AS c FROM packets WHERE {w} "
            "GROUP BY time/60;" for n, w in sql.items())))
        assert not any(qp.residual for qp in plan.queries)
        m = Metrics()
        engine = Engine(Spool(d), "packets", m)
        engine.set_plan(plan)
        path = capture("wikipedia.pcap")
        for raw in open_capture(path, batch_size=100):
            engine.process(raw, "t")
        ref = packets(path)
        for name in sql:
            matched = m.query_matched.labels(name)._value.get()
            avoided = m.query_avoided.labels(name)._value.get()
            assert matched + avoided == len(ref)
        assert m.query_matched.labels("udp")._value.get() == \
            sum(p["protocol"] == 17 for p in ref)
        assert m.query_matched.labels("web")._value.get() == \
            sum(p["protocol"] == 6 and p["dst_port"] in (80, 443) for p in ref)


@given(st.lists(st.integers(0, 300), min_size=1, max_size=12, unique=True))
def test_region_table_equals_region_of(constants):
    """The value -> region table of a small-integer ASC, built at once, equals the binary
    search of ASC.region_of for every value."""
    constants = sorted(constants)
    a = ASC("dst_port", "packets", "int", constants, [], [], [])
    length = constants[-1] + 2
    assert region_table(constants, length).tolist() == [a.region_of(v) for v in range(length)]
