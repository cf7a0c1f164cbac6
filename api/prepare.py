"""``flowsieve prepare``, run once at install (``make run``'s install step, the image's build) so
that a fresh install's first run is as fast as its second: every numba kernel the product runs
compiled into numba's cache (``compile_kernels``: 15 s of a first ``replay`` were compiling),
and the JVM's class-data archive made where it can finish (``make_class_archive``: a JVM that
wrote it at exit took a stop past its deadline).

The kernels: each compiled with every argument-type signature the product calls it with.

numba compiles one overload per signature, on the first call with those types, and a cached one
loads without compiling. A signature is types only (an array's dtype, dimensions, layout and
whether it is read-only), so the warm-up drives the product's own paths over the small captures
shipped in ``collector/data``, each kind of source once:

- reading and unpacking (``flowsieve decode``): a pcap file in windows small enough that
  records straddle them, a classic and a pcapng capture through a pipe (``decode -``), and a
  live ring's block (a synthetic one: an AF_PACKET socket needs root);
- NetFlow/IPFIX and sFlow exports in a capture file and a pipe, and received by the daemon's
  UDP listeners on the loopback (data before its template held, then released);
- the enrichment databases loaded, and batches enriched in each of the ways fields combine;
- the engine (prefilter, ASC, residual, LFTA, spool) as ``replay`` runs it (a measured plan)
  and as the daemon runs it (OM's charts, the read-ahead thread, flushes, heartbeats), with
  ``collector/data/warmup.sql``'s queries of each stream, and the daemon's default queries with
  their key layouts' own LFTA merge kernels (``lfta_kernels.specialize``);
- the answer tasks of Spark's Python workers over what the engines spooled
  (``derive.answer_locally``, and the worker daemon's preload), without a JVM.

The slowest kernels to compile, the NetFlow/IPFIX and sFlow decoders' and the enrichment
look-ups', compile in a process of their own, on another core, while the packets' kernels compile
here (62 s in one process, 31 s in two, on 2 idle cores); no kernel compiles in both at once
(numba's cache index is not written under a lock), and this process compiles what the other
failed to.

The one signature that depends on the queries is the LFTA's merge kernel of a key layout (its
key fields and words, compiled in): the warm-up queries' own layouts are not compiled (their
aggregate trees are theirs, not the user's); other queries' layouts compile on first use, in
the background while the generic kernel merges.
"""

from __future__ import annotations

import mmap
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import numpy as np

from collector.config import Settings, data_file

SAMPLE = data_file("sample.pcap")
SAMPLE_PCAPNG = data_file("sample.pcapng")
SAMPLE_FLOWS = data_file("sample-flows.pcap")
SAMPLE_SFLOW = data_file("sample-sflow.pcap")
ASN_MMDB = data_file("GeoLite2-ASN-Test.mmdb")
WARMUP_SQL = data_file("warmup.sql")
DEFAULT_SQL = data_file("example.sql")
# the operator's own prefixes for the sample capture (enrich.networks)
NETWORKS = """\
10.0.0.0/8: {name: home, role: lan, site: lab}
10.0.0.25/32: {name: laptop, role: client, site: lab}
216.58.192.0/19: {name: google, role: cdn}
2001:db8::/32: {name: documentation, role: test}
fe80::/10: link-local
"""
SMALL_BATCH = 128  # records per batch: several batches, windows closing between them
CAPTURES = {"packets": SAMPLE, "flows": SAMPLE_FLOWS, "samples": SAMPLE_SFLOW,
            "counters": SAMPLE_SFLOW}
PACKAGES = ("capture", "planner", "collector", "api")


