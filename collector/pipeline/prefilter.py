"""The prefilter (Golab et al.): one numba pass per batch computes, per tuple, the bit vector B
of the plan's bits and the query mask Q: slot i is set iff (B & S_i) == S_i.

The compiled plan is plain arrays, so a rebuild swaps data, not code. More than 64 bits and more
than 64 query slots are held in several 64-bit words.
"""

from __future__ import annotations

import numpy as np

from capture.batch import Batch, ip_words
from capture.jit import allocating, allocating_inline
from collector.pipeline.asc_runtime import AscRuntime
from collector.pipeline.compiled_prefilter import CompiledPrefilter
from planner.slots import n_words, set_bit_rows


@allocating_inline
def in_sorted(set_vals, start, count, x) -> bool:
    """x among set_vals[start:start + count] (sorted), by binary search."""
    lo = start
    hi = start + count
    while lo < hi:
        mid = (lo + hi) // 2
        if set_vals[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo < start + count and set_vals[lo] == x


# rows of a batch the prefilter kernel evaluates at a time: a chunk's predicate, bit and mask
# rows stay in the core's cache between the passes over them (a whole batch of 65,536 rows
# streamed the 50-query set's 47 rows of predicates and bits from memory on every pass)
CHUNK = 8192


@allocating
def _eval_atom_column(out, m, lo, a, ints, ip_hi, ip_lo, ip_ok, a_col, a_op, a_neg, a_v, a_ip,
                      set_vals, tmp):
    """out[i] |= atom a on tuple lo + i, for i < m: the operator is chosen once and the loop
    over tuples is branch-free (NULL is false, negated or not), over a contiguous slice of
    the column (so that it vectorizes); an IN of few constants is one pass per constant
    (``tmp``: scratch of m entries)."""
    op = a_op[a]
    c = a_col[a]
    neg = a_neg[a]
    if op == 8:
        vh, vl, mh, ml = a_ip[a, 0], a_ip[a, 1], a_ip[a, 2], a_ip[a, 3]
        hi_ = ip_hi[c, lo:lo + m]
        lo_ = ip_lo[c, lo:lo + m]
        ok_ = ip_ok[c, lo:lo + m]
        for i in range(m):
            hit = ((hi_[i] & mh) == vh) & ((lo_[i] & ml) == vl)
            out[i] |= (hit ^ neg) & ok_[i]
        return
    x_ = ints[c, lo:lo + m]
    v0 = a_v[a, 0]
    v1 = a_v[a, 1]
    if op == 0:
        for i in range(m):
            out[i] |= x_[i] == v0
    elif op == 1:
        for i in range(m):
            out[i] |= (x_[i] != v0) & (x_[i] >= 0)
    elif op == 2:
        for i in range(m):
            out[i] |= (x_[i] < v0) & (x_[i] >= 0)
    elif op == 3:
        for i in range(m):
            out[i] |= (x_[i] <= v0) & (x_[i] >= 0)
    elif op == 4:
        for i in range(m):
            out[i] |= x_[i] > v0
    elif op == 5:
        for i in range(m):
            out[i] |= x_[i] >= v0
    elif op == 7:
        for i in range(m):
            x = x_[i]
            out[i] |= (((x >= v0) & (x <= v1)) ^ neg) & (x >= 0)
    elif op == 9:  # bit test: (x & v0) == v1
        for i in range(m):
            x = x_[i]
            out[i] |= (((x & v0) == v1) ^ neg) & (x >= 0)
    else:  # IN: v0 = first constant, v1 = count
        hit = tmp[:m]
        if v1 <= 16:
            for i in range(m):
                hit[i] = False
            for k in range(v0, v0 + v1):
                v = set_vals[k]
                for i in range(m):
                    hit[i] |= x_[i] == v
        else:
            for i in range(m):
                hit[i] = in_sorted(set_vals, v0, v1, x_[i])
        for i in range(m):
            out[i] |= (hit[i] ^ neg) & (x_[i] >= 0)


@allocating
def prefilter_kernel(ints, ip_hi, ip_lo, ip_ok, a_col, a_op, a_neg, a_v, a_ip, set_vals,
                     p_start, p_len, b_start, b_len, b_preds, g_start, g_len, g_bits, g_mask,
                     B, Q):
    """Fill Q (n, slot words) and, when B has n rows, B (n, bit words); return the number of
    tuples with Q != 0.

    Column at a time, a chunk of rows (``CHUNK``) at a time: each predicate once over the
    chunk (an OR of its atoms), each composite bit the AND of its predicates (a one-predicate
    bit is its predicate's column), and the slots of signature g (``g_mask[g]``) where the
    bits of g are all set, i.e. (B & S_s) == S_s for each such slot s. The queries sharing a
    signature (most often one bit, or none) are set in one pass. Branch-free inner loops: a
    row-at-a-time loop with early exits spent ~13x more per tuple on the 50-query set
    (bench/bench_planner.py); packing B costs as much again, so it is optional. Copies and
    fills are loops too: numba's slice assignment took as long as the rest of the kernel.
    The backbone bench's 50 queries, per batch of 65,536: 1.55 ms before chunks, slices
    and shared signatures, 0.5 ms after."""
    n = Q.shape[0]
    words = Q.shape[1]
    size = max(min(CHUNK, n), 1)
    n_pred = p_start.shape[0]
    n_bits = b_start.shape[0]
    n_comp = 0
    for b in range(n_bits):
        n_comp += b_len[b] > 1
    M = np.empty((n_pred + n_comp, size), dtype=np.bool_)
    tmp = np.empty(size, dtype=np.bool_)
    word = np.empty(size, dtype=np.uint64)
    any_q = np.empty(size, dtype=np.bool_)
    bit_row = np.empty(n_bits, dtype=np.int64)
    kept = 0
    for lo in range(0, n, size):
        m = min(size, n - lo)
        for p in range(n_pred):
            row = M[p]
            for i in range(m):
                row[i] = False
            for a in range(p_start[p], p_start[p] + p_len[p]):
                _eval_atom_column(row, m, lo, a, ints, ip_hi, ip_lo, ip_ok, a_col, a_op,
                                  a_neg, a_v, a_ip, set_vals, tmp)
        c = n_pred
        for b in range(n_bits):
            if b_len[b] == 1:
                bit_row[b] = b_preds[b_start[b]]
                continue
            row = M[c]
            first = M[b_preds[b_start[b]]]
            for i in range(m):
                row[i] = first[i]
            for k in range(b_start[b] + 1, b_start[b] + b_len[b]):
                other = M[b_preds[k]]
                for i in range(m):
                    row[i] &= other[i]
            bit_row[b] = c
            c += 1
        if B.shape[0] == n:
            for b in range(n_bits):
                set_bit_rows(B[lo:lo + m], b, M[bit_row[b], :m])
        out = word[:m]
        seen = any_q[:m]
        for i in range(m):
            seen[i] = False
        for w in range(words):
            for i in range(m):
                out[i] = 0
            for g in range(g_start.shape[0]):
                mask = g_mask[g, w]
                if mask == 0:
                    continue
                if g_len[g] == 0:  # no bit: every tuple
                    for i in range(m):
                        out[i] |= mask
                    continue
                acc = M[bit_row[g_bits[g_start[g]]]]
                if g_len[g] > 1:  # the AND of its bits
                    for i in range(m):
                        tmp[i] = acc[i]
                    for k in range(g_start[g] + 1, g_start[g] + g_len[g]):
                        row = M[bit_row[g_bits[k]]]
                        for i in range(m):
                            tmp[i] &= row[i]
                    acc = tmp
                for i in range(m):
                    out[i] |= mask * np.uint64(acc[i])
            for i in range(m):
                Q[lo + i, w] = out[i]
                seen[i] |= out[i] != 0
        for i in range(m):
            kept += seen[i]
    return kept


def kernel_inputs(cp: CompiledPrefilter, tb: Batch
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The columns the kernels read: (ints, ip_hi, ip_lo, ip_ok) for the plan's fields; ``ip_ok[k]``
    says which tuples carry address field ``k`` (a flow record may lack its next hop)."""
    n = len(tb)
    ints = np.empty((len(cp.int_cols), n), dtype=np.int64)
    for k, name in enumerate(cp.int_cols):
        ints[k] = tb.column(name)
    ip_hi = np.empty((len(cp.ip_cols), n), dtype=np.uint64)
    ip_lo = np.empty((len(cp.ip_cols), n), dtype=np.uint64)
    ip_ok = np.empty((len(cp.ip_cols), n), dtype=np.bool_)  # each address field its own
    for k, name in enumerate(cp.ip_cols):
        ip_hi[k], ip_lo[k] = ip_words(tb.column(name))
        ip_ok[k] = tb.ip_valid(name)
    return ints, ip_hi, ip_lo, ip_ok


def run_prefilter(cp: CompiledPrefilter, tb: Batch, asc: AscRuntime | None = None,
                  want_b: bool = False) -> tuple[np.ndarray | None, np.ndarray]:
    """Q for every tuple of a batch (and B with ``want_b``): bits and signatures, then the
    ASCs (in the runtime's adaptive sequence, or in plan order)."""
    n = len(tb)
    ints, ip_hi, ip_lo, ip_ok = kernel_inputs(cp, tb)
    B = np.zeros((n if want_b else 0, n_words(len(cp.b_start))), dtype=np.uint64)
    Q = np.zeros((n, cp.q_words), dtype=np.uint64)
    prefilter_kernel(ints, ip_hi, ip_lo, ip_ok, *cp.kernel_arrays(), B, Q)
    if cp.ascs:
        if asc is None:
            asc = AscRuntime(cp, strategy="fixed")
        asc.run(ints, ip_hi, ip_lo, ip_ok, Q)
    return (B if want_b else None), Q
