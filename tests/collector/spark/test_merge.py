"""The HFTA when things go wrong: an unreadable spool file is set aside and counted, not a
stopped query; a streaming query that fails is reported (metric, errors) and restarted after a
back-off, and answers what the spool held meanwhile."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from prometheus_client import generate_latest
from pyspark.sql import functions as F

from capture.pcap import open_capture
from collector.config import Settings, data_file
from collector.daemon.results import read_results
from collector.metrics import Metrics
from collector.pipeline.engine import Engine
from collector.pipeline.spool import Spool, list_files
from collector.spark.merge import SparkJob, warm_up
from planner.plan import build_plan
from planner.query import parse_queries
from tests.pipelines import answers_of, reference, shifted, spread
from tests.processes import metric
from tests.reference import fields_of

pytestmark = pytest.mark.slow


def wait_for(cond, timeout: float, what: str) -> None:
    """Poll ``cond`` until it holds; the bound only catches a hang."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def spooled(tmp_path, path, fmt: str = "parquet", extra: str = "",
            only: set[str] | None = None):
    """ok.pcap's example queries (and ``extra`` ones; ``only`` those named) through one
    engine into a spool; the plan."""
    queries = [q for q in parse_queries(open(data_file("example.sql")).read() + extra)
               if only is None or q.name in only]
    plan = build_plan(queries, **Settings(initial_queries=None).plan_options())
    spool = Spool(tmp_path / "spool", format=fmt)
    engine = Engine(spool, "packets", watermark_delay_s=1)
    engine.set_plan(plan)
    for raw in open_capture(path, batch_size=100):
        engine.process(raw)
    engine.finish()
    return plan, spool


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_unreadable_spool_file_is_skipped(spark, tmp_path, fmt):
    """A torn file among good ones (a disk that lost its tail): the query does not stop and
    answers everything else exactly. Arrow IPC files move to bad/ with their reason (counted);
    Spark's Parquet reader skips them (spark.sql.files.ignoreCorruptFiles)."""
    path, recs = spread(tmp_path, "ok.pcap", 0.5)
    plan, spool = spooled(tmp_path, path, fmt)
    folder = spool.folder("packets", "60")
    torn = list_files(folder)[0]
    data = torn.read_bytes()
    torn.write_bytes(data[: len(data) // 2])  # the first file loses its tail
    whole = reference(recs)
    metrics = Metrics()
    slots = {qp.slot: qp.query for qp in plan.queries}
    job = SparkJob(spark, tmp_path / "spool", tmp_path / "results", tmp_path / "ck",
                   lambda: slots, 1, metrics, spool_format=fmt)
    job.run_available_now([(s, f) for s in plan.streams() for f in plan.folders(s)])
    if fmt == "arrow":
        assert spool.quarantined() == 1
        assert (folder / "bad" / (torn.name + ".reason")).read_text().startswith(
            "ArrowInvalid")
    got = answers_of([(qp.query, read_results(tmp_path / "results", qp.query))
                      for qp in plan.queries])
    # what the torn file held is gone; everything else is answered exactly
    assert set(got["udp_bw"]) <= set(whole["udp_bw"])
    assert len(got["udp_bw"]) >= len(whole["udp_bw"]) - 8
    for k, v in got["udp_bw"].items():
        assert v[0] <= whole["udp_bw"][k][0]


def test_failed_query_is_reported_and_restarted(spark, tmp_path):
    """The results folder cannot be written (a file sits where it should be): the streaming
    query fails, the failure is counted once and shown; once the folder can be written, the
    query restarts after its back-off and answers the whole spool."""
    path, recs = spread(tmp_path, "ok.pcap", 0.5)
    plan, _ = spooled(tmp_path, path)
    results = tmp_path / "results"
    results.write_text("not a folder")
    metrics = Metrics()
    slots = {qp.slot: qp.query for qp in plan.queries}
    job = SparkJob(spark, tmp_path / "spool", results, tmp_path / "ck", lambda: slots, 1,
                   metrics, trigger_s=0.5)
    try:
        job.start("packets", "60")

        def failed() -> bool:
            job.supervise(backoff_s=1.0)
            return bool(job.errors)
        wait_for(failed, 180, "the failure to be seen")
        assert metrics.spark_failures.labels("packets", "60")._value.get() == 1
        assert job.check() and "packets/60" in job.errors[0]
        # the Python workers' exception, in one line (it was Py4J's "An exception was raised
        # by the Python Proxy. Return Message: Traceback (most recent call last):")
        [why] = job.check()
        assert re.fullmatch(r"Spark batch packets/60: \w+Error: .+", why), why
        assert "Traceback" not in why and "Python Proxy" not in why
        exc = why.split(": ")[1]
        assert metrics.spark_batch_errors.labels("packets", "60", exc)._value.get() >= 1
        assert metrics.spark_up._value.get() == 0
        results.unlink()
        results.mkdir()

        def answered() -> bool:
            job.supervise(backoff_s=1.0)
            return bool(answers_of([(qp.query, read_results(results, qp.query))
                                    for qp in plan.queries])["udp_bw"])
        wait_for(answered, 180, "the restarted query's answers")
        wait_for(lambda: answers_of([(qp.query, read_results(results, qp.query))
                                     for qp in plan.queries]) == reference(recs), 180,
                 "every window answered")
        job.supervise(backoff_s=1.0)
        assert metrics.spark_failures.labels("packets", "60")._value.get() == 1
        assert metrics.spark_up._value.get() == 1
    finally:
        job.stop()


def test_a_failed_batch_is_one_line_with_its_python_exception(spark, tmp_path, monkeypatch,
                                                              caplog):
    """PySpark's mapInArrow needs pandas in the driver: on an install without it, every answer
    batch failed in the foreachBatch callback, and readiness said "Spark query packets/60: An
    exception was raised by the Python Proxy. Return Message: Traceback (most recent call
    last):". With pandas' import failing here as it fails there, readiness, the log and the
    metrics say one line with the Python exception."""
    import sys
    path, _ = spread(tmp_path, "ok.pcap", 0.5)
    plan, _ = spooled(tmp_path, path)
    metrics = Metrics()
    slots = {qp.slot: qp.query for qp in plan.queries}
    job = SparkJob(spark, tmp_path / "spool", tmp_path / "results", tmp_path / "ck",
                   lambda: slots, 1, metrics, trigger_s=0.5)
    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas fails
    caplog.set_level("INFO", logger="flowsieve.spark")
    try:
        job.start("packets", "60")

        def failed() -> bool:
            job.supervise(backoff_s=3600.0)
            return bool(job.errors)
        wait_for(failed, 180, "the failure to be seen")
    finally:
        job.stop()
    why = "Spark batch packets/60: PySparkImportError: Pandas >= 2.2.0 must be installed"
    assert job.errors[0].startswith(why), job.errors
    assert "\n" not in job.errors[0]
    assert metrics.spark_batch_errors.labels("packets", "60",
                                             "PySparkImportError")._value.get() == 1
    logged = [r for r in caplog.records if r.name == "flowsieve.spark"]
    assert any(r.levelname == "ERROR" and "PySparkImportError: Pandas" in r.getMessage()
               for r in logged), [r.getMessage() for r in logged]
    assert all(r.exc_info is None and "\n" not in r.getMessage() for r in logged)


def test_spark_merges_the_sketches_python_writes(spark):
    """Room for distinct counts: partial rows may carry Apache DataSketches HLL sketches made
    by the Python library; Spark's hll_union_agg merges them per group like any partial, and
    the Python library reads the union back. The estimates equal a union made in Python."""
    import datasketches

    rows, unions = [], {}
    for group, ranges in (("a", [(0, 3000), (2000, 6000)]), ("b", [(0, 10), (5, 40)])):
        u = datasketches.hll_union(12)
        for lo, hi in ranges:
            sk = datasketches.hll_sketch(12)
            for x in range(lo, hi):
                sk.update(x)
            u.update(sk)
            rows.append((group, bytearray(sk.serialize_compact())))
        unions[group] = u.get_result()
    df = spark.createDataFrame(rows, "g string, sketch binary")
    merged = {r["g"]: bytes(r["u"]) for r in df.groupBy("g").agg(
        F.expr("hll_union_agg(sketch, true)").alias("u")).collect()}
    for g, u in unions.items():
        back = datasketches.hll_sketch.deserialize(merged[g])
        assert back.get_estimate() == pytest.approx(u.get_estimate(), rel=1e-9)
    assert unions["b"].get_estimate() == pytest.approx(40, abs=0.5)


@pytest.mark.parametrize("engine", ["python", "sql"])
def test_a_batch_run_again_replaces_its_windows_answers(spark, tmp_path, engine):
    """Spark runs a batch again after a restart (the batch id its offset log holds, the same
    windows): its job writes each query's part under the same name, so the second run
    replaces the first and the answers still equal dpkt's, no row twice (Python's answer
    tasks, or Spark's engine and writer)."""
    from collector.spark.merge import merge_partials
    path, recs = spread(tmp_path, "ok.pcap", 0.5)
    plan, spool = spooled(tmp_path, path)
    slots = {qp.slot: qp.query for qp in plan.queries}
    results = tmp_path / "results"
    job = SparkJob(spark, tmp_path / "spool", results, tmp_path / "ck", lambda: slots, 1,
                   Metrics(), answer_engine=engine)
    merged = merge_partials(spark.read.parquet(str(spool.folder("packets", "60"))), "packets",
                            None)
    job._answer(merged, "packets", "60", "run-00000003")
    first = {qp.query.name: read_results(results, qp.query).num_rows for qp in plan.queries}
    job._answer(merged, "packets", "60", "run-00000003")
    pairs = [(qp.query, read_results(results, qp.query)) for qp in plan.queries]
    assert {q.name: t.num_rows for q, t in pairs} == first
    assert answers_of(pairs) == reference(recs)
    assert sum(len(v) for v in reference(recs).values()) == sum(first.values())
    assert not list(results.glob("_jobs/*")), "the staging folder is left"


def test_the_streaming_job_answers_in_spark_s_engine_as_dpkt_does(spark, tmp_path):
    """``spark.answer_engine: sql``: the daemon's streaming query (foreachBatch) answers
    with Spark's engine and writer, each window once, equal to dpkt's, and a selection's
    tuples in time order; the parts are Spark's Parquet files and the metrics count what
    they hold."""
    import pyarrow.parquet as pq

    from tests.reference import fields_of
    path, recs = spread(tmp_path, "ok.pcap", 0.5)
    plan, _ = spooled(tmp_path, path, extra="\n-- name: udp_sel\nSELECT ts, src_ip, dst_port "
                      "FROM packets WHERE protocol = 17;\n")
    slots = {qp.slot: qp.query for qp in plan.queries}
    metrics = Metrics()
    job = SparkJob(spark, tmp_path / "spool", tmp_path / "results", tmp_path / "ck",
                   lambda: slots, 1, metrics, answer_engine="sql")
    job.run_available_now([(s, f) for s in plan.streams() for f in plan.folders(s)])
    pairs = [(qp.query, read_results(tmp_path / "results", qp.query)) for qp in plan.queries]
    sel = next(t for q, t in pairs if q.name == "udp_sel")
    udp = [fields_of(ts, buf, 1) for ts, buf, _ in recs]
    want = [(p["src_ip"], p["dst_port"]) for p in udp if p["protocol"] == 17]
    assert want and list(zip(sel["src_ip"].to_pylist(), sel["dst_port"].to_pylist(),
                             strict=True)) == want
    assert answers_of([(q, t) for q, t in pairs if q.name != "udp_sel"]) == reference(recs)
    parts = list((tmp_path / "results").glob("query=*/part-*.parquet"))
    assert parts and all(b"org.apache.spark.version" in pq.read_metadata(f).metadata
                         for f in parts)
    text = generate_latest(metrics.registry).decode()
    for q, t in pairs:
        assert metric(text, "flowsieve_query_result_rows_total", f'query="{q.name}"') == t.num_rows


def test_the_first_batch_finds_its_answers_warmed_up(spark, tmp_path, monkeypatch, caplog):
    """Spark's engine warms up a folder's answers on a row of each node layout the plan's
    probes write (``node_layouts``: the engine's tables' own; rows of Spark's own, no file),
    into a folder of the results' staging area, removed after: the first batch then builds
    no pass of its own and needs one job to learn its layouts, and its answers equal
    dpkt's."""
    import collector.spark.compile as compile_module
    import collector.spark.derive as derive
    from collector.pipeline.compiled_plan import node_layouts
    from collector.spark.merge import merge_partials
    path, recs = spread(tmp_path, "ok.pcap", 0.5)
    plan, spool = spooled(tmp_path, path)
    engine = Engine(Spool(tmp_path / "other"), "packets", watermark_delay_s=1)
    engine.set_plan(plan)
    engine.take_plan()
    tables = {t.spool_layout.label for t in engine._c.node_tables() if t.period == 60}
    assert tables and set(node_layouts(plan, "packets", "60")) == tables
    slots = {qp.slot: qp.query for qp in plan.queries}
    results = tmp_path / "results"
    job = SparkJob(spark, tmp_path / "spool", results, tmp_path / "ck", lambda: slots, 1,
                   Metrics(), answer_engine="sql", layouts=lambda st, f: node_layouts(plan, st, f))
    monkeypatch.setattr(derive, "_PASSES", {})  # as if no test had built it
    monkeypatch.setattr(derive, "_LABELS", {})
    with caplog.at_level(logging.DEBUG, logger="flowsieve.spark"):
        job.warm("packets", "60")
    assert [r.message for r in caplog.records if "warm" in r.message][-1].startswith(
        "Spark's answer job for packets/60 warmed up"), caplog.text
    assert derive._PASSES, "no pass was built"
    assert not list(results.glob("query=*/*")), "the warm-up wrote answers"
    assert not list(results.glob("_jobs/*")), "the warm-up left its folder"
    built, counted = [], []
    real_pass, real_patterns = compile_module.shared_pass, compile_module.patterns
    monkeypatch.setattr(compile_module, "shared_pass",
                        lambda *a, **k: built.append(a) or real_pass(*a, **k))
    monkeypatch.setattr(compile_module, "patterns",
                        lambda *a, **k: counted.append(a) or real_patterns(*a, **k))
    merged = merge_partials(spark.read.parquet(str(spool.folder("packets", "60"))), "packets",
                            None)
    job._answer(merged, "packets", "60", "run-00000001")
    assert built == [] and len(counted) == 1
    pairs = [(qp.query, read_results(results, qp.query)) for qp in plan.queries]
    assert answers_of(pairs) == reference(recs)


def test_the_spool_reader_takes_files_in_any_order(tmp_path):
    """flowsieve's reader (spool.format: arrow) under several probes and durable sources: files
    appear out of sequence order (probes number their own; a held file is published after
    files numbered later). A batch takes every file no earlier batch took; Spark replans a
    logged batch exactly; commit deletes the batch's files and the previous batch's (a crash
    between Spark's commit log and ours leaves them), and an older offset (``{"seq": N}``)
    still means "every file numbered up to N"."""
    from collector.pipeline.spool import punctuation
    from collector.spark.source import SpoolStreamReader
    a = Spool(tmp_path / "spool", format="arrow", probe="a")
    b = Spool(tmp_path / "spool", format="arrow", probe="b")
    row = punctuation("packets", 1_700_000_040, 1, "x")
    folder = a.folder("packets", "60")
    reader = SpoolStreamReader(str(folder), "packets", "60")

    def names(offset) -> list[str]:
        return sorted(os.path.basename(x) for part in reader.partitions(start, offset)
                      for x in part.paths)

    start = reader.initialOffset()
    for _ in range(3):
        a.write("packets", "60", row)  # a: 0, 1, 2
    held = b.write("packets", "60", row, hold="b-src")  # b: 0, hidden
    first = reader.latestOffset(start, None)
    assert names(first) == [f"{s:016d}.a.arrow" for s in (0, 1, 2)]
    assert reader.latestOffset(start, None) == first  # a logged batch replans the same
    b.write("packets", "60", row)  # b: 1
    held.publish()  # b: 0, after b: 1 and a: 0-2
    start, second = first, reader.latestOffset(first, None)
    assert names(second) == [f"{0:016d}.b.arrow", f"{1:016d}.b.arrow"]
    reader.commit(second)  # the first batch's commit never ran (a crash): this one clears both
    assert list_files(folder) == []
    assert reader.latestOffset(second, None) == second  # nothing new: no batch
    for _ in range(2):
        a.write("packets", "60", row)  # a: 3, 4
    reader.commit({"seq": 3})
    assert [p.name for p in list_files(folder)] == [f"{4:016d}.a.arrow"]


def test_a_warm_jvm_is_not_warmed_up_again(spark, monkeypatch):
    """``warm_up`` runs its answer job once per JVM: a second call finds it done."""
    import collector.spark.merge as job_module
    monkeypatch.setattr(job_module, "_warmed", set())  # as if no test had warmed it up
    ran = []
    real = SparkJob._answer
    monkeypatch.setattr(SparkJob, "_answer",
                        lambda self, *a, **k: ran.append(a) or real(self, *a, **k))
    warm_up(spark)
    warm_up(spark)
    assert len(ran) == 1


def test_a_jvm_uses_the_archive_prepare_made_and_never_writes_one(tmp_path):
    """The daemon's and replay's JVMs start with the archive when it exists and write none
    (writing one at exit took a stop past its deadline); only ``prepare``'s JVM is told where
    to write one."""
    from collector.spark.session import class_archive_path, jvm_options
    archive = class_archive_path(tmp_path)
    for quick in (False, True):
        opts = jvm_options(archive, quick_start=quick)
        assert not any("SharedArchiveFile" in o or "ArchiveClassesAtExit" in o for o in opts)
    archive.write_bytes(b"classes")
    opts = jvm_options(archive, quick_start=True)
    assert f"-XX:SharedArchiveFile={archive}" in opts
    assert not any("ArchiveClassesAtExit" in o for o in opts)
    dump = tmp_path / f"{archive.name}.dump-{os.getpid()}"
    opts = jvm_options(archive, quick_start=False, dump=dump)
    assert f"-XX:ArchiveClassesAtExit={dump}" in opts
    assert not any("SharedArchiveFile" in o for o in opts)
    assert jvm_options(None, quick_start=False) == []


def test_a_one_shot_jvm_compiles_less_and_java_accepts_the_option():
    """``replay``'s JVM (one command, then it exits) raises HotSpot's compile thresholds; C1
    alone (a small capture) takes precedence; and this machine's java starts with the option
    (a flag it rejected would keep every replay's JVM from starting)."""
    from collector.spark.session import ONE_SHOT_COMPILE_SCALING, jvm_options
    opts = jvm_options(None, quick_start=False, one_shot=True)
    assert opts == [f"-XX:CompileThresholdScaling={ONE_SHOT_COMPILE_SCALING}"]
    assert not any("CompileThresholdScaling" in o
                   for o in jvm_options(None, quick_start=True, one_shot=True))
    out = subprocess.run(["java", *opts, "-XX:+PrintFlagsFinal", "-version"],
                         capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if " CompileThresholdScaling " in x)
    assert float(line.split("=")[1].split()[0]) == ONE_SHOT_COMPILE_SCALING


def test_hotspot_compiles_spark_s_huge_generated_methods_and_keeps_the_user_s_options(spark):
    """The driver's JVM (and executors', by their options) compiles methods of any size: a
    whole stage's generated method may reach Spark's 65,535 bytes, which HotSpot would
    otherwise leave interpreted. A JVM option in ``spark.extra`` (the test session's) is added
    after flowsieve's, not in their place."""
    jvm = spark.sparkContext._jvm
    bean = jvm.java.lang.management.ManagementFactory.getPlatformMXBean(
        jvm.java.lang.Class.forName("com.sun.management.HotSpotDiagnosticMXBean"))
    assert bean.getVMOption("DontCompileHugeMethods").getValue() == "false"
    args = list(jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments())
    assert args.index("-Dflowsieve.test=1") > args.index("-XX:-DontCompileHugeMethods")
    assert any(a.startswith("-Dlog4j2.configurationFile=") for a in args)
    conf = spark.sparkContext.getConf()
    assert "-XX:-DontCompileHugeMethods" in conf.get("spark.executor.extraJavaOptions")
    assert spark.conf.get("spark.sql.codegen.hugeMethodLimit") == "65535"


def test_other_installations_class_files_are_removed_once_stale(tmp_path):
    """Each installation's archive is about 190 MB in a shared cache folder: another
    installation's archive unused for 30 days goes (a deleted virtual environment's), and so
    does a dump that a ``prepare`` stopped part way left an hour ago; a recent one, a live
    process's and this installation's own stay, and a JVM's use keeps its archive fresh."""
    import subprocess
    import sys

    from collector.spark import session as job
    dead, later = (int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                                      capture_output=True, text=True, check=True).stdout)
                   for _ in range(2))
    live = os.getpid()
    mine = job.class_archive_path(tmp_path)
    mine.write_bytes(b"mine")
    day = 86400

    def file(name: str, age_days: float):
        path = tmp_path / name
        path.write_bytes(b"classes")
        os.utime(path, (time.time() - age_days * day,) * 2)
        return path
    os.utime(mine, (time.time() - 40 * day,) * 2)
    other = "spark-4.3.0-0123456789-job-classes.jsa"
    unused = file(other, 31)
    used = file("spark-4.2.0-abcdef0123-job-classes.jsa", 29)
    left = file(f"{other}.dump-{dead}", 0.1)
    fresh = file(f"{other}.dump-{later}", 0.01)
    running = file(f"{used.name}.dump-{live}", 3)
    foreign = file("notes.txt", 365)
    opts = job.jvm_options(mine, quick_start=True)
    assert f"-XX:SharedArchiveFile={mine}" in opts
    assert not unused.exists() and used.exists()
    assert not left.exists() and fresh.exists()
    assert running.exists() and foreign.exists()
    assert time.time() - mine.stat().st_mtime < 60 and mine.read_bytes() == b"mine"


