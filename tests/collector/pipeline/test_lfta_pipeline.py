"""The LFTA in the pipeline: replay over several windows with tables small enough to fill,
against dpkt/scapy; two capture daemons (engines) writing partials of the same windows into one
spool answer as one daemon over the union of their inputs; Spark sees far fewer rows than
tuples."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from api.replay import replay
from capture.pcap import open_capture
from collector.config import Settings, data_file
from collector.daemon.results import read_results
from collector.metrics import Metrics
from collector.pipeline.engine import Engine
from collector.pipeline.spool import Spool
from collector.spark.merge import SparkJob
from planner.plan import build_plan
from planner.query import parse_queries
from tests.pipelines import WHERE, answers_of, reference, spread
from tests.reference import fields_of, rows_of

pytestmark = pytest.mark.slow









def test_replay_over_windows_with_full_tables(spark, tmp_path):
    """ok.pcap over 7 one-minute windows, through 16-slot tables that fill again and again:
    every window's answer equals dpkt's, and Spark read a fraction of the tuples."""
    path, recs = spread(tmp_path, "ok.pcap", 0.5)
    settings = Settings(lfta={"capacity": 16, "max_load": 0.5}, om={"enabled": False},
                        initial_queries=None)
    metrics = Metrics()
    queries = parse_queries(open(data_file("example.sql")).read())
    res = replay(path, queries, tmp_path / "work", spark, settings=settings, metrics=metrics)
    assert res.error is None
    ref = reference(recs)
    assert len({k[0] for g in ref.values() for k in g}) >= 7
    assert answers_of(res.answers) == ref
    # the tables filled and windows closed on the way (a 16-slot table holds 8 groups)
    assert metrics.lfta_flushes.labels("packets", "full")._value.get() > 0
    assert 0 < metrics.lfta_evicted.labels("packets")._value.get() < \
        metrics.lfta_rows_out.labels("packets")._value.get()
    assert metrics.lfta_flushes.labels("packets", "window")._value.get() > 0
    rows_in = metrics.lfta_rows_in.labels("packets")._value.get()
    rows_out = metrics.lfta_rows_out.labels("packets")._value.get()
    # each maintained node of the aggregate tree takes the tuples of its queries once
    names = {qp.slot: qp.query.name for qp in res.plan.queries}
    decoded = [fields_of(ts, buf, 1) for ts, buf, _ in recs]
    assert rows_in == sum(sum(1 for p in decoded if any(WHERE[names[s]](p) for s in slots))
                          for t in res.plan.trees for _, slots in t.maintained())
    assert rows_out < rows_in / 5
    # every spool row came out of a table (no query here has a string key)
    assert metrics.spool_rows.labels("packets", "60")._value.get() == rows_out


def test_two_daemons_share_one_spool(spark, tmp_path):
    """Two engines (two capture daemons) take alternate packets of the same windows and write
    partials into one spool; Spark merges them into the answers one daemon gives over all."""
    path, recs = spread(tmp_path, "ok.pcap", 0.5)
    queries = parse_queries(open(data_file("example.sql")).read())
    # tables, not OM's choice for so little traffic (pass-through): partials from both
    plan = build_plan(queries, **Settings(initial_queries=None,
                                          om={"enabled": False}).plan_options())
    engines = two_daemons(spark, tmp_path, plan, path)
    assert all(e.lfta_usage()[0] == 0 for e in engines)  # everything reached the spool
    got = answers_of([(qp.query, read_results(tmp_path / "results", qp.query))
                      for qp in plan.queries])
    assert got == reference(recs)


def two_daemons(spark, tmp_path, plan, path) -> list[Engine]:
    """Two engines take alternate packets of the capture into one spool (each holding
    partials in its tables until the end); Spark's streaming merge answers them."""
    spool = Spool(tmp_path / "spool")
    engines = [Engine(spool, "packets", probe=f"probe{i}", watermark_delay_s=5)
               for i in range(2)]
    for e in engines:
        e.set_plan(plan)
    for raw in open_capture(path, batch_size=100):
        for i, e in enumerate(engines):
            e.process(_every_other(raw, i), f"probe{i}")
    assert all(e.lfta_usage()[0] > 0 and e.lfta_usage()[1] > 0 for e in engines)
    for e in engines:
        e.finish()
    slots = {qp.slot: qp.query for qp in plan.queries}
    job = SparkJob(spark, tmp_path / "spool", tmp_path / "results", tmp_path / "checkpoints",
                   lambda: slots, 5)
    job.run_available_now([(s, f) for s in plan.streams() for f in plan.folders(s)])
    return engines


def _every_other(raw, i):
    """The records i, i + 2, … of a RawBatch."""
    from capture.records import RawBatch
    idx = np.arange(i, len(raw), 2)
    return RawBatch(raw.buf, raw.offset[idx], raw.caplen[idx], raw.wirelen[idx],
                    raw.ts_ns[idx], raw.linktype[idx], raw.iface[idx])



OM_QUERIES = """-- name: by_proto
SELECT time/60 AS t, protocol, count(*) AS pkts, sum(wirelen) AS bytes FROM packets
GROUP BY time/60, protocol;
-- name: udp_ports
SELECT time/60 AS t, dst_port, count(*) AS pkts, sum(wirelen) AS bytes FROM packets
WHERE protocol = 17 GROUP BY time/60, dst_port;
"""


