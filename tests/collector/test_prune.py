"""Leaving out what no answer needs (``results.needed_rows``, ``replay``'s ``prune_spool``): the
answers of the rows kept are the answers of all of them, whatever rows were spooled before
(``forced``); a query without HAVING or LIMIT keeps every row; a LIMIT keeps its ties; a LEFT
JOIN keeps the partners of the left groups Spark sees."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from capture.pcap import open_capture
from collector.config import Settings
from collector.engine import Engine
from collector.keys import KeyLayout
from collector.metrics import Metrics
from collector.replay import replay
from collector.results import (
    answers_of,
    needed_rows,
    node_runs,
    prune_rows,
    query_partials,
    read_results,
    rows_of,
)
from collector.spool import Spool, list_files, read_spool_file
from planner.plan import build_plan
from planner.query import parse_queries
from planner.slots import has_slot
from tests.conftest import capture

QUERIES = """
-- name: top_dst
SELECT time/10 AS t, dst_ip, count(*) AS n, sum(wirelen) AS bytes FROM packets
WHERE protocol = 6 GROUP BY time/10, dst_ip ORDER BY n DESC LIMIT 2;
-- name: busy_dst
SELECT time/10 AS t, dst_ip, count(*) AS n FROM packets WHERE dst_port < 1024
GROUP BY time/10, dst_ip HAVING count(*) >= 20;
-- name: fanout
SELECT time/10 AS t, src_ip, count(DISTINCT dst_port) AS ports FROM packets
WHERE protocol = 6 OR protocol = 17 GROUP BY time/10, src_ip HAVING count(DISTINCT dst_port) > 3;
-- name: quiet_src
SELECT time/10 AS t, src_ip, count(*) AS n, avg(wirelen) AS mean FROM packets
WHERE protocol = 6 GROUP BY time/10, src_ip HAVING avg(wirelen) < 200 ORDER BY n LIMIT 2;
-- name: by_proto
SELECT time/10 AS t, protocol, count(*) AS n FROM packets GROUP BY time/10, protocol;
-- name: one_port
SELECT time/10 AS t, dst_port, count(*) AS n FROM packets WHERE protocol = 17
GROUP BY time/10, dst_port ORDER BY n DESC LIMIT 1;
-- name: half_open
WITH syn AS (SELECT time/10 AS t, dst_ip, count(*) AS n FROM packets
             WHERE (tcp_flags & 18) = 2 GROUP BY time/10, dst_ip),
     ack AS (SELECT time/10 AS t, src_ip, count(*) AS n FROM packets
             WHERE (tcp_flags & 18) = 18 GROUP BY time/10, src_ip)
SELECT syn.t AS t, syn.dst_ip AS host, syn.n - coalesce(ack.n, 0) AS open
FROM syn LEFT JOIN ack ON syn.t = ack.t AND syn.dst_ip = ack.src_ip
WHERE syn.n - coalesce(ack.n, 0) >= 0;
-- name: asym
WITH o AS (SELECT time/10 AS t, src_ip, count(*) AS n FROM packets WHERE protocol = 17
           GROUP BY time/10, src_ip),
     i AS (SELECT time/10 AS t, dst_ip, count(*) AS n FROM packets WHERE protocol = 17
           GROUP BY time/10, dst_ip)
SELECT o.t AS t, o.src_ip AS host, o.n - i.n AS d FROM o JOIN i
ON o.t = i.t AND o.src_ip = i.dst_ip WHERE o.n - i.n > 2
ORDER BY d DESC LIMIT 3
"""


def spooled(tmp_path, queries):
    """The plan, and every partial row an engine spools of a capture of 4 ten-second windows
    (many services), punctuation left out."""
    plan = build_plan(queries)
    spool = Spool(tmp_path / "spool")
    engine = Engine(spool, "packets", Metrics(), watermark_delay_s=1, finite=True)
    engine.set_plan(plan)
    for raw in open_capture(capture("var-services-std-ports.pcap"), batch_size=64):
        engine.process(raw)
    engine.finish()
    rows = pa.concat_tables([read_spool_file(f) for f in list_files(spool.root / "packets/10")])
    rows = rows.filter(pa.compute.not_equal(rows.column("node"), ""))
    return plan, rows


def answers(rows, resolve) -> dict:
    """Each query's answer rows (a query without one has none: Spark writes nothing)."""
    out = {q.name: sorted(map(repr, rows_of(q, a)))
           for q, a in answers_of("packets", "10", rows, resolve)}
    return {name: r for name, r in out.items() if r}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    plan, rows = spooled(tmp_path_factory.mktemp("prune"), parse_queries(QUERIES))
    resolve = {qp.slot: qp.query for qp in plan.queries}.get
    return plan, rows, resolve, answers(rows, resolve)