def compile_kernels(progress: Callable[[str], None] | None = None) -> dict:
    """Compile every kernel the product reaches, with every signature, into numba's cache
    (``$NUMBA_CACHE_DIR``, else ``__pycache__`` beside the sources); what is cached already
    loads. Returns the kernels and overloads reached, how many of those were compiled and how
    many loaded from the cache, and the seconds (of each step too)."""
    say = progress or (lambda line: None)
    started = time.perf_counter()
    steps: dict[str, float] = {}

    def step(name: str, fn: Callable, *args) -> None:
        t0 = time.perf_counter()
        fn(*args)
        steps[name] = round(time.perf_counter() - t0, 2)
        say(f"kernels: {name} ({steps[name]:.1f} s)")
    with tempfile.TemporaryDirectory(prefix="flowsieve-prepare-") as tmp:
        run = _Run(Path(tmp), say)
        try:
            step("export datagrams", run.read_exports)
            side = _Side(run)
            for name, fn in (("capture files and pipes", _reading), ("a live ring", _live_ring),
                             ("warm-up queries of packets", _packet_engines),
                             ("default queries", _default_engines)):
                step(name, fn, run)
            side_counts = side.join(say)
            for name, fn in (("exports in captures and pipes", _exports),
                             ("enrichment", _enrichment),
                             ("warm-up queries", _warmup_engines), ("answer tasks", _answers)):
                step(name, fn, run)
        finally:
            _reset_enrichment()
    out = {**_summary(_overloads(), side_counts), "seconds":
           round(time.perf_counter() - started, 2), "steps": steps}
    say(f"kernels: {out['overloads']} overloads of {out['kernels']} kernels "
        f"({out['compiled']} compiled, {out['loaded']} loaded from the cache) in "
        f"{out['seconds']:.1f} s")
    return out


class _Run:
    """One warm-up: its folder, configuration, the sample exports' datagrams, and the spools
    its engines wrote with their plans."""

    def __init__(self, work: Path, say: Callable[[str], None]):
        self.work, self.say = work, say
        networks = work / "networks.yaml"
        networks.write_text(NETWORKS)
        # the embedded configuration, with the warm-up's enrichment databases and folders
        self.settings = Settings(initial_queries=None, var_dir=work / "var",
                                 enrich={"asn": ASN_MMDB, "networks": networks})
        self.flow_datagrams: list[bytes] = []
        self.sflow_datagrams: list[bytes] = []
        self.spooled: list[tuple[Path, object]] = []

    def read_exports(self) -> None:
        """The UDP payloads of the sample NetFlow/IPFIX and sFlow captures."""
        from capture.netflow import DEFAULT_FLOW_PORTS
        from capture.sflow import DEFAULT_SFLOW_PORTS
        self.flow_datagrams = _datagrams(SAMPLE_FLOWS, DEFAULT_FLOW_PORTS)
        self.sflow_datagrams = _datagrams(SAMPLE_SFLOW, DEFAULT_SFLOW_PORTS)


def _queries(path: str) -> list:
    from planner.query import parse_queries
    return parse_queries(Path(path).read_text())


def _datagrams(capture: str, ports: Iterable[int]) -> list[bytes]:
    """The UDP payloads sent to ``ports`` in a capture."""
    from capture.netflow import export_datagrams
    from capture.pcap import open_capture
    out = []
    for raw in open_capture(capture):
        dg = export_datagrams(raw, ports)
        out += [dg.buf[o:o + n].tobytes() for o, n in zip(dg.offset, dg.length, strict=True)]
    return out


# --------------------------------------------------------------------------- the other process
class _Side:
    """The decoders' and the enrichment look-ups' kernels compiled in a process of their own
    (``_decode_and_look_up``) while this one compiles the packets'. A new interpreter, not a
    fork: the caller may run threads (a fork copies the locks they hold)."""

    def __init__(self, run: _Run):
        import multiprocessing as mp
        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_side, name="flowsieve-prepare-side", daemon=True,
                                args=(run.flow_datagrams, run.sflow_datagrams,
                                      run.settings.enrich, run.work / "side", theirs))
        self.proc.start()
        theirs.close()

    def join(self, say: Callable[[str], None]) -> dict:
        """Wait for it; what it compiled and loaded (nothing when it failed: this process
        compiles those kernels in the steps that follow)."""
        try:
            got = self.conn.recv()
        except EOFError:  # it died without a word
            got = None
        self.proc.join()
        if got is None:
            got = {"failed": f"exit code {self.proc.exitcode}"}
        if "failed" in got:
            say(f"kernels: the decoders' process failed ({got['failed']}): compiling them here")
            return {}
        say(f"kernels: decoders and look-ups, in a process of their own "
            f"({got['seconds']:.1f} s)")
        return got["overloads"]


