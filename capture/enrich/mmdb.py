"""MaxMind DB files (GeoLite2/GeoIP2, IPinfo, DB-IP all ship the format), read without a reader
library and compiled for numba.

An MMDB file is a binary trie over address bits (a node: two records of 24, 28 or 32 bits; a
record is another node, "no data", or a pointer into the data section), a data section of
records in a typed binary format (maps, strings, integers …; pointers share repeated values),
and a metadata map after the marker ``\\xab\\xcd\\xefMaxMind.com``
(https://maxmind.github.io/MaxMind-DB/). ``walk`` turns the trie into its leaves in address order
(one numba pass, no Python per node): they partition the address space, so the leaves are the
intervals ``lpm.py`` searches. Only the distinct records the leaves point at are decoded, and of
each only the values at the configured record paths.
"""

from __future__ import annotations

import struct

import numpy as np

from capture.jit import allocating

METADATA_MARKER = b"\xab\xcd\xefMaxMind.com"
MAX_METADATA = 128 * 1024  # the metadata lies within the file's last 128 KiB
V4_HERE = -2  # a v6 leaf ``V4_HERE - d``: the IPv4 tree again, from address bit d on (aliases)
NO_DATA = -1


class MmdbError(ValueError):
    """A file that is not a MaxMind DB, or a corrupt one: the reason and where."""


# -- the data section's format
class Decoder:
    """Values of the data section (``buf[start:]``): ``decode(offset) -> (value, next)``."""

    MAX_DEPTH = 32  # maps and arrays within each other
    MAX_VALUES = 100_000  # values in one record (pointers may share one many times)

    def __init__(self, buf: bytes, start: int, where: str):
        self.buf, self.start, self.where = buf, start, where
        self._left = self.MAX_VALUES

    def value(self, offset: int):
        """The record at ``offset``."""
        self._left = self.MAX_VALUES
        return self.decode(offset)[0]

    def fail(self, offset: int, reason: str):
        raise MmdbError(f"{self.where}: data section offset {offset}: {reason}")

    def _size(self, ctrl: int, at: int) -> tuple[int, int]:
        size = ctrl & 0x1F
        if size < 29:
            return size, at
        extra = size - 28
        if at + extra > len(self.buf):
            self.fail(at - self.start, "size runs past the end")
        b = int.from_bytes(self.buf[at:at + extra], "big")
        return (29 + b, 285 + b, 65821 + b)[extra - 1], at + extra

    def decode(self, offset: int, follow: bool = True, depth: int = 0):
        buf, at = self.buf, self.start + offset
        if at >= len(buf) or offset < 0:
            self.fail(offset, "past the end of the file")
        self._left -= 1
        if self._left < 0 or depth > self.MAX_DEPTH:
            self.fail(offset, "a record nested or repeated beyond any real one")
        ctrl = buf[at]
        at += 1
        kind = ctrl >> 5
        if kind == 1:  # a pointer: 11, 19, 27 or 32 bits
            ss, v = (ctrl >> 3) & 3, ctrl & 7
            n = ss + 1
            if at + n > len(buf):
                self.fail(offset, "pointer runs past the end")
            b = int.from_bytes(buf[at:at + n], "big")
            target = (((v << 8 * n) | b) + (0, 2048, 526336, 0)[ss]) if ss < 3 else b
            if not follow:
                return target, at + n
            value, _ = self.decode(target, False, depth + 1)  # a pointer never points at one
            return value, at + n
        if kind == 0:  # extended type
            if at >= len(buf):
                self.fail(offset, "extended type past the end")
            kind = 7 + buf[at]
            at += 1
        size, at = self._size(ctrl, at)
        if kind == 7:  # map
            out = {}
            for _ in range(size):
                key, at = self.decode(at - self.start, True, depth + 1)
                if not isinstance(key, str):
                    self.fail(at - self.start, "a map key is not a string")
                value, at = self.decode(at - self.start, True, depth + 1)
                out[key] = value
            return out, at
        if kind == 11:  # array
            items = []
            for _ in range(size):
                value, at = self.decode(at - self.start, True, depth + 1)
                items.append(value)
            return items, at
        if kind == 14:  # boolean: the size is the value
            return bool(size), at
        if at + size > len(buf):
            self.fail(offset, "value runs past the end")
        raw = buf[at:at + size]
        at += size
        if kind == 2:
            try:
                return raw.decode("utf-8"), at
            except UnicodeDecodeError:
                self.fail(offset, "a string is not UTF-8")
        if kind in (5, 6, 9, 10):  # uint16, uint32, uint64, uint128
            return int.from_bytes(raw, "big"), at
        if kind == 8:  # int32
            return int.from_bytes(raw.rjust(4, b"\0"), "big", signed=True), at
        if kind == 3 and size == 8:
            return struct.unpack(">d", raw)[0], at
        if kind == 15 and size == 4:
            return struct.unpack(">f", raw)[0], at
        if kind == 4:
            return bytes(raw), at
        if kind in (12, 13):  # data cache container, end marker: no value
            return None, at
        self.fail(offset, f"unknown type {kind} of size {size}")


