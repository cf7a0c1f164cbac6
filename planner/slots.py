"""Query slots as bits: bit ``i`` of word ``w`` of a query mask (``Q`` in the engine, ``qmask``
in the spool) is slot ``64·w + i`` (DESIGN, spool batch). The one place that arithmetic lives."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from numba.cpython.unsafe.numbers import trailing_zeros

from capture.jit import allocating, allocating_inline, kernel, kernel_inline


def n_words(n: int) -> int:
    """64-bit words that hold ``n`` bits (at least one)."""
    return max(1, (n + 63) // 64)


def slot_bit(slot: int) -> tuple[int, np.uint64]:
    """(word, bit) of a slot."""
    return slot >> 6, np.uint64(1) << np.uint64(slot & 63)


def slot_mask(slots: Iterable[int], words: int) -> np.ndarray:
    """A mask of ``words`` uint64 words with the slots' bits set."""
    m = np.zeros(words, dtype=np.uint64)
    for s in slots:
        w, bit = slot_bit(s)
        m[w] |= bit
    return m


def has_slot(Q: np.ndarray, slot: int) -> np.ndarray:
    """Per row of ``Q`` (rows × words), whether the slot's bit is set."""
    w, bit = slot_bit(slot)
    return (Q[:, w] & bit) != 0


TALLY_BITS = 12  # slot_counts' table holds 2^12 query-bit patterns (a batch, hundreds)
TALLY_PATTERNS = 1 << TALLY_BITS


@allocating
def slot_counts(Q):
    """Per slot, the rows of ``Q`` (rows × words) with its bit set (64 · words counts), and
    the rows with any bit set. A batch holds a few hundred distinct patterns (the backbone
    bench's 50 queries: 550-650 in 65,536 rows), so rows are counted per pattern in a small
    table and each pattern's bits are added once when it leaves the table: a bit loop per
    row took 3.5x as long (its exit mispredicts)."""
    out = np.zeros(Q.shape[1] * 64, dtype=np.int64)
    any_bit = _slot_counts(Q, out, np.zeros((TALLY_PATTERNS, Q.shape[1]), dtype=np.uint64),
                           np.zeros(TALLY_PATTERNS, dtype=np.int64))
    return out, any_bit


@kernel_inline
def _add_pattern(keys, cnts, s, out):
    for w in range(keys.shape[1]):
        x = keys[s, w]
        while x:
            out[w * 64 + trailing_zeros(x)] += cnts[s]
            x &= x - np.uint64(1)  # without its lowest set bit


@kernel
def _slot_counts(Q, out, keys, cnts):
    shift = np.uint64(64 - TALLY_BITS)
    any_bit = 0
    for i in range(Q.shape[0]):
        h = np.uint64(0)
        nonzero = False
        for w in range(Q.shape[1]):
            x = Q[i, w]
            h = (h ^ x) * np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: the top bits
            nonzero |= x != 0
        any_bit += nonzero
        s = np.int64(h >> shift)
        same = True
        for w in range(Q.shape[1]):
            same &= keys[s, w] == Q[i, w]
        if not same:  # another pattern held the entry (or none: its count is 0)
            _add_pattern(keys, cnts, s, out)
            for w in range(Q.shape[1]):
                keys[s, w] = Q[i, w]
            cnts[s] = 0
        cnts[s] += 1
    for s in range(cnts.shape[0]):
        _add_pattern(keys, cnts, s, out)
    return any_bit  # without numba's runtime: an array is never returned (its count)


def clear_slot(Q: np.ndarray, rows: np.ndarray, slot: int) -> None:
    """Clear the slot's bit in the given rows of ``Q``."""
    w, bit = slot_bit(slot)
    Q[rows, w] &= ~bit


@allocating_inline
def set_bit_rows(M, k, rows):
    """In numba kernels: set bit ``k`` (of word ``k >> 6``) in every row ``i`` of ``M`` where
    ``rows[i]`` holds (branch-free: the bit times the row's truth)."""
    w = k >> 6
    bit = np.uint64(1) << np.uint64(k & 63)
    for i in range(rows.shape[0]):
        M[i, w] |= bit * np.uint64(rows[i])


def slots_of(mask: np.ndarray) -> list[int]:
    """The slots whose bits are set in a mask of words."""
    return [64 * w + b for w, word in enumerate(mask.tolist()) for b in range(64)
            if word >> b & 1]