def _side(flows: list[bytes], sflow: list[bytes], databases, folder: Path, conn) -> None:
    """The other process: ``_decode_and_look_up``, then its overloads (or why it failed) sent
    on ``conn``."""
    try:
        t0 = time.perf_counter()
        _decode_and_look_up(flows, sflow, databases, folder)
        conn.send({"overloads": _overloads(), "seconds": time.perf_counter() - t0})
    except BaseException as e:  # noqa: BLE001 - the parent compiles what this did not
        conn.send({"failed": f"{type(e).__name__}: {e}"})
    finally:
        conn.close()


def _decode_and_look_up(flows: list[bytes], sflow: list[bytes], databases,
                        folder: Path) -> None:
    """NetFlow/IPFIX and sFlow datagrams decoded (as a listener hands them over), and the
    enrichment ``databases`` loaded and looked up in a batch of flow records in each way
    fields combine. Nothing here reaches a packets kernel (the other process compiles those)."""
    from capture import enrich
    from capture.netflow import Datagrams, Decoder
    from capture.sflow import SflowDecoder
    from collector.pipeline import enrichment
    records = Decoder().decode(Datagrams.from_payloads(flows))
    SflowDecoder().decode(Datagrams.from_payloads(sflow))
    enrichment.configure(databases, folder)
    _enrich_variants(enrich.current(), records)


def _enrich_variants(enriching, tb) -> None:
    """``tb`` enriched in each way fields combine: both addresses of one attribute at once,
    one address, record ids gathered for several attributes; AS numbers and text codes."""
    for names in (("src_asn", "dst_asn"), ("dst_asn",), ("src_net_name", "dst_net_name"),
                  ("dst_net_role",), ("src_asn", "src_as_name", "src_net_name", "src_net_site")):
        enriching.apply(tb, names)


# --------------------------------------------------------------------------- reading
def _second_record(path: str) -> int:
    """A byte inside the second record of a capture."""
    from capture.pcap import open_capture
    reader = open_capture(path)
    try:
        return int(next(iter(reader)).offset[1]) + 4
    finally:
        reader.close()


@contextmanager
def _piped(path: str) -> Iterator:
    """A pipe carrying ``path``'s bytes, as ``decode -`` reads its standard input: those
    before a cut inside the second record first, the rest once the reader has had a batch
    (or half a second later), so that a read ends inside a record. Yields the pipe's reading
    end and the event that lets the rest through."""
    data = Path(path).read_bytes()
    cut = _second_record(path)
    r, w = os.pipe()
    more = threading.Event()

    def write() -> None:
        try:
            with open(w, "wb", buffering=0) as f:
                f.write(data[:cut])
                more.wait(0.5)
                f.write(data[cut:])
        except BrokenPipeError:  # the reader stopped early
            pass
    t = threading.Thread(target=write, name="prepare-pipe", daemon=True)
    t.start()
    try:
        with open(r, "rb") as f:
            yield f, more
    finally:
        more.set()
        t.join()


def _reading(run: _Run) -> None:
    """``decode`` of packets: a mapped file in 64 KiB windows (records straddle them), a
    pcapng file, and both formats through a pipe; ``replay``'s readers of a large file, each
    its byte range; every field unpacked."""
    from capture.pcap import open_capture, split_pcap
    from capture.unpack import unpack
    for raw in open_capture(SAMPLE, SMALL_BATCH, window=1 << 16):
        unpack(raw)
    for byte_range in split_pcap(SAMPLE, 2):
        for raw in open_capture(SAMPLE, SMALL_BATCH, byte_range=byte_range):
            unpack(raw)
    for raw in open_capture(SAMPLE_PCAPNG, SMALL_BATCH):
        unpack(raw)
    for path in (SAMPLE, SAMPLE_PCAPNG):
        with _piped(path) as (pipe, more):
            for raw in open_capture(pipe, SMALL_BATCH):
                more.set()
                unpack(raw)


