"""Query slots as bits: bit ``i`` of word ``w`` of a query mask (``Q`` in the engine, ``qmask``
in the spool) is slot ``64·w + i`` (DESIGN, spool batch). The one place that arithmetic lives."""

from __future__ import annotations

from collections.abc import Iterable

import numba as nb
import numpy as np
from numba.cpython.unsafe.numbers import trailing_zeros


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


@nb.njit(cache=True, nogil=True)
def slot_counts(Q):
    """Per slot, the rows of ``Q`` (rows × words) with its bit set: 64 · words counts."""
    out = np.zeros(Q.shape[1] * 64, dtype=np.int64)
    for i in range(Q.shape[0]):
        for w in range(Q.shape[1]):
            x = Q[i, w]
            while x:
                out[w * 64 + trailing_zeros(x)] += 1
                x &= x - np.uint64(1)  # without its lowest set bit
    return out


def clear_slot(Q: np.ndarray, rows: np.ndarray, slot: int) -> None:
    """Clear the slot's bit in the given rows of ``Q``."""
    w, bit = slot_bit(slot)
    Q[rows, w] &= ~bit


@nb.njit(cache=True, nogil=True, inline="always")
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
