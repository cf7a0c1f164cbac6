"""Capture sources of the daemon. Each source type is registered by the name a source config's
``type`` gives (as goflow2 registers its transports); ``make_source`` builds the one named."""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Protocol

import numpy as np

from capture.listen import FlowListener
from capture.live import LiveCapture, RingConfig
from capture.netflow import Decoder, FlowBatch, TemplateStore
from capture.pcap import open_capture
from capture.records import RawBatch
from capture.sflow import CounterBatch, SflowBatch, SflowDecoder


class Source(Protocol):
    """A capture source: opens what it reads when ``batches`` starts, yields batches until it
    ends or ``stop`` is set, and closes it when the iteration ends (its ``finally``)."""

    name: str
    restamp: bool  # live time: the daemon writes heartbeats so windows close in quiet times

    def batches(self, stop: threading.Event) -> Iterator[RawBatch | FlowBatch | None]:
        """Batches; None as a tick when the source is waiting with everything it had handed
        over (the daemon's heartbeats may then close the windows before now)."""
        ...


SourceBuilder = Callable[..., Source]
SOURCE_TYPES: dict[str, SourceBuilder] = {}


def source_type(name: str) -> Callable[[SourceBuilder], SourceBuilder]:
    """Register a builder ``(cfg, batch_size, on_stats, var_dir) -> Source`` for a type name."""
    def register(builder: SourceBuilder) -> SourceBuilder:
        SOURCE_TYPES[name] = builder
        return builder
    return register


class PcapFileSource:
    """A pcap or pcapng file read once, followed as it grows (``tcpdump -w FILE``), or looped:
    each loop is re-stamped so that it replays at the current time and at the capture's own
    pace (results keep coming, windows keep closing). A followed file keeps its own times
    (they are live); ``restamp`` then only means live time (heartbeats)."""

    def __init__(self, path: str, name: str = "pcap", loop: bool = False, restamp: bool = False,
                 batch_size: int = 65536, tick_s: float = 0.2, follow: bool = False):
        self.path, self.name, self.loop, self.restamp = path, name, loop, restamp
        self.follow = follow
        self.batch_size = batch_size
        self.tick_s = tick_s
        self.reader = None
        self.records = 0  # records handed out from the file (a loop-free source's position)
        self._skip = 0  # records a resumed source reads past
        self._shift: int | None = None  # the re-stamping offset (ns) of the current pass

    @property
    def durable(self) -> bool:
        """A file read once or followed (loop-free) resumes where it was: its position is
        the records read."""
        return self.follow or not self.loop

    def caught_up_at(self) -> float | None:
        """A followed file: the wall time it was last found to hold nothing more (every
        record written before then was handed over and processed)."""
        src = getattr(self.reader, "src", None)
        return getattr(src, "waited_at", None) if self.follow else None

    def position(self, held: int = 0) -> dict:
        """Where the source is: past the records handed out, but the last ``held`` of them
        (records the daemon has yet to hand its engine)."""
        st = os.stat(self.path)
        return {"path": str(self.path), "dev": st.st_dev, "ino": st.st_ino,
                "records": self.records - held, "shift_ns": self._shift}

    def resume(self, position: dict | None) -> str | None:
        """Continue after ``position`` (a committed one) when it is this same file; else say
        why the file is read from its start."""
        if not position:
            return None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return f"{self.path} does not exist (yet): reading from its start"
        if (position.get("path"), position.get("dev"), position.get("ino")) != \
                (str(self.path), st.st_dev, st.st_ino):
            return f"{self.path} is not the file of the saved position: reading from its start"
        self._skip = self.records = int(position["records"])
        self._shift = position.get("shift_ns")
        return None

    def batches(self, stop: threading.Event) -> Iterator[RawBatch | None]:
        last_ns = 0
        while not stop.is_set():
            self.reader = reader = open_capture(self.path, self.batch_size, follow=self.follow,
                                                stop=stop)
            for raw in reader:
                if self._skip:  # a resumed source: what the spool holds already
                    if len(raw) <= self._skip:
                        self._skip -= len(raw)
                        continue
                    raw, self._skip = raw.slice(self._skip, len(raw)), 0
                if not self.restamp or self.follow:  # a followed file's times are live already
                    self.records += len(raw)
                    yield raw
                    continue
                if self._shift is None and len(raw):
                    start = max(time.time_ns(), last_ns + 1_000_000)
                    self._shift = start - int(raw.ts_ns[0])
                ts = raw.ts_ns + self._shift
                raw = raw.restamped(ts)
                due = np.maximum.accumulate(ts)
                pos = 0
                while pos < len(raw) and not stop.is_set():
                    end = int(np.searchsorted(due, time.time_ns(), side="right"))
                    if end > pos:
                        self.records += end - pos
                        yield raw.slice(pos, end)
                        last_ns = int(due[end - 1])
                        pos = end
                    else:
                        yield None
                        stop.wait(self.tick_s)
            if not self.loop:
                return
            self.records, self._shift = 0, None