def _ring(frames: list[bytes], block_size: int) -> np.ndarray:
    """A TPACKET_V3 ring of one ready block holding ``frames`` as the kernel lays them out
    (the second's VLAN tag in its header), mapped as ``LiveCapture`` maps its ring."""
    ring = np.frombuffer(mmap.mmap(-1, block_size), np.uint8)

    def put(at: int, value: int, size: int = 4) -> None:
        ring[at:at + size] = np.frombuffer(value.to_bytes(size, "little"), np.uint8)
    first, mac = 64, 80
    put(8, 1)  # TP_STATUS_USER
    put(12, len(frames))
    put(16, first)
    p = first
    for k, f in enumerate(frames):
        size = (mac + len(f) + 15) // 16 * 16
        for j, v in enumerate((size if k + 1 < len(frames) else 0, 1_700_000_000 + k, 1000 * k,
                               len(f), len(f), (1 << 4) | (1 << 6) if k == 1 else 0)):
            put(p + 4 * j, v)
        put(p + 24, mac, 2)
        put(p + 32, 42)  # the VLAN TCI
        put(p + 36, 0x8100, 2)  # its TPID
        ring[p + mac:p + mac + len(f)] = np.frombuffer(f, np.uint8)
        p += size
    return ring


def _live_ring(run: _Run) -> None:
    """A live capture's ready block copied as ``LiveCapture.batches`` copies it (an AF_PACKET
    ring needs root and an interface), and its batch unpacked."""
    from capture.live import copy_block
    from capture.pcap import open_capture
    from capture.records import RawBatch, batch_arrays
    from capture.unpack import unpack
    reader = open_capture(SAMPLE, 8)
    frames = [rec[-1] for rec in next(iter(reader)).records()]
    reader.close()
    block_size = 1 << 16
    ring = _ring(frames, block_size)
    out = np.empty(2 * block_size, np.uint8)
    offset, caplen, wirelen, ts, link, iface = batch_arrays(64)
    n, _ = copy_block(ring, 0 * block_size, out, 0, False, offset, caplen, wirelen, ts, 0)
    link[:n], iface[:n] = 1, 0
    unpack(RawBatch(out, offset[:n], caplen[:n], wirelen[:n], ts[:n], link[:n], iface[:n]))


def _exports(run: _Run) -> None:
    """``decode --stream flows|samples|counters``: exports in a mapped file and in a pipe."""
    from capture.netflow import DEFAULT_FLOW_PORTS, capture_flows
    from capture.pcap import open_capture
    from capture.sflow import DEFAULT_SFLOW_PORTS, capture_sflow
    for pipe_it in (False, True):
        with _piped(SAMPLE_FLOWS) as (pipe, more):
            reader = open_capture(pipe if pipe_it else SAMPLE_FLOWS, SMALL_BATCH)
            for fb in capture_flows(reader, DEFAULT_FLOW_PORTS):
                more.set()
                fb.arrow("src_ip")
        with _piped(SAMPLE_SFLOW) as (pipe, more):
            reader = open_capture(pipe if pipe_it else SAMPLE_SFLOW, SMALL_BATCH)
            for batch in capture_sflow(reader, DEFAULT_SFLOW_PORTS):
                more.set()
                batch.samples()
                batch.counters()


# --------------------------------------------------------------------------- enrichment
def _enrichment(run: _Run) -> None:
    """The databases loaded (the MMDB's trie walked, the tables built), and a batch of each
    stream enriched in each way fields combine."""
    from capture import enrich
    from capture.netflow import DEFAULT_FLOW_PORTS, capture_flows
    from capture.pcap import open_capture
    from capture.sflow import DEFAULT_SFLOW_PORTS, capture_sflow
    from capture.unpack import unpack
    from collector.pipeline import enrichment
    enrichment.configure(run.settings.enrich, run.work / "spool")
    for tb in (unpack(next(iter(open_capture(SAMPLE, SMALL_BATCH)))),
               next(capture_flows(SAMPLE_FLOWS, DEFAULT_FLOW_PORTS)),
               next(capture_sflow(SAMPLE_SFLOW, DEFAULT_SFLOW_PORTS)).samples()):
        _enrich_variants(enrich.current(), tb)


