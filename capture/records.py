"""Records and the bytes they come from, shared by every packet source.

A ``RawBatch`` is a buffer and, per record, where its bytes start, its lengths, timestamp, link
type and interface: the unpack kernel reads packets in place. A ``ByteSource`` hands a capture's
bytes out in windows so that memory stays bounded whatever the file size: a regular file is
memory-mapped one window at a time, a pipe (or stdin) is read in chunks, and a file that is still
being written is followed like ``tail -f``.
"""

from __future__ import annotations

import mmap
import os
import select
import stat
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from capture.jit import kernel_inline, readonly

# One window of a mapped file. Readers never need more than one block (pcapng caps blocks at
# 16 MiB, as libpcap does), so 64 MiB windows keep the RSS of any file near 64 MiB.
WINDOW = 64 << 20
CHUNK = 4 << 20  # pipe reads
_GRAN = mmap.ALLOCATIONGRANULARITY


@dataclass
class RawBatch:
    """Records of one batch: a byte buffer and, per record, where it starts and its lengths."""

    buf: np.ndarray  # uint8; records are read in place
    offset: np.ndarray  # int64, start of each record's data in buf
    caplen: np.ndarray  # int32
    wirelen: np.ndarray  # int32
    ts_ns: np.ndarray  # int64 epoch nanoseconds
    linktype: np.ndarray  # int32 per record (pcapng interfaces may differ)
    iface: np.ndarray  # int32 per record: pcapng interface id or source index

    def __len__(self) -> int:
        return len(self.offset)

    def slice(self, a: int, b: int) -> RawBatch:
        """Records a..b (views)."""
        return RawBatch(self.buf, self.offset[a:b], self.caplen[a:b], self.wirelen[a:b],
                        self.ts_ns[a:b], self.linktype[a:b], self.iface[a:b])

    def restamped(self, ts_ns: np.ndarray) -> RawBatch:
        return RawBatch(self.buf, self.offset, self.caplen, self.wirelen, ts_ns, self.linktype,
                        self.iface)

    def records(self):
        """(ts_ns, wirelen, linktype, iface, bytes) per record: for tests and tools."""
        for i in range(len(self)):
            o = int(self.offset[i])
            yield (int(self.ts_ns[i]), int(self.wirelen[i]), int(self.linktype[i]),
                   int(self.iface[i]), self.buf[o:o + int(self.caplen[i])].tobytes())


def batch_arrays(n: int):
    """Caller-allocated record columns for an index kernel."""
    return (np.empty(n, np.int64), np.empty(n, np.int32), np.empty(n, np.int32),
            np.empty(n, np.int64), np.empty(n, np.int32), np.empty(n, np.int32))


@dataclass
class ReadStats:
    """Counters of one reader, by reason (exported as metrics by the collector)."""

    records: int = 0
    bytes: int = 0
    errors: Counter = field(default_factory=Counter)


@kernel_inline
def u16(buf, pos, big):
    if big:
        return (np.uint32(buf[pos]) << 8) | np.uint32(buf[pos + 1])
    return (np.uint32(buf[pos + 1]) << 8) | np.uint32(buf[pos])


@kernel_inline
def u32(buf, pos, big):
    if big:
        return (np.uint32(buf[pos]) << 24) | (np.uint32(buf[pos + 1]) << 16) | \
            (np.uint32(buf[pos + 2]) << 8) | np.uint32(buf[pos + 3])
    return (np.uint32(buf[pos + 3]) << 24) | (np.uint32(buf[pos + 2]) << 16) | \
        (np.uint32(buf[pos + 1]) << 8) | np.uint32(buf[pos])


# Readers walk records that are contiguous in memory but far apart (a few hundred bytes), each
# address depending on the previous record's length: the hardware prefetcher does not see a
# stream and every record costs a DRAM miss (~8 Mpps). Touching every cache line a little ahead
# makes the access dense and sequential: the index kernel then runs at ~55 Mpps (bench_capture).
PREFETCH = 4096


@kernel_inline
def touch_ahead(buf, ahead, upto, end):
    """Read one byte of each cache line from ``ahead`` to ``upto`` (capped at ``end``); return
    the new ``ahead`` and a checksum the caller must use (so the loads are not removed)."""
    acc = np.int64(0)
    lim = min(upto, end)
    while ahead < lim:
        acc += buf[ahead]
        ahead += 64
    return max(ahead, lim), acc


