"""``flowsieve replay``: a capture through the whole pipeline, Spark included."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from multiprocessing.connection import wait as mp_wait
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from capture.errors import DecodeError
from capture.netflow import DEFAULT_FLOW_PORTS, Decoder, capture_flows
from capture.pcap import open_capture, split_pcap
from collector import freeze_startup_heap, functions, no_huge_pages, tables
from collector.config import Settings
from collector.engine import Engine
from collector.metrics import Metrics
from collector.results import Resolve, node_runs, prune_rows
from collector.sampling import TupleSampler
from collector.selectivity import SelectivityMeter
from collector.sources import ahead
from collector.spool import SUFFIXES, TS_US, MemorySpool, Spool, list_files, read_spool_file
from planner.plan import Plan, build_plan
from planner.query import Query

# replay_workers 0: one process per core but one (Spark's JVM runs its first job on that one
# while the capture is read: on 2 cores a second reading process only competed with it, 1.20 M
# against 1.22 M packets/s on bench_spark's backbone, 50 queries; since the first job starts
# before measuring, two readers measured 1.77 M against 1.60 M, to be A/B-tested), at most
# this many
AUTO_WORKERS = 4
MIN_RANGE_BYTES = 64 << 20  # ... each reading at least this much of the file
# pruning reads a folder's rows a run of windows at a time (every answer is per window), at
# most this many Arrow bytes of them at once over its threads (all the rows kept in memory
# fit)...
PRUNE_CHUNK_BYTES = 512 << 20
# ... and a window whose rows are more than this is merged whole (pruning takes a few times
# its rows' bytes)
PRUNE_MAX_BYTES = 1 << 30
# with the LFTA off (a row per tuple and node) a folder whose spool files hold more than this
# is merged whole: pruning there left out little and cost more than it saved (bench_spark's
# per_tuple mode, 50 queries: 14M rows, 12.8M of them needed, 25.6 s of pruning and 11 GiB
# against Spark's 8.4 s and 1.4 GiB)
PRUNE_PER_TUPLE_FILE_BYTES = 64 << 20
PRUNE_MAX_THREADS = 4  # threads that prune runs of windows at once
PARQUET_ARROW = 3  # Arrow bytes of a spool file's rows per byte Parquet encodes them in
# the partial rows replay's own reading keeps in memory for pruning, in Arrow bytes (the attack
# bench's 1.4M rows: 250 MiB); past it they go to files
PRUNE_MEMORY_BYTES = 512 << 20


class ReplayResult:
    def __init__(self, plan: Plan, answers: list[tuple[Query, pa.Table]],
                 error: DecodeError | None, metrics: Metrics, timings: dict | None = None,
                 workers: int = 1):
        self.plan, self.answers, self.error, self.metrics = plan, answers, error, metrics
        self.timings = timings or {}  # Spark's merge and the driver's answers, seconds
        self.workers = workers  # processes that read the packets


def _inputs(capture, stream: str, batch_size: int, flow_ports, decoder: Decoder | None):
    """The stream's batches; a flow decoder (its template state) is made only for flows."""
    if stream == "packets":
        return open_capture(capture, batch_size)
    return capture_flows(capture, flow_ports, decoder or Decoder())


def measured_plan(capture, queries: list[Query], plan: Plan, spool: Spool, settings: Settings,
                  flow_ports: Iterable[int] = DEFAULT_FLOW_PORTS) -> Plan:
    """The plan rebuilt on what the first ``planner.measure_tuples`` tuples of each stream
    show: predicate selectivities (the bit budget) and a tuple sample (aggregate-tree node
    sizes). Input errors are left to the real pass, which reports them."""
    selectivity, samples = measure(capture, plan, spool, settings, flow_ports)
    return build_plan(queries, selectivity=selectivity, samples=samples,
                      **replay_plan_options(settings))


def replay_plan_options(settings: Settings) -> dict:
    """The daemon's plan options without OM's charts: a finite input runs no OM (the engine's
    ``finite``), so charting its nodes would be planning thrown away (the backbone bench's 50
    queries: 8 charts, built twice)."""
    return {**settings.plan_options(), "charts": None}