def _reset_enrichment() -> None:
    from capture import enrich
    enrich.configure({})


# --------------------------------------------------------------------------- engines
@contextmanager
def _generic_merges() -> Iterator[None]:
    """The LFTA merges with the generic kernel only: no key layout's own is compiled."""
    from collector.pipeline import lfta_kernels
    lfta_kernels.SPECIALIZE = False
    try:
        yield
    finally:
        lfta_kernels.SPECIALIZE = True


def _spool(run: _Run, name: str):
    from collector.pipeline.spool import Spool
    return Spool(run.work / name, run.settings.spool.max_bytes, "block", 0.0,
                 format=run.settings.spool.format, probe="prepare")


def _stream_batches(stream: str, batch_size: int) -> Iterable:
    """A stream's batches of its sample capture, as ``replay`` reads them."""
    from capture.netflow import DEFAULT_FLOW_PORTS, capture_flows
    from capture.pcap import open_capture
    from capture.sflow import DEFAULT_SFLOW_PORTS, capture_sflow
    capture = CAPTURES[stream]
    if stream == "packets":
        return open_capture(capture, batch_size)
    if stream == "flows":
        return capture_flows(capture, DEFAULT_FLOW_PORTS, batch_size=batch_size)
    batches = capture_sflow(capture, DEFAULT_SFLOW_PORTS, batch_size=batch_size)
    return batches if stream == "samples" else (b.counters() for b in batches)


def _replay(run: _Run, queries: list) -> None:
    """``replay``: each capture's plan measured on its first tuples, then each stream of it
    through an engine of a finite input, read ahead."""
    from api.replay import measured_plan, replay_plan_options
    from collector.daemon.sources import ahead
    from collector.metrics import Metrics
    from collector.pipeline.engine import Engine
    from planner.plan import build_plan
    settings = run.settings
    name = f"replay-{len(run.spooled)}"
    spool = _spool(run, name)
    for capture in dict.fromkeys(CAPTURES[q.stream] for q in queries):
        mine = [q for q in queries if CAPTURES[q.stream] == capture]
        plan = build_plan(mine, **replay_plan_options(settings))
        plan = measured_plan(capture, mine, plan, spool, settings)
        run.spooled.append((run.work / name, plan))
        for stream in plan.streams():
            engine = Engine(spool, stream, Metrics(), "replay", settings.spark.watermark_delay_s,
                            asc=settings.asc, lfta=settings.lfta, residual=settings.residual,
                            om=settings.om, finite=True)
            engine.set_plan(plan)
            with closing(ahead(_stream_batches(stream, SMALL_BATCH), engine.prepare)) as read:
                for batch, tuples in read:
                    engine.process(batch, "replay", prepared=tuples)
            engine.finish()