def ahead(items: Iterable, prepare: Callable, depth: int = 2):
    """``(item, prepare(item))`` of ``items``, read and prepared on a thread of their own up to
    ``depth`` items ahead of the consumer: a capture's next batches are read and unpacked
    (numba, without the GIL) on the second core while the engine prefilters and aggregates
    this one. The reader's exception comes out in its place; a consumer that stops early
    stops the reader."""
    q: queue.Queue = queue.Queue(depth)
    stop = threading.Event()
    end = object()

    def put(x) -> bool:
        while not stop.is_set():
            try:
                q.put(x, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        try:
            for item in items:
                if not put((item, prepare(item))):
                    return
            put(end)
        except BaseException as e:  # noqa: BLE001 - raised again in the consumer
            put(e)
    t = threading.Thread(target=read, name="replay-reader", daemon=True)
    t.start()
    try:
        while (x := q.get()) is not end:
            if isinstance(x, BaseException):
                raise x
            yield x
    finally:
        stop.set()
        t.join()


class Alignment:
    """Event-time alignment of the sources that keep their files' own times (a file read once
    or followed, not re-stamped). Spark's watermark follows the latest window start any
    engine spooled, so the tuples of a file read behind another would all reach Spark late and
    be dropped: two captures of the same hour from two taps, one busy and one quiet, or a
    file of yesterday beside one of today. Each such source hands its engine only the records
    up to the other sources' next record plus the watermark delay (``pieces``) and waits for
    the others to catch up with the rest; a tuple's window is then never older than what the
    watermark keeps open. The source whose next record is the earliest can always go on, so
    they advance together (Flink's watermark alignment, FLIP-182, pauses sources alike). A
    source waiting for its file to grow, finished or failed holds nobody back (``idle``,
    ``leave``). A file's records are taken in their order: a capture's out-of-order records
    are as late as the watermark delay allows, as in one engine."""

    def __init__(self, slack_s: float):
        self.slack_ns = int(slack_s * 1e9)
        self._next: dict[str, int | float] = {}  # name -> its next record's time (ns; ±inf)
        self._cv = threading.Condition()

    def join(self, name: str) -> None:
        """A source to wait for (before any source starts: its next record is not known)."""
        self._set(name, float("-inf"))

    def idle(self, name: str) -> None:
        """The source waits with nothing to hand over (a followed file at its end)."""
        self._set(name, float("inf"))

    leave = idle  # the source ended

    def _set(self, name: str, t: int | float) -> None:
        with self._cv:
            self._next[name] = t
            self._cv.notify_all()

    def bound(self, name: str) -> int | float:
        """The latest time source ``name`` may hand over now (ns; ±inf)."""
        with self._cv:
            return self._bound(name)

    def _bound(self, name: str) -> int | float:
        return min((t for n, t in self._next.items() if n != name),
                   default=float("inf")) + self.slack_ns

    def pieces(self, name: str, raw: RawBatch, stop: threading.Event,
               waited: Callable[[float], None] | None = None) -> Iterator[RawBatch]:
        """``raw``'s records in the pieces source ``name`` may hand over, in order; waits
        between them (until ``stop``) and tells ``waited`` how long it waited."""
        pos = 0
        while pos < len(raw) and not stop.is_set():
            ts = raw.ts_ns[pos:]
            due = np.maximum.accumulate(ts)
            t0 = time.monotonic()
            with self._cv:
                self._next[name] = int(ts[0])  # exact: a float loses nanoseconds
                self._cv.notify_all()
                while not stop.is_set():
                    b = self._bound(name)
                    end = 0 if b == float("-inf") else len(due) if b == float("inf") else \
                        int(np.searchsorted(due, b, side="right"))
                    if end:
                        break
                    self._cv.wait(0.2)
            if waited is not None and time.monotonic() - t0 > 0.001:
                waited(time.monotonic() - t0)
            if stop.is_set():
                return
            yield raw.slice(pos, pos + end)
            pos += end
        if len(raw):  # the next record follows this batch's last in the file
            self._set(name, int(raw.ts_ns[-1]))


class InterfaceSource:
    """A Linux interface through a TPACKET_V3 ring, with the plan's kernel filter attached and
    swapped at each rebuild; kernel statistics are read after every batch and tick."""

    restamp = True  # live time: heartbeats close windows when traffic stops

    def __init__(self, iface: str, name: str, bpf: bool = True, ring: RingConfig | None = None,
                 batch_size: int = 65536, skip_outgoing: bool = False, promisc: bool = True,
                 index: int = 0, on_stats=None):
        self.name, self.use_bpf = name, bpf
        self.capture = LiveCapture(iface, "", ring, index, promisc, skip_outgoing, batch_size)
        self.on_stats = on_stats  # called with (KernelStats) after each batch
        self._expr = ""
        self._last_ns: int | None = None  # the latest packet handed over

    durable = True  # its partials are committed with its position (below)

    def position(self) -> dict:
        """The time of the latest packet handed over: a crash loses at most ``spool.commit_s``
        of partials (the LFTA's are committed with it), and a restart says from when nothing
        was captured."""
        return {"last_ns": self._last_ns}

    def resume(self, position: dict | None) -> str | None:
        last = (position or {}).get("last_ns")
        if last:
            gap = max(0.0, time.time() - last / 1e9)
            return (f"nothing was captured for {gap:.0f} s, since "
                    f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(last / 1e9))} (the last "
                    f"packet committed before this start)")
        return None

    def set_filter(self, expr: str) -> None:
        """The plan's kernel filter (kept until the socket opens)."""
        self._expr = expr if self.use_bpf else ""
        if self.capture.sock is not None:
            self.capture.set_filter(self._expr)

    def batches(self, stop: threading.Event) -> Iterator[RawBatch | None]:
        self.capture.expr = self._expr
        self.capture.open()
        try:
            for raw in self.capture.batches(stop):
                if self.on_stats is not None:
                    self.on_stats(self.capture.stats())
                if raw is not None and len(raw):
                    self._last_ns = int(raw.ts_ns.max())
                yield raw
        finally:
            self.capture.close()
            if self.on_stats is not None:
                self.on_stats(self.capture.kernel)