def test_each_pyspark_installation_keeps_its_own_archive(tmp_path, monkeypatch):
    """The JVM ignores an archive dumped with another class path: two installations sharing a
    cache folder (two virtual environments) must not share one name."""
    import pyspark

    from collector.spark.session import class_archive_path
    here = class_archive_path(tmp_path)
    assert here == class_archive_path(tmp_path) and pyspark.__version__ in here.name
    monkeypatch.setattr(pyspark, "__file__", str(tmp_path / "other" / "pyspark" / "__init__.py"))
    assert class_archive_path(tmp_path) != here


def test_rows_that_come_after_their_window_closed_are_counted(spark, tmp_path):
    """A probe writes the hour after another's first, and Spark's watermark has passed every
    window of the second one's rows: Spark drops them. The job counts them by folder
    (``flowsieve_spark_late_rows_total``) instead of losing them silently; rows in time are
    not counted."""
    path, _ = spread(tmp_path, "ok.pcap", 0.5)  # 851 packets over seven minutes
    later = shifted(path, tmp_path / "later.pcap", 3600)
    plan = build_plan(parse_queries("SELECT time/60 AS t, count(*) AS n FROM packets "
                                    "GROUP BY time/60"), aggregate_tree=False)
    folder = tmp_path / "spool" / "packets" / "60"

    def spool_rows(capture, probe: str) -> int:
        engine = Engine(Spool(tmp_path / "spool", probe=probe), "packets", Metrics(), probe, 1)
        engine.set_plan(plan)
        for raw in open_capture(capture, batch_size=100):
            engine.process(raw)
        engine.finish(close=False)
        return sum(pq.read_metadata(f).num_rows for f in list_files(folder)
                   if f.name.split(".")[1] == probe)
    metrics = Metrics()
    slots = {qp.slot: qp.query for qp in plan.queries}
    job = SparkJob(spark, tmp_path / "spool", tmp_path / "results", tmp_path / "ck",
                   lambda: slots, 1, metrics)

    def late() -> float:
        return metric(generate_latest(metrics.registry).decode(),
                      "flowsieve_spark_late_rows_total", 'folder="60",stream="packets"')
    assert spool_rows(later, "first") > 0
    job.run_available_now([("packets", "60")])
    assert late() == 0
    behind = spool_rows(path, "second")
    job.run_available_now([("packets", "60")])
    assert 0 < late() <= behind