def _daemon(run: _Run, queries: list) -> None:
    """``flowsieve run``: the sample capture as a pcap source reads it (read ahead), a
    NetFlow/IPFIX and an sFlow listener on the loopback (with the sFlow listener's counters
    feed), each feeding its engine as the daemon does (OM's charts, a selectivity meter, a
    tuple sampler); then the daemon's clock: due flushes, a heartbeat, a stop."""
    from collector.config import SourceConfig
    from collector.daemon.sources import FlowSource, PcapFileSource, SflowSource, ahead
    from collector.metrics import Metrics
    from collector.pipeline.engine import Engine
    from collector.pipeline.sampling import TupleSampler
    from collector.pipeline.selectivity import SelectivityMeter
    from planner.plan import build_plan
    settings = run.settings
    name = f"daemon-{len(run.spooled)}"
    spool = _spool(run, name)
    plan = build_plan(queries, **settings.plan_options())
    run.spooled.append((run.work / name, plan))
    meter, sampler, metrics = SelectivityMeter(), TupleSampler(), Metrics()
    engines = {}

    def engine(stream: str, source: str) -> Engine:
        e = Engine(spool, stream, metrics, "prepare", settings.spark.watermark_delay_s, meter,
                   settings.asc, settings.lfta, sampler, source=source,
                   residual=settings.residual, om=settings.om)
        e.set_plan(plan)
        engines[stream] = e
        return e
    streams = plan.streams()
    if "packets" in streams:  # its own times (re-stamped, it would play at the capture's pace)
        src = PcapFileSource(SAMPLE, "sample", loop=False, restamp=False,
                             batch_size=SMALL_BATCH)
        e = engine("packets", src.name)
        with closing(ahead(src.batches(threading.Event()), lambda raw: e.prepare(raw)
                           if raw is not None and len(raw) else None)) as read:
            for raw, tuples in read:
                if raw is not None and len(raw):
                    e.process(raw, src.name, prepared=tuples)
    try:
        if "flows" in streams:
            flows = FlowSource(SourceConfig(type="netflow", name="flows",
                                            listen=["127.0.0.1:0"]))
            _listen(flows, engine("flows", flows.name), _templates_last(run.flow_datagrams))
        if "samples" in streams or "counters" in streams:
            sflow = SflowSource(SourceConfig(type="sflow", name="sflow",
                                             listen=["127.0.0.1:0"]))
            _listen(sflow, engine("samples", sflow.name), run.sflow_datagrams,
                    sflow.counters, engine("counters", sflow.counters.name))
    except OSError as e:  # no loopback (a sandbox): replay's engines ran the same kernels
        run.say(f"kernels: the listeners were left out ({e})")
    now = int(time.time())
    for e in engines.values():
        e.flush_due(e.max_time, time.monotonic_ns())
        if e.flush_before(now):
            e.heartbeat(now)
        e.finish(close=False)


def _templates_last(datagrams: list[bytes]) -> list[bytes]:
    """NetFlow v9/IPFIX datagrams, those carrying templates last: the data arrives first and
    is held until its template comes (an exporter met mid-stream)."""
    def templates(d: bytes) -> bool:
        head = {9: 20, 10: 16}.get(int.from_bytes(d[:2], "big"))
        return head is not None and int.from_bytes(d[head:head + 2], "big") in (0, 1, 2, 3)
    return [d for d in datagrams if not templates(d)] + [d for d in datagrams if templates(d)]


def _listen(src, engine, payloads: list[bytes], feed=None, feed_engine=None) -> None:
    """``payloads`` sent to a listening source on the loopback, what it yields processed by
    ``engine`` (what its feed yields by ``feed_engine``) until it has received them all, or
    for 5 s at most."""
    src.open()
    host, port = src.listener.bound[0]

    def send() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for p in payloads:
                s.sendto(p, (host, port))
    sender = threading.Thread(target=send, name="prepare-send", daemon=True)
    sender.start()
    stop = threading.Event()
    deadline = time.monotonic() + 5
    for batch in src.batches(stop):
        if batch is not None and len(batch):
            engine.process(batch, src.name)
        if src.listener.stats.datagrams >= len(payloads) or time.monotonic() > deadline:
            stop.set()
    sender.join()
    if feed is not None:
        for batch in feed.batches(threading.Event()):
            if batch is not None:
                feed_engine.process(batch, feed.name)


def _packet_engines(run: _Run) -> None:
    """``warmup.sql``'s queries of packets that read no enrichment field (the other process
    compiles the look-ups meanwhile), with the generic LFTA merge kernel only."""
    from capture.fields import enriched
    from collector.pipeline.enrichment import read_fields
    queries = [q for q in _queries(WARMUP_SQL) if q.stream == "packets" and
               not read_fields(q) & set(enriched("packets"))]
    with _generic_merges():
        _replay(run, queries)
        _daemon(run, queries)


def _warmup_engines(run: _Run) -> None:
    """``warmup.sql``'s queries of every stream through ``replay``'s engines and the
    daemon's, with the generic LFTA merge kernel only (its queries' aggregate trees are not
    the user's)."""
    with _generic_merges():
        queries = _queries(WARMUP_SQL)
        _replay(run, queries)
        _daemon(run, queries)


