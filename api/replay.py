"""``flowsieve replay``: a capture through the whole pipeline, Spark included."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from contextlib import closing
from multiprocessing.connection import wait as mp_wait
from pathlib import Path

import pyarrow as pa

from capture.errors import DecodeError
from capture.fields import STREAMS
from capture.netflow import DEFAULT_FLOW_PORTS, Decoder, capture_flows
from capture.pcap import open_capture, split_pcap
from capture.sflow import DEFAULT_SFLOW_PORTS, capture_sflow
from collector.config import Settings
from collector.daemon.process import freeze_startup_heap, no_huge_pages
from collector.daemon.results import read_results
from collector.daemon.sources import ahead
from collector.metrics import Metrics
from collector.pipeline import enrichment, prefix_tables, user_predicates
from collector.pipeline.engine import Engine
from collector.pipeline.sampling import TupleSampler
from collector.pipeline.selectivity import SelectivityMeter
from collector.pipeline.spool import Spool
from planner.ir import Query
from planner.plan import Plan, build_plan

# replay_workers 0: one process per core but one (Spark's JVM runs its first job on that one
# while the capture is read: on 2 cores a second reading process only competed with it, 1.20 M
# against 1.22 M packets/s on bench_spark's backbone, 50 queries; since the first job starts
# before measuring, two readers measured 1.77 M against 1.60 M, to be A/B-tested), at most
# this many
AUTO_WORKERS = 4
MIN_RANGE_BYTES = 64 << 20  # ... each reading at least this much of the file
# a capture this large takes longer to read than Spark's first (warm-up) job: it runs while the
# capture is read; a smaller one's answer job warms up itself. A warm-up replay has to wait
# for costs more than it saves: the warm-up's one-row job takes 6.5-7.5 s in a fresh JVM on
# the core the reading leaves, and the answer job still compiles its own plan (the 851-packet
# sample: 6.5 against 7.1 s with it; the backbone bench's 704 MB, read in about 3 s by a
# session already up: 11.9-12.2 against 12.6-15.0 s with the Python engine, 18.0-19.5
# against 21.1-23.3 s with Spark's). A JVM that is up only once the capture is read skips
# it: the answer job then waited for it (the 3M-packet CSV bench, whose JVM starts alongside
# the reading: 23.1 against 25.5 s whole command with the Python engine, 30 against 33.5 s
# with Spark's)
WARM_UP_BYTES = 2 << 30

class ReplayResult:
    """What ``replay`` did: its plan, the queries' answers as Spark wrote them under
    ``results`` (``collector.daemon.results`` reads them), the decode error that stopped the input
    (if any), its metrics and timings, and the processes that read the packets."""

    def __init__(self, plan: Plan, queries: list[Query], results: Path,
                 error: DecodeError | None, metrics: Metrics, timings: dict | None = None,
                 workers: int = 1):
        self.plan, self.queries, self.results = plan, queries, results
        self.error, self.metrics = error, metrics
        self.timings = timings or {}  # Spark's answer job, seconds
        self.workers = workers

    @property
    def answers(self) -> list[tuple[Query, pa.Table]]:
        """Every query's whole answer, read back (a small one's: the command line streams)."""
        return [(q, read_results(self.results, q)) for q in self.queries]


def _inputs(capture, stream: str, batch_size: int, flow_ports, decoder: Decoder | None,
            sflow_ports: Iterable[int] = DEFAULT_SFLOW_PORTS):
    """The stream's batches; a flow decoder (its template state) is made only for flows, an
    sFlow decoder for samples or counters (each stream decodes the datagrams on its own)."""
    if stream == "packets":
        return open_capture(capture, batch_size)
    if stream == "samples":
        return capture_sflow(capture, sflow_ports, batch_size=batch_size)
    if stream == "counters":
        return (b.counters() for b in capture_sflow(capture, sflow_ports,
                                                    batch_size=batch_size))
    return capture_flows(capture, flow_ports, decoder or Decoder())


def measured_plan(capture, queries: list[Query], plan: Plan, spool: Spool, settings: Settings,
                  flow_ports: Iterable[int] = DEFAULT_FLOW_PORTS,
                  sflow_ports: Iterable[int] = DEFAULT_SFLOW_PORTS) -> Plan:
    """The plan rebuilt on what the first ``planner.measure_tuples`` tuples of each stream
    show: predicate selectivities (the bit budget) and a tuple sample (aggregate-tree node
    sizes). Input errors are left to the real pass, which reports them."""
    selectivity, samples = measure(capture, plan, spool, settings, flow_ports, sflow_ports)
    return build_plan(queries, selectivity=selectivity, samples=samples,
                      **replay_plan_options(settings))


def replay_plan_options(settings: Settings) -> dict:
    """The daemon's plan options without OM's charts: a finite input runs no OM (the engine's
    ``finite``), so charting its nodes would be planning thrown away (the backbone bench's 50
    queries: 8 charts, built twice)."""
    return {**settings.plan_options(), "charts": None}


def measure(capture, plan: Plan, spool: Spool, settings: Settings,
            flow_ports: Iterable[int] = DEFAULT_FLOW_PORTS,
            sflow_ports: Iterable[int] = DEFAULT_SFLOW_PORTS) -> tuple[dict, dict]:
    """Predicate selectivities and tuple samples per stream of a capture's first tuples."""
    limit = settings.planner.measure_tuples
    meter = SelectivityMeter()
    # a capture smaller than the limit is sampled as densely as its size allows (a packet or
    # a flow record takes at least 60 bytes of the file)
    expect = min(limit, max(1, os.path.getsize(capture) // 60))
    sampler = TupleSampler(rows=8192, probability=min(1.0, 8192 / expect))
    for stream in plan.streams():
        engine = Engine(spool, stream, Metrics(), "measure", meter=meter, asc=settings.asc,
                        lfta=settings.lfta, sampler=sampler, residual=settings.residual,
                        om=settings.om)
        engine.set_plan(plan)
        seen = 0
        try:
            for batch in _inputs(capture, stream, settings.batch_size, flow_ports, None,
                                 sflow_ports):
                engine.observe(batch)
                seen += len(batch)
                if seen >= limit:
                    break
        except DecodeError:
            pass
    return meter.selectivities(), sampler.samples()


def byte_ranges(capture, settings: Settings) -> list[tuple[int, int]]:
    """The byte ranges of a capture that ``replay`` reads in parallel (one: it reads alone)."""
    n = settings.replay_workers
    if n == 0:
        n = min(len(os.sched_getaffinity(0)) - 1, AUTO_WORKERS)
    return split_pcap(capture, n, MIN_RANGE_BYTES if settings.replay_workers == 0 else 0)


def _new_engine(spool: Spool, stream: str, metrics: Metrics, settings: Settings,
                plan: Plan) -> Engine:
    engine = Engine(spool, stream, metrics, "replay", settings.spark.watermark_delay_s,
                    asc=settings.asc, lfta=settings.lfta, residual=settings.residual,
                    om=settings.om, finite=True)
    engine.set_plan(plan)
    return engine


def _read_range(k: int, capture, byte_range: tuple[int, int], plan: Plan, settings: Settings,
                spool_root: Path, done, conn) -> None:
    """A worker process (forked: the plan and the compiled kernels are its parent's): the
    packets of one byte range through its own engine into the spool, as its own probe; sends
    back its counters and the decode error that stopped it, if any."""
    try:
        metrics = Metrics()
        spool = Spool(spool_root, settings.spool.max_bytes, "block", 0.0,
                      format=settings.spool.format, probe=f"{settings.probe[:58]}_{k}")
        engine = _new_engine(spool, "packets", metrics, settings, plan)
        error = None
        try:
            batches = open_capture(capture, settings.batch_size, byte_range=byte_range)
            with closing(ahead(batches, engine.prepare)) as read:
                for batch, tuples in read:
                    engine.process(batch, "replay", prepared=tuples)
                    done[k] += len(batch)
        except DecodeError as e:
            error = {"reason": e.reason, "kind": e.kind, "offset": e.offset, "layer": e.layer,
                     "source": e.source}
            metrics.decode_errors.labels("replay", e.kind or "input").inc()
        engine.finish()
        conn.send({"counts": metrics.counts(), "error": error})
    except BaseException as e:  # noqa: BLE001 - the parent reports it in one line
        conn.send({"failed": f"{type(e).__name__}: {e}"})
    finally:
        conn.close()


def _read_in_parallel(capture, ranges: list[tuple[int, int]], plan: Plan, settings: Settings,
                      spool_root: Path, metrics: Metrics, report) -> DecodeError | None:
    """The packets of a pcap file, one forked process per byte range; the first range's
    decode error (ranges before a fault hold only readable records, so only the last can)."""
    ctx = mp.get_context("fork")
    done = ctx.Array("q", len(ranges), lock=False)
    procs, conns = [], []
    for k, byte_range in enumerate(ranges):
        mine, theirs = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_read_range, name=f"flowsieve-replay-{k}", daemon=True,
                        args=(k, capture, byte_range, plan, settings, spool_root, done, theirs))
        p.start()
        theirs.close()
        procs.append(p)
        conns.append(mine)
    replies: list[dict | None] = [None] * len(ranges)
    waiting = dict(enumerate(conns))
    while waiting:
        for conn in mp_wait(list(waiting.values()), timeout=0.25):
            k = conns.index(conn)
            try:
                replies[k] = conn.recv()
            except EOFError:  # the process died without a word (killed: out of memory?)
                procs[k].join()
                replies[k] = {"failed": f"exit code {procs[k].exitcode}"}
            del waiting[k]
        report("reading packets", sum(done))
    for p in procs:
        p.join()
    failed = [f"worker {k}: {r['failed']}" for k, r in enumerate(replies) if "failed" in r]
    if failed:
        raise RuntimeError(f"replay's reading processes failed ({'; '.join(failed)})")
    for r in replies:
        metrics.add(r["counts"])
    errors = [r["error"] for r in replies if r["error"]]
    return DecodeError(errors[0].pop("reason"), **errors[0]) if errors else None


def _warm_up(spark, answer_engine: str, read: threading.Event) -> threading.Thread:
    """Spark's first answer job of ``answer_engine`` warms up (class loading, code generation,
    the Python engine's workers' imports) on the second core while ``replay`` measures, plans
    and reads the capture, unless the capture is ``read`` by the time the JVM is up; a failure
    here is left to the real job to report."""
    from collector.spark.merge import warm_up

    def run() -> None:
        try:
            session = spark.result() if isinstance(spark, Future) else spark
            if not read.is_set():
                warm_up(session, answer_engine)
        except Exception:  # noqa: BLE001, S110 - the real job reports Spark's failures
            pass
    t = threading.Thread(target=run, name="spark-warm-up", daemon=True)
    t.start()
    return t


def replay(capture: str | os.PathLike, queries: list[Query], workdir: str | os.PathLike,
           spark, *, settings: Settings | None = None, metrics: Metrics | None = None,
           flow_ports: Iterable[int] = DEFAULT_FLOW_PORTS, decoder: Decoder | None = None,
           progress: Callable[[str, int | None], None] | None = None,
           sflow_ports: Iterable[int] = DEFAULT_SFLOW_PORTS
           ) -> ReplayResult:
    """Run ``queries`` over a capture file; the answers of every window (end of input closes
    them all). Queries FROM packets read its packets, queries FROM flows the NetFlow/IPFIX
    datagrams sent to ``flow_ports``, FROM samples and FROM counters the sFlow datagrams sent
    to ``sflow_ports``. The plan, the ASC runtime, the batch size and the
    watermark come from ``settings`` (the daemon's configuration; default: the embedded one).
    A decode error stops the input: what came before it is answered, and the error is
    returned. ``progress(stage, records)`` is told how far the input is (records read; None
    once Spark's stage begins). ``spark`` is a session, or a Future of one (a JVM starting
    while the capture is read). The input being finite, Spark merges the spool in one batch
    job per folder (the streaming queries' merge, without waiting for a watermark)."""
    from collector.pipeline.compiled_plan import node_layouts
    from collector.spark.merge import SparkJob

    freeze_startup_heap()
    no_huge_pages()
    work = Path(workdir)
    settings = settings or Settings()
    prefix_tables.configure(settings.tables)
    user_predicates.configure(settings.predicates)
    enrichment.configure(settings.enrich, work / "spool")
    for q in queries:
        prefix_tables.check(q)
        user_predicates.check(q)
        enrichment.check(q)
    batch_size = settings.batch_size
    watermark_delay_s = settings.spark.watermark_delay_s
    report = progress or (lambda stage, n: None)
    metrics = metrics or Metrics()
    # nothing consumes the spool before the end of the input: a full one is an error
    spool = Spool(work / "spool", settings.spool.max_bytes, "block", 0.0,
                  format=settings.spool.format, probe=settings.probe)
    plan = build_plan(queries, **replay_plan_options(settings))
    # Spark's first job warms up from here on, on the core that measuring and planning leave
    # idle, when reading the capture takes long enough to hide it
    captured = threading.Event()
    warming = _warm_up(spark, settings.spark.answer_engine, captured) \
        if settings.spool.format == "parquet" and os.path.getsize(capture) >= WARM_UP_BYTES \
        else None
    if settings.planner.measure_tuples:
        report("measuring", 0)
        plan = measured_plan(capture, queries, plan, spool, settings, flow_ports, sflow_ports)
    error = None
    ranges = byte_ranges(capture, settings) if "packets" in plan.streams() else []
    for stream in STREAMS:
        if not any(q.stream == stream for q in queries):
            continue
        if stream == "packets" and len(ranges) > 1:
            error = _read_in_parallel(capture, ranges, plan, settings, work / "spool",
                                      metrics, report)
            continue
        engine = _new_engine(spool, stream, metrics, settings, plan)
        try:
            done = 0
            if stream == "flows":
                decoder = decoder or Decoder()
            batches = _inputs(capture, stream, batch_size, flow_ports, decoder, sflow_ports)
            with closing(ahead(batches, engine.prepare)) as read:  # the reader stops with us
                for batch, tuples in read:
                    engine.process(batch, "replay", prepared=tuples)
                    done += len(batch)
                    report(f"reading {stream}", done)
            if stream == "flows":
                for reason, n in decoder.errors.items():
                    metrics.decode_errors.labels("replay", reason).inc(n)
        except DecodeError as e:
            error = e
            metrics.decode_errors.labels("replay", e.kind or "input").inc()
        engine.finish()
    captured.set()
    folders = [(s, f) for s in plan.streams() for f in plan.folders(s)]
    report("Spark: answering", None)
    t0 = time.perf_counter()
    if isinstance(spark, Future):
        spark = spark.result()
    if warming is not None:
        warming.join()
    timings = {"wait_s": time.perf_counter() - t0}  # for the JVM or its first job
    slots = {qp.slot: qp.query for qp in plan.queries}
    job = SparkJob(spark, work / "spool", work / "results", work / "checkpoints",
                   lambda: slots, watermark_delay_s, metrics,
                   spool_format=settings.spool.format,
                   answer_engine=settings.spark.answer_engine,
                   answer_task_rows=settings.spark.answer_task_rows,
                   layouts=lambda stream, folder: node_layouts(plan, stream, folder))
    job.timings.update(timings)
    if settings.spool.format == "parquet":
        job.run_batch(folders)
    else:  # the Python data source reads Arrow IPC as a stream
        job.run_available_now(folders)
    return ReplayResult(plan, queries, work / "results", error, metrics, job.timings,
                        max(len(ranges), 1))
