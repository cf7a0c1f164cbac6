"""Longest-prefix match as numba look-ups into compiled tables.

A prefix database's leaves partition the address space (``mmdb.py``): every address lies in one
interval, and its value (a record id; -1 none) is the answer. The intervals become:

- IPv4, DIR-24-8 (Gupta, Lin, McKeown, "Routing lookups in hardware at memory access speeds",
  1998): a table of 2^24 entries, one per /24, holding the value when the /24 lies in one
  interval, else a chunk of 256 values (one per address) for the /24s a longer prefix splits.
  One memory access per address, two for the few in a split /24; the accesses of consecutive
  addresses do not depend on each other, so the processor overlaps their cache misses (a binary
  search's steps each wait for the last: 67 ns a look-up on a 1.4M-network database, against
  the table's 64 MiB).
- IPv6: the interval starts sorted (two 64-bit words, with the value beside them: a search's
  last step reads it from the line it compared), an index by the top 16 bits and, for a
  /16 holding many intervals (2001::/16, 2a00::/16 …), a second index by the next 16, so a
  binary search covers a few intervals. A ``V4_HERE - d`` value sends the look-up to the IPv4
  table with the 32 bits after bit d (the IPv4 tree and its aliases in an IPv6 database, e.g.
  6to4's 2002::/16).
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

from capture.enrich.mmdb import V4_HERE
from capture.jit import allocating, kernel, kernel_inline, prefetch

BLOCK_BITS = 16
DENSE = 64  # a /16 of more IPv6 intervals than this gets a second index
SPLIT = -2  # t24 values <= SPLIT: chunk SPLIT - value


@allocating
def dir24(starts, values, t24):
    """The IPv4 tables of intervals (starts as int64 in [0, 2^32), sorted, the first 0):
    ``t24`` filled, the chunks returned."""
    n = starts.shape[0]
    chunks_needed = 0
    j = 0
    for b in range(1 << 24):  # count the split /24s
        end = (b + 1) << 8
        while j + 1 < n and starts[j + 1] <= b << 8:
            j += 1
        if j + 1 < n and starts[j + 1] < end:
            chunks_needed += 1
    chunks = np.empty(chunks_needed * 256, np.int32)
    c = 0
    j = 0
    for b in range(1 << 24):
        first = b << 8
        end = first + 256
        while j + 1 < n and starts[j + 1] <= first:
            j += 1
        if j + 1 < n and starts[j + 1] < end:
            k = j
            for a in range(256):
                while k + 1 < n and starts[k + 1] <= first + a:
                    k += 1
                chunks[c * 256 + a] = values[k]
            t24[b] = SPLIT - c
            c += 1
        else:
            t24[b] = values[j]
    return chunks


def huge_page_array(n: int, dtype) -> np.ndarray:
    """A long-lived array of ``n`` items on transparent huge pages where the kernel gives them
    on request (the Debian default ``madvise``): the IPv4 table's random look-ups then miss the
    TLB rarely (its 64 MiB are 32 pages of 2 MiB instead of 16,384 of 4 KiB). numpy's own
    request is switched off in the daemon (collector/daemon/process.py), rightly for arrays
    made and freed per batch."""
    size = n * np.dtype(dtype).itemsize
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return np.frombuffer(mm, dtype, n)


@kernel
def block_index(hi, lo, first, base, shift, out):
    """``out[c]`` (c < len - 1): the last interval at or after ``first`` starting at or
    before ``base + (c << shift)`` (its low word 0); the last entry: the last interval."""
    n = hi.shape[0]
    j = first
    blocks = out.shape[0] - 1
    for c in range(blocks):
        edge = base + (np.uint64(c) << np.uint64(shift))
        while j + 1 < n and (hi[j + 1] < edge or hi[j + 1] == edge and lo[j + 1] == 0):
            j += 1
        out[c] = j
    out[blocks] = n - 1


@kernel_inline
def find4(t24, chunks, a):
    """The value of IPv4 address ``a`` (uint32 as uint64)."""
    r = t24[a >> np.uint64(8)]
    if r <= SPLIT:
        r = chunks[(SPLIT - r) * 256 + (a & np.uint64(255))]
    return r


@kernel_inline
def find6(t6, index, sub_of, sub, h, low):
    b = h >> np.uint64(64 - BLOCK_BITS)
    s = sub_of[b]
    if s >= 0:
        c = (h >> np.uint64(64 - 2 * BLOCK_BITS)) & np.uint64(0xFFFF)
        lo = sub[s, c]
        hi = sub[s, c + np.uint64(1)]
    else:
        lo = index[b]
        hi = index[b + np.uint64(1)]
    while lo < hi:  # the last start <= (h, low) within [lo, hi]
        mid = (lo + hi + 1) >> 1
        if t6[mid, 0] < h or t6[mid, 0] == h and t6[mid, 1] <= low:
            lo = mid
        else:
            hi = mid - 1
    return np.int64(t6[lo, 2])


@kernel_inline
def bswap64(x):
    x = ((x & np.uint64(0x00FF00FF00FF00FF)) << np.uint64(8)) | \
        ((x >> np.uint64(8)) & np.uint64(0x00FF00FF00FF00FF))
    x = ((x & np.uint64(0x0000FFFF0000FFFF)) << np.uint64(16)) | \
        ((x >> np.uint64(16)) & np.uint64(0x0000FFFF0000FFFF))
    return (x << np.uint64(32)) | (x >> np.uint64(32))


@kernel_inline
def record_of(w0, w1, t24, chunks, t6, i6, sub_of, sub):
    """The record id of an address given as the two little-endian words of its 16 bytes."""
    if w0 == 0 and (w1 & np.uint64(0xFFFFFFFF)) == np.uint64(0xFFFF0000):  # ::ffff:a.b.c.d
        return find4(t24, chunks, bswap64(w1) & np.uint64(0xFFFFFFFF))
    h = bswap64(w0)
    low = bswap64(w1)
    r = find6(t6, i6, sub_of, sub, h, low)
    if r <= V4_HERE:  # the IPv4 tree, from bit d on
        d = V4_HERE - r
        if d <= 32:
            a = h >> np.uint64(32 - d)
        elif d < 64:
            a = (h << np.uint64(d - 32)) | (low >> np.uint64(96 - d))
        else:
            a = low >> np.uint64(96 - d) if d <= 96 else np.uint64(0)
        r = find4(t24, chunks, a & np.uint64(0xFFFFFFFF))
    return r


@kernel
def lookup(words, ok, t24, chunks, t6, i6, sub_of, sub, out):
    """Record ids of addresses given as (n, 2) little-endian uint64 words of their 16 bytes
    (IPv4-mapped for IPv4; -1: none, or ``ok`` False)."""
    for i in range(words.shape[0]):
        out[i] = record_of(words[i, 0], words[i, 1], t24, chunks, t6, i6, sub_of,
                           sub) if ok[i] else -1


@kernel
def lookup_values(words, ok, t24, chunks, t6, i6, sub_of, sub, values, out):
    """``values`` (uint32, 0 none) of the records of addresses (as ``lookup``) as int64, -1
    (NULL) for none."""
    n = words.shape[0]
    for i in range(n):
        if i + AHEAD < n:
            prefetch4(words, i + AHEAD, t24)
        r = record_of(words[i, 0], words[i, 1], t24, chunks, t6, i6, sub_of,
                      sub) if ok[i] else -1
        v = np.int64(values[r]) if r >= 0 else 0
        out[i] = v if v != 0 else -1


@kernel_inline
def prefetch4(words, j, t24):
    """Prefetch the IPv4 table's entry of address ``j`` (IPv4 addresses only)."""
    w1 = words[j, 1]
    if words[j, 0] == 0 and (w1 & np.uint64(0xFFFFFFFF)) == np.uint64(0xFFFF0000):
        prefetch(t24, (bswap64(w1) & np.uint64(0xFFFFFFFF)) >> np.uint64(8))


