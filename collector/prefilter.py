"""The prefilter (Golab et al.): one numba pass per batch computes, per tuple, the bit vector B
of the plan's bits and the query mask Q: slot i is set iff (B & S_i) == S_i.

The compiled plan is plain arrays, so a rebuild swaps data, not code. More than 64 bits and more
than 64 query slots are held in several 64-bit words.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba as nb
import numpy as np

from capture.fields import IP, fields, prefix_mask, split128
from capture.unpack import TupleBatch
from planner.asc import ASC, hybrid_arrows, macro_sequence, qrb_words, qub_words
from planner.plan import Plan
from planner.slots import n_words

OPS = {"=": 0, "!=": 1, "<": 2, "<=": 3, ">": 4, ">=": 5, "in": 6, "between": 7, "prefix": 8}


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
    s_slot: np.ndarray  # int64 per query of this stream: its slot
    s_start: np.ndarray  # int64: first entry of its signature in s_bits
    s_len: np.ndarray
    s_bits: np.ndarray  # int64 local bit ids
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
    asc_tstart: np.ndarray  # int64 per ASC: first entry of its region table, -1 if none
    asc_tlen: np.ndarray  # int64: table length (values >= it are above every constant)
    r_table: np.ndarray  # int16 region of every value 0..len-1, for small integer domains

    def asc_arrays(self) -> tuple:
        """The arrays a region look-up needs, in the kernels' argument order."""
        return (self.asc_is_ip, self.asc_col, self.asc_cstart, self.asc_clen, self.c_int,
                self.c_hi, self.c_lo, self.asc_tstart, self.asc_tlen, self.r_table)

    @property
    def q_words(self) -> int:
        return n_words(self.n_slots)


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
                a_ip.append((*split128(value), *split128(prefix_mask(length))))
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
            hi, lo = split128(c) if is_ip else (0, 0)
            c_hi.append(hi)
            c_lo.append(lo)
    # integer ASCs whose constants are below 2^16 (ports, TTL, protocol, VLAN) get a table
    # value -> region: one load instead of a binary search
    asc_tstart, asc_tlen, tables = [], [], []
    size = 0
    for a in ascs:
        top = max(a.constants) if a.constants else 0
        if a.kind == "int" and 0 <= top < (1 << 16) and a.constants[0] >= 0:
            length = top + 2
            asc_tstart.append(size)
            asc_tlen.append(length)
            tables.append(np.array([a.region_of(v) for v in range(length)], np.int16))
            size += length
        else:
            asc_tstart.append(-1)
            asc_tlen.append(0)
    r_table = np.concatenate(tables) if tables else np.zeros(0, np.int16)
    n_slots = max([qp.slot for qp in plan.queries] + [-1]) + 1
    s_slot, s_start, s_len, s_bits = [], [], [], []
    for qp in plan.queries:
        if qp.query.stream != stream:
            continue
        s_slot.append(qp.slot)
        s_start.append(len(s_bits))
        s_len.append(len(qp.signature))
        s_bits.extend(local_bit[b] for b in qp.signature)
    return CompiledPrefilter(
        stream, plan.version, int_cols, ip_cols,
        np.array(a_col, np.int32), np.array(a_op, np.int32), np.array(a_neg, np.bool_),
        np.array(a_v, np.int64).reshape(-1, 2), np.array(a_ip, np.uint64).reshape(-1, 4),
        np.array(set_vals, np.int64), np.array(p_start, np.int32), np.array(p_len, np.int32),
        np.array(b_start, np.int32), np.array(b_len, np.int32), np.array(b_preds, np.int32),
        np.array(s_slot, np.int64), np.array(s_start, np.int64),
        np.array(s_len, np.int64), np.array(s_bits, np.int64), pred_ids, n_slots, ascs,
        np.array(asc_is_ip, np.bool_),
        np.array(asc_col, np.int32), np.array(asc_cstart, np.int32),
        np.array(asc_clen, np.int32), np.array(c_int, np.int64), np.array(c_hi, np.uint64),
        np.array(c_lo, np.uint64), qrb_words(ascs, n_words(n_slots)),
        qub_words(ascs, n_words(n_slots)), np.array(asc_tstart, np.int64),
        np.array(asc_tlen, np.int64), r_table)


