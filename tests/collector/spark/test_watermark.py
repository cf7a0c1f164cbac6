"""Nothing reaches Spark late. Spark's watermark follows the latest window start its spool files
held, and a row of an earlier window that arrives after it is dropped: so whatever the
engine writes (an early flush of a full table, a heartbeat) must never close a window whose
partials are still to come. The tests play Spark: they read the spool's files in order, as
Spark's file source does, keep its watermark and count the rows that would arrive late (none
may), and every window closed holds every packet of it, as dpkt counts them.

- Heartbeats close quiet windows, never one a live source has still to read: the collector
  follows a capture that grows in real time while its engine stalls for seconds (what a plan
  compile under a burst of registrations, a pause or a slow disk does).
- Spark's watermark lags the latest window start by the period and the delay, so a table that
  fills early in a window closes nothing the folder's other tables, or another engine a little
  behind, still hold; a batch that spans windows takes the rows of those its flush closes from
  every table."""

from __future__ import annotations

import threading
import time
from collections import Counter

import dpkt
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from prometheus_client import generate_latest

from capture.pcap import open_capture
from capture.records import RawBatch
from collector.config import LftaConfig, OmConfig, SourceConfig, load_settings
from collector.daemon.service import Collector
from collector.daemon.sources import Alignment
from collector.metrics import Metrics
from collector.pipeline.engine import Engine
from collector.pipeline.spool import Spool, list_files
from planner.plan import build_plan
from planner.query import parse_queries
from tests.pipelines import shifted, spread
from tests.processes import Feeder, metric

PERIOD = 2  # a window two seconds long: a heartbeat at now - 1 s may fall inside one
STALL_S = 7  # longer than any idle time a heartbeat waits for