def test_om_switches_plans_at_window_boundaries_and_answers_stay_right(spark, tmp_path):
    """OM on (history 1: each round's plan follows the last round): windows alternate between
    a fast and a slow arrival rate (50 tuples in 10 µs or in 10,000 s: the test drives the
    engine's clock), so every node's chart flips between a hash table (fast: Spark's share
    would not keep up with a row per tuple) and pass-through (slow: no memory held) at each
    window boundary. The old table retires and leaves as its windows close; Spark's answers still
    equal dpkt's."""
    from collector.config import OmConfig
    path, recs = spread(tmp_path, "ok.pcap", 0.5)
    queries = parse_queries(OM_QUERIES)
    # pass-through is a candidate where Spark's watermark waits a whole period (planner/plan.py)
    plan = build_plan(queries, **Settings(initial_queries=None,
                                          spark={"watermark_delay_s": 60}).plan_options())
    assert all(t.charts for t in plan.trees)
    now, prev = [0], [None]
    metrics = Metrics()
    spool = Spool(tmp_path / "spool")
    e = Engine(spool, "packets", metrics, watermark_delay_s=5, om=OmConfig(history=1),
               clock=lambda: now[0])
    e.set_plan(plan)
    for raw in open_capture(path, batch_size=50):
        window = int(raw.ts_ns.max() // 1_000_000_000) // 60
        # the time since the last batch belongs to the window that batch was in
        now[0] += 10_000 if (prev[0] if prev[0] is not None else window) % 2 else 10**13
        prev[0] = window
        e.process(raw)
    e.finish()
    nodes = e.om_state()
    assert len(nodes) == 2 and all(n["switches"] >= 4 and n["rounds"] >= 6 for n in nodes)
    for n in nodes:
        label = ("packets", n["node"])
        assert metrics.om_switches.labels(*label)._value.get() == n["switches"]
        assert metrics.om_rounds.labels(*label)._value.get() == n["rounds"]
    # the tables of earlier plans left with their windows, none early
    assert metrics.lfta_flushes.labels("packets", "full")._value.get() == 0
    assert metrics.lfta_flushes.labels("packets", "window")._value.get() > 0
    slots = {qp.slot: qp.query for qp in plan.queries}
    job = SparkJob(spark, tmp_path / "spool", tmp_path / "results", tmp_path / "checkpoints",
                   lambda: slots, 5)
    job.run_available_now([(s, f) for s in plan.streams() for f in plan.folders(s)])
    want: dict = {"by_proto": defaultdict(lambda: [0, 0]), "udp_ports": defaultdict(
        lambda: [0, 0])}
    for ts, buf, wl in recs:
        p = fields_of(ts, buf, 1)
        if p["protocol"] is None:
            continue
        for name, key, ok in (("by_proto", "protocol", True),
                              ("udp_ports", "dst_port", p["protocol"] == 17)):
            if ok:
                acc = want[name][(int(ts) // 60, p[key])]
                acc[0] += 1
                acc[1] += wl
    for qp in plan.queries:
        key = qp.query.keys[0]
        got = {(r["t"], r[key]): [r["pkts"], r["bytes"]]
               for r in rows_of(qp.query, read_results(tmp_path / "results", qp.query))}
        assert got == dict(want[qp.query.name])


def test_a_finite_input_runs_no_om(tmp_path):
    """A replayed file has no arrival rate to chart: it arrives as fast as the engine reads it,
    which changes with whatever else the machine does (the same replay sent 0.5 or 1.4 rows
    a packet to Spark). Its engine (``finite``) keeps every node on ``lfta.capacity``, so the
    clock that flips the plans above at every window changes nothing."""
    from collector.config import LftaConfig, OmConfig
    path, _ = spread(tmp_path, "ok.pcap", 0.5)
    plan = build_plan(parse_queries(OM_QUERIES), **Settings(
        initial_queries=None, spark={"watermark_delay_s": 60}).plan_options())
    assert all(t.charts for t in plan.trees)
    now = [0]
    e = Engine(Spool(tmp_path / "spool"), "packets", Metrics(), watermark_delay_s=5,
               om=OmConfig(history=1), clock=lambda: now[0], finite=True)
    e.set_plan(plan)
    for raw in open_capture(path, batch_size=50):
        now[0] += 10_000 if int(raw.ts_ns.max() // 1_000_000_000) // 60 % 2 else 10**13
        e.process(raw)
    tables = [t.table for fp in e._c.folders for t in fp.tables]
    e.finish()
    assert e.om_state() == []
    assert len(tables) == 2 and all(x.capacity == LftaConfig().capacity for x in tables)


def test_two_daemons_sketches_unite_in_the_streaming_merge(spark, tmp_path):
    """approx_count_distinct through the streaming HFTA: two capture daemons each send a
    sketch per group, Spark's streaming merge unites them (its own branch of the merge, apart
    from the hash aggregation of the other rows), and the estimate equals the exact distinct
    count over both daemons' packets (these sets are small: HLL counts them exactly)."""
    from tests.reference import rows_of
    path, _ = spread(tmp_path, "ok.pcap", 0.5)
    queries = parse_queries("""
-- name: approx
SELECT time/60 AS t, src_ip, approx_count_distinct(dst_port) AS ports, count(*) AS n
FROM packets GROUP BY time/60, src_ip;
-- name: exact
SELECT time/60 AS t, src_ip, count(DISTINCT dst_port) AS ports, count(*) AS n
FROM packets GROUP BY time/60, src_ip
""")
    plan = build_plan(queries, **Settings(initial_queries=None,
                                          om={"enabled": False}).plan_options())
    two_daemons(spark, tmp_path, plan, path)
    got = {q.name: {(r["t"], r["src_ip"]): (r["ports"], r["n"])
                    for r in rows_of(q, read_results(tmp_path / "results", q))}
           for q in queries}
    assert len(got["exact"]) > 10 and got["approx"] == got["exact"]
    assert any(v[0] > 1 for v in got["exact"].values())
