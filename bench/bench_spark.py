"""Spark at scale (issue 12): end to end, Spark included, on a backbone-shaped trace and on the
peers' uniform trace, with 1, 10 and 50 queries, in three modes:

- ``full``: prefilter + LFTA + aggregate trees + the HFTA on Spark's executors (``flowsieve
  replay``'s path; ``replay_workers`` 0: on 2 cores one process reads the capture);
- ``full_2proc``: ``full`` with the capture read by two processes (``replay_workers`` 2);
- ``per_tuple``: the same with the LFTA off: one spool row per tuple and node (the old path);
- ``full_arrow``: ``full`` with the Arrow IPC spool read by flowsieve's Python data source as
  a stream (the spool format the Parquet default was measured against);
- ``batch`` (the fair baseline, bench/spark_sql.py): what a competent Spark user writes for a
  finite capture: the decoded fields as a Parquet DataFrame, cached and counted before the
  clock starts, one Spark SQL statement per query, Spark's default JVM options; only the
  statements (their rows collected) are timed;
- ``naive``: the streaming baseline: the tuples (flowsieve's decoder, every field the
  queries read, no prefilter) as Parquet, and one Spark streaming query per registered query.

Every mode's answers must equal a numpy truth computed from the trace generator's own arrays
(bench/spark_queries.py), or the run fails. Each run is a fresh process (its JVM start timed
apart; peak RSS of the process tree — Python, the JVM, Spark's Python workers — sampled).
Also: the fixed cost of ``flowsieve replay`` on the 851-packet sample capture, and seed 002's
comparison (aggregate tree vs one LFTA table per query, the engine alone).

``python bench/bench_spark.py [--quick]``; figures in ``bench/results/spark.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import CACHE, answer_rows, spark_rows, write_result  # noqa: E402
from bench.spark_queries import (  # noqa: E402
    backbone_sql,
    canonical,
    columns,
    paper_sql,
    peer_sql,
    truth,
)
from bench.traces import trace  # noqa: E402
from planner.query import parse_queries  # noqa: E402

SIZES = {"backbone": 6_000_000, "uniform": 3_000_000}
QUICK = {"backbone": 400_000, "uniform": 200_000}
SETS = (1, 10, 50)


# ----------------------------------------------------------------------------- one run
class TreeRss:
    """Peak resident memory of this process and of its descendants (the JVM, Spark's Python
    workers), sampled from /proc every 0.2 s."""

    def __init__(self):
        self.me = os.getpid()
        self.peak_self = self.peak_total = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    @staticmethod
    def _rss(pid: int) -> int:
        try:
            with open(f"/proc/{pid}/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            return 0

    def _tree(self) -> list[int]:
        kids: dict[int, list[int]] = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                kids.setdefault(ppid, []).append(int(d))
        out, todo = [], [self.me]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo += kids.get(pid, [])
        return out

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            pids = self._tree()
            own = self._rss(self.me)
            self.peak_self = max(self.peak_self, own)
            self.peak_total = max(self.peak_total, own + sum(self._rss(p) for p in pids[1:]))

    def stop(self) -> dict:
        self._stop.set()
        self._t.join()
        return {"peak_rss_python_mib": self.peak_self / 2**20,
                "peak_rss_total_mib": self.peak_total / 2**20}


def start_spark(app_name: str, capture: Path):
    """Spark as ``flowsieve replay`` starts it for ``capture`` (default settings; C1 only for a
    small capture, fewer compiles for a larger one), timed: (session, JVM start s)."""
    from collector.config import Settings, cache_dir
    from collector.spark.session import QUICK_START_BYTES, build_session, class_archive_path
    s = Settings(initial_queries=None).spark
    t0 = time.perf_counter()
    spark = build_session(s.master, s.driver_memory, s.shuffle_partitions,
                          s.state_store == "rocksdb", app_name=app_name,
                          class_archive=class_archive_path(cache_dir()),
                          quick_start=capture.stat().st_size < QUICK_START_BYTES,
                          one_shot=True)
    return spark, time.perf_counter() - t0


def stop_spark(spark) -> None:
    """Stop the session and wait for its JVM to exit (it exits at the end of its stdin): a
    JVM still shutting down when its Python process has gone (a naive plan's took 1-2 s at
    over a core) shared the machine with the next measured run."""
    from pyspark import SparkContext
    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)
    spark.stop()
    if gateway is not None:
        gateway.shutdown()
    if proc is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _sql(kind: str, p: dict) -> str:
    return backbone_sql(p) if kind == "backbone" else peer_sql()


def run_one(mode: str, kind: str, n: int, nq: int, out: Path) -> None:
    """One measured run in this (fresh) process; writes its figures and answers to ``out``."""
    from collector.config import Settings

    path, p = trace(kind, n, CACHE)
    queries = parse_queries(_sql(kind, p))[:nq]
    packets = len(p["proto"])
    del p  # the generator's arrays are the orchestrator's truth, not part of this run
    rss = TreeRss()
    if mode == "batch":
        from bench.spark_sql import start_session
        spark, jvm_s = start_session("bench-spark-batch")
    else:
        spark, jvm_s = start_spark("bench-spark", path)
    work = Path(tempfile.mkdtemp(prefix=f"bench-spark-{mode}-", dir=CACHE))
    stages: dict[str, float] = {}
    t1 = time.perf_counter()
    if mode == "batch":
        answers, rows_in, t1 = _batch(spark, path, queries, work, stages)
        done = True
    elif mode == "naive":
        answers, rows_in, done = _naive(spark, path, queries, work, stages, t1)
    else:
        from api.replay import replay
        from collector.metrics import Metrics
        settings = Settings(initial_queries=None, lfta={"enabled": mode != "per_tuple"},
                            spool={"format": "arrow" if mode == "full_arrow" else "parquet"},
                            replay_workers=2 if mode == "full_2proc" else 0)
        metrics = Metrics()

        def progress(stage: str, records) -> None:
            stages.setdefault(stage.split(":")[0], time.perf_counter() - t1)
        res = replay(path, queries, work, spark, settings=settings, metrics=metrics,
                     progress=progress)
        answers = {q.name: t for q, t in res.answers}
        stages.update({f"spark_{k}": v for k, v in res.timings.items()})
        rows_in = spark_rows(metrics)
        stages["reading_processes"] = res.workers
        done = True
    wall = time.perf_counter() - t1  # the answers are written; reading them back is not timed
    if mode == "batch":
        wall = stages["statements"]  # its rows printed outside the clock
    if mode != "batch":
        answers = {q.name: answer_rows(q, answers[q.name]) if q.name in answers else []
                   for q in queries}
    stop_spark(spark)
    # the run's files go with it: their dirty pages would otherwise be written back while
    # the next run is measured (the naive plans write 70 MB to 1 GB)
    shutil.rmtree(work, ignore_errors=True)
    doc = {"mode": mode, "trace": kind, "packets": packets, "queries": nq,
           "jvm_start_s": jvm_s, "wall_s": wall, "stages_s": stages, "rows_into_spark": rows_in,
           "finished": done, **rss.stop(), "answers": answers}
    out.write_text(json.dumps(doc))


def raw_parquet(spark, path, need: list[str], work: Path):
    """A naive PySpark user's input: the capture's tuples (flowsieve's decoder, the fields
    ``need``) as Parquet in ``work/raw``, and a one-row stream ``work/punctuation`` whose time
    lies beyond every window. Returns (raw folder, punctuation folder, Spark schema, tuples)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from capture.pcap import open_capture
    from capture.unpack import unpack
    raw = work / "raw"
    raw.mkdir()
    parts, rows, last = [], 0, 0
    for i, batch in enumerate(open_capture(path, 1 << 16)):
        tb = unpack(batch, need)
        parts.append(pa.table({f: tb.arrow(f) for f in need}))
        rows += len(tb)
        last = max(last, int(tb.time.max()))
        if sum(t.num_rows for t in parts) >= 1_000_000:
            pq.write_table(pa.concat_tables(parts), raw / f"part-{i:06d}.parquet")
            parts = []
    if parts:
        pq.write_table(pa.concat_tables(parts), raw / "part-last.parquet")
    schema = pq.read_schema(next(raw.glob("*.parquet")))
    spark_schema = spark.read.parquet(str(next(raw.glob("*.parquet")))).schema
    # a last row beyond every window closes them: its own stream, joined to each query's
    # matching tuples after the filter (Spark pushes a filter below the watermark, which would
    # never see a punctuation row the filter drops)
    punct = work / "punctuation"
    punct.mkdir()
    pq.write_table(pa.table({f: pa.array([last + 7200 if f == "time" else None],
                                         schema.field(f).type) for f in need}),
                   punct / "punctuation.parquet")
    return raw, punct, spark_schema, rows