def measure(capture, plan: Plan, spool: Spool, settings: Settings,
            flow_ports: Iterable[int] = DEFAULT_FLOW_PORTS) -> tuple[dict, dict]:
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
            for batch in _inputs(capture, stream, settings.batch_size, flow_ports, None):
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


def _warm_up(spark, streams: list[str], only: set[str], sketches: bool,
             sets: bool) -> threading.Thread:
    """Spark's first job warms up (class loading, code generation) on the second core while
    ``replay`` measures, plans and reads the capture; a failure here is left to the real job
    to report."""
    from collector.spark.job import warm_up

    def run() -> None:
        try:
            warm_up(spark.result() if isinstance(spark, Future) else spark, streams, only,
                    sketches=sketches, sets=sets)
        except Exception:  # noqa: BLE001, S110 - the real job reports Spark's failures
            pass
    t = threading.Thread(target=run, name="spark-warm-up", daemon=True)
    t.start()
    return t


def prune_spool(spool: Spool, stream: str, folder: str, resolve: Resolve,
                kept: list[pa.Table] = (), per_tuple: bool = False) -> int:
    """Rewrite an aggregate folder of a finished input (every writer done, every window
    closed) without the partial rows no answer needs, each row kept with the query bits of
    the queries that need it (``results.prune_rows``): Spark then merges the rows that
    matter. ``kept``: the folder's partial rows a ``MemorySpool`` kept in memory, with its
    files. The rows are pruned a run of windows at a time (``window_chunks``), so a capture
    whose rows outgrow memory prunes in bounded memory too, and runs are pruned on
    ``prune_threads()`` threads at once (within the same bytes; a window larger than a
    thread's share of them is pruned alone); a window of more than
    ``PRUNE_MAX_BYTES`` is written whole, and so is the folder of rows ``per_tuple`` (the
    LFTA off) whose files hold more than ``PRUNE_PER_TUPLE_FILE_BYTES``. Returns the rows
    left out."""
    files = list_files(spool.root / stream / folder)
    if per_tuple and sum(f.stat().st_size for f in files) > PRUNE_PER_TUPLE_FILE_BYTES:
        for t in kept:
            spool.write(stream, folder, t, "force")
        return 0
    sources = [*kept, *files]
    windows = [_windows(x) for x in sources]
    threads = prune_threads()

    def prune(chunk: tuple[int, int, float]) -> int:
        """One run of windows pruned and written; the rows left out."""
        lo, hi, size = chunk
        parts = [x if w[0].min() >= lo and w[0].max() <= hi
                 else _window_rows(x, lo, hi) for x, w in zip(sources, windows, strict=True)
                 if len(w[0]) and w[0].max() >= lo and w[0].min() <= hi]
        parts = [read_spool_file(x) if isinstance(x, Path) else x for x in parts]
        if size > PRUNE_MAX_BYTES:
            for t in parts:
                spool.write(stream, folder, t, "force")
            return 0
        rows, runs = node_runs(parts)
        if not rows.num_rows:
            return 0
        forced = np.zeros(rows.num_rows, bool)  # punctuation stays
        forced[slice(*runs.get("", (0, 0)))] = True
        out = prune_rows(stream, rows, resolve, forced, runs)
        spool.write(stream, folder, out, "force")
        return rows.num_rows - out.num_rows

    share = PRUNE_CHUNK_BYTES / threads
    chunks = window_chunks(windows, share, threads)
    # a run of one window larger than a thread's share is pruned alone (memory stays bound)
    alone = [c for c in chunks if c[2] > share]
    together = [c for c in chunks if c[2] <= share]
    left_out = sum(map(prune, alone))
    if threads > 1 and len(together) > 1:
        with ThreadPoolExecutor(threads, thread_name_prefix="flowsieve-prune") as pool:
            left_out += sum(pool.map(prune, together))
    else:
        left_out += sum(map(prune, together))
    for f in files:
        f.unlink()
    return left_out


