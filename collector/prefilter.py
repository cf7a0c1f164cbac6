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
from planner.asc import ASC, hybrid_arrows, macro_sequence, qrb_words, qub_words
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
    active: np.ndarray  # uint64 (slot words): the slots of this stream's queries
    b_users: np.ndarray  # uint64 (n_bits, slot words): slots whose signature holds the bit
    b_order: np.ndarray  # int32: bits by decreasing number of users
    pred_ids: list[int]  # plan predicate id of each local predicate
    n_slots: int
    ascs: list[ASC]
    asc_is_ip: np.ndarray  # bool per ASC
    asc_col: np.ndarray  # int32: row in the int or ip matrix
    asc_cstart: np.ndarray  # int32: first constant in c_int / c_hi, c_lo
    asc_clen: np.ndarray  # int32
    c_int: np.ndarray  # int64 constants of integer ASCs
    c_hi: np.ndarray  # uint64 high and low words of address constants
    c_lo: np.ndarray
    asc_qrb: np.ndarray  # uint64 (n_asc, max regions, q words)
    asc_qub: np.ndarray  # uint64 (n_asc, q words): the queries each ASC decides

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
    ascs = plan.stream_ascs(stream)
    asc_is_ip, asc_col, asc_cstart, asc_clen, c_int, c_hi, c_lo = [], [], [], [], [], [], []
    for a in ascs:
        is_ip = a.kind == "ip"
        cols = ip_cols if is_ip else int_cols
        if a.attribute not in cols:
            cols.append(a.attribute)
        asc_is_ip.append(is_ip)
        asc_col.append(cols.index(a.attribute))
        asc_cstart.append(len(c_int))
        asc_clen.append(len(a.constants))
        for c in a.constants:
            c_int.append(0 if is_ip else c)
            c_hi.append(c >> 64 if is_ip else 0)
            c_lo.append(c & MASK64 if is_ip else 0)
    n_slots = max([qp.slot for qp in plan.queries] + [-1]) + 1
    b_words = max(1, (len(bit_ids) + 63) // 64)
    q_words = max(1, (n_slots + 63) // 64)
    sig = np.zeros((n_slots, b_words), dtype=np.uint64)
    active = np.zeros(q_words, dtype=np.uint64)
    b_users = np.zeros((len(bit_ids), q_words), dtype=np.uint64)
    for qp in plan.queries:
        if qp.query.stream != stream:
            continue
        slot_bit = np.uint64(1) << np.uint64(qp.slot & 63)
        active[qp.slot >> 6] |= slot_bit
        for b in qp.signature:
            k = local_bit[b]
            sig[qp.slot, k >> 6] |= np.uint64(1 << (k & 63))
            b_users[k, qp.slot >> 6] |= slot_bit
    users = [int(np.bitwise_count(b_users[k]).sum()) for k in range(len(bit_ids))]
    b_order = np.array(sorted(range(len(bit_ids)), key=lambda k: (-users[k], k)), np.int32)
    return CompiledPrefilter(
        stream, plan.version, int_cols, ip_cols,
        np.array(a_col, np.int32), np.array(a_op, np.int32), np.array(a_neg, np.bool_),
        np.array(a_v, np.int64).reshape(-1, 2), np.array(a_ip, np.uint64).reshape(-1, 4),
        np.array(set_vals, np.int64), np.array(p_start, np.int32), np.array(p_len, np.int32),
        np.array(b_start, np.int32), np.array(b_len, np.int32), np.array(b_preds, np.int32),
        sig, active, b_users, b_order, pred_ids, n_slots, ascs, np.array(asc_is_ip, np.bool_),
        np.array(asc_col, np.int32), np.array(asc_cstart, np.int32),
        np.array(asc_clen, np.int32), np.array(c_int, np.int64), np.array(c_hi, np.uint64),
        np.array(c_lo, np.uint64), qrb_words(ascs, max(1, (n_slots + 63) // 64)),
        qub_words(ascs, max(1, (n_slots + 63) // 64)))


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
                     p_start, p_len, b_start, b_len, b_preds, b_order, b_users, active, B, Q):
    """Fill B (n, bit words) and Q (n, slot words); return the number of tuples with Q != 0.

    Q starts as every active slot; bits are evaluated in ``b_order`` (most-shared first) and a
    failed bit clears the slots whose signature holds it (``b_users``). A bit none of whose
    slots is still set is skipped (its B bit stays 0): once the shared bits fail, the
    query-specific ones cost nothing. At the end Q[i] = {s : (B & S_s) == S_s}."""
    n = B.shape[0]
    words = Q.shape[1]
    n_pred = p_start.shape[0]
    pred_val = np.zeros(n_pred, dtype=np.int8)  # per-tuple cache: 0 unknown, 1 true, 2 false
    kept = 0
    for i in range(n):
        pred_val[:] = 0
        alive = False
        for w in range(words):
            Q[i, w] = active[w]
            if active[w] != 0:
                alive = True
        for k in range(b_order.shape[0]):
            if not alive:
                break
            b = b_order[k]
            needed = False
            for w in range(words):
                if Q[i, w] & b_users[b, w]:
                    needed = True
                    break
            if not needed:
                continue
            ok = True
            for j in range(b_start[b], b_start[b] + b_len[b]):
                p = b_preds[j]
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
            else:
                alive = False
                for w in range(words):
                    Q[i, w] &= ~b_users[b, w]
                    if Q[i, w] != 0:
                        alive = True
        if alive:
            kept += 1
    return kept


@nb.njit(cache=True, inline="always")
def _asc_region(i, a, ints, ip_hi, ip_lo, ip_ok, asc_is_ip, asc_col, asc_cstart, asc_clen,
                c_int, c_hi, c_lo):
    """Region of tuple i in ASC a: 2k + 1 for constant k, 2k for the gap below it, 2m + 1 NULL."""
    m = asc_clen[a]
    st = asc_cstart[a]
    col = asc_col[a]
    lo = 0
    hi = m
    if asc_is_ip[a]:
        if not ip_ok[i]:
            return 2 * m + 1
        h = ip_hi[col, i]
        low = ip_lo[col, i]
        while lo < hi:
            mid = (lo + hi) // 2
            if c_hi[st + mid] < h or (c_hi[st + mid] == h and c_lo[st + mid] < low):
                lo = mid + 1
            else:
                hi = mid
        if lo < m and c_hi[st + lo] == h and c_lo[st + lo] == low:
            return 2 * lo + 1
        return 2 * lo
    x = ints[col, i]
    if x < 0:
        return 2 * m + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if c_int[st + mid] < x:
            lo = mid + 1
        else:
            hi = mid
    if lo < m and c_int[st + lo] == x:
        return 2 * lo + 1
    return 2 * lo


@nb.njit(cache=True, nogil=True)
def asc_kernel(Q, ints, ip_hi, ip_lo, ip_ok, asc_is_ip, asc_col, asc_cstart, asc_clen, c_int,
               c_hi, c_lo, qrb, qub, macro, arrows):
    """AND each tuple's query mask with one region's qrb per ASC, in the (macro or hybrid)
    sequence, dropping the tuple as soon as the mask is 0, and stopping as soon as no ASC left
    constrains a query still set (the rest could not change the mask). Returns ASCs evaluated."""
    n_asc = macro.shape[0]
    words = Q.shape[1]
    done = np.zeros(n_asc, dtype=np.bool_)
    evals = 0
    for i in range(Q.shape[0]):
        alive = False
        for w in range(words):
            if Q[i, w] != 0:
                alive = True
        if not alive:
            continue
        done[:] = False
        cur = macro[0]
        while cur >= 0:
            open_q = False  # does an unevaluated ASC decide a query still set?
            for a in range(n_asc):
                if not done[a]:
                    for w in range(words):
                        if Q[i, w] & qub[a, w]:
                            open_q = True
                            break
                if open_q:
                    break
            if not open_q:
                break
            r = _asc_region(i, cur, ints, ip_hi, ip_lo, ip_ok, asc_is_ip, asc_col, asc_cstart,
                            asc_clen, c_int, c_hi, c_lo)
            alive = False
            for w in range(words):
                Q[i, w] &= qrb[cur, r, w]
                if Q[i, w] != 0:
                    alive = True
            done[cur] = True
            evals += 1
            if not alive:
                break
            nxt = arrows[cur, r]
            if nxt < 0 or done[nxt]:
                nxt = -1
                for k in range(n_asc):
                    if not done[macro[k]]:
                        nxt = macro[k]
                        break
            cur = nxt
    return evals


@nb.njit(cache=True, nogil=True)
def asc_regions(rows, ints, ip_hi, ip_lo, ip_ok, asc_is_ip, asc_col, asc_cstart, asc_clen,
                c_int, c_hi, c_lo):
    """Region of each listed tuple in every ASC (the sample the sequences are chosen on)."""
    n_asc = asc_col.shape[0]
    out = np.empty((rows.shape[0], n_asc), dtype=np.int64)
    for k in range(rows.shape[0]):
        for a in range(n_asc):
            out[k, a] = _asc_region(rows[k], a, ints, ip_hi, ip_lo, ip_ok, asc_is_ip, asc_col,
                                    asc_cstart, asc_clen, c_int, c_hi, c_lo)
    return out


class AscRuntime:
    """The ASC evaluation sequence of one compiled prefilter, chosen on sampled traffic and
    re-chosen whenever the dropping ratio of the last period of ``period`` tuples moved by
    ``mu`` relative to its value when the sequence was chosen (Lee & Lee, eq. 5)."""

    def __init__(self, cp: CompiledPrefilter, strategy: str = "hybrid", period: int = 100_000,
                 mu: float = 0.1, sample: int = 2048, seed: int = 0):
        if strategy not in ("macro", "hybrid", "fixed"):
            raise ValueError("ASC strategy is macro, hybrid or fixed")
        n = len(cp.ascs)
        self.cp, self.strategy, self.period, self.mu, self.sample = cp, strategy, period, mu, \
            sample
        self.macro = np.arange(n, dtype=np.int64)
        self.arrows = np.full((n, cp.asc_qrb.shape[1] if n else 1), -1, dtype=np.int64)
        self.d_init: float | None = None
        self.rearrangements = 0
        self.evaluations = 0
        self.reached = 0
        self._rng = np.random.default_rng(seed)
        self._reset_period()

    def _reset_period(self) -> None:
        self._p_reached = 0
        self._p_dropped = 0
        self._R: list[np.ndarray] = []
        self._Q0: list[np.ndarray] = []
        self._kept = 0

    def run(self, ints, ip_hi, ip_lo, ip_ok, Q: np.ndarray) -> int:
        """Apply the ASCs to Q in place; return the ASC evaluations of this batch."""
        cp = self.cp
        if not cp.ascs:
            return 0
        reach = np.flatnonzero(Q.any(axis=1))
        adapt = self.strategy != "fixed"
        if adapt and len(reach) and self._kept < self.sample:
            take = min(len(reach), self.sample - self._kept, max(64, self.sample // 16))
            rows = np.sort(self._rng.choice(reach, take, replace=False))
            self._R.append(asc_regions(rows, ints, ip_hi, ip_lo, ip_ok, cp.asc_is_ip,
                                       cp.asc_col, cp.asc_cstart, cp.asc_clen, cp.c_int,
                                       cp.c_hi, cp.c_lo))
            self._Q0.append(Q[rows].copy())
            self._kept += take
        evals = asc_kernel(Q, ints, ip_hi, ip_lo, ip_ok, cp.asc_is_ip, cp.asc_col, cp.asc_cstart,
                           cp.asc_clen, cp.c_int, cp.c_hi, cp.c_lo, cp.asc_qrb, cp.asc_qub,
                           self.macro, self.arrows)
        self.evaluations += evals
        self.reached += len(reach)
        self._p_reached += len(reach)
        self._p_dropped += int((~Q[reach].any(axis=1)).sum())
        if adapt and self._p_reached >= self.period:
            self._end_period()
        return evals

    def _end_period(self) -> None:
        d_cur = self._p_dropped / self._p_reached
        moved = (self.d_init is None or (d_cur > 0 if self.d_init == 0 else
                 abs(d_cur - self.d_init) / self.d_init >= self.mu))
        if moved and self._R:
            self.choose(np.concatenate(self._R), np.concatenate(self._Q0))
            self.d_init = d_cur
        self._reset_period()

    def choose(self, R: np.ndarray, Q0: np.ndarray) -> None:
        """Choose the sequence on a sample: regions per ASC and masks before the ASCs."""
        cp = self.cp
        macro = macro_sequence(cp.ascs, cp.asc_qrb, R, Q0)
        self.macro = np.array(macro, dtype=np.int64)
        if self.strategy == "hybrid":
            self.arrows = hybrid_arrows(cp.ascs, cp.asc_qrb, R, Q0, macro)
        self.rearrangements += 1

    def describe(self) -> dict:
        names = [a.attribute for a in self.cp.ascs]
        micro = [{"from": names[a], "region": self.cp.ascs[a].region_text(r),
                  "to": names[int(t)]}
                 for a in range(len(names)) for r, t in enumerate(self.arrows[a]) if t >= 0]
        return {"strategy": self.strategy, "macro_sequence": [names[a] for a in self.macro],
                "micro_arrows": micro, "dropping_ratio_init": self.d_init,
                "rearrangements": self.rearrangements,
                "asc_evaluations_per_tuple": self.evaluations / self.reached
                if self.reached else None}


def ip_words(col: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n, 16) address bytes as big-endian (hi, lo) uint64 words."""
    w = np.ascontiguousarray(col).view(">u8").reshape(-1, 2).astype(np.uint64)
    return w[:, 0], w[:, 1]


def run_prefilter(cp: CompiledPrefilter, tb: TupleBatch, asc: AscRuntime | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """B and Q for every tuple of a batch: bits and signatures, then the ASCs (in the
    runtime's adaptive sequence, or in plan order)."""
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
                     cp.b_order, cp.b_users, cp.active, B, Q)
    if cp.ascs:
        if asc is None:
            asc = AscRuntime(cp, strategy="fixed")
        asc.run(ints, ip_hi, ip_lo, ip_ok, Q)
    return B, Q