def _batch(spark, path, queries, work: Path, stages: dict):
    """The fair baseline: the decoded tuples as Parquet, cached and counted (not timed), then
    one Spark SQL statement per query (timed). Returns (answers, rows Spark read, the clock's
    start)."""
    from bench.spark_sql import cached_packets, run_queries
    from planner.plan import build_plan

    need = sorted(build_plan(queries, asc_min_constants=None).unpack_fields("packets")
                  - {"ts"})
    raw, _, _, _ = raw_parquet(spark, path, need, work)
    rows = cached_packets(spark, raw)
    t1 = time.perf_counter()
    answers, wall = run_queries(spark, queries)
    stages["statements"] = wall
    return answers, rows * len(queries), t1


def _naive(spark, path, queries, work: Path, stages: dict, t1: float):
    """Decoded tuples as Parquet, then one streaming aggregation per query (all at once, as
    a PySpark user starts them). Returns (answers, rows read by Spark, finished)."""
    import pyarrow as pa
    from pyspark.sql import functions as F

    from collector.spark.answers import finalize
    from planner.plan import build_plan

    need = sorted(build_plan(queries, asc_min_constants=None).unpack_fields("packets")
                  - {"ts"})
    raw, punct, spark_schema, rows = raw_parquet(spark, path, need, work)
    stages["spark"] = time.perf_counter() - t1
    got: dict[str, list] = {q.name: [] for q in queries}
    running = []
    for q in queries:
        df = (spark.readStream.schema(spark_schema).parquet(str(raw)).where(spark_where(q))
              .unionByName(spark.readStream.schema(spark_schema).parquet(str(punct)))
              .withColumn("window_start", F.timestamp_seconds(
                  F.floor(F.col("time") / q.period).cast("long") * q.period))
              .withWatermark("window_start", "1 seconds"))
        aggs = [F.count(F.lit(1)).alias("cnt")]
        for m in q.measures:
            aggs += [F.sum(m).alias(f"sum_{m}"), F.min(m).alias(f"min_{m}"),
                     F.max(m).alias(f"max_{m}")]
        agg = df.groupBy("window_start", *q.keys).agg(*aggs)

        def sink(bdf, _id, q=q):
            t = bdf.toArrow()
            if t.num_rows:
                got[q.name].append(t)
        running.append(agg.writeStream.outputMode("append").foreachBatch(sink)
                       .option("checkpointLocation", str(work / "ck" / q.name))
                       .trigger(availableNow=True).start())
    deadline = time.monotonic() + NAIVE_BUDGET_S
    done = True
    for sq in running:
        left = deadline - time.monotonic()
        if left <= 0 or not sq.awaitTermination(left):
            done = False
            break
        if sq.exception() is not None:
            done = False
            break
    for sq in running:
        sq.stop()
    answers = {q.name: finalize(q, _longs(pa.concat_tables(got[q.name])))
               for q in queries if got[q.name]}
    return answers, rows * len(queries), done