def test_the_rows_kept_answer_as_all_of_them(case):
    plan, rows, resolve, want = case
    kept = prune_rows("packets", rows, resolve)
    assert answers(kept, resolve) == want
    need = np.logical_or.reduce(list(needed_rows("packets", rows, resolve).values()))
    assert all(want[name] for name in ("top_dst", "busy_dst", "fanout", "quiet_src",
                                       "half_open", "asym"))
    assert need.sum() < len(need)
    # a query without HAVING or LIMIT keeps its every row
    slot = next(qp.slot for qp in plan.queries if qp.query.name == "by_proto")
    for label in set(rows.column("node").to_pylist()):
        at = np.flatnonzero(rows.column("node").to_numpy(zero_copy_only=False) == label)
        _, pattern = KeyLayout.parse("packets", label).decode(rows.column("key").take(at))
        assert need[at[has_slot(pattern, slot)]].all()


def test_a_distinct_count_s_having_keeps_the_rows_of_its_answer_s_groups_only(case):
    """``fanout`` (HAVING count(DISTINCT dst_port) > 3), counted here in Python: its slot
    needs the rows of the groups with more than three ports, and no other (the groups with
    at most three rows are left out without their values counted)."""
    plan, rows, resolve, _ = case
    slot = next(qp.slot for qp in plan.queries if qp.query.name == "fanout")
    part = next(t for q, t in query_partials("packets", rows.append_column(
        "_row", pa.array(np.arange(rows.num_rows))), resolve) if q.name == "fanout")
    ports: dict = {}
    for ws, src, port in zip(*(part.column(c).to_pylist() for c in (
            "window_start", "src_ip", "dst_port")), strict=True):
        ports.setdefault((ws, src), []).append(port)
    passing = {k for k, v in ports.items() if len({p for p in v if p is not None}) > 3}
    small = {k for k, v in ports.items() if len(v) <= 3}  # rows
    assert passing and small, "groups that pass, and groups too small to"
    want = sorted(r for ws, src, r in zip(*(part.column(c).to_pylist() for c in (
        "window_start", "src_ip", "_row")), strict=True) if (ws, src) in passing)
    assert np.flatnonzero(needed_rows("packets", rows, resolve)[slot]).tolist() == want


def test_a_limit_keeps_its_ties_and_a_having_no_group_passes_keeps_nothing(tmp_path):
    """By hand: LIMIT 1 keeps the rows of every host tied first in its window (so Spark picks
    the same host whatever order its rows come in); a HAVING that no group passes keeps no
    row."""
    plan, rows = spooled(tmp_path, parse_queries("""
-- name: smallest
SELECT time/10 AS t, dst_ip, min(wirelen) AS lo FROM packets GROUP BY time/10, dst_ip
ORDER BY lo LIMIT 1;
-- name: never
SELECT time/10 AS t, src_ip, count(*) AS n FROM packets GROUP BY time/10, src_ip
HAVING count(*) > 1000000
"""))
    resolve = {qp.slot: qp.query for qp in plan.queries}.get
    by_slot = needed_rows("packets", rows, resolve)
    need = np.logical_or.reduce(list(by_slot.values()))
    everything = answers(rows, resolve)
    assert answers(prune_rows("packets", rows, resolve), resolve) == everything
    assert "never" not in everything and everything["smallest"]
    part = next(t for q, t in query_partials("packets", rows.append_column(
        "_row", pa.array(np.arange(rows.num_rows))), resolve) if q.name == "smallest")
    keys = list(zip(part.column("window_start").to_pylist(), part.column("dst_ip").to_pylist(),
                    strict=True))
    lo: dict = {}
    for k, v in zip(keys, part.column("min_wirelen").to_pylist(), strict=True):
        lo[k] = min(lo.get(k, v), v)
    first: dict = {}
    for (ws, _), v in lo.items():
        first[ws] = min(first.get(ws, v), v)
    tied = {k for k, v in lo.items() if v == first[k[0]]}
    assert len(tied) > len(first), "a window where hosts tie first"
    assert {k for k, r in zip(keys, part.column("_row").to_pylist(), strict=True)
            if need[r]} == tied
    assert need.sum() == sum(need[r] for r in part.column("_row").to_pylist()), \
        "of the other query's rows, none"



