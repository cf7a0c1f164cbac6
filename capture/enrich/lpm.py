"""Longest-prefix match as numba searches sorted intervals.

A prefix database's leaves partition the address space (``mmdb.py``), so longest-prefix match
is "the last interval starting at or before the address". Each family keeps its interval starts
sorted with one value each (a record id; -1 none) and an index by the address's top 16 bits:
``index[b]`` is the interval holding the block's first address, so a look-up binary-searches
only ``index[b] .. index[b + 1]`` (a few intervals of one or two cache lines on a
routing-table-like database: 1M prefixes leave about 30 per /16 on average). IPv4 starts are
32-bit words (an IPv4 table of 2M intervals is 8 MiB); IPv6 ones two 64-bit words, where a
``V4_HERE - d`` value sends the look-up to the IPv4 table with the 32 bits after bit d (the
IPv4 tree and its aliases, e.g. 6to4's 2002::/16, in an IPv6 database).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from capture.enrich.mmdb import V4_HERE
from capture.jit import kernel, kernel_inline

BLOCK_BITS = 16


@kernel
def block_index(hi, lo, shift, out):
    """``out[b]``: the last interval starting at or before block b's first address (block b
    starts at ``b << shift`` of the high word, the low word 0); the last entry: the last
    interval."""
    n = hi.shape[0]
    j = 0
    blocks = out.shape[0] - 1
    for b in range(blocks):
        edge = np.uint64(b) << np.uint64(shift)
        while j + 1 < n and (hi[j + 1] < edge or hi[j + 1] == edge and lo[j + 1] == 0):
            j += 1
        out[b] = j
    out[blocks] = n - 1


@kernel_inline
def find4(starts, index, values, a):
    """The value of the last IPv4 interval starting at or before ``a`` (uint32 as uint64)."""
    b = a >> np.uint64(BLOCK_BITS)
    lo = index[b]
    hi = index[b + np.uint64(1)]
    while lo < hi:  # the last start <= a within [lo, hi]
        mid = (lo + hi + 1) >> 1
        if np.uint64(starts[mid]) <= a:
            lo = mid
        else:
            hi = mid - 1
    return values[lo]


@kernel_inline
def find6(hi_w, lo_w, index, values, h, low):
    b = h >> np.uint64(64 - BLOCK_BITS)
    lo = index[b]
    hi = index[b + np.uint64(1)]
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if hi_w[mid] < h or hi_w[mid] == h and lo_w[mid] <= low:
            lo = mid
        else:
            hi = mid - 1
    return values[lo]


@kernel
def lookup(addrs, ok, s4, i4, v4, h6, l6, i6, v6, out):
    """Record ids of (n, 16) addresses (IPv4-mapped for IPv4; -1: none, or ``ok`` False)."""
    for i in range(addrs.shape[0]):
        if not ok[i]:
            out[i] = -1
            continue
        mapped = addrs[i, 10] == 0xFF and addrs[i, 11] == 0xFF
        for k in range(10):
            if addrs[i, k] != 0:
                mapped = False
        if mapped:
            a = np.uint64(0)
            for k in range(12, 16):
                a = (a << np.uint64(8)) | np.uint64(addrs[i, k])
            out[i] = find4(s4, i4, v4, a)
            continue
        h = np.uint64(0)
        low = np.uint64(0)
        for k in range(8):
            h = (h << np.uint64(8)) | np.uint64(addrs[i, k])
            low = (low << np.uint64(8)) | np.uint64(addrs[i, 8 + k])
        r = find6(h6, l6, i6, v6, h, low)
        if r <= V4_HERE:  # the IPv4 tree, from bit d on
            d = V4_HERE - r
            if d <= 32:
                a = h >> np.uint64(32 - d)
            elif d < 64:
                a = (h << np.uint64(d - 32)) | (low >> np.uint64(96 - d))
            else:
                a = low >> np.uint64(96 - d) if d <= 96 else np.uint64(0)
            a &= np.uint64(0xFFFFFFFF)
            r = find4(s4, i4, v4, a)
        out[i] = r


@dataclass
class PrefixIndex:
    """The compiled intervals of both families (``values``: record ids, -1 none)."""

    s4: np.ndarray  # uint32 starts
    i4: np.ndarray  # int64 block index
    v4: np.ndarray  # int32 values
    h6: np.ndarray
    l6: np.ndarray
    i6: np.ndarray
    v6: np.ndarray

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.s4, self.i4, self.v4, self.h6, self.l6, self.i6,
                                      self.v6))

    @property
    def intervals(self) -> int:
        return len(self.s4) + len(self.h6)

    def lookup(self, addrs: np.ndarray, ok: np.ndarray) -> np.ndarray:
        """Record ids (int32, -1 none) of (n, 16) addresses; ``ok``: which rows have one."""
        out = np.empty(len(addrs), np.int32)
        lookup(np.ascontiguousarray(addrs), ok, self.s4, self.i4, self.v4, self.h6, self.l6,
               self.i6, self.v6, out)
        return out


def _merged(hi: np.ndarray, lo: np.ndarray, values: np.ndarray):
    """Neighbouring intervals of one value as one."""
    keep = np.ones(len(values), bool)
    keep[1:] = values[1:] != values[:-1]
    return hi[keep], lo[keep], values[keep]


def build(v4: tuple[np.ndarray, np.ndarray], v6: tuple[np.ndarray, np.ndarray, np.ndarray]
          ) -> PrefixIndex:
    """The index of IPv4 leaves (starts as 32-bit values, values) and IPv6 ones (hi, lo,
    values), each in address order and covering its whole space."""
    s4, val4 = v4
    _, s4, val4 = _merged(np.zeros(len(s4), np.uint64), s4.astype(np.uint64), val4)
    i4 = np.empty((1 << BLOCK_BITS) + 1, np.int64)
    block_index(np.ascontiguousarray(s4, np.uint64) << np.uint64(32), np.zeros(len(s4), np.uint64),
                np.uint64(64 - BLOCK_BITS), i4)
    h6, l6, val6 = _merged(*v6)
    i6 = np.empty((1 << BLOCK_BITS) + 1, np.int64)
    block_index(np.ascontiguousarray(h6), np.ascontiguousarray(l6), np.uint64(64 - BLOCK_BITS),
                i6)
    return PrefixIndex(s4.astype(np.uint32), i4, val4.astype(np.int32),
                       np.ascontiguousarray(h6), np.ascontiguousarray(l6), i6,
                       val6.astype(np.int32))