@nb.njit(cache=True, inline="always")
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


@nb.njit(cache=True, nogil=True)
def _eval_atom_column(out, a, ints, ip_hi, ip_lo, ip_ok, a_col, a_op, a_neg, a_v, a_ip,
                      set_vals):
    """out[i] |= atom a on tuple i, for the whole batch: the operator is chosen once and the
    loop over tuples is branch-free (NULL is false, negated or not)."""
    n = out.shape[0]
    op = a_op[a]
    c = a_col[a]
    neg = a_neg[a]
    if op == 8:
        vh, vl, mh, ml = a_ip[a, 0], a_ip[a, 1], a_ip[a, 2], a_ip[a, 3]
        for i in range(n):
            hit = ((ip_hi[c, i] & mh) == vh) & ((ip_lo[c, i] & ml) == vl)
            out[i] |= (hit ^ neg) & ip_ok[i]
        return
    v0 = a_v[a, 0]
    v1 = a_v[a, 1]
    if op == 0:
        for i in range(n):
            out[i] |= ints[c, i] == v0
    elif op == 1:
        for i in range(n):
            x = ints[c, i]
            out[i] |= (x != v0) & (x >= 0)
    elif op == 2:
        for i in range(n):
            x = ints[c, i]
            out[i] |= (x < v0) & (x >= 0)
    elif op == 3:
        for i in range(n):
            x = ints[c, i]
            out[i] |= (x <= v0) & (x >= 0)
    elif op == 4:
        for i in range(n):
            out[i] |= ints[c, i] > v0
    elif op == 5:
        for i in range(n):
            out[i] |= ints[c, i] >= v0
    elif op == 7:
        for i in range(n):
            x = ints[c, i]
            out[i] |= (((x >= v0) & (x <= v1)) ^ neg) & (x >= 0)
    else:  # IN: v0 = first constant, v1 = count
        if v1 <= 16:
            for i in range(n):
                x = ints[c, i]
                hit = False
                for k in range(v0, v0 + v1):
                    hit |= x == set_vals[k]
                out[i] |= (hit ^ neg) & (x >= 0)
        else:
            for i in range(n):
                x = ints[c, i]
                out[i] |= (in_sorted(set_vals, v0, v1, x) ^ neg) & (x >= 0)