def at_path(record, path: tuple[str, ...]):
    """The value at a record path (map keys, array indexes as digits); None when absent."""
    value = record
    for part in path:
        if isinstance(value, dict):
            value = value.get(part)
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


# -- the search tree
@allocating
def walk(tree, record_size, node_count, data_size, root, depth0, max_depth, v4node):
    """The leaves of the trie below ``root`` (at bit ``depth0``), in address order: (hi, lo)
    start words, prefix length, and data offset (``NO_DATA``; ``V4_HERE - d`` where a v6 walk
    meets the IPv4 tree's root ``v4node`` at bit d). Returns the count; -1 a corrupt tree (a
    record past the data, a path deeper than the address)."""
    cap = node_count + 2
    out_hi = np.zeros(cap, np.uint64)
    out_lo = np.zeros(cap, np.uint64)
    out_len = np.zeros(cap, np.int32)
    out_rec = np.zeros(cap, np.int64)
    st_node = np.zeros(2 * 130, np.int64)
    st_depth = np.zeros(2 * 130, np.int64)
    st_hi = np.zeros(2 * 130, np.uint64)
    st_lo = np.zeros(2 * 130, np.uint64)
    sp = 0
    st_node[0], st_depth[0] = root, depth0
    sp = 1
    n = 0
    bytes_per_node = record_size // 4
    while sp > 0:
        sp -= 1
        value, d = st_node[sp], st_depth[sp]
        hi, lo = st_hi[sp], st_lo[sp]
        if value < node_count and value != v4node or value == v4node and d == depth0:
            if d >= max_depth:
                return -1, out_hi, out_lo, out_len, out_rec
            off = value * bytes_per_node
            if record_size == 24:
                left = (np.int64(tree[off]) << 16) | (np.int64(tree[off + 1]) << 8) | tree[off + 2]
                right = (np.int64(tree[off + 3]) << 16) | (np.int64(tree[off + 4]) << 8) \
                    | tree[off + 5]
            elif record_size == 28:
                mid = np.int64(tree[off + 3])
                left = ((mid & 0xF0) << 20) | (np.int64(tree[off]) << 16) \
                    | (np.int64(tree[off + 1]) << 8) | tree[off + 2]
                right = ((mid & 0x0F) << 24) | (np.int64(tree[off + 4]) << 16) \
                    | (np.int64(tree[off + 5]) << 8) | tree[off + 6]
            else:
                left = (np.int64(tree[off]) << 24) | (np.int64(tree[off + 1]) << 16) \
                    | (np.int64(tree[off + 2]) << 8) | tree[off + 3]
                right = (np.int64(tree[off + 4]) << 24) | (np.int64(tree[off + 5]) << 16) \
                    | (np.int64(tree[off + 6]) << 8) | tree[off + 7]
            # the right child sets bit d (counted from the top of 128)
            rhi, rlo = hi, lo
            if d < 64:
                rhi = hi | (np.uint64(1) << np.uint64(63 - d))
            else:
                rlo = lo | (np.uint64(1) << np.uint64(127 - d))
            st_node[sp], st_depth[sp], st_hi[sp], st_lo[sp] = right, d + 1, rhi, rlo
            st_node[sp + 1], st_depth[sp + 1], st_hi[sp + 1], st_lo[sp + 1] = left, d + 1, hi, lo
            sp += 2
            continue
        if n >= cap:
            return -1, out_hi, out_lo, out_len, out_rec
        out_hi[n], out_lo[n], out_len[n] = hi, lo, d
        if value == v4node:
            out_rec[n] = V4_HERE - d
        elif value == node_count:
            out_rec[n] = NO_DATA
        else:
            ptr = value - node_count - 16
            if ptr < 0 or ptr >= data_size:
                return -1, out_hi, out_lo, out_len, out_rec
            out_rec[n] = ptr
        n += 1
    return n, out_hi, out_lo, out_len, out_rec