AHEAD = 12  # addresses whose table entry is asked for before it is read


@kernel
def lookup_values_pair(wa, oka, wb, okb, t24, chunks, t6, i6, sub_of, sub, values, out_a,
                       out_b):
    """``lookup_values`` of two address columns at once (a tuple's source and destination):
    each iteration has two independent searches for the processor to overlap, and asks for
    the table entries of the addresses ``AHEAD`` iterations on."""
    n = wa.shape[0]
    for i in range(n):
        if i + AHEAD < n:
            prefetch4(wa, i + AHEAD, t24)
            prefetch4(wb, i + AHEAD, t24)
        ra = record_of(wa[i, 0], wa[i, 1], t24, chunks, t6, i6, sub_of, sub) if oka[i] else -1
        rb = record_of(wb[i, 0], wb[i, 1], t24, chunks, t6, i6, sub_of, sub) if okb[i] else -1
        va = np.int64(values[ra]) if ra >= 0 else 0
        vb = np.int64(values[rb]) if rb >= 0 else 0
        out_a[i] = va if va != 0 else -1
        out_b[i] = vb if vb != 0 else -1


@dataclass
class PrefixIndex:
    """The compiled tables of both families (values: record ids, -1 none)."""

    t24: np.ndarray
    chunks: np.ndarray
    t6: np.ndarray  # (m, 3) uint64: start's high and low words, value (int64 bits)
    i6: np.ndarray
    sub_of: np.ndarray
    sub: np.ndarray
    intervals: int

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.t24, self.chunks, self.t6, self.i6,
                                      self.sub_of, self.sub))

    def lookup(self, addrs: np.ndarray, ok: np.ndarray) -> np.ndarray:
        """Record ids (int32, -1 none) of (n, 16) addresses; ``ok``: which rows have one."""
        out = np.empty(len(addrs), np.int32)
        lookup(_words(addrs), ok, self.t24, self.chunks, self.t6, self.i6, self.sub_of,
               self.sub, out)
        return out

    def values(self, addrs: np.ndarray, ok: np.ndarray, values: np.ndarray) -> np.ndarray:
        """``values[record]`` (int64) of each address, -1 where it has no record: the look-up
        and the gather in one pass."""
        out = np.empty(len(addrs), np.int64)
        lookup_values(_words(addrs), ok, self.t24, self.chunks, self.t6, self.i6,
                      self.sub_of, self.sub, values, out)
        return out


    def values_pair(self, a: np.ndarray, ok_a: np.ndarray, b: np.ndarray, ok_b: np.ndarray,
                    values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``values`` of two address columns of one batch in one pass."""
        out_a, out_b = np.empty(len(a), np.int64), np.empty(len(b), np.int64)
        lookup_values_pair(_words(a), ok_a, _words(b), ok_b, self.t24, self.chunks, self.t6,
                           self.i6, self.sub_of, self.sub, values, out_a, out_b)
        return out_a, out_b


def _words(addrs: np.ndarray) -> np.ndarray:
    """(n, 16) address bytes as (n, 2) little-endian words, without a copy when contiguous."""
    return np.ascontiguousarray(addrs).view("<u8").reshape(-1, 2)


def _merged(hi: np.ndarray, lo: np.ndarray, values: np.ndarray):
    """Neighbouring intervals of one value as one."""
    keep = np.ones(len(values), bool)
    keep[1:] = values[1:] != values[:-1]
    return hi[keep], lo[keep], values[keep]


def build(v4: tuple[np.ndarray, np.ndarray], v6: tuple[np.ndarray, np.ndarray, np.ndarray]
          ) -> PrefixIndex:
    """The tables of IPv4 leaves (starts as 32-bit values, values) and IPv6 ones (hi, lo,
    values), each in address order and covering its whole space."""
    s4, val4 = v4
    _, s4, val4 = _merged(np.zeros(len(s4), np.uint64), s4.astype(np.uint64), val4)
    t24 = huge_page_array(1 << 24, np.int32)
    chunks = dir24(s4.astype(np.int64), val4.astype(np.int32), t24)
    h6, l6, val6 = _merged(*v6)
    h6, l6 = np.ascontiguousarray(h6), np.ascontiguousarray(l6)
    i6 = np.empty((1 << BLOCK_BITS) + 1, np.int64)
    block_index(h6, l6, 0, np.uint64(0), np.uint64(64 - BLOCK_BITS), i6)
    sub_of = np.full(1 << BLOCK_BITS, -1, np.int64)
    dense = np.flatnonzero(np.diff(i6) > DENSE)
    sub = np.empty((len(dense), (1 << BLOCK_BITS) + 1), np.int64)
    for s, b in enumerate(dense):
        sub_of[b] = s
        block_index(h6, l6, int(i6[b]), np.uint64(int(b) << (64 - BLOCK_BITS)),
                    np.uint64(64 - 2 * BLOCK_BITS), sub[s])
        sub[s, -1] = i6[b + 1]  # the block's last interval bounds its last search
    t6 = np.empty((len(h6), 3), np.uint64)  # a start and its value in one cache line or two
    t6[:, 0], t6[:, 1] = h6, l6
    t6[:, 2] = val6.astype(np.int64).view(np.uint64)
    return PrefixIndex(t24, chunks, t6, i6.astype(np.int32), sub_of.astype(np.int32),
                       sub.astype(np.int32), len(s4) + len(h6))