@pytest.mark.parametrize("engine", ["python", "sql"])
def test_a_batch_run_again_over_fewer_tasks_leaves_nothing_of_the_first(spark, tmp_path,
                                                                        engine):
    """Either engine spreads a query's answer over tasks (a part file each) when its rows
    outnumber ``answer_task_rows`` (the Python engine in a folder of fewer answers than
    Spark's cores: one here). The same batch run again spread less (another setting)
    replaces the whole part: the first run's further files go, and the answers still equal
    dpkt's, no row twice."""
    from collector.daemon.results import part_files
    from collector.spark.merge import merge_partials
    path, recs = spread(tmp_path, "ok.pcap", 0.5)
    plan, spool = spooled(tmp_path, path, only={"udp_bw"})
    slots = {qp.slot: qp.query for qp in plan.queries}
    results = tmp_path / "results"
    job = SparkJob(spark, tmp_path / "spool", results, tmp_path / "ck", lambda: slots, 1,
                   Metrics(), answer_engine=engine, answer_task_rows=3)
    merged = merge_partials(spark.read.parquet(str(spool.folder("packets", "60"))), "packets",
                            None)
    job._answer(merged, "packets", "60", "run-00000003")
    files = {qp.query.name: len(part_files(results, qp.query.name)) for qp in plan.queries}
    assert max(files.values()) > 1, files
    first = {qp.query.name: read_results(results, qp.query) for qp in plan.queries}
    job.answer_task_rows = None  # the default: every answer of this capture in one task
    job._answer(merged, "packets", "60", "run-00000003")
    assert {qp.query.name: len(part_files(results, qp.query.name))
            for qp in plan.queries} == {n: min(k, 1) for n, k in files.items()}
    pairs = [(qp.query, read_results(results, qp.query)) for qp in plan.queries]
    assert all(t.equals(first[q.name]) for q, t in pairs)  # the same rows, the same order
    assert answers_of(pairs) == {"udp_bw": reference(recs)["udp_bw"]}


