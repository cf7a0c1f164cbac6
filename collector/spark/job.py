"""The Spark HFTA: one streaming query per spool folder — per (stream, period) — never one per
registered query. It merges partial aggregates under a watermark and writes each query's answer
(derived on the driver in ``foreachBatch``) to ``results/<query>/`` as Parquet."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Collection
from datetime import datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from pyspark import SparkConf, SparkContext
from pyspark.java_gateway import launch_gateway
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from capture.fields import measures
from collector.metrics import Metrics
from collector.results import answers_of, results_table, write_results
from collector.spark.source import SpoolDataSource
from collector.spool import schema_for, spark_ddl
from planner.query import Query

log = logging.getLogger("flowsieve.spark")

ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"

_dump_ready: Path | None = None  # marks this process's JVM's class dump as worth keeping


def jvm_options(class_archive: str | os.PathLike | None, quick_start: bool) -> list[str]:
    """JVM start-up options. A class-data archive (AppCDS) maps the classes Spark loads instead
    of parsing them from its jars: a JVM that finds none writes one when it exits, and later
    ones start about 2 s sooner and run their first job about 1.4 s sooner (bench/README.md).
    A dump is kept only from a JVM that ran a job (``class_dump_ready``): one that only started
    holds a fifth of the classes a merge loads. It is promoted to ``class_archive`` once the
    process that started its JVM is gone and it has not changed for 10 s; a stale or foreign
    archive is ignored by the JVM (``-Xshare:auto``)."""
    global _dump_ready
    opts = []
    if quick_start:
        opts += ["-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC"]
    if class_archive is not None:
        archive = Path(class_archive)
        archive.parent.mkdir(parents=True, exist_ok=True)
        _promote(archive)
        _forget_others(archive)
        opts.append("-Xlog:cds=off,cds+dynamic=off")
        if archive.exists():
            with contextlib.suppress(OSError):
                os.utime(archive)  # its last use: another installation's cleanup reads it
            opts.append(f"-XX:SharedArchiveFile={archive}")
        else:
            dump = archive.with_name(f"{archive.name}.dump-{os.getpid()}")
            opts.append(f"-XX:ArchiveClassesAtExit={dump}")
            _dump_ready = dump.with_name(dump.name + ".ready")
    return opts


def _promote(archive: Path) -> None:
    """Dumps of JVMs that are gone become the archive (one that ran a job) or are removed."""
    now = time.time()
    paths = sorted(archive.parent.glob(archive.name + ".dump-*"),
                   key=lambda p: p.suffix == ".ready")  # each dump before the markers
    for path in paths:
        dump = path.with_name(path.name.removesuffix(".ready"))
        try:
            pid = _dump_pid(path)
            if _alive(pid) or now - path.stat().st_mtime <= 10:
                continue
            ready = dump.with_name(dump.name + ".ready")
            if path == dump and ready.exists() and not archive.exists():
                os.replace(dump, archive)
            else:
                path.unlink()  # a dump of a JVM that ran no job, or a marker left over
        except (FileNotFoundError, ValueError):
            pass


FORGET_ARCHIVE_S = 30 * 86400  # another installation's archive unused this long is removed
FORGET_DUMP_S = 86400  # ... and a dump its JVM left this long ago that it never promoted


def _dump_pid(path: Path) -> int:
    """The process whose JVM wrote a dump ``….jsa.dump-<pid>`` (or its ``.ready`` marker)."""
    return int(path.name.removesuffix(".ready").rsplit("-", 1)[1])


def _forget_others(archive: Path) -> None:
    """Class-data files of other pyspark installations sharing the folder (180 MB each):
    an archive no JVM has used for 30 days (a deleted virtual environment's) and a dump whose
    JVM is gone for a day without its installation starting again to promote it."""
    now = time.time()
    for path in archive.parent.glob("spark-*-job-classes.jsa*"):
        if path.name.startswith(archive.name):
            continue  # this installation's: _promote's
        try:
            age = now - path.stat().st_mtime
            if path.name.endswith(".jsa"):
                stale = age > FORGET_ARCHIVE_S
            else:
                stale = age > FORGET_DUMP_S and not _alive(_dump_pid(path))
            if stale:
                path.unlink()
        except (FileNotFoundError, ValueError, IndexError):
            pass


def class_dump_ready() -> None:
    """This process's JVM has run a Spark job: the class dump it writes at exit holds the
    classes a job needs and is kept (marked once: every later batch finds nothing to do)."""
    global _dump_ready
    if _dump_ready is not None:
        with contextlib.suppress(OSError):
            _dump_ready.touch()
        _dump_ready = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def class_archive_path(folder: str | os.PathLike) -> Path:
    """The class-data archive of this pyspark installation in ``folder``. The JVM ignores an
    archive dumped with another class path (``-Xshare:auto``), so the name holds a digest of
    where this pyspark's jars are: two installations (two virtual environments) sharing a
    cache each keep their own, where one name kept the first one's, useless to the other."""
    import hashlib

    import pyspark
    where = hashlib.sha1(str(Path(pyspark.__file__).resolve().parent).encode()).hexdigest()
    return Path(folder) / f"spark-{pyspark.__version__}-{where[:10]}-job-classes.jsa"


def build_session(master: str = "local[*]", driver_memory: str = "2g", shuffle_partitions: int = 4,
                  rocksdb: bool = True, extra: dict[str, str] | None = None,
                  app_name: str = "flowsieve", jvm_log: str | os.PathLike | None = None,
                  class_archive: str | os.PathLike | None = None, quick_start: bool = False
                  ) -> SparkSession:
    """A Spark session configured for flowsieve (workers run this interpreter). With
    ``jvm_log`` the JVM's own output (its stack traces, log4j's console) goes to that file
    instead of this process's terminal: commands report Spark's failures in one line.
    ``class_archive`` is a class-data archive of the JVM (``jvm_options``); ``quick_start``
    trades peak JIT speed for start-up (a command that runs once, such as ``replay``)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    local = master.startswith("local")
    if local:  # nothing outside this host talks to a local driver
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    log4j = Path(__file__).with_name("log4j2.properties")
    b = (SparkSession.builder.master(master).appName(app_name)
         .config("spark.driver.memory", driver_memory)
         .config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false")
         .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
         .config("spark.sql.session.timeZone", "UTC")
         .config("spark.sql.streaming.noDataMicroBatches.enabled", "true")
         .config("spark.sql.files.ignoreCorruptFiles", "true")
         .config("spark.driver.extraJavaOptions", " ".join(
             [f"-Dlog4j2.configurationFile=file:{log4j}",
              *jvm_options(class_archive, quick_start)])))
    if local:  # a cluster's executors reach the driver at spark.driver.host (spark.extra)
        b = b.config("spark.driver.bindAddress", "127.0.0.1")
    if rocksdb:
        b = b.config("spark.sql.streaming.stateStore.providerClass", ROCKSDB).config(
            "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled", "true")
    for k, v in (extra or {}).items():
        b = b.config(k, v)
    if jvm_log is not None and SparkContext._gateway is None:
        # the gateway pyspark would launch, with the JVM's stdout and stderr in the log file
        out = open(jvm_log, "ab")  # noqa: SIM115 - the JVM holds it for its lifetime
        conf = SparkConf().setAll(list(b._options.items()))
        SparkContext._gateway = launch_gateway(conf, popen_kwargs={"stdout": out,
                                                                   "stderr": out})
        SparkContext._jvm = SparkContext._gateway.jvm
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(SpoolDataSource)
    return spark


def merge_partials(df: DataFrame, stream: str, watermark_delay_s: int | None,
                   only: Collection[str] | None = None, sketches: bool = True,
                   sets: bool = False, one_pass: bool = False) -> DataFrame:
    """Merge the partials of each (window, node, key), from any number of capture daemons,
    under the watermark. The key is one binary value (collector/keys.py): the group never
    spans the catalogue's columns and no row is exploded per query. ``only``: the measures
    the queries read (a batch job's queries are known), the others are left out;
    ``sketches``: False when no query counts approximately (no row carries a sketch);
    ``sets``: rows may carry value sets (``replay``'s pruning makes them); ``one_pass``: one
    aggregation for every row (a merge of few rows, ``small_merge``)."""
    aggs = [F.sum("cnt").alias("cnt")]
    for m in measures(stream):
        if only is not None and m.name not in only:
            continue
        aggs += [F.sum(f"sum_{m.name}").alias(f"sum_{m.name}"),
                 F.min(f"min_{m.name}").alias(f"min_{m.name}"),
                 F.max(f"max_{m.name}").alias(f"max_{m.name}")]
    if watermark_delay_s is not None:  # streaming; a batch job (replay) has none
        df = df.withWatermark("window_start", f"{watermark_delay_s} seconds")
    keys = ("window_start", "node", "key")
    no_set = F.lit(None).cast("array<binary>")
    if one_pass:
        # the object aggregates on every row: on few rows their cost per row is nothing
        # against a second aggregation's (and the union's) fixed cost (the telemetry bench's
        # 63 rows, warm: 0.19-0.23 s split, 0.10-0.14 s in one); a group without sketches
        # or sets (a node's rows all carry them, or none does) gets NULL, as when split
        hll = F.when(F.count("hll") > 0, F.hll_union_agg("hll", True)) if sketches \
            else F.lit(None).cast("binary")
        vals = F.when(F.count("vals") > 0, F.flatten(F.collect_list("vals"))) if sets \
            else no_set
        return df.groupBy(*keys).agg(*aggs, hll.alias("hll"), vals.alias("vals"))
    # the sketches of approx_count_distinct (a node's rows all carry one, or none do) merge
    # apart: Spark's hll_union_agg (DataSketches, so sketches of every capture daemon unite)
    # is an object aggregate, which would take the hash aggregation away from every row
    # (2.3x the merge time on the backbone bench's 50 queries)
    unsketched = F.col("hll").isNull()
    plain = df.where(unsketched & F.col("vals").isNull() if sets else unsketched) \
        .groupBy(*keys).agg(*aggs) \
        .withColumn("hll", F.lit(None).cast("binary")).withColumn("vals", no_set)
    out = [plain]
    if sketches:
        out.append(df.where(F.col("hll").isNotNull()).groupBy(*keys).agg(
            *aggs, F.hll_union_agg("hll", True).alias("hll")).withColumn("vals", no_set))
    if sets:  # the value sets of a group's rows, concatenated (collect_list: an object
        # aggregate too); the driver counts their distinct values. Spark's array_distinct
        # compares binary values pairwise (no hashing): 5k values a set took seconds
        out.append(df.where(F.col("vals").isNotNull()).groupBy(*keys).agg(
            *aggs, F.flatten(F.collect_list("vals")).alias("vals"))
            .withColumn("hll", F.lit(None).cast("binary")))
    return functools.reduce(lambda a, b: a.unionByName(b), out)


BYPASS_PARTIAL = "spark.sql.execution.bypassPartialAggregation"
# Spark's generated code for a plan: whole-stage code generation, and the code-generated
# projections and predicates of each operator (its factory mode, an internal setting:
# NO_CODEGEN interprets them)
CODEGEN = {"spark.sql.codegen.wholeStage": "false", "spark.sql.codegen.factoryMode": "NO_CODEGEN"}
# a batch merge of at most this many partial rows is interpreted: compiling the generated Java
# (Janino, then the JIT) is much of a fresh JVM's first merge. On the backbone bench (17k rows
# left after pruning) the JVM took 2.5-2.8 s of CPU interpreted, 2.9-3.6 s code-generated (3
# runs each), on 2 cores shared with the reading. On the telemetry bench's 130k rows the
# merge took 1.05-1.12 s interpreted, 0.71-0.79 s code-generated and warmed up while reading,
# and the whole replay the same within noise; larger merges keep generated code.
INTERPRET_MAX_ROWS = 150_000
# ... and one of at most this many aggregates every row in one pass (``merge_partials``'
# one_pass: a sketch or a value set makes it an object aggregation, which costs more a row)
ONE_PASS_MAX_ROWS = 20_000


def small_merge(df: DataFrame) -> DataFrame:
    """A merge of few rows (``INTERPRET_MAX_ROWS``) in one partition: Spark then aggregates
    without a shuffle (one partition satisfies any grouping), which was most of such a merge
    (backbone bench, 16k rows, warm: 0.26 -> 0.21 s; the first merge after the warm-up 0.44 ->
    0.27 s)."""
    return df.coalesce(1)


@contextlib.contextmanager
def batch_merge(spark: SparkSession, interpreted: bool = False):
    """A batch merge aggregates after the shuffle only: the LFTA was the partial aggregation,
    so Spark's own before the shuffle finds almost every group once (0.5 s of 2.7 on the
    telemetry benchmark's 1.2M rows). ``interpreted``: without generated code (a merge of few
    rows, ``INTERPRET_MAX_ROWS``). The session's settings are restored after."""
    sets = {BYPASS_PARTIAL: "true", **(CODEGEN if interpreted else {})}
    before = {k: spark.conf.get(k, None) for k in sets}
    for k, v in sets.items():
        spark.conf.set(k, v)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                spark.conf.unset(k)
            else:
                spark.conf.set(k, v)


def warm_up(spark: SparkSession, streams: list[str], only: Collection[str] | None = None,
            interpreted: bool = True, sketches: bool = True, sets: bool = False) -> None:
    """Run the batch merge (of the measures in ``only``) once on a one-row spool file, so that
    the JVM has loaded, compiled and code-generated what the real job needs (``replay`` does
    this while it reads; the code of another set of measures is other code: 1.5 s more).
    ``interpreted``: as a merge of few rows runs (``batch_merge``, in one pass), most
    merges; ``sketches`` and ``sets``: as ``merge_partials``. A JVM that ran this warm-up
    once is warm: it does not run again (a second replay through the same session, the
    telemetry bench's warm pass: 0.15-0.35 s of the JVM's CPU that the reading competed
    with)."""
    import tempfile

    import pyarrow.parquet as pq

    from collector.spool import null_columns
    key = (spark.sparkContext.applicationId, tuple(streams),
           None if only is None else frozenset(only), interpreted, sketches, sets)
    if key in _warmed:
        return
    with tempfile.TemporaryDirectory(prefix="flowsieve-warm-") as d, \
            batch_merge(spark, interpreted):
        for stream in streams:
            schema = schema_for(stream, "0")
            pq.write_table(pa.Table.from_arrays(null_columns(schema, 1, {}), schema=schema),
                           f"{d}/{stream}.parquet")
            df = spark.read.schema(spark_ddl(schema)).parquet(f"{d}/{stream}.parquet")
            if interpreted:
                df = small_merge(df)
            merge_partials(df, stream, None, only, sketches, sets, interpreted).toArrow()
    _warmed.add(key)
    class_dump_ready()


_warmed: set[tuple] = set()  # warm_up's runs: (the JVM's Spark application, what it merged)


Resolver = Callable[[int], Query | None]


def _first_line(e) -> str:
    """A Spark exception in one line (its message without the JVM stack)."""
    text = str(getattr(e, "desc", None) or e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


class SparkJob:
    """Starts and stops the per-folder streaming queries."""

    def __init__(self, spark: SparkSession, spool_root: str | os.PathLike,
                 results_root: str | os.PathLike, checkpoint_root: str | os.PathLike,
                 resolve: Resolver, watermark_delay_s: int = 1, metrics: Metrics | None = None,
                 trigger_s: float = 2.0, spool_format: str = "parquet",
                 keep_answers: bool = False):
        self.spark = spark
        self.spool_root = Path(spool_root)
        self.results_root = Path(results_root)
        self.checkpoint_root = Path(checkpoint_root)
        self.resolve = resolve
        self.delay = watermark_delay_s
        self.metrics = metrics or Metrics()
        self.trigger_s = trigger_s
        self.spool_format = spool_format
        self.queries: dict[tuple[str, str], object] = {}
        self._lock = threading.Lock()
        self.errors: list[str] = []  # the latest failures, newest last
        self._failed: dict[tuple[str, str], tuple[float, int]] = {}  # -> (retry at, attempts)
        self.timings: dict[str, float] = {}  # batch jobs: Spark's merge, the driver's answers
        self._seen_batch: dict[tuple[str, str], int] = {}  # progress reports counted
        # per folder: every window starting before this (epoch s) is answered, for good
        self.complete_before: dict[tuple[str, str], float] = {}
        self._skipped: set[tuple[str, str, int]] = set()  # slots whose partials were skipped
        # keep_answers (replay): each query's result parts as written, by part name
        self.answers: dict[str, dict[str, pa.Table]] | None = {} if keep_answers else None

    def _sink(self, stream: str, folder: str):
        def write_batch(batch_df: DataFrame, batch_id: int) -> None:
            table = batch_df.toArrow()
            if table.num_rows:
                self.write_answers(stream, folder, table, batch_id)
            self.metrics.spark_batches.labels(stream, folder).inc()
            class_dump_ready()
        return write_batch

    def write_answers(self, stream: str, folder: str, table: pa.Table, batch_id: int,
                      per_window: bool = True) -> None:
        """Derive each query's answer from a batch of merged rows (vectorised) and write it.
        ``per_window``: a part per window (a streaming batch); False: one part per query
        (a batch job's answer of a finite input, ``run_batch``: its windows all at once)."""
        now = time.time()
        for q, answer in answers_of(stream, folder, table, self._resolver(stream, folder)):
            self.metrics.result_rows.labels(q.name).inc(answer.num_rows)
            if q.period is not None and "window_start" in answer.column_names:
                starts = pc.cast(answer.column("window_start"), pa.int64())
                windows = pc.unique(starts).to_pylist()
                lag = self.metrics.query_lag.labels(q.name)
                for ws in windows:
                    self.metrics.query_windows.labels(q.name).inc()
                    lag.observe(max(0.0, now - ws / 1e6 - q.period))
                if per_window:
                    # one part per window: a window's answer is written once, and a batch
                    # Spark runs again (after a restart) replaces it rather than adding to it
                    for ws in windows:
                        self._write(q, f"{stream}-{folder}-w{ws:020d}",
                                    answer.filter(pc.equal(starts, ws)))
                    continue
            # a selection's batch, or a batch job's whole answer (50 queries' 5 windows a
            # part each were 0.16 s of a replay)
            self._write(q, f"{stream}-{folder}-{batch_id:010d}", answer)

    def _write(self, q: Query, part: str, answer: pa.Table) -> None:
        write_results(self.results_root, q.name, part, answer)
        if self.answers is not None:
            self.answers.setdefault(q.name, {})[part] = answer

    def answer(self, q: Query) -> pa.Table:
        """A query's answers this job wrote (``keep_answers``), as ``read_results`` reads
        them."""
        parts = (self.answers or {}).get(q.name, {})
        return results_table(q, [parts[k] for k in sorted(parts)])

    def _resolver(self, stream: str, folder: str) -> Resolver:
        def resolve(slot: int) -> Query | None:
            q = self.resolve(slot)
            if q is None or q.stream != stream or q.folder != folder:
                # partials of a query deleted since they were spooled: expected, said once
                if (stream, folder, slot) not in self._skipped:
                    self._skipped.add((stream, folder, slot))
                    log.info("no query of %s/%s holds slot %s (deleted): its partials in "
                             "flight are skipped", stream, folder, slot)
                return None
            self._skipped.discard((stream, folder, slot))
            return q
        return resolve

    def _dataframe(self, stream: str, folder: str) -> DataFrame:
        path = self.spool_root / stream / folder
        path.mkdir(parents=True, exist_ok=True)
        if self.spool_format == "parquet":
            # Spark's own reader; committed files are deleted (a torn file is skipped:
            # spark.sql.files.ignoreCorruptFiles)
            df = (self.spark.readStream.schema(spark_ddl(schema_for(stream, folder)))
                  .option("cleanSource", "delete").parquet(str(path)))
        else:
            df = (self.spark.readStream.format("flowsieve_spool").option("path", str(path))
                  .option("stream", stream).option("folder", folder).load())
        if folder == "select":
            return df
        # the watermark lags the latest window start by the period and the delay: a row of
        # window W then closes only windows that end before W - delay, which every engine
        # whose latest tuple is within the delay of W's first has closed; a row flushed
        # early (a full table, pass-through) closes nothing another engine or probe still
        # holds. A punctuation says W + period to close what ends by W (Engine._punctuate).
        return merge_partials(df, stream, self.delay + int(folder))

    def start(self, stream: str, folder: str, available_now: bool = False):
        """Start the streaming query of one folder (idempotent while it runs)."""
        with self._lock:
            running = self.queries.get((stream, folder))
            if running is not None and running.isActive:
                return running
            writer = (self._dataframe(stream, folder).writeStream
                      .outputMode("append")
                      .foreachBatch(self._sink(stream, folder))
                      .option("checkpointLocation",
                              str(self.checkpoint_root / stream / folder))
                      .queryName(f"flowsieve_{stream}_{folder}"))
            writer = (writer.trigger(availableNow=True) if available_now
                      else writer.trigger(processingTime=f"{self.trigger_s} seconds"))
            sq = writer.start()
            self.queries[(stream, folder)] = sq
            return sq

    def ensure(self, folders: list[tuple[str, str]]) -> None:
        """Start queries for folders that have none (new periods after a rebuild)."""
        for stream, folder in folders:
            self.start(stream, folder)

    def run_available_now(self, folders: list[tuple[str, str]]) -> None:
        """Process everything in the spool now and return (``replay``)."""
        started = [((s, f), self.start(s, f, available_now=True)) for s, f in folders]
        for key, sq in started:
            sq.awaitTermination()
            self._progress(key, sq)
            if sq.exception() is not None:
                raise RuntimeError(f"Spark query {sq.name} failed: {sq.exception()}")

    def run_batch(self, folders: list[tuple[str, str]], only: Collection[str] | None = None,
                  sketches: bool = True, sets: bool = False) -> None:
        """Answer a finite spool (``replay``) with one batch job per folder: the same merge as
        the streaming queries', without a watermark to wait for or state to keep (a bounded
        input is Spark's batch case), of the measures in ``only`` (default: all; a measure
        no query reads costs Spark three aggregates per row). The spool's files are left in
        place. ``sketches`` and ``sets``: as ``merge_partials``."""
        for stream, folder in folders:
            self._run_batch(stream, folder, only, sketches, sets)

    def _run_batch(self, stream: str, folder: str, only: Collection[str] | None,
                   sketches: bool, sets: bool) -> None:
        import pyarrow.parquet as pq

        path = self.spool_root / stream / folder
        files = sorted(path.glob("*.parquet"))
        if not files:
            return
        try:
            rows = sum(pq.read_metadata(f).num_rows for f in files)
        except (OSError, pa.ArrowInvalid):  # a torn file: Spark skips it, the rest is read
            rows = None
        small = rows is not None and rows <= INTERPRET_MAX_ROWS
        one_pass = rows is not None and rows <= ONE_PASS_MAX_ROWS
        with batch_merge(self.spark, interpreted=small):
            self._merge_batch(stream, folder, path, only, sketches, sets, small, one_pass)

    def _merge_batch(self, stream: str, folder: str, path: Path,
                     only: Collection[str] | None, sketches: bool, sets: bool,
                     small: bool, one_pass: bool) -> None:
        df = (self.spark.read.schema(spark_ddl(schema_for(stream, folder)))
              .parquet(str(path)))
        if folder != "select":
            df = merge_partials(small_merge(df) if small else df, stream, None, only, sketches,
                                sets, one_pass)
        t0 = time.perf_counter()
        table = df.toArrow()
        t1 = time.perf_counter()
        if table.num_rows:
            self.write_answers(stream, folder, table, 0, per_window=False)
        self.timings["merge_s"] = self.timings.get("merge_s", 0.0) + t1 - t0
        self.timings["answers_s"] = self.timings.get("answers_s", 0.0) + \
            time.perf_counter() - t1
        self.metrics.spark_batches.labels(stream, folder).inc()
        class_dump_ready()

    def check(self) -> list[str]:
        """Errors of queries that stopped and are not running again."""
        out = []
        for (s, f), sq in list(self.queries.items()):
            if not sq.isActive and sq.exception() is not None:
                out.append(f"{s}/{f}: {_first_line(sq.exception())}")
        return out

    def supervise(self, backoff_s: float = 30.0, max_backoff_s: float = 600.0) -> None:
        """Count and restart failed streaming queries (the daemon calls it every tick): a
        failure is reported once (metric, ``errors``, the log) and the query restarts after a
        back-off that doubles while it keeps failing. Meanwhile the capture side keeps
        spooling (the spool is bounded)."""
        now = time.monotonic()
        for key, sq in list(self.queries.items()):
            self._progress(key, sq)
            if sq.isActive:
                if key in self._failed and sq.lastProgress is not None:
                    del self._failed[key]  # it ran a batch again
                continue
            if sq.exception() is None:
                continue  # stopped on purpose
            retry_at, attempts = self._failed.get(key, (None, 0))
            if retry_at is None:
                msg = f"{key[0]}/{key[1]}: {_first_line(sq.exception())}"
                log.error("Spark query %s failed: %s", sq.name, msg)
                self.errors = (self.errors + [msg])[-10:]
                self.metrics.spark_failures.labels(*key).inc()
                self._failed[key] = (now + min(max_backoff_s, backoff_s * 2 ** attempts),
                                     attempts)
            elif now >= retry_at:
                self._failed[key] = (None, attempts + 1)
                try:
                    self.start(*key)
                except Exception as e:  # noqa: BLE001 - reported, retried on the next tick
                    self.errors = (self.errors + [f"{key[0]}/{key[1]}: restart: {e}"])[-10:]
                    self._failed[key] = (now + min(max_backoff_s, backoff_s * 2 ** attempts),
                                         attempts + 1)
        self.metrics.spark_up.set(int(bool(self.queries) and
                                      all(sq.isActive for sq in self.queries.values())))

    def _progress(self, key: tuple[str, str], sq) -> None:
        """Spark's progress reports of a streaming query since the last look: batch durations
        and input rows into the metrics; the watermark a completed batch used (its answers are
        written by then) into ``complete_before``: Spark emits a window once the watermark
        reaches its start (DESIGN's grouping by ``window_start``), and never again."""
        try:
            reports = sq.recentProgress
        except Exception:  # noqa: BLE001 - a stopped query's JVM side may be gone
            return
        seen = self._seen_batch.get(key, -1)
        for rep in reports:
            bid = rep.get("batchId", -1)
            if bid <= seen:
                continue
            seen = bid
            self.metrics.spark_input_rows.labels(*key).inc(rep.get("numInputRows", 0))
            late = sum(op.get("numRowsDroppedByWatermark", 0)
                       for op in rep.get("stateOperators") or ())
            if late:
                self.metrics.spark_late_rows.labels(*key).inc(late)
            ms = (rep.get("durationMs") or {}).get("triggerExecution")
            if ms is not None:
                self.metrics.spark_batch_seconds.labels(*key).observe(ms / 1000)
            wm = (rep.get("eventTime") or {}).get("watermark")
            if wm:
                t = datetime.fromisoformat(wm).timestamp()
                self.complete_before[key] = max(t, self.complete_before.get(key, t))
        self._seen_batch[key] = seen

    def stop(self) -> None:
        for sq in list(self.queries.values()):
            try:
                sq.stop()
            except Exception as e:  # noqa: BLE001 - stopping must not raise
                log.warning("stopping %s: %s", sq.name, e)
        self.queries.clear()