NAIVE_BUDGET_S = 600.0


def _longs(t):
    """Counts and measures as int64 (what finalize expects of partial rows)."""
    import pyarrow as pa
    cols = {}
    for name in t.column_names:
        c = t.column(name)
        if name == "cnt" or name[:4] in ("sum_", "min_", "max_"):
            c = c.cast(pa.int64())
        cols[name] = c
    return pa.table(cols)


def spark_where(q) -> str:
    """A query's WHERE clause in Spark SQL over the naive Parquet columns."""
    from bench.spark_sql import where_sql
    return where_sql(q)


# ------------------------------------------------------------------------------ orchestration
def measure(mode: str, kind: str, n: int, nq: int, timeout: float) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", dir=CACHE, delete=False) as f:
        out = Path(f.name)
    os.sync()  # each run starts with nothing left to write back
    cmd = [sys.executable, __file__, "--one", mode, kind, str(n), str(nq), str(out)]
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "trace": kind, "queries": nq, "finished": False,
                "failure": f"did not finish in {timeout:.0f} s"}
    if proc.returncode != 0 or not out.stat().st_size:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"mode": mode, "trace": kind, "queries": nq, "finished": False,
                "failure": " | ".join(tail), "process_s": time.perf_counter() - t}
    doc = json.loads(out.read_text())
    out.unlink()
    return doc