def test_the_python_engine_leaves_a_folder_that_fills_the_cores_unspread(spark, tmp_path,
                                                                          monkeypatch):
    """Three answers in a folder on Spark's two cores: the Python engine gives each its own
    task, one file, however many rows it has (``answer_task_rows`` 3), and counts none;
    the answers equal dpkt's."""
    from collector.daemon.results import part_files
    from collector.spark import compile as compile_module
    from collector.spark.merge import merge_partials
    path, recs = spread(tmp_path, "ok.pcap", 0.5)
    plan, spool = spooled(tmp_path, path)
    assert len(plan.queries) > spark.sparkContext.defaultParallelism
    slots = {qp.slot: qp.query for qp in plan.queries}
    results = tmp_path / "results"
    job = SparkJob(spark, tmp_path / "spool", results, tmp_path / "ck", lambda: slots, 1,
                   Metrics(), answer_engine="python", answer_task_rows=3)
    merged = merge_partials(spark.read.parquet(str(spool.folder("packets", "60"))), "packets",
                            None)
    counted = []
    slot_rows = compile_module.slot_rows
    monkeypatch.setattr(compile_module, "slot_rows", lambda *a: counted.append(a) or slot_rows(*a))
    job._answer(merged, "packets", "60", "run-00000001")
    assert not counted
    assert {qp.query.name: len(part_files(results, qp.query.name)) for qp in plan.queries} \
        == {qp.query.name: 1 for qp in plan.queries}
    pairs = [(qp.query, read_results(results, qp.query)) for qp in plan.queries]
    assert answers_of(pairs) == reference(recs)