class ByteSource:
    """A capture's bytes in windows: ``buf`` holds file bytes ``[base, base + len(buf))``.

    ``source`` is a path, ``"-"`` (stdin), a binary file object (a pipe) or bytes. With
    ``follow`` a regular file is watched for growth every ``poll_s`` until ``stop`` is set.
    Buffers handed out are never modified afterwards, so batches may keep referring to them;
    they are read-only (a mapped file's are, a pipe's chunks are made so: one type for the
    kernels, ``capture/jit.readonly``).
    """

    def __init__(self, source, *, window: int = WINDOW, follow: bool = False,
                 poll_s: float = 0.2, stop: threading.Event | None = None,
                 limit: int | None = None):
        self.window = max(window, 1 << 16)
        self.limit = limit  # a regular file read as if it ended here (a byte range's end)
        self.follow = follow
        self.poll_s = poll_s
        self.stop = stop or threading.Event()
        self.base = 0
        self.buf = np.zeros(0, np.uint8)
        self._fd = None  # regular file
        self._pipe = None  # file object read in chunks
        self.eof = False
        # a followed file: the wall time (s) it was last found to hold nothing more, so every
        # record written before then was handed out (a live source's clock, collector/service)
        self.waited_at: float | None = None
        if isinstance(source, bytes | bytearray | memoryview):
            self.name = "<bytes>"
            self.buf = np.frombuffer(bytes(source), np.uint8)
            self.eof = True
        elif isinstance(source, str | os.PathLike):
            self.name = str(source)
            if self.name == "-":
                self.name = "<stdin>"
                self._pipe = sys.stdin.buffer
            else:
                fh = open(source, "rb")  # noqa: SIM115 (kept open while reading)
                if stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                    self._fd = fh
                else:  # a FIFO or character device
                    self._pipe = fh.raw
        else:
            self.name = getattr(source, "name", "<stream>")
            self._pipe = source
        # one raw read at a time: a buffered readinto would wait to fill the whole chunk
        self._read = getattr(self._pipe, "readinto1", None) or getattr(self._pipe, "readinto",
                                                                         None)
        self._size = self._stat() if self._fd is not None else 0

    def _stat(self) -> int:
        size = os.fstat(self._fd.fileno()).st_size
        return size if self.limit is None else min(size, self.limit)

    @property
    def end(self) -> int:
        return self.base + len(self.buf)

    def ensure(self, pos: int, need: int) -> int:
        """Make ``buf`` cover ``pos`` and, if the data exists, ``need`` bytes from it; return
        how many bytes from ``pos`` are available (fewer than ``need`` only at the end)."""
        if pos < self.base:
            raise ValueError(f"position {pos} was released (window starts at {self.base})")
        if self._fd is not None:
            return self._ensure_file(pos, need)
        if self._pipe is not None:
            return self._ensure_pipe(pos, need)
        return max(self.end - pos, 0)

    def _ensure_file(self, pos: int, need: int) -> int:
        while True:
            avail = self.end - pos
            if avail >= need:
                return avail
            if self.follow and self._size <= self.end:
                self._size = self._stat()
            if self._size > self.end:
                self._map(pos, need)
                continue
            if not self.follow or self.stop.is_set():
                return max(avail, 0)
            self.waited_at = time.time()
            self.stop.wait(self.poll_s)

    def _map(self, pos: int, need: int) -> None:
        start = pos - pos % _GRAN
        length = min(self._size - start, max(self.window, pos - start + need))
        if length <= 0:
            self.base, self.buf = pos, np.zeros(0, np.uint8)
            return
        mm = mmap.mmap(self._fd.fileno(), length, access=mmap.ACCESS_READ, offset=start)
        if hasattr(mm, "madvise"):
            mm.madvise(mmap.MADV_SEQUENTIAL)
        # the array keeps the mapping alive; it is unmapped when the last batch using it goes
        self.base, self.buf = start, np.frombuffer(mm, np.uint8)

    def _ensure_pipe(self, pos: int, need: int) -> int:
        if self.end - pos >= need or self.eof:
            return max(self.end - pos, 0)
        tail = self.buf[pos - self.base:]
        out = np.empty(max(CHUNK, 2 * need), np.uint8)
        out[:len(tail)] = tail
        fill = len(tail)
        view = memoryview(out)
        try:
            fd = self._pipe.fileno()
        except (AttributeError, OSError, ValueError):
            fd = None
        while fill < len(out):
            if fill >= need and (fd is None or not _readable(fd)):
                break  # enough for progress and nothing more waiting: hand it out now
            k = self._read(view[fill:])
            if not k:
                self.eof = True
                break
            fill += k
        self.base, self.buf = pos, readonly(out[:fill])
        return fill


def _readable(fd: int) -> bool:
    try:
        return bool(select.select([fd], [], [], 0)[0])
    except (OSError, ValueError):
        return False