def _default_engines(run: _Run) -> None:
    """The daemon's default queries (``example.sql``, ``initial_queries``) replayed and run,
    their key layouts' own merge kernels compiled."""
    from collector.pipeline.lfta_kernels import wait_specialized
    queries = _queries(DEFAULT_SQL)
    _replay(run, queries)
    _daemon(run, queries)
    wait_specialized()  # compiled on threads of their own


# --------------------------------------------------------------------------- answers
def _first_windows(rows, windows: int = 2):
    """The partial rows of a folder's first windows (``answer_locally`` takes each window's
    rows out of the whole table: a few windows cover every step)."""
    import pyarrow.compute as pc
    if "window_start" not in rows.column_names:
        return rows  # a selection's tuples
    first = pc.unique(rows.column("window_start")).sort()[:windows]
    return rows.filter(pc.is_in(rows.column("window_start"), value_set=first))


def _answers(run: _Run) -> None:
    """The Spark answer tasks' Python steps (fan-out, merges to each query's keys, distinct
    counts, sketches, HAVING, LIMIT, joins, selections) over what the engines spooled, as
    ``derive.answer_locally`` runs them; and the worker daemon's preload."""
    import pyarrow as pa

    from capture.enrich.dictionary import folder_of
    from collector.pipeline.spool import list_files, read_spool_file
    from collector.spark.derive import Folder, answer_locally
    from collector.spark.worker import preload
    preload()
    for root, plan in run.spooled:
        slots = [(qp.slot, qp.query) for qp in plan.queries]
        for stream in plan.streams():
            for folder in plan.folders(stream):
                files = list_files(root / stream / folder)
                if not files:
                    continue
                spec = Folder(stream, folder, tuple(sorted(
                    (s, q) for s, q in slots if q.stream == stream and q.folder == folder)),
                    str(folder_of(run.work / "spool")))
                answer_locally(_first_windows(pa.concat_tables(
                    [read_spool_file(f) for f in files])), spec)


# --------------------------------------------------------------------------- counts
def _dispatchers() -> list:
    """The numba dispatchers of flowsieve's modules imported now."""
    from numba.core.dispatcher import Dispatcher
    seen: dict[int, Dispatcher] = {}
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".")[0] not in PACKAGES:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, Dispatcher):
                seen[id(value)] = value
    return list(seen.values())


def _overloads() -> dict[str, dict[str, bool]]:
    """Per kernel (``module.function``) of this process, its overloads (their signatures as
    text) and whether each was compiled here (else loaded from numba's cache)."""
    out: dict[str, dict[str, bool]] = {}
    for d in _dispatchers():
        if d.overloads:
            compiled = set(d.stats.cache_misses)
            out[f"{d.py_func.__module__}.{d.py_func.__qualname__}"] = {
                str(sig): sig in compiled for sig in d.overloads}
    return out


def _summary(*parts: dict[str, dict[str, bool]]) -> dict:
    """Kernels and overloads reached by the processes of ``parts``, those compiled by one of
    them and those loaded only."""
    merged: dict[tuple[str, str], bool] = {}
    for part in parts:
        for kernel, sigs in part.items():
            for sig, compiled in sigs.items():
                merged[(kernel, sig)] = merged.get((kernel, sig), False) or compiled
    compiled = sum(merged.values())
    return {"kernels": len({k for k, _ in merged}), "overloads": len(merged),
            "compiled": compiled, "loaded": len(merged) - compiled}


