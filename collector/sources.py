"""Capture sources of the daemon; ``make_source`` builds the one a source config's ``type``
names."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import numpy as np

from capture.listen import FlowListener
from capture.live import LiveCapture, RingConfig
from capture.netflow import Decoder, FlowBatch, TemplateStore
from capture.pcap import open_capture
from capture.records import RawBatch


class Source(Protocol):
    """A source yields RawBatches until it ends or ``stop`` is set."""

    name: str

    def batches(self, stop: threading.Event) -> Iterator[RawBatch | None]:
        """RawBatches; None as a tick when a paced source is waiting (for heartbeats)."""
        ...


class PcapFileSource:
    """A pcap or pcapng file read once, followed as it grows (``tcpdump -w FILE``), or looped:
    each loop is re-stamped so that it replays at the current time and at the capture's own
    pace (results keep coming, windows keep closing)."""

    def __init__(self, path: str, name: str = "pcap", loop: bool = False, restamp: bool = False,
                 batch_size: int = 65536, tick_s: float = 0.2, follow: bool = False):
        self.path, self.name, self.loop, self.restamp = path, name, loop, restamp
        self.follow = follow
        self.batch_size = batch_size
        self.tick_s = tick_s
        self.loops = 0
        self.reader = None

    def batches(self, stop: threading.Event) -> Iterator[RawBatch | None]:
        last_ns = 0
        while not stop.is_set():
            self.reader = reader = open_capture(self.path, self.batch_size, follow=self.follow,
                                                stop=stop)
            shift = None
            for raw in reader:
                if not self.restamp:
                    yield raw
                    continue
                if shift is None and len(raw):
                    start = max(time.time_ns(), last_ns + 1_000_000)
                    shift = start - int(raw.ts_ns[0])
                ts = raw.ts_ns + shift
                raw = raw.restamped(ts)
                due = np.maximum.accumulate(ts)
                pos = 0
                while pos < len(raw) and not stop.is_set():
                    end = int(np.searchsorted(due, time.time_ns(), side="right"))
                    if end > pos:
                        yield raw.slice(pos, end)
                        last_ns = int(due[end - 1])
                        pos = end
                    else:
                        yield None
                        stop.wait(self.tick_s)
            self.loops += 1
            if not self.loop:
                return


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
                yield raw
        finally:
            self.capture.close()
            if self.on_stats is not None:
                self.on_stats(self.capture.kernel)


class FlowSource:
    """A UDP listener of NetFlow v5/v9/IPFIX exports and its decoder: yields FlowBatches.
    Templates and options sampling are saved to ``state_path`` whenever they change and loaded
    at start, so a restart decodes data whose templates came before it."""

    restamp = True  # live time: heartbeats close windows when exports stop
    stream = "flows"

    def __init__(self, cfg, state_path: str | None = None, on_stats=None,
                 batch_bytes: int = 4 << 20):
        self.name = cfg.name
        self.state_path = state_path
        store = TemplateStore(cfg.enterprise_map())
        if state_path:
            store.load(state_path)
        self.decoder = Decoder(store, sampling_override=cfg.sampling,
                               default_sampling_interval=cfg.default_sampling_interval,
                               pending_max_bytes=cfg.pending_max_bytes,
                               pending_ttl_s=cfg.pending_ttl_s)
        self.listener = FlowListener(cfg.listen, cfg.rcvbuf, batch_bytes)
        self.on_stats = on_stats
        self.lock = threading.Lock()  # the API reads decoder state

    def open(self) -> None:
        if not self.listener.socks:
            self.listener.open()

    def batches(self, stop: threading.Event) -> Iterator[FlowBatch | None]:
        self.open()
        try:
            for dg in self.listener.batches(stop):
                if self.on_stats is not None:
                    self.on_stats(self.listener.stats)
                if dg is None:
                    yield None
                    continue
                with self.lock:
                    fb = self.decoder.decode(dg)
                    if self.state_path and self.decoder.store.dirty:
                        self.decoder.store.save(self.state_path)
                yield fb
        finally:
            self.listener.close()

    def exporters(self) -> list[dict]:
        with self.lock:
            return self.decoder.streams()


def make_source(cfg, batch_size: int, on_stats=None, var_dir=None):
    """The source a SourceConfig describes."""
    if cfg.type == "netflow":
        state = None if var_dir is None else str(Path(var_dir) / f"flow-templates-{cfg.name}.json")
        return FlowSource(cfg, state, on_stats)
    if cfg.type == "interface":
        return InterfaceSource(cfg.interface, cfg.name, cfg.bpf,
                               RingConfig(cfg.ring_block_size, cfg.ring_blocks), batch_size,
                               cfg.skip_outgoing, cfg.promisc, on_stats=on_stats)
    return PcapFileSource(cfg.path, cfg.name, cfg.loop, cfg.restamp, batch_size,
                          follow=cfg.follow)