def check(doc: dict, queries, want: dict) -> bool:
    got = doc.pop("answers", None)
    if got is None or not doc.get("finished"):
        return False
    ok = True
    for q in queries:
        if canonical(q, got.get(q.name, [])) != want[q.name]:
            print(f"   MISMATCH {doc['mode']} {q.name}: {len(got.get(q.name, []))} rows vs "
                  f"{len(want[q.name])}", flush=True)
            ok = False
    return ok


CSV_TRACE = ("uniform", 3_000_000)


ENGINES = {"flowsieve": "python", "flowsieve_sql": "sql"}  # spark.answer_engine of each run


def csv_export(repeat: int, n: int) -> dict:
    """``flowsieve replay --format csv`` into a file, the whole command, with each answer
    engine (``ENGINES``), against batch PySpark doing the same 50 GROUP BYs (``pairs_sql``: an
    answer row per host pair and filter) over a cached decoded DataFrame (addresses as text,
    as a user writing CSV keeps them) and writing them with Spark's CSV writer, in the same
    run, alternating; every output's rows must be equal."""
    from bench.spark_queries import pairs_sql
    path, _ = trace(CSV_TRACE[0], n, CACHE)
    sql = CACHE / "pairs.sql"
    sql.write_text(pairs_sql())
    exe = Path(sys.executable).with_name("flowsieve")
    runs: dict[str, list] = {**{k: [] for k in ENGINES}, "batch": []}
    rows: dict[str, int] = {}
    for _ in range(repeat):
        doc = measure_csv_batch(n)
        runs["batch"].append(doc["wall_s"])
        want = doc["rows"]
        rows["batch"] = len(want)
        for name, engine in ENGINES.items():
            out = CACHE / "pairs-flowsieve.csv"
            os.sync()
            t = time.perf_counter()
            with open(out, "wb") as f:
                subprocess.run([str(exe), "replay", str(path), "--queries", str(sql),
                                "--format", "csv"], check=True, stdout=f,
                               stderr=subprocess.DEVNULL,
                               env={**os.environ, "FLOWSIEVE_SPARK__ANSWER_ENGINE": engine})
            runs[name].append(time.perf_counter() - t)
            got = _csv_rows(out)
            out.unlink()
            rows[name] = len(got)
            if got != want:
                raise SystemExit(f"CSV export: flowsieve's {len(got)} rows ({engine}) differ "
                                 f"from Spark's {len(want)}")
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"packets": n, "queries": 50, "answer_rows": rows["flowsieve"], "runs_s": runs,
            "median_s": med, "ratio": med["batch"] / med["flowsieve"],
            "ratio_sql": med["batch"] / med["flowsieve_sql"]}


GROUPS = 4_000_000  # the big window: every packet its own group (tests.helpers.many_groups)
GROUPS_SQL = ("-- name: pairs\nSELECT time/60 AS t, src_ip, dst_ip, src_port, count(*) AS n, "
              "sum(wirelen) AS b FROM packets GROUP BY time/60, src_ip, dst_ip, src_port\n")