class ListenerSource:
    """A UDP listener of flow exports and its decoder (``decode`` of a subclass turns each
    batch of datagrams into what it yields). Durable when it has a state folder: its position
    is the next sequence number of every export stream, committed with what it spooled;
    exporters resend nothing, so after a restart the gap at each stream's next export counts
    (``flowsieve_flow_sequence_lost``) what the restart lost."""

    restamp = True  # live time: heartbeats close windows when exports stop

    def __init__(self, cfg, decoder, durable: bool, on_stats=None, batch_bytes: int = 4 << 20):
        self.name = cfg.name
        self.decoder = decoder
        self.listener = FlowListener(cfg.listen, cfg.rcvbuf, batch_bytes)
        self.on_stats = on_stats
        self.lock = threading.Lock()  # the API reads decoder state
        self._durable = durable

    @property
    def durable(self) -> bool:
        return self._durable

    def position(self) -> dict:
        with self.lock:
            return {"sequences": self.decoder.sequences()}

    def resume(self, position: dict | None) -> str | None:
        if position:
            with self.lock:
                self.decoder.resume_sequences(position.get("sequences", []))
        return None

    def open(self) -> None:
        if not self.listener.socks:
            self.listener.open()

    def decode(self, dg):
        raise NotImplementedError

    def tick(self) -> None:
        """The listener is quiet (nothing received for a moment)."""

    def closing(self) -> None:
        """The listener closes."""

    def batches(self, stop: threading.Event) -> Iterator:
        self.open()
        try:
            for dg in self.listener.batches(stop):
                if self.on_stats is not None:
                    self.on_stats(self.listener.stats)
                if dg is None:
                    self.tick()
                    yield None
                    continue
                with self.lock:
                    batch = self.decode(dg)
                yield batch
        finally:
            self.closing()
            self.listener.close()

    def exporters(self) -> list[dict]:
        with self.lock:
            return self.decoder.streams()