def test_a_streaming_batch_s_bound_holds_its_merged_rows(spark, tmp_path, monkeypatch):
    """``SparkJob._released_at_most``: a streaming batch after the first is given a bound of
    the merged rows it releases (the state's rows after the previous batch and its files'
    rows), and the bound holds; the first batch after a start gets none (its state is
    unknown)."""
    import shutil

    from collector.spark import merge as merge_module
    path, _ = spread(tmp_path, "ok.pcap", 0.5)
    plan, spool = spooled(tmp_path, path)
    folder = spool.folder("packets", "60")
    files = sorted(folder.glob("*.parquet"))
    aside = tmp_path / "aside"
    aside.mkdir()
    for f in files[len(files) // 2:]:
        shutil.move(f, aside / f.name)
    slots = {qp.slot: qp.query for qp in plan.queries}
    seen: list[tuple[int | None, int]] = []
    answer = merge_module.SparkJob._answer

    def recorded(self, rows, stream, folder_, job, streamed=True, at_most=None):
        seen.append((at_most, rows.count()))
        return answer(self, rows, stream, folder_, job, streamed, at_most)
    monkeypatch.setattr(merge_module.SparkJob, "_answer", recorded)
    job = SparkJob(spark, tmp_path / "spool", tmp_path / "results", tmp_path / "ck",
                   lambda: slots, 1, Metrics(), trigger_s=0.5)
    sq = job.start("packets", "60")
    try:
        deadline = time.monotonic() + 120
        while not seen and time.monotonic() < deadline:
            time.sleep(0.2)
        for f in aside.iterdir():
            shutil.move(f, folder / f.name)
        # until a batch after the first releases rows (the later files move the watermark
        # past windows); batches that release none may come before it
        while not any(n for _, n in seen[1:]) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        job.stop()
    assert sq is not None and len(seen) >= 2, seen
    assert seen[0][0] is None
    assert all(bound is not None and bound >= n for bound, n in seen[1:]), seen
    assert any(n for _, n in seen[1:]), seen


def test_each_answer_goes_to_the_task_chosen_for_it(spark):
    """``derive.placed``: the rows of each ``g`` land in the partition chosen for it, as
    Spark's own hash partitioning (``pmod(hash(g), n)``) reads the value given; plain
    ``repartition(2, "g")`` put g 0 and 1 in one task."""
    from pyspark.sql import functions as F

    from collector.spark.derive import placed, spark_partition
    assert spark_partition(0, 2) == spark_partition(1, 2)  # why placed() exists
    frame = spark.range(0, 600).selectExpr("cast(id % 12 as int) AS g")
    for tasks in (2, 5, 8):
        task_of = {g: (g * 7) % tasks for g in range(12)}
        got = placed(frame, task_of, tasks).select("g", F.spark_partition_id().alias("p"))
        assert {(r["g"], r["p"]) for r in got.distinct().collect()} == set(task_of.items())


def test_a_dead_answer_job_s_leftovers_are_swept_once_stale(tmp_path):
    """What an answer job left when it died (a Python task's hidden part, a staging folder of
    Spark's writer whose batch never ran again) goes once an hour old; a job's fresh staging
    folder (its batch may be running) stays."""
    from collector.spark.write import STALE_S, stage_dir, sweep_results
    old_part = tmp_path / "query=q" / ".part-run-1.parquet.abc.tmp"
    old_part.parent.mkdir()
    old_part.write_bytes(b"x")
    old_stage, new_stage = stage_dir(tmp_path, "run-1"), stage_dir(tmp_path, "run-2")
    for d in (old_stage, new_stage):
        (d / "query=q").mkdir(parents=True)
        (d / "query=q" / "part-0.parquet").write_bytes(b"x")
    past = time.time() - STALE_S - 60
    for p in (old_part, old_stage):
        os.utime(p, (past, past))
    assert sweep_results(tmp_path) == 2
    assert not old_part.exists() and not old_stage.exists() and new_stage.exists()


PORTS = """
-- name: ports
SELECT time/60 AS t, dst_port, count(*) AS pkts FROM packets WHERE protocol = 6
GROUP BY time/60, dst_port;"""


def test_replay_learns_its_patterns_from_the_spool_footers(spark, tmp_path, monkeypatch):
    """Each Parquet spool file of partial rows carries its (node layout, query-bit pattern)
    counts in its footer: the same as counting the rows' keys one by one and as Spark's
    counting job. A finite spool's batch answer (``replay``) reads them and runs no such job;
    a spool with a file of an older probe (no footer counts) is counted by the job. Either
    way every answer equals dpkt's."""
    import collections

    import collector.spark.compile as compile_module
    from collector.keys import KeyLayout, pattern_counts
    from collector.pipeline.compiled_plan import node_layouts
    from collector.pipeline.spool import footer_patterns
    path, recs = spread(tmp_path, "ok.pcap", 0.5)
    plan, spool = spooled(tmp_path, path, extra=PORTS)  # a second node layout
    folder = spool.folder("packets", "60")
    files = sorted(folder.glob("*.parquet"))
    assert len(files) > 1
    by_row = collections.Counter()
    for f in files:
        t = pq.read_table(f, columns=["node", "key"])
        for node, key in zip(t.column("node").to_pylist(), t.column("key").to_pylist(),
                             strict=True):
            if not node:  # a punctuation row: no node's
                continue
            lay = KeyLayout.parse("packets", node)
            by_row[(node, key[8 * lay.field_words:8 * lay.words])] += 1
    footers = footer_patterns(files)  # a node's rows a batch each, as the LFTA writes them
    assert footers == dict(by_row) and len({n for n, _ in footers}) > 1
    mixed = pa.concat_tables(map(pq.read_table, files)).combine_chunks()  # one batch
    assert pattern_counts("packets", mixed) == footers
    labels = node_layouts(plan, "packets", "60")
    by_spark = compile_module.patterns(spark.read.parquet(*map(str, files)), "packets", labels)
    assert footers == {(n, bytes(p)): c for (n, p), c in by_spark.items()}

    truth = collections.Counter()  # the second layout's query, from dpkt's fields
    for ts, buf, _ in recs:
        p = fields_of(ts, buf, 1)
        if p["protocol"] == 6:
            truth[(int(ts) // 60, p["dst_port"])] += 1
    assert truth
    slots = {qp.slot: qp.query for qp in plan.queries}
    counted = []
    real_patterns = compile_module.patterns
    monkeypatch.setattr(compile_module, "patterns",
                        lambda *a, **k: counted.append(a) or real_patterns(*a, **k))
    for engine, old in (("sql", False), ("python", False), ("sql", True)):
        if old:  # a file as a probe of an older version wrote it
            t = pq.read_table(files[0])
            pq.write_table(t.replace_schema_metadata(None), files[0])
            assert footer_patterns(files) is None
        counted.clear()
        results = tmp_path / f"results-{engine}-{old}"
        job = SparkJob(spark, spool.root, results, tmp_path / "ck", lambda: slots, 1,
                       Metrics(), answer_engine=engine,
                       layouts=lambda st, f: node_layouts(plan, st, f))
        job.run_batch([("packets", "60")])
        assert len(counted) == (1 if old else 0), (engine, old)
        pairs = [(qp.query, read_results(results, qp.query)) for qp in plan.queries]
        assert answers_of(p for p in pairs if p[0].name != "ports") == reference(recs), \
            (engine, old)
        ports = next(t for q, t in pairs if q.name == "ports")
        assert {(r["t"], r["dst_port"]): r["pkts"] for r in ports.to_pylist()} == truth