def spark_view(folder, period: int, delay_s: int = 1) -> tuple[Counter, int, int]:
    """(counts per (node, window start), rows Spark would drop as late, the final watermark in
    s) from a spool folder's files read in order; Spark's watermark lags the latest window
    start by the period and the delay (collector/spark/merge.py)."""
    counts: Counter = Counter()
    late, top = 0, None
    for f in sorted(list_files(folder), key=lambda p: p.name):
        t = pq.read_table(f, columns=["window_start", "node", "cnt"])
        ws = [us // 1_000_000 for us in pc.cast(t.column("window_start"), pa.int64()).to_pylist()]
        watermark = None if top is None else top - period - delay_s
        for w, node, n in zip(ws, t.column("node").to_pylist(), t.column("cnt").to_pylist(),
                              strict=True):
            if watermark is not None and w < watermark:
                late += 1
            elif node:
                counts[node, w] += n
        top = max([top, *ws] if top is not None else ws)
    return counts, late, top - period - delay_s


def read(c: Collector) -> float:
    return metric(generate_latest(c.metrics.registry).decode(), "flowsieve_packets_in_total",
                  'source="traffic"')


@pytest.mark.slow  # waits out real heartbeats
def test_a_heartbeat_never_closes_what_a_stalled_source_has_not_read(tmp_path, monkeypatch):
    path = tmp_path / "traffic.pcap"
    feeder = Feeder(path, per_tick=20)
    queries = tmp_path / "q.sql"
    queries.write_text(f"SELECT time/{PERIOD} AS t, count(*) AS n FROM packets "
                       f"GROUP BY time/{PERIOD}")
    src = SourceConfig(type="pcap", name="traffic", path=str(path), follow=True)
    c = Collector(load_settings(var_dir=tmp_path / "var", initial_queries=str(queries),
                                sources=[src], batch_size=64, spark={"trigger_s": 0.2}))
    real, calls = Engine.process, [0]

    def process(self, raw, *args, **kw):
        calls[0] += 1
        if calls[0] == 5:
            time.sleep(STALL_S)  # the source's thread stalls; the daemon's clock runs on
        return real(self, raw, *args, **kw)
    monkeypatch.setattr(Engine, "process", process)
    feeder.start()
    c.start(with_sources=True, with_spark=False)
    try:
        deadline = time.monotonic() + 60
        while calls[0] < 6 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert calls[0] >= 6, "the stall did not happen"
        time.sleep(3)  # heartbeats after the stall, as the source reads its backlog
        feeder.stop.set()
        feeder.join(10)
        while read(c) < feeder.written and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1)  # the heartbeats and commits of the time read last
    finally:
        feeder.stop.set()
        c.stop()
    counts, late, watermark = spark_view(c.settings.spool_dir / "packets" / str(PERIOD), PERIOD)
    counts = Counter({w: n for (_, w), n in counts.items()})  # one query, one node
    with open(path, "rb") as fh:
        truth = Counter(int(ts) // PERIOD * PERIOD for ts, _ in dpkt.pcap.Reader(fh))
    assert late == 0
    closed = sorted(w for w in truth if w < watermark)
    assert len(closed) >= (STALL_S + 3) // PERIOD  # the stalled time's windows closed too
    assert {w: counts[w] for w in closed} == {w: truth[w] for w in closed}


def two_tables(period: int):
    """A plan of two queries of one folder, a table each (no tree): the first one's groups
    are the packets' connections (a 16-slot table fills), the second one's their TTLs."""
    queries = parse_queries(
        f"SELECT time/{period} AS t, src_ip, dst_ip, src_port, dst_port, count(*) AS n "
        f"FROM packets GROUP BY time/{period}, src_ip, dst_ip, src_port, dst_port;\n"
        f"SELECT time/{period} AS t, ttl, count(*) AS n FROM packets GROUP BY time/{period}, ttl")
    return build_plan(queries, aggregate_tree=False)


def engine_of(spool: Spool, probe: str, plan) -> Engine:
    e = Engine(spool, "packets", Metrics(), probe, 1, lfta=LftaConfig(capacity=16, max_load=0.5),
               om=OmConfig(enabled=False))
    e.set_plan(plan)
    return e


def full_flushes(e: Engine) -> float:
    return metric(generate_latest(e.metrics.registry).decode(), "flowsieve_lfta_flushes_total",
                  'reason="full",stream="packets"')


@pytest.mark.parametrize("batch", [32, 1024])
def test_an_early_flush_takes_the_windows_it_closes_from_every_table(tmp_path, batch):
    """A table fills inside a window; with batches of a third of a second its flush closes
    nothing the other table holds; a batch of the whole capture (8.5 s) holds four windows,
    and the rows of the earliest go with the flush of the latest."""
    path, recs = spread(tmp_path, "ok.pcap", 0.01)  # 851 packets over 8.5 s
    period = 2
    spool = Spool(tmp_path / "spool", 1 << 30, "block", 0.0)
    engine = engine_of(spool, "probe", two_tables(period))
    for raw in open_capture(path, batch):
        engine.process(raw)
    engine.finish()
    counts, late, _ = spark_view(spool.folder("packets", str(period)), period)
    assert full_flushes(engine) > 0  # the precondition: tables filled inside windows
    assert late == 0
    truth = Counter(int(ts) // period * period for ts, _, _ in recs)
    nodes = {node for node, _ in counts}
    assert len(nodes) == 2
    for node in nodes:
        assert {w: n for (x, w), n in counts.items() if x == node} == truth


def test_an_engine_a_little_behind_another_loses_nothing(tmp_path):
    """Two engines (two sources of a daemon, or two probes) write one folder; the second reads
    half a second behind the first. Rows of the first one's full tables reach Spark before the
    second has read the end of the window before: they must not close it."""
    path, recs = spread(tmp_path, "ok.pcap", 0.01)
    period = 2
    spool = Spool(tmp_path / "spool", 1 << 30, "block", 0.0)
    plan = two_tables(period)
    ahead, behind = engine_of(spool, "ahead", plan), engine_of(spool, "behind", plan)
    batches = list(open_capture(path, 25))  # a quarter of a second each
    for i in range(len(batches) + 2):
        if i < len(batches):
            ahead.process(batches[i].slice(0, len(batches[i]) // 2))
        if i >= 2:  # two batches (half a second) behind
            behind.process(batches[i - 2].slice(len(batches[i - 2]) // 2,
                                                len(batches[i - 2])))
    ahead.finish(close=False)  # as the daemon ends them: the last one closes the windows
    behind.finish(ahead.max_time)
    assert full_flushes(ahead) > 0
    counts, late, _ = spark_view(spool.folder("packets", str(period)), period)
    assert late == 0
    truth = Counter(int(ts) // period * period for ts, _, _ in recs)
    for node in {node for node, _ in counts}:
        assert {w: n for (x, w), n in counts.items() if x == node} == truth





@pytest.mark.parametrize(("shift", "batch"), [(6, 64), (6, 4096), (3600, 64)])
def test_files_read_with_their_own_times_keep_in_step(tmp_path, shift, batch):
    """Two files read once, with their own times, by one daemon: the second holds the first's
    packets ``shift`` seconds later (two taps of one link, or a capture of the hour after).
    Read freely, whichever ran ahead would close windows in Spark before the other's tuples
    of them came (six late rows in the overlapping case). Aligned, no row comes late and
    every window holds both files' packets; a batch of the whole file (4096) is split where
    the other source's next packet says."""
    a, recs = spread(tmp_path, "ok.pcap", 0.01)  # 851 packets over 8.5 s
    b = shifted(a, tmp_path / "later.pcap", shift)
    queries = tmp_path / "q.sql"
    queries.write_text(f"SELECT time/{PERIOD} AS t, count(*) AS n FROM packets "
                       f"GROUP BY time/{PERIOD}")
    sources = [SourceConfig(type="pcap", name=n, path=str(p), loop=False, restamp=False)
               for n, p in (("a", a), ("b", b))]
    c = Collector(load_settings(var_dir=tmp_path / "var", initial_queries=str(queries),
                                sources=sources, batch_size=batch, spark={"trigger_s": 0.2}))
    run_to_end(c)
    assert_in_step(c.settings.spool_dir, recs, shift)


def run_to_end(c: Collector) -> None:
    """Start the daemon without Spark and stop it when sources a and b have finished."""
    c.start(with_sources=True, with_spark=False)
    try:
        deadline = time.monotonic() + 60
        while any(c.source_state.get(n) != "finished" for n in "ab") and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.source_state == {"a": "finished", "b": "finished"}
    finally:
        c.stop()


def assert_in_step(spool_dir, recs, shift: int) -> None:
    """No row late, and every window holds the packets of both files (the second one's
    ``shift`` seconds later), as dpkt reads them."""
    counts, late, _ = spark_view(spool_dir / "packets" / str(PERIOD), PERIOD)
    assert late == 0
    truth = Counter(int(ts) // PERIOD * PERIOD for ts, _, _ in recs)
    truth.update(Counter(int(ts + shift) // PERIOD * PERIOD for ts, _, _ in recs))
    assert Counter({w: n for (_, w), n in counts.items()}) == truth


def raw_at(*seconds: float) -> RawBatch:
    """A batch of empty records at these times."""
    n = len(seconds)
    return RawBatch(np.zeros(1, np.uint8), np.zeros(n, np.int64), np.zeros(n, np.int32),
                    np.zeros(n, np.int32), (np.array(seconds) * 1e9).astype(np.int64),
                    np.ones(n, np.int32), np.zeros(n, np.int32))


def test_aligned_sources_advance_together_and_release_each_other():
    """The aligner's rules without a daemon: a source goes as far as the other's next record
    plus the slack; the one behind always can; one that idles, leaves or is stopped holds
    nobody back."""
    al = Alignment(1.0)
    al.join("a")
    al.join("b")
    stop = threading.Event()
    assert al.bound("a") == float("-inf")  # b's next record is not known yet
    got: list[tuple[str, list[float]]] = []

    def run(name, raw):
        for piece in al.pieces(name, raw, stop):
            got.append((name, [t / 1e9 for t in piece.ts_ns.tolist()]))
        al.leave(name)
    ta = threading.Thread(target=run, args=("a", raw_at(10, 11, 12, 13, 14)))
    ta.start()
    time.sleep(0.3)
    assert got == []  # a waits for b's first record
    tb = threading.Thread(target=run, args=("b", raw_at(11.5, 12.5)))
    tb.start()
    ta.join(5)
    tb.join(5)
    assert not ta.is_alive() and not tb.is_alive()
    # a up to b's 11.5 + 1; b up to a's 13 + 1; a's rest once b is done
    assert got == [("a", [10, 11, 12]), ("b", [11.5, 12.5]), ("a", [13, 14])]
    al.join("c")
    al.idle("c")  # a followed file at its end
    assert al.bound("a") == float("inf")
    al.join("d")
    stop.set()  # d never reports: a stop ends the wait
    assert list(al.pieces("a", raw_at(20), stop)) == []


def test_a_file_stopped_inside_its_batch_resumes_after_what_it_handed_over(tmp_path,
                                                                          monkeypatch):
    """Files in step hand their engines pieces of a batch (here each file is one batch of
    4096). The daemon stops while one file waits for the other in the middle of its batch,
    and starts again: each file resumes after the records it handed over, so every packet is
    counted once, and none late."""
    a, recs = spread(tmp_path, "ok.pcap", 0.01)
    b = shifted(a, tmp_path / "later.pcap", 2)
    queries = tmp_path / "q.sql"
    queries.write_text(f"SELECT time/{PERIOD} AS t, count(*) AS n FROM packets "
                       f"GROUP BY time/{PERIOD}")
    sources = [SourceConfig(type="pcap", name=n, path=str(p), loop=False, restamp=False)
               for n, p in (("a", a), ("b", b))]
    settings = load_settings(var_dir=tmp_path / "var", initial_queries=str(queries),
                             sources=sources, batch_size=4096,
                             spark={"trigger_s": 0.2}, spool={"commit_s": 0.01})
    real, calls = Engine.process, []

    def stalled_a(self, raw, source=None, *args, **kw):
        if source == "a" and sum(x == "a" for x, _ in calls) >= 3:
            c._stop.wait(60)  # a's fourth piece waits for the stop: b can go no further
        calls.append((source, len(raw)))
        return real(self, raw, source, *args, **kw)
    monkeypatch.setattr(Engine, "process", stalled_a)
    c = Collector(settings)
    c.start(with_sources=True, with_spark=False)
    deadline = time.monotonic() + 60
    while sum(s == "b" for s, _ in calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    c.stop()
    handed = {n: sum(k for s, k in calls if s == n) for n in "ab"}
    assert 0 < handed["b"] < len(recs)  # b stopped inside its one batch
    monkeypatch.setattr(Engine, "process", real)
    run_to_end(Collector(settings))
    assert_in_step(settings.spool_dir, recs, 2)


def test_a_file_read_ahead_resumes_after_what_its_engine_processed(tmp_path, monkeypatch):
    """A file read once alone is read ahead of its engine (the next batches unpacked on a
    thread of their own). Stopped while batches read ahead wait, the daemon starts again
    after the last batch its engine processed, not after what was read: every packet once."""
    a, recs = spread(tmp_path, "ok.pcap", 0.01)
    queries = tmp_path / "q.sql"
    queries.write_text(f"SELECT time/{PERIOD} AS t, count(*) AS n FROM packets "
                       f"GROUP BY time/{PERIOD}")
    settings = load_settings(var_dir=tmp_path / "var", initial_queries=str(queries),
                             sources=[SourceConfig(type="pcap", name="a", path=str(a),
                                                   loop=False, restamp=False)],
                             batch_size=64, spark={"trigger_s": 0.2},
                             spool={"commit_s": 0.01})
    real, calls, read = Engine.process, [], []
    prepare = Engine.prepare

    def stalled(self, raw, *args, **kw):
        if len(calls) >= 3:
            c._stop.wait(60)  # the fourth batch waits for the stop while the reader goes on
        calls.append(len(raw))
        return real(self, raw, *args, **kw)

    def reading(self, raw):
        read.append(len(raw))
        return prepare(self, raw)
    monkeypatch.setattr(Engine, "process", stalled)
    monkeypatch.setattr(Engine, "prepare", reading)
    c = Collector(settings)
    c.start(with_sources=True, with_spark=False)
    deadline = time.monotonic() + 60
    while len(read) < 6 and time.monotonic() < deadline:  # three read ahead of the fourth
        time.sleep(0.02)
    c.stop()
    assert sum(read) > sum(calls)  # batches were read ahead of the engine when it stopped
    monkeypatch.setattr(Engine, "process", real)
    c = Collector(settings)
    c.start(with_sources=True, with_spark=False)
    try:
        while c.source_state.get("a") != "finished" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.source_state == {"a": "finished"}
    finally:
        c.stop()
    counts, late, _ = spark_view(settings.spool_dir / "packets" / str(PERIOD), PERIOD)
    assert late == 0
    truth = Counter(int(ts) // PERIOD * PERIOD for ts, _, _ in recs)
    assert Counter({w: n for (_, w), n in counts.items()}) == truth


def test_files_at_the_same_nanosecond_both_go_on_without_slack():
    """Times are compared exactly (a float of epoch nanoseconds loses the last ones): two
    sources whose next records share one nanosecond both go on, with no slack at all."""
    al = Alignment(0.0)
    al.join("a")
    al.join("b")
    stop = threading.Event()
    t = 1_700_000_000_123_456_789
    got: dict[str, int] = {}

    def run(name):
        raw = raw_at(0, 0)
        raw.ts_ns[:] = t
        got[name] = sum(len(p) for p in al.pieces(name, raw, stop))
        al.leave(name)
    threads = [threading.Thread(target=run, args=(n,)) for n in "ab"]
    for th in threads:
        th.start()
    for th in threads:
        th.join(5)
    stop.set()
    assert got == {"a": 2, "b": 2}