def prune_threads() -> int:
    """Threads that prune runs of windows at once: one per core, at most
    ``PRUNE_MAX_THREADS``. Most of the pruning is numba, Arrow and numpy work that lets go of
    the GIL (the telemetry bench's rows: 0.28 s on one thread, 0.20 s on two)."""
    return max(1, min(len(os.sched_getaffinity(0)), PRUNE_MAX_THREADS))


def _windows(source: pa.Table | Path) -> tuple[np.ndarray, np.ndarray]:
    """A folder's rows (a table, or a spool file) per window: the window starts (µs, in
    order) and the Arrow bytes of their rows."""
    if isinstance(source, Path):
        if source.suffix == SUFFIXES["parquet"]:
            meta = pq.read_metadata(source)
            # its columns' encoded bytes: about a third of them in Arrow (2.7 on the telemetry
            # bench's rows; dictionaries and run lengths)
            nbytes = PARQUET_ARROW * sum(meta.row_group(i).total_byte_size
                                         for i in range(meta.num_row_groups))
            ws = pq.read_table(source, columns=["window_start"]).column("window_start")
        else:
            t = read_spool_file(source)
            nbytes, ws = t.nbytes, t.column("window_start")
    else:
        nbytes, ws = source.nbytes, source.column("window_start")
    starts = pc.cast(ws, pa.int64()).to_numpy(zero_copy_only=False)
    if not len(starts):
        return starts, starts
    values, counts = np.unique(starts, return_counts=True)
    return values, counts * (nbytes / len(starts))


def window_chunks(windows: list[tuple[np.ndarray, np.ndarray]], max_bytes: float,
                  parts: int = 1) -> list[tuple[int, int, float]]:
    """Runs of consecutive windows (first, last window start, their rows' bytes) of at most
    ``max_bytes`` each, but at least one window, over every source's ``_windows``; with
    ``parts``, a run also ends before a window that would take it more than half that
    window past ``1/parts`` of all the bytes (runs for ``parts`` threads)."""
    if not windows:
        return []
    starts = np.concatenate([w for w, _ in windows])
    if not len(starts):
        return []
    values, at = np.unique(starts, return_inverse=True)
    size = np.bincount(at, weights=np.concatenate([b for _, b in windows]),
                       minlength=len(values))
    out: list[tuple[int, int, float]] = []
    first, total = 0, 0.0
    share = float(size.sum()) / parts
    for i, b in enumerate(size.tolist()):
        if i > first and (total + b > max_bytes or (parts > 1 and total + b / 2 > share)):
            out.append((int(values[first]), int(values[i - 1]), total))
            first, total = i, 0.0
        total += b
    out.append((int(values[first]), int(values[-1]), total))
    return out


def _window_rows(source: pa.Table | Path, lo: int, hi: int) -> pa.Table:
    """A source's rows of the windows ``lo`` to ``hi`` (µs)."""
    if isinstance(source, Path) and source.suffix == SUFFIXES["parquet"]:
        return pq.read_table(source, filters=[("window_start", ">=", pa.scalar(lo, TS_US)),
                                              ("window_start", "<=", pa.scalar(hi, TS_US))])
    t = read_spool_file(source) if isinstance(source, Path) else source
    ws = pc.cast(t.column("window_start"), pa.int64())
    return t.filter(pc.and_(pc.greater_equal(ws, lo), pc.less_equal(ws, hi)))


