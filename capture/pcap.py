"""Classic pcap files: both byte orders, µs and ns timestamps.

The file is memory-mapped; a numba kernel walks the record headers and returns, per batch,
the offsets and lengths of the records, so the unpack kernel reads packets in place.
Every record before a fault is delivered; then a DecodeError names the byte offset and reason.
"""

from __future__ import annotations

import mmap
import os
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import numba as nb
import numpy as np

from capture.errors import DecodeError

MAGIC_US = 0xA1B2C3D4
MAGIC_NS = 0xA1B23C4D
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


@dataclass
class RawBatch:
    """Records of one batch: a byte buffer and, per record, where it starts and its lengths."""

    buf: np.ndarray  # uint8, the whole mapped file (records are read in place)
    offset: np.ndarray  # int64, start of each record's data
    caplen: np.ndarray  # int32
    wirelen: np.ndarray  # int32
    ts_ns: np.ndarray  # int64 epoch nanoseconds
    linktype: int
    iface: int = 0

    def __len__(self) -> int:
        return len(self.offset)

    def slice(self, a: int, b: int) -> RawBatch:
        """Records a..b (views)."""
        return RawBatch(self.buf, self.offset[a:b], self.caplen[a:b], self.wirelen[a:b],
                        self.ts_ns[a:b], self.linktype, self.iface)


@dataclass
class ReadStats:
    """Counters of one reader, by reason (exported as metrics by the collector)."""

    records: int = 0
    bytes: int = 0
    errors: Counter = field(default_factory=Counter)


@nb.njit(cache=True, nogil=True)
def _u32(buf, pos, swapped):
    if swapped:
        return (np.uint32(buf[pos]) << 24) | (np.uint32(buf[pos + 1]) << 16) | \
            (np.uint32(buf[pos + 2]) << 8) | np.uint32(buf[pos + 3])
    return (np.uint32(buf[pos + 3]) << 24) | (np.uint32(buf[pos + 2]) << 16) | \
        (np.uint32(buf[pos + 1]) << 8) | np.uint32(buf[pos])


@nb.njit(cache=True, nogil=True)
def index_records(buf, pos, end, swapped, nano, max_caplen, offset, caplen, wirelen, ts_ns):
    """Walk record headers from ``pos``; fill up to len(offset) records.

    Returns (records, next position, status); status is OK or an ERR_* code for the record
    header at ``next position``.
    """
    n = 0
    cap = offset.shape[0]
    while n < cap:
        if pos == end:
            return n, pos, OK
        if pos + 16 > end:
            return n, pos, ERR_TRUNC_HEADER
        sec = _u32(buf, pos, swapped)
        frac = _u32(buf, pos + 4, swapped)
        incl = _u32(buf, pos + 8, swapped)
        orig = _u32(buf, pos + 12, swapped)
        if incl > max_caplen:
            return n, pos, ERR_CAPLEN
        if pos + 16 + incl > end:
            return n, pos, ERR_TRUNC_DATA
        offset[n] = pos + 16
        caplen[n] = incl
        wirelen[n] = min(orig, np.uint32(2**31 - 1))
        if nano:
            ts_ns[n] = np.int64(sec) * 1_000_000_000 + np.int64(frac)
        else:
            ts_ns[n] = np.int64(sec) * 1_000_000_000 + np.int64(frac) * 1000
        pos += 16 + incl
        n += 1
    return n, pos, OK


class PcapReader:
    """Iterate RawBatches of a classic pcap file (or a bytes object, or '-' for stdin)."""

    def __init__(self, source: str | os.PathLike | bytes, batch_size: int = 65536, iface: int = 0):
        self.source = source
        self.name = "<bytes>" if isinstance(source, bytes | bytearray) else str(source)
        self.batch_size = batch_size
        self.iface = iface
        self.stats = ReadStats()
        self._mm: mmap.mmap | None = None
        self.buf = self._load()
        self._header()

    def _load(self) -> np.ndarray:
        if isinstance(self.source, bytes | bytearray):
            return np.frombuffer(bytes(self.source), dtype=np.uint8)
        if str(self.source) == "-":
            return np.frombuffer(sys.stdin.buffer.read(), dtype=np.uint8)
        size = os.path.getsize(self.source)
        if size == 0:
            return np.zeros(0, dtype=np.uint8)
        with open(self.source, "rb") as fh:
            self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        return np.frombuffer(self._mm, dtype=np.uint8)

    def _header(self) -> None:
        b = self.buf
        if len(b) < GLOBAL_HEADER:
            raise DecodeError(f"file too short for a pcap header ({len(b)} of 24 bytes)",
                              offset=0, layer="pcap", source=self.name)
        magic_le = int.from_bytes(b[:4].tobytes(), "little")
        magic_be = int.from_bytes(b[:4].tobytes(), "big")
        if magic_le in (MAGIC_US, MAGIC_NS):
            self.swapped, self.nano = False, magic_le == MAGIC_NS
        elif magic_be in (MAGIC_US, MAGIC_NS):
            self.swapped, self.nano = True, magic_be == MAGIC_NS
        elif b[:4].tobytes() == b"\x0a\x0d\x0d\x0a":
            raise DecodeError("pcapng is not supported yet; convert with "
                              "`editcap -F pcap IN OUT`", offset=0, layer="pcap",
                              source=self.name)
        else:
            raise DecodeError(f"not a pcap file (magic {b[:4].tobytes().hex()})", offset=0,
                              layer="pcap", source=self.name)
        order = "big" if self.swapped else "little"
        self.snaplen = int.from_bytes(b[16:20].tobytes(), order)
        self.linktype = int.from_bytes(b[20:24].tobytes(), order) & 0x0FFFFFFF

    def __iter__(self) -> Iterator[RawBatch]:
        pos, end = GLOBAL_HEADER, len(self.buf)
        max_caplen = max(self.snaplen, MAX_SNAPLEN)
        while True:
            n_cap = self.batch_size
            offset = np.empty(n_cap, np.int64)
            caplen = np.empty(n_cap, np.int32)
            wirelen = np.empty(n_cap, np.int32)
            ts = np.empty(n_cap, np.int64)
            n, pos, status = index_records(self.buf, pos, end, self.swapped, self.nano,
                                           max_caplen, offset, caplen, wirelen, ts)
            if n:
                self.stats.records += n
                self.stats.bytes += int(caplen[:n].sum())
                yield RawBatch(self.buf, offset[:n], caplen[:n], wirelen[:n], ts[:n],
                               self.linktype, self.iface)
            if status != OK:
                self.stats.errors[REASONS[status]] += 1
                raise DecodeError(MESSAGES[status], offset=int(pos), layer="pcap",
                                  source=self.name)
            if pos == end and n < n_cap:
                return

    def close(self) -> None:
        """Release the mapping (batches handed out keep their own reference)."""
        self.buf = np.zeros(0, dtype=np.uint8)
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # a batch still references it; the mapping goes with the last reference
            self._mm = None