@nb.njit(cache=True, nogil=True)
def prefilter_kernel(ints, ip_hi, ip_lo, ip_ok, a_col, a_op, a_neg, a_v, a_ip, set_vals,
                     p_start, p_len, b_start, b_len, b_preds, s_slot, s_start, s_len, s_bits,
                     B, Q):
    """Fill Q (n, slot words) and, when B has n rows, B (n, bit words); return the number of
    tuples with Q != 0.

    Column at a time: each predicate once over the batch (an OR of its atoms), each composite
    bit the AND of its predicates (a one-predicate bit is its predicate's column), and slot s
    the AND of the bits of its signature, i.e. (B & S_s) == S_s. Branch-free inner loops over
    the batch: a row-at-a-time loop with early exits spent ~13x more per tuple on the 50-query
    set (bench/bench_planner.py); packing B costs as much again, so it is optional."""
    n = Q.shape[0]
    n_pred = p_start.shape[0]
    n_bits = b_start.shape[0]
    n_comp = 0
    for b in range(n_bits):
        n_comp += b_len[b] > 1
    M = np.zeros((n_pred + n_comp, n), dtype=np.bool_)
    for p in range(n_pred):
        for a in range(p_start[p], p_start[p] + p_len[p]):
            _eval_atom_column(M[p], a, ints, ip_hi, ip_lo, ip_ok, a_col, a_op, a_neg, a_v,
                              a_ip, set_vals)
    bit_row = np.empty(n_bits, dtype=np.int64)
    c = n_pred
    for b in range(n_bits):
        if b_len[b] == 1:
            bit_row[b] = b_preds[b_start[b]]
            continue
        row = M[c]
        row[:] = M[b_preds[b_start[b]]]
        for k in range(b_start[b] + 1, b_start[b] + b_len[b]):
            other = M[b_preds[k]]
            for i in range(n):
                row[i] &= other[i]
        bit_row[b] = c
        c += 1
    if B.shape[0] == n:
        for b in range(n_bits):
            row = M[bit_row[b]]
            w = b >> 6
            bit = np.uint64(1) << np.uint64(b & 63)
            for i in range(n):
                B[i, w] |= bit * np.uint64(row[i])
    acc = np.empty(n, dtype=np.bool_)
    for q in range(s_slot.shape[0]):
        acc[:] = True
        for k in range(s_start[q], s_start[q] + s_len[q]):
            row = M[bit_row[s_bits[k]]]
            for i in range(n):
                acc[i] &= row[i]
        s = s_slot[q]
        w = s >> 6
        bit = np.uint64(1) << np.uint64(s & 63)
        for i in range(n):
            Q[i, w] |= bit * np.uint64(acc[i])
    kept = 0
    for i in range(n):
        any_q = False
        for w in range(Q.shape[1]):
            any_q |= Q[i, w] != 0
        kept += any_q
    return kept


@nb.njit(cache=True, nogil=True)
def _regions(a, idx, lo_j, hi_j, ints, ip_hi, ip_lo, ip_ok, asc_is_ip, asc_col, asc_cstart,
             asc_clen, c_int, c_hi, c_lo, asc_tstart, asc_tlen, r_table, out):
    """out[idx[j]] = region of tuple idx[j] in ASC a, for j in [lo_j, hi_j): 2k + 1 for
    constant k, 2k for the gap below it, 2m + 1 for NULL. The ASC's kind is decided once; the
    table path (small integer domains) is branch-free: the last entry is the region above
    every constant and NULL is a select."""
    m = asc_clen[a]
    st = asc_cstart[a]
    col = asc_col[a]
    t = asc_tstart[a]
    null_r = 2 * m + 1
    if t >= 0:
        last = asc_tlen[a] - 1
        for j in range(lo_j, hi_j):
            i = idx[j]
            x = ints[col, i]
            r = np.int64(r_table[t + min(max(x, 0), last)])
            out[i] = null_r if x < 0 else r
        return
    if asc_is_ip[a]:
        for j in range(lo_j, hi_j):
            i = idx[j]
            if not ip_ok[i]:
                out[i] = null_r
                continue
            h = ip_hi[col, i]
            low = ip_lo[col, i]
            lo = 0
            hi = m
            while lo < hi:
                mid = (lo + hi) // 2
                if c_hi[st + mid] < h or (c_hi[st + mid] == h and c_lo[st + mid] < low):
                    lo = mid + 1
                else:
                    hi = mid
            exact = lo < m and c_hi[st + lo] == h and c_lo[st + lo] == low
            out[i] = 2 * lo + 1 if exact else 2 * lo
        return
    for j in range(lo_j, hi_j):
        i = idx[j]
        x = ints[col, i]
        if x < 0:
            out[i] = null_r
            continue
        lo = 0
        hi = m
        while lo < hi:
            mid = (lo + hi) // 2
            if c_int[st + mid] < x:
                lo = mid + 1
            else:
                hi = mid
        exact = lo < m and c_int[st + lo] == x
        out[i] = 2 * lo + 1 if exact else 2 * lo


