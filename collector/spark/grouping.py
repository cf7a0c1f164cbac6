"""Hash grouping of Arrow rows in numba, for the answer tasks' merges of partial rows to a
query's keys (``collector/spark/answers.merge_to_keys``, run by Spark's Python workers): each
row's group by its key columns, and each group's sum, minimum and maximum of a column (Arrow's
``group_by`` took several times as long on the telemetry benchmark's 1.5M partial rows).

A key column becomes int64 words that are equal exactly when the values are (NULL its own
value): integers and times as they are, fixed-width binaries (addresses) as their bytes,
other strings and binaries by a dictionary of their values; a column with NULLs adds a word
of validity. The hash table is the LFTA's (``collector/pipeline/lfta.py``).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from capture.jit import allocating
from collector.keys import binary_buffers
from collector.pipeline.lfta_kernels import RUN, hash_key, prefetch_row


def _words_of(a: pa.Array | np.ndarray) -> list[np.ndarray]:
    """One key column as int64 word columns (see the module's docstring); a numpy column is
    one word as it is."""
    if isinstance(a, np.ndarray):
        return [a.astype(np.int64, copy=False)]
    if isinstance(a, pa.ChunkedArray):
        a = a.combine_chunks()
    t = a.type
    valid = None if not a.null_count else a.is_valid().to_numpy(zero_copy_only=False)
    out = None
    if pa.types.is_integer(t) or pa.types.is_timestamp(t) or pa.types.is_boolean(t):
        out = [pc.fill_null(a.cast(pa.int64()), 0).to_numpy(zero_copy_only=False)]
    elif pa.types.is_binary(t) and len(a):
        off, data = binary_buffers(a)
        width = int(off[1] - off[0])
        if width and width % 8 == 0 and (np.diff(off) == width).all():
            w = data[off[0]:off[-1]].view("<i8").reshape(len(a), width // 8)
            # a NULL's bytes are whatever was written: all count as 0
            out = [w[:, k] if valid is None else np.where(valid, w[:, k], 0)
                   for k in range(width // 8)]
    out = out or [_codes(a)]
    return out if valid is None else [*out, valid.astype(np.int64)]


def _codes(a: pa.Array) -> np.ndarray:
    """A value's index in the column's dictionary of values (NULL: -1)."""
    idx = pc.dictionary_encode(a).indices
    return pc.fill_null(idx.cast(pa.int64()), -1).to_numpy(zero_copy_only=False)


def key_words(columns: list[pa.Array | np.ndarray], n: int) -> np.ndarray:
    """The key columns of ``n`` rows as (n, words) int64 (at least one word)."""
    cols = [c for a in columns for c in _words_of(a)]
    if not cols:
        return np.zeros((n, 1), np.int64)
    return np.ascontiguousarray(np.stack(cols, axis=1))


@allocating
def group_ids(words):
    """Each row's group (numbered in order of first appearance) and each group's first row.
    The table holds group numbers only (4 bytes a slot, so that it stays in the cache): a
    probe compares the row's words with its group's first row's."""
    n = words.shape[0]
    k = words.shape[1]
    size = 16
    while size < 2 * n:
        size *= 2
    mask = np.uint64(size - 1)
    table = np.full(size, -1, np.int32)
    gid = np.empty(n, np.int64)
    first = np.empty(n, np.int64)
    g = 0
    home = np.empty(RUN, np.int64)
    for i0 in range(0, n, RUN):
        run = min(RUN, n - i0)
        for r in range(run):  # the home slots of a run first, their cache misses overlapping
            home[r] = np.int64(hash_key(words, i0 + r, k) & mask)
            prefetch_row(table, home[r])
        for r in range(run):
            i = i0 + r
            slot = home[r]
            while True:
                t = table[slot]
                if t < 0:
                    table[slot] = g
                    first[g] = i
                    gid[i] = g
                    g += 1
                    break
                f = first[t]
                same = True
                for c in range(k):
                    if words[f, c] != words[i, c]:
                        same = False
                        break
                if same:
                    gid[i] = t
                    break
                slot = np.int64((np.uint64(slot) + np.uint64(1)) & mask)
    return gid, first[:g].copy()


@allocating
def group_reduce(gid, groups, values, valid, op):
    """Per group, the sum (``op`` 0), minimum (1) or maximum (2) of its rows' valid values,
    and whether it has any."""
    out = np.zeros(groups, np.int64)
    has = np.zeros(groups, np.bool_)
    for i in range(gid.shape[0]):
        if not valid[i]:
            continue
        g = gid[i]
        v = values[i]
        if not has[g]:
            out[g] = v
            has[g] = True
        elif op == 0:
            out[g] += v
        elif op == 1:
            out[g] = min(out[g], v)
        else:
            out[g] = max(out[g], v)
    return out, has


def reduce_column(col: pa.Array, gid: np.ndarray, groups: int, op: str) -> pa.Array:
    """A column's ``sum``, ``min`` or ``max`` per group, as Arrow's hash aggregates give it
    (NULLs skipped; a group of NULLs only is NULL); int64 columns."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    valid = np.ones(len(col), np.bool_) if not col.null_count else \
        col.is_valid().to_numpy(zero_copy_only=False)
    v = pc.fill_null(col, 0).to_numpy(zero_copy_only=False)
    out, has = group_reduce(gid, groups, v, valid, {"sum": 0, "min": 1, "max": 2}[op])
    return pa.array(out, pa.int64(), mask=None if has.all() else ~has)


def list_column(col: pa.Array, gid: np.ndarray, groups: int) -> pa.Array:
    """Each group's values of a column, in row order (Arrow's ``list`` aggregate)."""
    order = np.argsort(gid, kind="stable")
    offsets = np.zeros(groups + 1, np.int32)
    np.cumsum(np.bincount(gid, minlength=groups), out=offsets[1:])
    values = col.take(pa.array(order))
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    return pa.ListArray.from_arrays(pa.array(offsets), values)
