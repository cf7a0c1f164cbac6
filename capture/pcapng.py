"""pcapng (draft-ietf-opsawg-pcapng): sections in either byte order, many interfaces.

A numba kernel walks Enhanced, Simple and (obsolete) Packet Blocks and skips statistics, name
resolution, decryption-secret, custom and unknown blocks; it hands Section Header and Interface
Description Blocks back to Python, which reads their options (``if_tsresol``, ``if_tsoffset``)
into per-interface arrays. Interface ids are those of the file: each section numbers its
interfaces from 0 (the pcapng specification's scope, and tshark's ``frame.interface_id``).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from capture.errors import DecodeError
from capture.jit import kernel, kernel_inline
from capture.records import (
    PREFETCH,
    ByteSource,
    RawBatch,
    ReadStats,
    batch_arrays,
    touch_ahead,
    u16,
    u32,
)

SHB, IDB, PB, SPB, EPB = 0x0A0D0D0A, 0x00000001, 0x00000002, 0x00000003, 0x00000006
MAX_BLOCK = 16 << 20  # libpcap's limit on a block; larger is corruption

OK, NEED_PYTHON, ERR_TRUNC, ERR_LENGTH, ERR_TRAILER, ERR_CAPLEN, ERR_IFACE = range(7)
REASONS = {
    ERR_TRUNC: "truncated_block",
    ERR_LENGTH: "bad_block_length",
    ERR_TRAILER: "block_length_mismatch",
    ERR_CAPLEN: "caplen_past_block",
    ERR_IFACE: "unknown_interface",
}
MESSAGES = {
    ERR_TRUNC: "truncated block (file ends inside a block)",
    ERR_LENGTH: "bad block length (under 12, not a multiple of 4, or over 16 MiB)",
    ERR_TRAILER: "block length at the end of the block differs from its start",
    ERR_CAPLEN: "packet caplen runs past the end of its block",
    ERR_IFACE: "packet refers to an interface with no Interface Description Block",
}
# timestamp conversions per interface
TS_MUL, TS_DIV, TS_BIN = 0, 1, 2


@kernel_inline
def _ts_ns(ticks, kind, param, off_ns):
    if kind == TS_MUL:
        return np.int64(ticks * np.uint64(param)) + off_ns
    if kind == TS_DIV:
        return np.int64(ticks // np.uint64(param)) + off_ns
    whole = ticks >> np.uint64(param)
    frac = ticks & ((np.uint64(1) << np.uint64(param)) - np.uint64(1))
    return np.int64(whole) * 1_000_000_000 + np.int64(
        (frac * np.uint64(1_000_000_000)) >> np.uint64(param)) + off_ns


@kernel
def index_blocks(buf, pos, end, big, n_if, if_link, if_snap, if_kind, if_param,
                 if_off, last_ts, offset, caplen, wirelen, ts_ns, link, iface):
    """Walk blocks from ``pos``; fill up to len(offset) packet records.

    Returns (records, next position, status, last timestamp, checksum); status NEED_PYTHON stops
    at a Section Header or Interface Description Block for the caller to read.
    """
    n = 0
    cap = offset.shape[0]
    ahead = pos
    sink = np.int64(0)
    while n < cap:
        if pos == end:
            return n, pos, OK, last_ts, sink
        if pos + 12 > end:
            return n, pos, ERR_TRUNC, last_ts, sink
        btype = u32(buf, pos, big)
        blen = np.int64(u32(buf, pos + 4, big))
        if btype == SHB or btype == IDB:
            return n, pos, NEED_PYTHON, last_ts, sink
        if blen < 12 or blen % 4 != 0 or blen > MAX_BLOCK:
            return n, pos, ERR_LENGTH, last_ts, sink
        if pos + blen > end:
            return n, pos, ERR_TRUNC, last_ts, sink
        ahead, acc = touch_ahead(buf, ahead, pos + blen + PREFETCH, end)
        sink += acc
        if np.int64(u32(buf, pos + blen - 4, big)) != blen:
            return n, pos, ERR_TRAILER, last_ts, sink
        if btype == EPB or btype == PB:
            if blen < 32:
                return n, pos, ERR_LENGTH, last_ts, sink
            if btype == EPB:
                ifc = np.int64(u32(buf, pos + 8, big))
            else:
                ifc = np.int64(u16(buf, pos + 8, big))
            if ifc >= n_if:
                return n, pos, ERR_IFACE, last_ts, sink
            incl = np.int64(u32(buf, pos + 20, big))
            if incl > blen - 32:
                return n, pos, ERR_CAPLEN, last_ts, sink
            ticks = (np.uint64(u32(buf, pos + 12, big)) << np.uint64(32)) | \
                np.uint64(u32(buf, pos + 16, big))
            last_ts = _ts_ns(ticks, if_kind[ifc], if_param[ifc], if_off[ifc])
            offset[n] = pos + 28
            caplen[n] = incl
            wirelen[n] = min(np.int64(u32(buf, pos + 24, big)), 2**31 - 1)
            ts_ns[n] = last_ts
            link[n] = if_link[ifc]
            iface[n] = ifc
            n += 1
        elif btype == SPB:
            if blen < 16 or n_if == 0:
                return n, pos, ERR_IFACE if n_if == 0 else ERR_LENGTH, last_ts, sink
            orig = np.int64(u32(buf, pos + 8, big))
            incl = min(orig, blen - 16)
            if if_snap[0] > 0:
                incl = min(incl, np.int64(if_snap[0]))
            offset[n] = pos + 12
            caplen[n] = incl
            wirelen[n] = min(orig, 2**31 - 1)
            ts_ns[n] = last_ts  # a Simple Packet Block has no timestamp: the previous one
            link[n] = if_link[0]
            iface[n] = 0
            n += 1
        pos += blen
    return n, pos, OK, last_ts, sink


class _Interfaces:
    """Per-interface arrays of the current section."""

    def __init__(self):
        self.link, self.snap, self.kind, self.param, self.off = [], [], [], [], []

    def add(self, linktype: int, snaplen: int, tsresol: int, tsoffset_s: int) -> None:
        value = tsresol & 0x7F
        if tsresol & 0x80:  # 2^-value seconds
            kind, param = TS_BIN, min(value, 32)
        elif value <= 9:
            kind, param = TS_MUL, 10 ** (9 - value)
        else:
            kind, param = TS_DIV, 10 ** (value - 9)
        self.link.append(linktype)
        self.snap.append(snaplen)
        self.kind.append(kind)
        self.param.append(param)
        self.off.append(tsoffset_s * 1_000_000_000)

    def arrays(self):
        return (np.array(self.link, np.int32), np.array(self.snap, np.int64),
                np.array(self.kind, np.int32), np.array(self.param, np.int64),
                np.array(self.off, np.int64))


class PcapngReader:
    """Iterate RawBatches of a pcapng file or stream."""

    def __init__(self, src: ByteSource, batch_size: int = 65536):
        self.src = src
        self.name = src.name
        self.batch_size = batch_size
        self.stats = ReadStats()
        self.big = False
        self.sections = 0
        self.interfaces: list[dict] = []  # every interface seen, with its section
        self._ifs = _Interfaces()
        self._last_ts = np.int64(0)

    @property
    def linktype(self) -> int:
        """The first interface's link type (classic-pcap readers have exactly one)."""
        return self.interfaces[0]["linktype"] if self.interfaces else -1

    def _fail(self, reason: str, key: str, pos: int):
        self.stats.errors[key] += 1
        return DecodeError(reason, offset=int(pos), layer="pcapng", source=self.name, kind=key)

    def _block(self, pos: int) -> int:
        """Read the SHB or IDB at ``pos``; return the position after it."""
        src = self.src
        if src.ensure(pos, 12) < 12:
            raise self._fail(MESSAGES[ERR_TRUNC], REASONS[ERR_TRUNC], pos)
        b = src.buf
        r = pos - src.base
        if b[r:r + 4].tobytes() == b"\x0a\x0d\x0d\x0a":
            bom = b[r + 8:r + 12].tobytes()
            if bom == b"\x1a\x2b\x3c\x4d":
                self.big = True
            elif bom == b"\x4d\x3c\x2b\x1a":
                self.big = False
            else:
                raise self._fail(f"bad byte-order magic {bom.hex()} in section header",
                                 "bad_byte_order_magic", pos)
            self.sections += 1
            self._ifs = _Interfaces()
        order = "big" if self.big else "little"
        btype = int.from_bytes(b[r:r + 4].tobytes(), order)
        blen = int.from_bytes(b[r + 4:r + 8].tobytes(), order)
        if blen < (28 if btype == SHB else 20) or blen % 4 or blen > MAX_BLOCK:
            raise self._fail(MESSAGES[ERR_LENGTH], REASONS[ERR_LENGTH], pos)
        if src.ensure(pos, blen) < blen:
            raise self._fail(MESSAGES[ERR_TRUNC], REASONS[ERR_TRUNC], pos)
        b = src.buf
        r = pos - src.base
        block = b[r:r + blen].tobytes()
        if int.from_bytes(block[-4:], order) != blen:
            raise self._fail(MESSAGES[ERR_TRAILER], REASONS[ERR_TRAILER], pos)
        if btype == SHB:
            major = int.from_bytes(block[12:14], order)
            if major != 1:
                raise self._fail(f"unsupported pcapng major version {major}",
                                 "unsupported_version", pos)
            return pos + blen
        linktype = int.from_bytes(block[8:10], order)
        snaplen = int.from_bytes(block[12:16], order)
        tsresol, tsoffset, ifname = 6, 0, ""
        for code, value in _options(block[16:-4], order):
            if code == 9 and value:
                tsresol = value[0]
            elif code == 14 and len(value) >= 8:
                tsoffset = int.from_bytes(value[:8], order, signed=True)
            elif code == 2:
                ifname = value.decode("utf-8", "replace")
        self._ifs.add(linktype, snaplen, tsresol, tsoffset)
        self.interfaces.append({"section": self.sections, "id": len(self._ifs.link) - 1,
                                "linktype": linktype, "snaplen": snaplen,
                                "tsresol": tsresol, "name": ifname})
        return pos + blen

    def __iter__(self) -> Iterator[RawBatch]:
        src, pos = self.src, 0
        arrays = self._ifs.arrays()
        while True:
            if src.ensure(pos, 12) == 0:
                return
            offset, caplen, wirelen, ts, link, iface = batch_arrays(self.batch_size)
            rel = pos - src.base
            n, rel, status, self._last_ts, _ = index_blocks(
                src.buf, rel, len(src.buf), self.big, len(arrays[0]), *arrays,
                self._last_ts, offset, caplen, wirelen, ts, link, iface)
            if n:
                self.stats.records += n
                self.stats.bytes += int(caplen[:n].sum())
                yield RawBatch(src.buf, offset[:n], caplen[:n], wirelen[:n], ts[:n], link[:n],
                               iface[:n])
            pos = src.base + rel
            if status == OK:
                continue
            if status == NEED_PYTHON:
                pos = self._block(pos)
                arrays = self._ifs.arrays()
                continue
            if status == ERR_TRUNC:
                r = pos - src.base
                have = len(src.buf) - r
                need = 12
                if have >= 8:
                    need = max(12, int(u32(src.buf, r + 4, self.big)))
                if need <= MAX_BLOCK and src.ensure(pos, need) >= need:
                    continue
                if src.follow and src.stop.is_set():
                    return
            raise self._fail(MESSAGES[status], REASONS[status], pos)

    def close(self) -> None:
        self.src.buf = np.zeros(0, np.uint8)


def _options(data: bytes, order: str):
    """(code, value) of a block's options, up to opt_endofopt."""
    i = 0
    while i + 4 <= len(data):
        code = int.from_bytes(data[i:i + 2], order)
        ln = int.from_bytes(data[i + 2:i + 4], order)
        if code == 0:
            return
        yield code, data[i + 4:i + 4 + ln]
        i += 4 + ln + (-ln % 4)