@nb.njit(cache=True, nogil=True)
def asc_kernel(Q, ints, ip_hi, ip_lo, ip_ok, asc_is_ip, asc_col, asc_cstart, asc_clen, c_int,
               c_hi, c_lo, asc_tstart, asc_tlen, r_table, qrb, rest_qub, first_undone, macro,
               arrows):
    """AND each tuple's query mask with one region's qrb per ASC, in the (macro or hybrid)
    sequence; a tuple leaves as soon as its mask is 0 or no unevaluated ASC decides a query
    still set. Evaluated in rounds over selection vectors: the live tuples are grouped by
    the ASC they visit next, so every inner loop runs one ASC over many tuples.

    rest_qub[d]: the queries decided by the ASCs outside the evaluated set d (a bitmask);
    first_undone[d]: the first ASC of the macro-sequence outside d. Returns ASCs evaluated."""
    n = Q.shape[0]
    words = Q.shape[1]
    n_asc = macro.shape[0]
    alive = np.empty(n, dtype=np.int64)
    n_alive = 0
    for i in range(n):
        open_q = False
        for w in range(words):
            open_q |= (Q[i, w] & rest_qub[0, w]) != 0
        if open_q:
            alive[n_alive] = i
            n_alive += 1
    done = np.zeros(n, dtype=np.int64)
    nxt = np.full(n, macro[0], dtype=np.int64)
    reg = np.zeros(n, dtype=np.int64)
    counts = np.zeros(n_asc + 1, dtype=np.int64)
    order = np.empty(n, dtype=np.int64)
    evals = 0
    while n_alive > 0:
        counts[:] = 0
        for j in range(n_alive):
            counts[nxt[alive[j]] + 1] += 1
        for a in range(n_asc):
            counts[a + 1] += counts[a]
        for j in range(n_alive):  # counting sort of the live tuples by next ASC
            i = alive[j]
            order[counts[nxt[i]]] = i
            counts[nxt[i]] += 1
        start = 0
        for a in range(n_asc):
            stop = counts[a]
            if stop > start:
                _regions(a, order, start, stop, ints, ip_hi, ip_lo, ip_ok, asc_is_ip, asc_col,
                         asc_cstart, asc_clen, c_int, c_hi, c_lo, asc_tstart, asc_tlen, r_table,
                         reg)
                bit = np.int64(1) << a
                for j in range(start, stop):
                    i = order[j]
                    r = reg[i]
                    for w in range(words):
                        Q[i, w] &= qrb[a, r, w]
                    done[i] |= bit
            evals += stop - start
            start = stop
        m = 0
        for j in range(n_alive):
            i = order[j]
            d = done[i]
            open_q = False
            for w in range(words):
                open_q |= (Q[i, w] & rest_qub[d, w]) != 0
            if not open_q:
                continue
            t = arrows[nxt[i], reg[i]]
            if t < 0 or (d >> t) & 1:
                t = first_undone[d]
            nxt[i] = t
            alive[m] = i
            m += 1
        n_alive = m
    return evals


@nb.njit(cache=True, nogil=True)
def asc_regions(rows, ints, ip_hi, ip_lo, ip_ok, asc_is_ip, asc_col, asc_cstart, asc_clen,
                c_int, c_hi, c_lo, asc_tstart, asc_tlen, r_table):
    """Region of each listed tuple in every ASC (the sample the sequences are chosen on)."""
    n_asc = asc_col.shape[0]
    n = ints.shape[1] if ints.shape[0] else ip_ok.shape[0]
    out = np.empty((rows.shape[0], n_asc), dtype=np.int64)
    col = np.zeros(n, dtype=np.int64)
    for a in range(n_asc):
        _regions(a, rows, 0, rows.shape[0], ints, ip_hi, ip_lo, ip_ok, asc_is_ip, asc_col,
                 asc_cstart, asc_clen, c_int, c_hi, c_lo, asc_tstart, asc_tlen, r_table, col)
        for k in range(rows.shape[0]):
            out[k, a] = col[rows[k]]
    return out