def test_rows_ordered_by_node_prune_as_the_rows_do(case):
    """``node_runs`` orders a folder's rows by node: a batch of one node (what the engine
    writes) is placed whole, without a copy; a batch of several (a file read back) is split.
    Pruning by the runs keeps the rows pruning the rows does, with the same query bits."""
    _, rows, resolve, want = case
    labels = rows.column("node").to_numpy(zero_copy_only=False)
    assert len(set(labels)) > 2
    one_each = [rows.filter(pa.array(labels == label)).combine_chunks()
                for label in sorted(set(labels), reverse=True)]
    for parts in ([rows], one_each):
        ordered, runs = node_runs(parts)
        assert ordered.num_rows == rows.num_rows
        assert list(runs) == sorted(runs) == sorted(set(labels))
        assert [b for _, (a, b) in runs.items()][-1] == rows.num_rows
        for label, (a, b) in runs.items():
            assert set(ordered.column("node").slice(a, b - a).to_pylist()) == {label}
        assert sorted(map(repr, ordered.to_pylist())) == sorted(map(repr, rows.to_pylist()))
        by_runs = prune_rows("packets", ordered, resolve, runs=runs)
        assert sorted(map(repr, by_runs.to_pylist())) == \
            sorted(map(repr, prune_rows("packets", rows, resolve).to_pylist()))
        assert answers(by_runs, resolve) == want
    # the engine's shape: each batch of one node is the very same memory
    ordered, _ = node_runs(one_each)
    placed = {c.buffers()[2].address for c in ordered.column("key").chunks}
    assert placed == {t.column("key").chunks[0].buffers()[2].address for t in one_each}

@given(st.data())
def test_groups_spooled_before_are_kept_whole(case, data):
    """Rows spooled before (a full table's, an aged table's) are in Spark whatever
    ``needed_rows`` says: every group they touch keeps all its rows, and a LEFT JOIN's left
    group in Spark keeps its right partner (else Spark would join it to NULL)."""
    _, rows, resolve, want = case
    forced = np.zeros(rows.num_rows, bool)
    forced[data.draw(st.lists(st.integers(0, rows.num_rows - 1), max_size=24))] = True
    kept = prune_rows("packets", rows, resolve, forced=forced)
    assert answers(kept, resolve) == want
    assert set(rows.column("key").filter(pa.array(forced)).to_pylist()) <= \
        set(kept.column("key").to_pylist()), "a forced row is kept as it is"



