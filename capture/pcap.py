"""Capture files and streams: classic pcap here, pcapng in ``capture/pcapng.py``.

``open_capture`` reads the first four bytes and picks the reader. Both read through a
``ByteSource`` (memory-mapped windows of a file, chunks of a pipe, a followed growing file), so
memory stays bounded whatever the size. A numba kernel walks the record headers of a window and
returns per batch the offsets and lengths of the records; the unpack kernel reads them in place.
Every record before a fault is delivered; then a ``DecodeError`` names the byte offset and reason.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator

import numpy as np

from capture.errors import DecodeError
from capture.jit import kernel
from capture.records import (
    PREFETCH,
    ByteSource,
    RawBatch,
    ReadStats,
    batch_arrays,
    touch_ahead,
    u32,
)

MAGIC_US = 0xA1B2C3D4
MAGIC_NS = 0xA1B23C4D
PCAPNG_MAGIC = b"\x0a\x0d\x0d\x0a"
GLOBAL_HEADER = 24
RECORD_HEADER = 16
# libpcap refuses caplen beyond max(snaplen, 262144) ("bigger than snaplen"); so do we.
MAX_SNAPLEN = 262144

OK, ERR_TRUNC_HEADER, ERR_TRUNC_DATA, ERR_CAPLEN = 0, 1, 2, 3
REASONS = {
    ERR_TRUNC_HEADER: "truncated_record_header",
    ERR_TRUNC_DATA: "truncated_record_data",
    ERR_CAPLEN: "caplen_too_large",
}
MESSAGES = {
    ERR_TRUNC_HEADER: "truncated record header (file ends inside a 16-byte record header)",
    ERR_TRUNC_DATA: "truncated record data (file ends inside a packet)",
    ERR_CAPLEN: "record caplen larger than the snapshot length",
}


@kernel
def index_records(buf, pos, end, big, nano, max_caplen, offset, caplen, wirelen, ts_ns):
    """Walk record headers from ``pos``; fill up to len(offset) records.

    Returns (records, next position, status, checksum); status is OK or an ERR_* code for the
    record header at ``next position`` (a truncation may only mean the window ends there).
    """
    n = 0
    cap = offset.shape[0]
    ahead = pos
    sink = np.int64(0)
    while n < cap:
        if pos == end:
            return n, pos, OK, sink
        if pos + 16 > end:
            return n, pos, ERR_TRUNC_HEADER, sink
        sec = u32(buf, pos, big)
        frac = u32(buf, pos + 4, big)
        incl = u32(buf, pos + 8, big)
        orig = u32(buf, pos + 12, big)
        if incl > max_caplen:
            return n, pos, ERR_CAPLEN, sink
        if pos + 16 + incl > end:
            return n, pos, ERR_TRUNC_DATA, sink
        ahead, acc = touch_ahead(buf, ahead, pos + 16 + incl + PREFETCH, end)
        sink += acc
        offset[n] = pos + 16
        caplen[n] = incl
        wirelen[n] = min(orig, np.uint32(2**31 - 1))
        if nano:
            ts_ns[n] = np.int64(sec) * 1_000_000_000 + np.int64(frac)
        else:
            ts_ns[n] = np.int64(sec) * 1_000_000_000 + np.int64(frac) * 1000
        pos += 16 + incl
        n += 1
    return n, pos, OK, sink


@kernel
def walk_records(buf, pos, end, big, max_caplen, target):
    """Follow record headers from ``pos`` to the first record starting at or after ``target``;
    returns (its position, status, checksum): a position short of ``target`` with OK is the
    end of ``buf``, with an ERR_* code a record that cannot be read."""
    ahead = pos
    sink = np.int64(0)
    while pos < target:
        if pos == end:
            return pos, OK, sink
        if pos + 16 > end:
            return pos, ERR_TRUNC_HEADER, sink
        incl = u32(buf, pos + 8, big)
        if incl > max_caplen:
            return pos, ERR_CAPLEN, sink
        if pos + 16 + incl > end:
            return pos, ERR_TRUNC_DATA, sink
        ahead, acc = touch_ahead(buf, ahead, pos + 16 + incl + PREFETCH, end)
        sink += acc
        pos += 16 + incl
    return pos, OK, sink


class PcapReader:
    """Iterate RawBatches of a classic pcap file or stream (after its 4-byte magic); ``start``
    (a record boundary) begins later than the first record."""

    def __init__(self, src: ByteSource, batch_size: int = 65536, iface: int = 0,
                 start: int = GLOBAL_HEADER):
        self.src = src
        self.name = src.name
        self.batch_size = batch_size
        self.iface = iface
        self.start = max(start, GLOBAL_HEADER)
        self.stats = ReadStats()
        self._header()

    def _header(self) -> None:
        have = self.src.ensure(0, GLOBAL_HEADER)
        b = self.src.buf
        if have < GLOBAL_HEADER:
            self.stats.errors["short_file_header"] += 1
            raise DecodeError(f"file too short for a pcap header ({have} of 24 bytes)",
                              offset=0, layer="pcap", source=self.name, kind="short_file_header")
        magic_le = int.from_bytes(b[:4].tobytes(), "little")
        magic_be = int.from_bytes(b[:4].tobytes(), "big")
        if magic_le in (MAGIC_US, MAGIC_NS):
            self.big, self.nano = False, magic_le == MAGIC_NS
        elif magic_be in (MAGIC_US, MAGIC_NS):
            self.big, self.nano = True, magic_be == MAGIC_NS
        else:
            self.stats.errors["bad_magic"] += 1
            raise DecodeError(f"not a pcap or pcapng file (magic {b[:4].tobytes().hex()})",
                              offset=0, layer="pcap", source=self.name, kind="bad_magic")
        order = "big" if self.big else "little"
        self.snaplen = int.from_bytes(b[16:20].tobytes(), order)
        self.linktype = int.from_bytes(b[20:24].tobytes(), order) & 0x0FFFFFFF

    def __iter__(self) -> Iterator[RawBatch]:
        src, pos = self.src, self.start
        max_caplen = max(self.snaplen, MAX_SNAPLEN)
        while True:
            if src.ensure(pos, RECORD_HEADER) == 0:
                return
            offset, caplen, wirelen, ts, link, iface = batch_arrays(self.batch_size)
            rel = pos - src.base
            n, rel, status, _ = index_records(src.buf, rel, len(src.buf), self.big, self.nano,
                                           max_caplen, offset, caplen, wirelen, ts)
            if n:
                self.stats.records += n
                self.stats.bytes += int(caplen[:n].sum())
                link[:n] = self.linktype
                iface[:n] = self.iface
                yield RawBatch(src.buf, offset[:n], caplen[:n], wirelen[:n], ts[:n], link[:n],
                               iface[:n])
            pos = src.base + rel
            if status == OK:
                continue
            if status != ERR_CAPLEN:  # truncated here: the window may end, or the file
                need = RECORD_HEADER
                if status == ERR_TRUNC_DATA:
                    need += int(u32(src.buf, rel + 8, self.big))
                if src.ensure(pos, need) >= need:
                    continue
                if src.follow and src.stop.is_set():
                    return  # a follower stopped while the writer was inside a record
            self.stats.errors[REASONS[status]] += 1
            raise DecodeError(MESSAGES[status], offset=int(pos), layer="pcap", source=self.name,
                              kind=REASONS[status])

    def close(self) -> None:
        """Drop the current window (batches handed out keep their own reference)."""
        self.src.buf = np.zeros(0, np.uint8)


def split_pcap(path: str | os.PathLike, parts: int, min_bytes: int = 0
               ) -> list[tuple[int, int]]:
    """Byte ranges ``[start, stop)`` of a classic pcap file, at record boundaries and of
    about equal size, each at least ``min_bytes``: one reader (a process) per range reads the
    file in parallel. A pcapng file, a pipe or a file with a record that cannot be read before
    a boundary gives fewer ranges (the one range that holds the fault reports it)."""
    whole = [(GLOBAL_HEADER, 2**63 - 1)]
    try:
        size = os.path.getsize(path)
        regular = stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return whole
    parts = min(parts, size // max(min_bytes, 1))
    if parts <= 1 or not regular:
        return whole
    try:
        head = open_capture(path)
    except DecodeError:
        return whole  # not a capture: one reader says what it is
    head.close()
    if not isinstance(head, PcapReader):
        return whole  # pcapng
    buf = np.memmap(path, np.uint8, mode="r")
    bounds, pos = [GLOBAL_HEADER], GLOBAL_HEADER
    for k in range(1, parts):
        pos, status, _ = walk_records(buf, pos, len(buf), head.big,
                                      max(head.snaplen, MAX_SNAPLEN), k * size // parts)
        if status != OK or pos >= len(buf):
            break
        if pos > bounds[-1]:
            bounds.append(int(pos))
    del buf
    return [(a, b) for a, b in zip(bounds, bounds[1:] + [2**63 - 1], strict=True)]


def open_capture(source: str | os.PathLike | bytes, batch_size: int = 65536, *,
                 follow: bool = False, stop=None, window: int | None = None, iface: int = 0,
                 byte_range: tuple[int, int] | None = None):
    """A reader of RawBatches for a pcap or pcapng file, ``-`` (stdin), a pipe or bytes.

    ``follow`` keeps reading a file as it grows until ``stop`` (a threading.Event) is set.
    ``byte_range`` (from ``split_pcap``) reads the records of one range of a classic pcap file.
    """
    kw = {"follow": follow, "stop": stop}
    start = GLOBAL_HEADER
    if byte_range is not None:
        start, kw["limit"] = byte_range
    if window is not None:
        kw["window"] = window
    src = ByteSource(source, **kw)
    have = src.ensure(0, 4)
    if have >= 4 and src.buf[:4].tobytes() == PCAPNG_MAGIC:
        from capture.pcapng import PcapngReader
        return PcapngReader(src, batch_size)
    return PcapReader(src, batch_size, iface, start)