def replay(capture: str | os.PathLike, queries: list[Query], workdir: str | os.PathLike,
           spark, *, settings: Settings | None = None, metrics: Metrics | None = None,
           flow_ports: Iterable[int] = DEFAULT_FLOW_PORTS, decoder: Decoder | None = None,
           progress: Callable[[str, int | None], None] | None = None
           ) -> ReplayResult:
    """Run ``queries`` over a capture file; the answers of every window (end of input closes
    them all). Queries FROM packets read its packets, queries FROM flows the NetFlow/IPFIX
    datagrams sent to ``flow_ports``. The plan, the ASC runtime, the batch size and the
    watermark come from ``settings`` (the daemon's configuration; default: the embedded one).
    A decode error stops the input: what came before it is answered, and the error is
    returned. ``progress(stage, records)`` is told how far the input is (records read; None
    once Spark's stage begins). ``spark`` is a session, or a Future of one (a JVM starting
    while the capture is read). The input being finite, Spark merges the spool in one batch
    job per folder (the streaming queries' merge, without waiting for a watermark)."""
    from collector.spark.job import SparkJob

    freeze_startup_heap()
    no_huge_pages()
    work = Path(workdir)
    settings = settings or Settings()
    tables.configure(settings.tables)
    functions.configure(settings.predicates)
    for q in queries:
        tables.check(q)
        functions.check(q)
    batch_size = settings.batch_size
    watermark_delay_s = settings.spark.watermark_delay_s
    report = progress or (lambda stage, n: None)
    metrics = metrics or Metrics()
    # nothing consumes the spool before the end of the input: a full one is an error
    spool_args = (work / "spool", settings.spool.max_bytes, "block", 0.0)
    spool_kw = {"format": settings.spool.format, "probe": settings.probe}
    # what it keeps in memory counts against the spool's bound too
    spool = MemorySpool(*spool_args, **spool_kw,
                        limit=min(PRUNE_MEMORY_BYTES, settings.spool.max_bytes)) \
        if settings.replay_prune else Spool(*spool_args, **spool_kw)
    plan = build_plan(queries, **replay_plan_options(settings))
    only = {m for qp in plan.queries for m in qp.query.measures}  # what Spark merges
    sketches = any(qp.query.approx for qp in plan.queries)
    # the pruning makes a distinct count's rows value sets (results.value_sets)
    sets = settings.replay_prune and any(qp.query.distinct for qp in plan.queries)
    # Spark's first job warms up from here on, on the core that measuring and planning leave
    # idle (it needs the queries' streams and measures only, not the plan)
    warming = _warm_up(spark, plan.streams(), only, sketches, sets) \
        if settings.spool.format == "parquet" else None
    if settings.planner.measure_tuples:
        report("measuring", 0)
        plan = measured_plan(capture, queries, plan, spool, settings, flow_ports)
    error = None
    ranges = byte_ranges(capture, settings) if "packets" in plan.streams() else []
    for stream in ("packets", "flows"):
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
            batches = _inputs(capture, stream, batch_size, flow_ports, decoder)
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
    folders = [(s, f) for s in plan.streams() for f in plan.folders(s)]
    timings: dict[str, float] = {}
    if settings.replay_prune:  # on the driver, while Spark's first job may still warm up
        report("Spark: leaving out what no answer needs", None)
        t0 = time.perf_counter()
        resolve = {qp.slot: qp.query for qp in plan.queries}.get
        kept = spool.release()
        for s, f in dict.fromkeys([*folders, *kept]):  # the plan's, and any rows kept
            if f != "select":
                metrics.spool_pruned.labels(s, f).inc(
                    prune_spool(spool, s, f, resolve, kept.get((s, f), []),
                                per_tuple=not settings.lfta.enabled))
        timings["prune_s"] = time.perf_counter() - t0
    report("Spark: merging partial aggregates", None)
    t0 = time.perf_counter()
    if isinstance(spark, Future):
        spark = spark.result()
    if warming is not None:
        warming.join()
    timings["wait_s"] = time.perf_counter() - t0  # for the JVM or its first job
    job = SparkJob(spark, work / "spool", work / "results", work / "checkpoints",
                   {qp.slot: qp.query for qp in plan.queries}.get, watermark_delay_s, metrics,
                   spool_format=settings.spool.format, keep_answers=True)
    job.timings.update(timings)
    if settings.spool.format == "parquet":
        job.run_batch(folders, only, sketches, sets)
    else:  # the Python data source reads Arrow IPC as a stream
        job.run_available_now(folders)
    t0 = time.perf_counter()
    answers = [(q, job.answer(q)) for q in queries]  # as written to work/results
    job.timings["read_results_s"] = time.perf_counter() - t0
    return ReplayResult(plan, answers, error, metrics, job.timings, max(len(ranges), 1))