def big_window(repeat: int, n: int) -> dict:
    """``flowsieve replay --format csv`` of one window of ``n`` groups (the driver-memory
    test's capture) with ``spark.driver_memory: 512m``, the whole command, with each answer
    engine, alternating; the outputs must be identical (the same rows in the same order) and
    hold a row per group. Peak RSS of the command's process tree (the JVM included)."""
    from tests.helpers import many_groups
    path = CACHE / f"groups-{n}.pcap"
    if not path.exists():
        many_groups(path, n)
    sql = CACHE / "groups.sql"
    sql.write_text(GROUPS_SQL)
    exe = Path(sys.executable).with_name("flowsieve")
    runs: dict[str, list] = {k: [] for k in ENGINES}
    rss: dict[str, list] = {k: [] for k in ENGINES}
    for _ in range(repeat):
        outs = {}
        for name, engine in ENGINES.items():
            out = CACHE / f"groups-{engine}.csv"
            os.sync()
            t = time.perf_counter()
            with open(out, "wb") as f:
                proc = subprocess.Popen(
                    [str(exe), "replay", str(path), "--queries", str(sql), "--format", "csv"],
                    stdout=f, stderr=subprocess.DEVNULL,
                    env={**os.environ, "FLOWSIEVE_SPARK__ANSWER_ENGINE": engine,
                         "FLOWSIEVE_SPARK__DRIVER_MEMORY": "512m"})
                peak = TreeRss()
                if proc.wait(timeout=1800):
                    raise SystemExit(f"big window: replay ({engine}) failed")
            runs[name].append(time.perf_counter() - t)
            rss[name].append(peak.stop()["peak_rss_total_mib"])
            outs[name] = out
        first, *others = (o.read_bytes() for o in outs.values())
        if any(o != first for o in others):
            raise SystemExit("big window: the engines' outputs differ")
        lines = first.count(b"\n")
        if lines != n + 1:  # a header, then a row per group
            raise SystemExit(f"big window: {lines - 1} rows, {n} groups")
        for o in outs.values():
            o.unlink()
    return {"groups": n, "driver_memory": "512m", "runs_s": runs,
            "median_s": {k: statistics.median(v) for k, v in runs.items()},
            "peak_rss_mib": {k: statistics.median(v) for k, v in rss.items()}}


def _csv_rows(path: Path) -> set:
    """(query, minute, source, destination, packets) of flowsieve's CSV."""
    import pyarrow.csv as pacsv
    t = pacsv.read_csv(path, convert_options=pacsv.ConvertOptions(
        include_columns=["query", "t", "src_ip", "dst_ip", "pkts"]))
    return set(zip(*(t.column(c).to_pylist() for c in t.column_names), strict=True))


def measure_csv_batch(n: int) -> dict:
    """The batch baseline of ``csv_export`` in a fresh process."""
    with tempfile.NamedTemporaryFile(suffix=".json", dir=CACHE, delete=False) as f:
        out = Path(f.name)
    os.sync()
    subprocess.run([sys.executable, __file__, "--csv-batch", str(n), str(out)], check=True,
                   capture_output=True, timeout=3600)
    doc = json.loads(out.read_text())
    out.unlink()
    doc["rows"] = {tuple(r) for r in doc["rows"]}
    return doc