class FlowSource(ListenerSource):
    """A UDP listener of NetFlow v5/v9/IPFIX exports and its decoder: yields FlowBatches.
    Templates and options sampling are saved to ``state_path`` whenever they change and loaded
    at start, so a restart decodes data whose templates came before it."""

    stream = "flows"

    def __init__(self, cfg, state_path: str | None = None, on_stats=None,
                 batch_bytes: int = 4 << 20):
        self.state_path = state_path
        store = TemplateStore(cfg.enterprise_map())
        if state_path:
            store.load(state_path)
        super().__init__(cfg, Decoder(store, sampling_override=cfg.sampling,
                                      default_sampling_interval=cfg.default_sampling_interval,
                                      pending_max_bytes=cfg.pending_max_bytes,
                                      pending_ttl_s=cfg.pending_ttl_s),
                         state_path is not None, on_stats, batch_bytes)

    def decode(self, dg) -> FlowBatch:
        fb = self.decoder.decode(dg)
        if self.state_path and self.decoder.store.dirty:
            self.decoder.store.save(self.state_path)
        return fb


class SflowSource(ListenerSource):
    """A UDP listener of sFlow v5 datagrams and its decoder: yields the flow samples
    (``SflowBatch``: the samples stream, unpacked by its engine with the plan's fields) and
    hands each batch's counter samples to its ``counters`` feed (the counters stream's
    source). Durable as a NetFlow listener is: its sequences are each agent's datagrams' and
    each data source's samples' (an agent that restarted meanwhile loses nothing)."""

    stream = "samples"

    def __init__(self, cfg, durable: bool = False, on_stats=None, batch_bytes: int = 4 << 20):
        super().__init__(cfg, SflowDecoder(), durable, on_stats, batch_bytes)
        self.counters = CountersFeed(f"{cfg.name}-counters")

    def decode(self, dg) -> SflowBatch:
        batch = self.decoder.decode(dg)
        self.counters.put(batch.counters())
        return batch

    def tick(self) -> None:
        self.counters.put(None)

    def closing(self) -> None:
        self.counters.put(CountersFeed.END)


class CountersFeed:
    """The counters stream of an sFlow listener: the counter samples its thread decoded, in
    order, through a bounded queue (a full one drops the batch, counted in ``dropped``).
    Counters are totals since the agent started: a dropped or lost counter sample costs
    resolution, never a count; the feed is not durable (a clean stop flushes it)."""

    restamp = True
    stream = "counters"
    END = object()

    def __init__(self, name: str, depth: int = 256):
        self.name = name
        self._q: queue.Queue = queue.Queue(depth)
        self.dropped = 0

    def put(self, item) -> None:
        if item is not None and item is not self.END and not len(item):
            return
        try:
            self._q.put_nowait(item)
        except queue.Full:
            if item is self.END:
                self._q.put(item)
            elif item is not None:
                self.dropped += len(item)

    def batches(self, stop: threading.Event) -> Iterator[CounterBatch | None]:
        while not stop.is_set():
            try:
                item = self._q.get(timeout=0.5)
            except queue.Empty:
                yield None
                continue
            if item is self.END:
                return
            yield item


@source_type("pcap")
def _pcap_source(cfg, batch_size: int, on_stats=None, var_dir=None) -> Source:
    return PcapFileSource(cfg.path, cfg.name, cfg.loop, cfg.restamp, batch_size,
                          follow=cfg.follow)


@source_type("interface")
def _interface_source(cfg, batch_size: int, on_stats=None, var_dir=None) -> Source:
    return InterfaceSource(cfg.interface, cfg.name, cfg.bpf,
                           RingConfig(cfg.ring_block_size, cfg.ring_blocks), batch_size,
                           cfg.skip_outgoing, cfg.promisc, on_stats=on_stats)


@source_type("netflow")
def _netflow_source(cfg, batch_size: int, on_stats=None, var_dir=None) -> Source:
    state = None if var_dir is None else str(Path(var_dir) / f"flow-templates-{cfg.name}.json")
    return FlowSource(cfg, state, on_stats)


@source_type("sflow")
def _sflow_source(cfg, batch_size: int, on_stats=None, var_dir=None) -> Source:
    return SflowSource(cfg, var_dir is not None, on_stats)


def make_source(cfg, batch_size: int, on_stats=None, var_dir=None) -> Source:
    """The source a SourceConfig describes, built by the builder registered for its type."""
    try:
        builder = SOURCE_TYPES[cfg.type]
    except KeyError:
        raise ValueError(f"source {cfg.name}: unknown type {cfg.type!r} "
                         f"(types: {', '.join(sorted(SOURCE_TYPES))})") from None
    return builder(cfg, batch_size, on_stats, var_dir)