def test_a_distinct_count_s_rows_become_value_sets_that_spark_merges(case, spark, tmp_path):
    """The rows only a count(DISTINCT f) query needs become a row per (window, its keys) with
    the distinct values of f (``vals``): fewer rows, the same answers. Spark merges such rows
    of several writers, each holding part of a group's values (overlapping) and of its
    counts: the answers are those of all the rows."""
    import pyarrow.compute as pc

    from collector.metrics import Metrics
    from collector.spark.job import SparkJob
    from collector.spool import as_spool_table

    _, rows, resolve, want = case
    plain = prune_rows("packets", rows, resolve, sets=False)
    sets = prune_rows("packets", rows, resolve)
    has = pc.is_valid(sets.column("vals")).to_numpy(zero_copy_only=False)
    assert has.any() and sets.num_rows < plain.num_rows
    assert {label.split("#")[0] for label in sets.column("node").filter(pa.array(has))
            .to_pylist()} == {"+dst_port,src_ip"}, "the fanout query's rows"
    assert answers(sets, resolve) == answers(plain, resolve) == want
    # two writers: the first holds each set's first half of values and the counts, the
    # second the other half and the first value again, with no counts of its own
    lists = sets.column("vals").to_pylist()
    first = [v if v is None else v[:max(1, len(v) // 2)] for v in lists]
    second = [v if v is None else [*v[len(v) // 2:], v[0]] for v in lists]
    a = sets.set_column(sets.column_names.index("vals"), "vals",
                        pa.array(first, sets.schema.field("vals").type))
    b = sets.set_column(sets.column_names.index("vals"), "vals",
                        pa.array(second, sets.schema.field("vals").type)).filter(pa.array(has))
    b = b.set_column(b.column_names.index("cnt"), "cnt", pa.array(np.zeros(b.num_rows, np.int64)))
    for c in b.column_names:
        if c.split("_", 1)[0] in ("sum", "min", "max"):
            b = b.set_column(b.column_names.index(c), c, pa.nulls(b.num_rows, pa.int64()))
    spool = Spool(tmp_path / "spool")
    for t in (a, b):
        spool.write("packets", "10", as_spool_table("packets", "10", t), "force")
    job = SparkJob(spark, tmp_path / "spool", tmp_path / "results", tmp_path / "ck", resolve,
                   1, Metrics(), keep_answers=True)
    job.run_batch([("packets", "10")], sets=True)
    got = {}
    for q in {resolve(s).name: resolve(s) for s in range(64) if resolve(s)}.values():
        if q.parent is None:
            got[q.name] = sorted(map(repr, rows_of(q, job.answer(q))))
    for name, r in want.items():
        if name in got:
            assert got[name] == r, name
    assert got["fanout"]

def test_replay_leaves_out_rows_and_answers_the_same(spark, tmp_path, monkeypatch):
    """Through replay and Spark: the same answers with and without leaving rows out, and the
    rows left out counted; also when the rows kept in memory outgrow their bound (they go to
    files and are pruned from there), when the rows are pruned a window at a time (from
    memory, from files) and when a window outgrows its bound (merged whole), or with the
    LFTA off, the files theirs (merged whole); and on one thread (one run) as on several."""
    import collector.replay as replay_module

    got, pruned, spooled_rows, files, chunks = {}, {}, {}, {}, {}
    window_chunks = replay_module.window_chunks
    big = 512 << 20
    cases = {"off": (False, big, big, big), "memory": (True, big, big, big),
             "files": (True, 1, big, big), "windows": (True, big, 1, big),
             "file_windows": (True, 1, 1, big), "whole": (True, 1, big, 0),
             "per_tuple": (True, 1, big, big), "per_tuple_whole": (True, 1, big, big),
             "one_thread": (True, big, big, big)}
    for case, (prune, memory_bytes, chunk_bytes, window_bytes) in cases.items():
        monkeypatch.setattr(replay_module, "PRUNE_MAX_THREADS", 1 if case == "one_thread" else 4)
        monkeypatch.setattr(replay_module, "PRUNE_PER_TUPLE_FILE_BYTES",
                            0 if case == "per_tuple_whole" else big)
        monkeypatch.setattr(replay_module, "PRUNE_MEMORY_BYTES", memory_bytes)
        monkeypatch.setattr(replay_module, "PRUNE_CHUNK_BYTES", chunk_bytes)
        monkeypatch.setattr(replay_module, "PRUNE_MAX_BYTES", window_bytes)
        chunks[case] = []
        monkeypatch.setattr(replay_module, "window_chunks", lambda w, b, parts=1, case=case: (
            chunks[case].extend(cut := window_chunks(w, b, parts)) or cut))
        m = Metrics()
        res = replay(capture("var-services-std-ports.pcap"), parse_queries(QUERIES),
                     tmp_path / case, spark, metrics=m,
                     settings=Settings(initial_queries=None, replay_prune=prune,
                                       lfta={"enabled": not case.startswith("per_tuple")}))
        assert res.error is None
        got[case] = {q.name: sorted(map(repr, rows_of(q, t))) for q, t in res.answers}
        for q, t in res.answers:  # replay's answers are those it wrote
            assert t.equals(read_results(tmp_path / case / "results", q)), q.name
        pruned[case], spooled_rows[case], files[case] = (
            sum(s.value for x in c.collect() for s in x.samples if s.name.endswith("_total"))
            for c in (m.spool_pruned, m.spool_rows, m.spool_files))
    for case in cases:
        assert got[case] == got["off"], case
    assert got["off"]["asym"] and got["off"]["half_open"]
    assert 0 < pruned["memory"] == pruned["files"] < spooled_rows["memory"]
    assert pruned["windows"] == pruned["file_windows"] == pruned["memory"] == \
        pruned["one_thread"]
    assert len(chunks["one_thread"]) == 1 < len(chunks["windows"]) == len(chunks["file_windows"])
    if replay_module.prune_threads() > 1:  # runs for the threads, pruned at once
        assert 1 < len(chunks["memory"]) < len(chunks["windows"])
    assert pruned["off"] == pruned["whole"] == pruned["per_tuple_whole"] == 0
    assert pruned["per_tuple"] > pruned["memory"], "a row per tuple: more rows left out"
    assert len({v for k, v in spooled_rows.items() if not k.startswith("per_tuple")}) == 1, \
        "every case with the LFTA spools the same rows"
    assert files["memory"] < files["off"], "a batch kept in memory is no file"


def test_window_chunks_are_runs_of_whole_windows_within_their_bytes():
    """Hand-worked: windows 0, 60, 120 and 180 hold 10, 5 + 10, 10 and 40 bytes over two
    sources; runs of at most 25 bytes, a window too large for any run alone."""
    from collector.replay import window_chunks
    a = (np.array([0, 60, 120]), np.array([10.0, 10.0, 10.0]))
    b = (np.array([60, 180]), np.array([5.0, 40.0]))
    assert window_chunks([a, b], 25) == [(0, 60, 25.0), (120, 120, 10.0), (180, 180, 40.0)]
    assert window_chunks([a, b], 1000) == [(0, 180, 75.0)]
    assert window_chunks([], 25) == window_chunks([(np.array([]), np.array([]))], 25) == []
    # for two threads, halves of the 75 bytes: window 120 takes the run to 35 (its half to
    # 30, within 37.5), window 180 would take it to 55 (its half: 55 > 37.5)
    assert window_chunks([a, b], 1000, 2) == [(0, 120, 35.0), (180, 180, 40.0)]
    assert window_chunks([a, b], 25, 2) == window_chunks([a, b], 25)