def sequence_tables(qub: np.ndarray, macro: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per set of evaluated ASCs (a bitmask): the queries the other ASCs decide, and the first
    ASC of the macro-sequence not yet evaluated (-1 when all are)."""
    n_asc = qub.shape[0]
    size = 1 << n_asc
    rest = np.zeros((size, qub.shape[1]), dtype=np.uint64)
    first = np.full(size, -1, dtype=np.int64)
    for d in range(size):
        for a in range(n_asc):
            if not d >> a & 1:
                rest[d] |= qub[a]
        for a in macro:
            if not d >> int(a) & 1:
                first[d] = a
                break
    return rest, first


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
        # the dropping ratio is over the queries the ASCs decide: a query no ASC constrains
        # (e.g. one without cheap predicates) keeps every tuple and would hide every drop
        self._decided = np.bitwise_or.reduce(cp.asc_qub, axis=0) if n else None
        self.macro = np.arange(n, dtype=np.int64)
        self.arrows = np.full((n, cp.asc_qrb.shape[1] if n else 1), -1, dtype=np.int64)
        self.d_init: float | None = None
        self._tables: tuple | None = None
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
        union = self._decided
        reach = np.flatnonzero((Q & union).any(axis=1))
        adapt = self.strategy != "fixed"
        if adapt and len(reach) and self._kept < self.sample:
            take = min(len(reach), self.sample - self._kept, max(64, self.sample // 16))
            rows = np.sort(self._rng.choice(reach, take, replace=False))
            self._R.append(asc_regions(rows, ints, ip_hi, ip_lo, ip_ok, *cp.asc_arrays()))
            self._Q0.append(Q[rows].copy())
            self._kept += take
        if self._tables is None:
            self._tables = sequence_tables(cp.asc_qub, self.macro)
        evals = asc_kernel(Q, ints, ip_hi, ip_lo, ip_ok, *cp.asc_arrays(), cp.asc_qrb,
                           *self._tables, self.macro, self.arrows)
        self.evaluations += evals
        self.reached += len(reach)
        self._p_reached += len(reach)
        self._p_dropped += int((~(Q[reach] & union).any(axis=1)).sum())
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
        self._tables = None
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


def kernel_inputs(cp: CompiledPrefilter, tb: TupleBatch
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The columns the kernels read: (ints, ip_hi, ip_lo, ip_ok) for the plan's fields."""
    n = len(tb)
    ints = np.empty((len(cp.int_cols), n), dtype=np.int64)
    for k, name in enumerate(cp.int_cols):
        ints[k] = tb.column(name)
    ip_hi = np.empty((len(cp.ip_cols), n), dtype=np.uint64)
    ip_lo = np.empty((len(cp.ip_cols), n), dtype=np.uint64)
    for k, name in enumerate(cp.ip_cols):
        ip_hi[k], ip_lo[k] = ip_words(tb.column(name))
    return ints, ip_hi, ip_lo, tb.ip_valid()


def run_prefilter(cp: CompiledPrefilter, tb: TupleBatch, asc: AscRuntime | None = None,
                  want_b: bool = False) -> tuple[np.ndarray | None, np.ndarray]:
    """Q for every tuple of a batch (and B with ``want_b``): bits and signatures, then the
    ASCs (in the runtime's adaptive sequence, or in plan order)."""
    n = len(tb)
    ints, ip_hi, ip_lo, ip_ok = kernel_inputs(cp, tb)
    B = np.zeros((n if want_b else 0, n_words(len(cp.b_start))), dtype=np.uint64)
    Q = np.zeros((n, cp.q_words), dtype=np.uint64)
    prefilter_kernel(ints, ip_hi, ip_lo, ip_ok, cp.a_col, cp.a_op, cp.a_neg, cp.a_v, cp.a_ip,
                     cp.set_vals, cp.p_start, cp.p_len, cp.b_start, cp.b_len, cp.b_preds,
                     cp.s_slot, cp.s_start, cp.s_len, cp.s_bits, B, Q)
    if cp.ascs:
        if asc is None:
            asc = AscRuntime(cp, strategy="fixed")
        asc.run(ints, ip_hi, ip_lo, ip_ok, Q)
    return (B if want_b else None), Q
