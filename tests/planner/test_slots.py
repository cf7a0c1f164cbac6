"""Query slots as bits: per-slot counts of a batch's masks against counting bit by bit."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.slots import TALLY_PATTERNS, slot_counts, slot_mask


def _by_bit(Q: np.ndarray) -> list[int]:
    """The count of every slot, one bit at a time (numpy)."""
    return [int(((Q[:, s >> 6] >> np.uint64(s & 63)) & np.uint64(1)).sum())
            for s in range(64 * Q.shape[1])]


@settings(max_examples=60, deadline=None)
@given(words=st.integers(1, 3), rows=st.integers(0, 3000),
       patterns=st.integers(1, 3 * TALLY_PATTERNS), seed=st.integers(0, 2**32 - 1))
def test_counts_equal_counting_bit_by_bit(words, rows, patterns, seed):
    """Few patterns (a batch as the engine sees it) and more patterns than the table holds
    (every entry taken over again and again): the same counts, and the rows with a bit."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 2**64, (patterns, words), dtype=np.uint64, endpoint=False)
    pool &= rng.integers(0, 2**64, (patterns, words), dtype=np.uint64)  # sparser masks
    pool[0] = 0  # the empty mask (a tuple no query kept) is the most common
    Q = pool[rng.integers(0, patterns, rows)]
    counts, any_bit = slot_counts(Q)
    assert counts.tolist() == _by_bit(Q)
    assert any_bit == int(Q.any(axis=1).sum())


def test_counts_of_named_slots():
    """Slots 0, 63, 64 and 130 of three words, each in a known number of rows."""
    Q = np.zeros((10, 3), np.uint64)
    Q[:4] |= slot_mask([0, 63], 3)
    Q[2:9] |= slot_mask([64], 3)
    Q[9] = slot_mask([130], 3)
    counts, any_bit = slot_counts(Q)
    want = np.zeros(192, np.int64)
    want[[0, 63, 64, 130]] = [4, 4, 7, 1]
    assert counts.tolist() == want.tolist()
    assert any_bit == 10