def make_class_archive(settings: Settings, progress: Callable[[str], None] | None = None,
                       force: bool = False) -> dict:
    """The JVM's class-data archive of this pyspark installation, made where it can finish:
    a JVM told to write one (``-XX:ArchiveClassesAtExit``) runs what the daemon's and
    ``replay``'s JVMs run — ``replay``'s answer jobs for the warm-up queries of every stream
    over the shipped captures, then a streaming query's batches over the same spool (Spark's
    file source, the watermark, the RocksDB state store) — and exits, writing the classes it
    loaded, as long as that takes (about 15 s for 160 MB); the dump is then renamed into place
    (``spark.class_archive_dir``, default the user's cache). An archive that exists is kept
    (unless ``force``). Returns where it is, whether it was made, its size and the seconds."""
    from collector.config import cache_dir
    from collector.spark.session import build_session, class_archive_path, stop_jvm
    say = progress or (lambda line: None)
    s = settings.spark
    if not s.class_archive:
        say("class-data archive: none (spark.class_archive is false)")
        return {"archive": None, "made": False}
    archive = class_archive_path(s.class_archive_dir or cache_dir())
    if archive.exists() and not force:
        say(f"class-data archive: {archive} (kept)")
        return {"archive": str(archive), "made": False, "bytes": archive.stat().st_size}
    archive.parent.mkdir(parents=True, exist_ok=True)
    dump = archive.with_name(f"{archive.name}.dump-{os.getpid()}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="flowsieve-prepare-") as tmp:
        work = Path(tmp)
        jvm_log = work / "spark.log"
        say("class-data archive: a JVM runs Spark's jobs")
        spark = build_session("local[2]", s.driver_memory, s.shuffle_partitions,
                              s.state_store == "rocksdb", s.extra, "flowsieve-prepare",
                              jvm_log=jvm_log, class_dump=dump)
        how = "none"
        try:
            _spark_jobs(spark, work, settings, say)
            say("class-data archive: the JVM writes its classes as it exits")
        finally:
            how = stop_jvm(spark, ARCHIVE_EXIT_S)
            _reset_enrichment()
        if how != "exited (0)" or not dump.exists():
            dump.unlink(missing_ok=True)
            tail = jvm_log.read_text(errors="replace")[-2000:] if jvm_log.exists() else ""
            raise RuntimeError(f"the JVM did not write its class-data archive ({how}): {tail}")
    os.replace(dump, archive)
    out = {"archive": str(archive), "made": True, "bytes": archive.stat().st_size,
           "seconds": round(time.perf_counter() - started, 1)}
    say(f"class-data archive: {archive} ({out['bytes'] / 1e6:.0f} MB) in "
        f"{out['seconds']:.0f} s")
    return out


ARCHIVE_EXIT_S = 600.0  # the archiving JVM's exit: writing 160 MB took 16 s here


def _spark_jobs(spark, work: Path, settings: Settings, say: Callable[[str], None]) -> None:
    """``replay``'s answer jobs of the warm-up queries over each shipped capture, then the
    daemon's streaming queries over the same spool files, as the daemon's and replay's JVMs
    run them."""
    from api.replay import replay
    from collector.spark.merge import SparkJob
    from planner.query import parse_queries
    queries = parse_queries(Path(WARMUP_SQL).read_text())
    networks = work / "networks.yaml"
    networks.write_text(NETWORKS)
    # the configured settings, with the warm-up's enrichment databases (its queries read AS
    # and network names) and folders
    replay_settings = settings.model_copy(update={"initial_queries": None,
                                                  "var_dir": work / "var"})
    replay_settings.enrich = Settings(enrich={"asn": ASN_MMDB, "networks": networks}).enrich
    streamed = None
    for stream, capture in (("packets", SAMPLE), ("flows", SAMPLE_FLOWS),
                            ("samples", SAMPLE_SFLOW)):
        mine = [q for q in queries if q.stream == stream or
                (stream == "samples" and q.stream == "counters")]
        t0 = time.perf_counter()
        res = replay(capture, mine, work / stream, spark, settings=replay_settings)
        say(f"class-data archive: replay's answers of {stream} "
            f"({time.perf_counter() - t0:.1f} s)")
        if streamed is None:  # the streaming classes are the same for every stream
            slots = {qp.slot: qp.query for qp in res.plan.queries}
            streamed = (work / stream, slots, [(stream, f) for f in res.plan.folders(stream)
                                               if f != "select"][:1] + [(stream, "select")])
    out, slots, spooled = streamed
    t0 = time.perf_counter()
    job = SparkJob(spark, out / "spool", out / "streamed", out / "checkpoints",
                   lambda: slots, settings.spark.watermark_delay_s)
    job.run_available_now(spooled)
    say(f"class-data archive: the daemon's streaming queries ({time.perf_counter() - t0:.1f} "
        "s)")