class MmdbFile:
    """One MMDB file: its metadata, search tree and data section."""

    def __init__(self, path: str):
        self.path = str(path)
        try:
            with open(path, "rb") as f:
                self.buf = f.read()
        except OSError as e:
            raise MmdbError(f"{path}: {e.strerror or e}") from None
        buf = self.buf
        at = buf.rfind(METADATA_MARKER, max(0, len(buf) - MAX_METADATA))
        if at < 0:
            raise MmdbError(f"{path}: not a MaxMind DB file (no metadata marker)")
        meta_start = at + len(METADATA_MARKER)
        meta = Decoder(buf, meta_start, f"{path} metadata").value(0)
        if not isinstance(meta, dict):
            raise MmdbError(f"{path}: the metadata is not a map")
        try:
            self.node_count = int(meta["node_count"])
            self.record_size = int(meta["record_size"])
            self.ip_version = int(meta["ip_version"])
        except (KeyError, TypeError, ValueError) as e:
            raise MmdbError(f"{path}: metadata lacks {e}") from None
        if self.record_size not in (24, 28, 32) or self.ip_version not in (4, 6):
            raise MmdbError(f"{path}: record size {self.record_size}, IP version "
                            f"{self.ip_version}: not a format this reader knows")
        self.database_type = str(meta.get("database_type", ""))
        self.build_epoch = int(meta.get("build_epoch", 0) or 0)
        self.tree_size = self.record_size * 2 // 8 * self.node_count
        if self.tree_size + 16 > at:
            raise MmdbError(f"{path}: a tree of {self.node_count} nodes does not fit the file")
        self.data = Decoder(buf, self.tree_size + 16, path)
        self.data_size = at - (self.tree_size + 16)
        self.tree = np.frombuffer(buf, np.uint8, self.tree_size)
        self.v4node = self._v4node()

    def _v4node(self) -> int:
        """The node of ::/96 (the IPv4 tree) in an IPv6 database; the root in an IPv4 one."""
        if self.ip_version == 4:
            return 0
        node = 0
        for _ in range(96):
            if node >= self.node_count:
                break
            off = node * (self.record_size // 4)
            t = self.tree
            if self.record_size == 24:
                node = int(t[off]) << 16 | int(t[off + 1]) << 8 | int(t[off + 2])
            elif self.record_size == 28:
                node = (int(t[off + 3]) & 0xF0) << 20 | int(t[off]) << 16 | \
                    int(t[off + 1]) << 8 | int(t[off + 2])
            else:
                node = int.from_bytes(t[off:off + 4].tobytes(), "big")
        return node

    def leaves(self, v6: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The trie's leaves in address order as (hi, lo, data offset): the IPv4 tree's
        (addresses in ``lo``'s low 32 bits) or, ``v6``, the whole tree's with the IPv4 tree
        (and any alias of it) left as ``V4_HERE - bit`` leaves."""
        if v6 and self.ip_version == 4:
            return np.zeros(1, np.uint64), np.zeros(1, np.uint64), np.full(1, NO_DATA)
        if not v6 and self.v4node >= self.node_count:  # ::/96 is one record: data or none
            rec = NO_DATA if self.v4node == self.node_count else \
                self.v4node - self.node_count - 16
            return np.zeros(1, np.uint64), np.zeros(1, np.uint64), np.full(1, rec)
        if v6:
            root, depth0, v4node = 0, 0, self.v4node if self.ip_version == 6 else -1
        else:
            root, depth0, v4node = self.v4node, 96 if self.ip_version == 6 else 0, -1
        max_depth = 128 if self.ip_version == 6 else 32
        n, hi, lo, _, rec = walk(self.tree, self.record_size, self.node_count, self.data_size,
                                 root, depth0, max_depth, v4node)
        if n < 0:
            raise MmdbError(f"{self.path}: corrupt search tree (a record points past the data "
                            "or a path is deeper than an address)")
        if not v6 and self.ip_version == 4:  # addresses in the top 32 bits: move them down
            lo = hi[:n] >> np.uint64(32)
            return np.zeros(n, np.uint64), lo, rec[:n]
        return hi[:n], lo[:n], rec[:n]

    def record(self, offset: int):
        return self.data.value(offset)
