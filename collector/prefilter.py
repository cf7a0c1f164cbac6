"""The prefilter (Golab et al.): one numba pass per batch computes, per tuple, the bit vector B
of the plan's bits and the query mask Q: slot i is set iff (B & S_i) == S_i.

The compiled plan is plain arrays, so a rebuild swaps data, not code. More than 64 bits and more
than 64 query slots are held in several 64-bit words.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba as nb
import numpy as np

from capture.fields import IP, fields
from capture.unpack import TupleBatch
from planner.plan import Plan

OPS = {"=": 0, "!=": 1, "<": 2, "<=": 3, ">": 4, ">=": 5, "in": 6, "between": 7, "prefix": 8}
MASK64 = (1 << 64) - 1


@dataclass
class CompiledPrefilter:
    """A plan's prefilter for one stream, as arrays for the kernel."""

    stream: str
    version: int
    int_cols: list[str]
    ip_cols: list[str]
    a_col: np.ndarray  # int32: row in the int or ip matrix
    a_op: np.ndarray  # int32
    a_neg: np.ndarray  # bool
    a_v: np.ndarray  # int64 (n_atoms, 2): constant(s); for IN: start and length in set_vals
    a_ip: np.ndarray  # uint64 (n_atoms, 4): value hi, lo, mask hi, lo
    set_vals: np.ndarray  # int64, sorted per IN atom
    p_start: np.ndarray  # int32 per local predicate: first atom
    p_len: np.ndarray
    b_start: np.ndarray  # int32 per bit: first entry in b_preds
    b_len: np.ndarray
    b_preds: np.ndarray  # int32 local predicate indices
    sig: np.ndarray  # uint64 (n_slots, words of B)
    active: np.ndarray  # bool per slot: a query of this stream holds it
    pred_ids: list[int]  # plan predicate id of each local predicate
    n_slots: int

    @property
    def q_words(self) -> int:
        return max(1, (self.n_slots + 63) // 64)


def compile_prefilter(plan: Plan, stream: str) -> CompiledPrefilter:
    """Turn a plan's bits and signatures for ``stream`` into kernel arrays."""
    cat = fields(stream)
    bit_ids = [i for i, b in enumerate(plan.bits)
               if plan.predicates[b[0]].predicate.stream == stream]
    local_bit = {b: k for k, b in enumerate(bit_ids)}
    pred_ids = sorted({p for b in bit_ids for p in plan.bits[b]})
    local_pred = {p: k for k, p in enumerate(pred_ids)}
    int_cols: list[str] = []
    ip_cols: list[str] = []
    a_col, a_op, a_neg, a_v, a_ip, set_vals, p_start, p_len = [], [], [], [], [], [], [], []
    for pid in pred_ids:
        atoms = plan.predicates[pid].predicate.atoms
        p_start.append(len(a_col))
        p_len.append(len(atoms))
        for a in atoms:
            kind = cat[a.field].kind
            cols = ip_cols if kind == IP else int_cols
            if a.field not in cols:
                cols.append(a.field)
            a_col.append(cols.index(a.field))
            a_op.append(OPS[a.op])
            a_neg.append(a.negated)
            if a.op == "prefix":
                value, length = a.values
                mask = (MASK64 << 64 | MASK64) ^ ((1 << (128 - length)) - 1)
                a_ip.append((value >> 64, value & MASK64, mask >> 64, mask & MASK64))
                a_v.append((0, 0))
            elif a.op == "in":
                a_v.append((len(set_vals), len(a.values)))
                set_vals.extend(a.values)
                a_ip.append((0, 0, 0, 0))
            else:
                a_v.append((a.values[0], a.values[1] if len(a.values) > 1 else 0))
                a_ip.append((0, 0, 0, 0))
    b_start, b_len, b_preds = [], [], []
    for b in bit_ids:
        b_start.append(len(b_preds))
        b_len.append(len(plan.bits[b]))
        b_preds.extend(local_pred[p] for p in plan.bits[b])
    n_slots = max([qp.slot for qp in plan.queries] + [-1]) + 1
    b_words = max(1, (len(bit_ids) + 63) // 64)
    sig = np.zeros((n_slots, b_words), dtype=np.uint64)
    active = np.zeros(n_slots, dtype=np.bool_)
    for qp in plan.queries:
        if qp.query.stream != stream:
            continue
        active[qp.slot] = True
        for b in qp.signature:
            k = local_bit[b]
            sig[qp.slot, k >> 6] |= np.uint64(1 << (k & 63))
    return CompiledPrefilter(
        stream, plan.version, int_cols, ip_cols,
        np.array(a_col, np.int32), np.array(a_op, np.int32), np.array(a_neg, np.bool_),
        np.array(a_v, np.int64).reshape(-1, 2), np.array(a_ip, np.uint64).reshape(-1, 4),
        np.array(set_vals, np.int64), np.array(p_start, np.int32), np.array(p_len, np.int32),
        np.array(b_start, np.int32), np.array(b_len, np.int32), np.array(b_preds, np.int32),
        sig, active, pred_ids, n_slots)


@nb.njit(cache=True, inline="always")
def _atom(i, a, ints, ip_hi, ip_lo, ip_ok, a_col, a_op, a_neg, a_v, a_ip, set_vals):
    op = a_op[a]
    c = a_col[a]
    if op == 8:  # address prefix
        if not ip_ok[i]:
            return False
        hit = (ip_hi[c, i] & a_ip[a, 2]) == a_ip[a, 0] and (ip_lo[c, i] & a_ip[a, 3]) == a_ip[a, 1]
        return hit != a_neg[a]
    x = ints[c, i]
    if x < 0:  # NULL: every comparison is false, negated or not
        return False
    if op == 0:
        return x == a_v[a, 0]
    if op == 1:
        return x != a_v[a, 0]
    if op == 2:
        return x < a_v[a, 0]
    if op == 3:
        return x <= a_v[a, 0]
    if op == 4:
        return x > a_v[a, 0]
    if op == 5:
        return x >= a_v[a, 0]
    if op == 7:
        return (a_v[a, 0] <= x <= a_v[a, 1]) != a_neg[a]
    # IN: binary search in the sorted constants
    lo = a_v[a, 0]
    hi = lo + a_v[a, 1]
    while lo < hi:
        mid = (lo + hi) // 2
        if set_vals[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    found = lo < a_v[a, 0] + a_v[a, 1] and set_vals[lo] == x
    return found != a_neg[a]


@nb.njit(cache=True, nogil=True)
def prefilter_kernel(ints, ip_hi, ip_lo, ip_ok, a_col, a_op, a_neg, a_v, a_ip, set_vals,
                     p_start, p_len, b_start, b_len, b_preds, sig, active, B, Q):
    """Fill B (n, bit words) and Q (n, slot words); return the number of tuples with Q != 0."""
    n = B.shape[0]
    n_bits = b_start.shape[0]
    n_pred = p_start.shape[0]
    pred_val = np.zeros(n_pred, dtype=np.int8)  # per-tuple cache: 0 unknown, 1 true, 2 false
    kept = 0
    for i in range(n):
        pred_val[:] = 0
        for b in range(n_bits):
            ok = True
            for k in range(b_start[b], b_start[b] + b_len[b]):
                p = b_preds[k]
                if pred_val[p] == 0:
                    v = False
                    for a in range(p_start[p], p_start[p] + p_len[p]):
                        if _atom(i, a, ints, ip_hi, ip_lo, ip_ok, a_col, a_op, a_neg, a_v,
                                 a_ip, set_vals):
                            v = True
                            break
                    pred_val[p] = 1 if v else 2
                if pred_val[p] == 2:
                    ok = False
                    break
            if ok:
                B[i, b >> 6] |= np.uint64(1) << np.uint64(b & 63)
        any_q = False
        for s in range(sig.shape[0]):
            if not active[s]:
                continue
            hit = True
            for w in range(sig.shape[1]):
                if (B[i, w] & sig[s, w]) != sig[s, w]:
                    hit = False
                    break
            if hit:
                Q[i, s >> 6] |= np.uint64(1) << np.uint64(s & 63)
                any_q = True
        if any_q:
            kept += 1
    return kept


def ip_words(col: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n, 16) address bytes as big-endian (hi, lo) uint64 words."""
    w = np.ascontiguousarray(col).view(">u8").reshape(-1, 2).astype(np.uint64)
    return w[:, 0], w[:, 1]


def run_prefilter(cp: CompiledPrefilter, tb: TupleBatch) -> tuple[np.ndarray, np.ndarray]:
    """B and Q for every tuple of a batch."""
    n = len(tb)
    ints = np.empty((len(cp.int_cols), n), dtype=np.int64)
    for k, name in enumerate(cp.int_cols):
        ints[k] = tb.column(name)
    ip_hi = np.empty((len(cp.ip_cols), n), dtype=np.uint64)
    ip_lo = np.empty((len(cp.ip_cols), n), dtype=np.uint64)
    for k, name in enumerate(cp.ip_cols):
        ip_hi[k], ip_lo[k] = ip_words(tb.column(name))
    ip_ok = tb.ip_valid()
    B = np.zeros((n, max(1, (len(cp.b_start) + 63) // 64)), dtype=np.uint64)
    Q = np.zeros((n, cp.q_words), dtype=np.uint64)
    prefilter_kernel(ints, ip_hi, ip_lo, ip_ok, cp.a_col, cp.a_op, cp.a_neg, cp.a_v, cp.a_ip,
                     cp.set_vals, cp.p_start, cp.p_len, cp.b_start, cp.b_len, cp.b_preds,
                     cp.sig, cp.active, B, Q)
    return B, Q