def csv_batch(n: int, out: Path) -> None:
    """Spark's side of ``csv_export``: decode (addresses as text), Parquet, cache and count
    outside the clock; then each statement written by Spark's CSV writer, timed."""
    import pyarrow as pa
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    from bench.spark_queries import pairs_sql
    from bench.spark_sql import cached_packets, select_sql, spark_session
    from capture.pcap import open_capture
    from capture.unpack import unpack
    from collector.spark.answers import ip_strings
    from planner.plan import build_plan
    path, _ = trace(CSV_TRACE[0], n, CACHE)
    queries = parse_queries(pairs_sql())
    need = sorted(build_plan(queries, asc_min_constants=None).unpack_fields("packets") - {"ts"})
    work = Path(tempfile.mkdtemp(prefix="bench-csv-", dir=CACHE))
    try:
        raw = work / "raw"
        raw.mkdir()
        for i, batch in enumerate(open_capture(path, 1 << 20)):
            tb = unpack(batch, need)
            pq.write_table(pa.table({f: ip_strings(tb.arrow(f)) if f.endswith("_ip")
                                     else tb.arrow(f) for f in need}), raw / f"{i:05d}.parquet")
        spark = spark_session("bench-csv-batch")
        cached_packets(spark, raw)
        t0 = time.perf_counter()
        for q in queries:
            spark.sql(select_sql(q, text_ips=True)).write.csv(str(work / "out" / q.name),
                                                             header=True)
        wall = time.perf_counter() - t0
        rows = []
        for q in queries:
            t = ds.dataset(str(work / "out" / q.name), format="csv").to_table()
            rows += [[q.name, *r] for r in zip(*(t.column(c).to_pylist()
                                                for c in ("t", "src_ip", "dst_ip", "pkts")),
                                             strict=True)]
        spark.stop()
        out.write_text(json.dumps({"wall_s": wall, "rows": rows}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def fixed_cost(repeat: int) -> dict:
    """``flowsieve replay`` of the 851-packet sample capture, wall time, JVM start included."""
    exe = Path(sys.executable).with_name("flowsieve")
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run([str(exe), "replay", str(ROOT / "tests/data/pcap/ok.pcap"), "--queries",
                        str(ROOT / "collector/data/example.sql"), "--format", "csv"],
                       check=True, capture_output=True)
        times.append(time.perf_counter() - t)
    return {"median_s": statistics.median(times), "runs_s": times}


def _samples(path, queries, n: int) -> dict:
    """The tuple sample ``replay`` plans on (its measuring pass over the first tuples)."""
    from api.replay import measure
    from collector.config import Settings
    from collector.pipeline.spool import Spool
    from planner.plan import build_plan
    with tempfile.TemporaryDirectory(dir=CACHE) as d:
        return measure(path, build_plan(queries), Spool(d), Settings(initial_queries=None))[1]


def lfta_tree_vs_per_query(kind: str, n: int, repeat: int) -> dict:
    """Seed 002's comparison in the LFTA alone (tuples unpacked and prefiltered beforehand):
    the aggregate tree's tables vs one LFTA table per query, on the paper's kind of workload
    (overlapping group-bys, no filters; the paper's cost model, no HFTA term) and on the
    50-query set (flowsieve's model)."""
    import numpy as np

    from capture.pcap import open_capture
    from capture.unpack import unpack
    from collector.config import LftaConfig
    from collector.pipeline.compiled_prefilter import compile_prefilter
    from collector.pipeline.lfta import NodeTable
    from collector.pipeline.prefilter import run_prefilter
    from planner.plan import build_plan
    path, p = trace(kind, n, CACHE)
    out = {}
    for workload, sql, row_cost in (("paper", paper_sql(), 0.0),
                                    ("backbone50", _sql(kind, p), 200.0)):
        queries = parse_queries(sql)
        res = {}
        samples = _samples(path, queries, n)  # node sizes measured as replay measures them
        for name, tree in (("aggregate_tree", True), ("per_query", False)):
            plan = build_plan(queries, aggregate_tree=tree, hfta_row_cost=row_cost,
                              samples=samples)
            cp = compile_prefilter(plan, "packets")
            fields = plan.unpacking("packets").fields
            batches = []
            for raw in open_capture(path, 1 << 16):
                tb = unpack(raw, fields)
                _, Q = run_prefilter(cp, tb)
                keep = np.flatnonzero(Q.any(axis=1))
                batches.append((tb.take(keep), Q[keep]))
            times, rows = [], 0
            for _ in range(repeat):
                tables = [NodeTable("packets", t.period, keys, slots, cp.q_words, LftaConfig())
                          for t in plan.trees for keys, slots in t.maintained()]
                t0 = time.perf_counter()
                rows = 0
                for tb, Q in batches:
                    for t in tables:
                        rows += sum(x.num_rows for x in t.add(tb, Q, 0, 1, "bench"))
                for t in tables:
                    rows += len(t.table.flush_all())
                times.append(time.perf_counter() - t0)
            res[name] = {"median_s": statistics.median(times), "tables": len(tables),
                         "rows_out": rows}
        res["speedup"] = res["per_query"]["median_s"] / res["aggregate_tree"]["median_s"]
        out[workload] = res
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small traces, one repeat (smoke)")
    ap.add_argument("--one", nargs=5, metavar=("MODE", "TRACE", "N", "NQ", "OUT"))
    ap.add_argument("--csv-batch", nargs=2, metavar=("N", "OUT"))
    ap.add_argument("--csv-only", action="store_true", help="the CSV export comparison only")
    ap.add_argument("--groups-only", action="store_true",
                    help="4M groups in one window with a 512 MiB driver, each answer engine")
    ap.add_argument("--headline", action="store_true",
                    help="the backbone trace's 1 and 50 queries (full, batch and naive at 50), "
                    "the CSV export and the 851-packet replay: the runs the targets name")
    args = ap.parse_args()
    if args.csv_batch:
        csv_batch(int(args.csv_batch[0]), Path(args.csv_batch[1]))
        return 0
    if args.csv_only:
        doc = csv_export(1 if args.quick else 3, QUICK["uniform"] if args.quick
                         else CSV_TRACE[1])
        print(json.dumps({k: v for k, v in doc.items() if k != "runs_s"}), flush=True)
        if not args.quick:  # the figure replaces the last full run's in results/spark.json
            res = Path(__file__).resolve().parent / "results" / "spark.json"
            whole = json.loads(res.read_text()) if res.exists() else {}
            write_result("spark", {**whole, "csv_export": doc})
        return 0
    if args.groups_only:
        doc = big_window(1 if args.quick else 3, 100_000 if args.quick else GROUPS)
        print(json.dumps({k: v for k, v in doc.items() if k != "runs_s"}), flush=True)
        if not args.quick:
            res = Path(__file__).resolve().parent / "results" / "spark.json"
            whole = json.loads(res.read_text()) if res.exists() else {}
            write_result("spark", {**whole, "big_window": doc})
        return 0
    if args.one:
        mode, kind, n, nq, out = args.one
        run_one(mode, kind, int(n), int(nq), Path(out))
        return 0
    sizes = QUICK if args.quick else SIZES
    if args.headline:
        sizes = {"backbone": sizes["backbone"]}
    repeat = 1 if args.quick else 3
    CACHE.mkdir(exist_ok=True)
    results: dict = {"sizes": sizes, "runs": [], "failures": []}
    first = True
    for kind, n in sizes.items():
        path, p = trace(kind, n, CACHE)
        queries = parse_queries(_sql(kind, p))
        cols = columns(p)
        print(f"== {kind}: {len(p['proto']):,} packets, {path.stat().st_size / 2**20:,.0f} MiB",
              flush=True)
        wants = {nq: {q.name: canonical(q, truth(q, p, cols)) for q in queries[:nq]}
                 for nq in SETS}
        # the runs' parent holds no trace: a parent holding the generator's 1.1 GB made
        # pyarrow's kernels in the run 3x slower (replay's pruning 0.45 s against 0.15 s)
        del p, cols
        gc.collect()
        if first:  # a machine's first JVM writes the class-data archive: run it uncounted
            measure("full", kind, n, 1, 1800)
            first = False
        for nq in (1, 50) if args.headline else SETS:
            qs = queries[:nq]
            want = wants[nq]
            modes = [("full", repeat)]
            if args.headline:
                modes += [("batch", repeat), ("naive", 1)] if nq == 50 else []
            elif kind == "backbone" or nq == 50:
                modes += [("batch", repeat), ("per_tuple", 1), ("naive", 1)]
            if kind == "backbone" and nq == 50 and not args.headline:
                modes += [("full_arrow", repeat),  # the spool's other format and reader
                          ("full_2proc", repeat)]  # the capture read by two processes
            for mode, reps in modes:
                for _ in range(reps):
                    doc = measure(mode, kind, n, nq, 1800)
                    doc["correct"] = check(doc, qs, want)
                    if doc.get("finished"):
                        doc["pps"] = doc["packets"] / doc["wall_s"]
                        doc["rows_per_packet"] = doc["rows_into_spark"] / doc["packets"]
                    results["runs"].append(doc)
                    if not doc["correct"]:
                        results["failures"].append({k: doc.get(k) for k in
                                                    ("mode", "trace", "queries", "failure")})
                    print(f"   {mode:9} {nq:2} queries: " + (
                        f"{doc['pps'] / 1e3:8,.0f} kpps, wall {doc['wall_s']:6.1f} s (JVM "
                        f"{doc['jvm_start_s']:.1f} s), rows/pkt {doc['rows_per_packet']:.4f}, "
                        f"RSS {doc['peak_rss_total_mib']:,.0f} MiB, "
                        f"{'correct' if doc['correct'] else 'WRONG'}"
                        if doc.get("finished") else f"failed: {doc.get('failure')}"), flush=True)
    results["summary"] = summarize(results["runs"])
    # the memory bound: default settings, 10M packets, 50 queries
    if not args.quick and not args.headline:
        n10 = 10_000_000
        path, p = trace("backbone", n10, CACHE)
        qs = parse_queries(_sql("backbone", p))
        want = {q.name: canonical(q, truth(q, p, columns(p))) for q in qs}
        del p
        gc.collect()
        doc = measure("full", "backbone", n10, 50, 1800)
        doc["correct"] = check(doc, qs, want)
        results["memory_10m"] = doc
        print(f"== 10M packets, 50 queries: peak RSS {doc.get('peak_rss_total_mib', 0):,.0f} MiB"
              f" (Python {doc.get('peak_rss_python_mib', 0):,.0f}), "
              f"{'correct' if doc['correct'] else 'WRONG'}", flush=True)
    results["csv_export"] = csv_export(repeat, QUICK["uniform"] if args.quick else CSV_TRACE[1])
    c = results["csv_export"]
    print(f"== replay --format csv, {c['answer_rows']:,} answer rows: flowsieve "
          f"{c['median_s']['flowsieve']:.1f} s (whole command), batch PySpark "
          f"{c['median_s']['batch']:.1f} s (statements only): {c['ratio']:.2f}x; Spark's "
          f"engine answering {c['median_s']['flowsieve_sql']:.1f} s, {c['ratio_sql']:.2f}x",
          flush=True)
    results["fixed_cost_851"] = fixed_cost(repeat)
    print(f"== replay of the 851-packet capture: {results['fixed_cost_851']['median_s']:.1f} s",
          flush=True)
    if not args.headline:
        results["lfta_tree_vs_per_query"] = lfta_tree_vs_per_query(
            "backbone", sizes["backbone"], repeat)
        for w, r in results["lfta_tree_vs_per_query"].items():
            print(f"== LFTA alone ({w}), aggregate tree ({r['aggregate_tree']['tables']} tables)"
                  f" vs one table per query ({r['per_query']['tables']}): {r['speedup']:.2f}x",
                  flush=True)
    results["scope"] = "headline" if args.headline else "all"
    if not args.quick:
        write_result("spark", results)
    wrong = [r for r in results["runs"] if r.get("finished") and not r["correct"]]
    return 1 if wrong else 0


def summarize(runs: list[dict]) -> dict:
    """Medians per (trace, queries, mode) of the finished runs."""
    out: dict = {}
    for r in runs:
        if not r.get("finished"):
            continue
        key = f"{r['trace']}/{r['queries']}/{r['mode']}"
        out.setdefault(key, []).append(r)
    summary = {}
    for key, rs in out.items():
        summary[key] = {
            "pps": statistics.median(r["pps"] for r in rs),
            "wall_s": statistics.median(r["wall_s"] for r in rs),
            "jvm_start_s": statistics.median(r["jvm_start_s"] for r in rs),
            "rows_per_packet": statistics.median(r["rows_per_packet"] for r in rs),
            "peak_rss_total_mib": max(r["peak_rss_total_mib"] for r in rs),
            "correct": all(r["correct"] for r in rs), "runs": len(rs)}
    return summary


if __name__ == "__main__":
    sys.exit(main())
