"""The ASC runtime (Lee & Lee): attribute selection constructs evaluated per tuple by region
look-up, in a sequence chosen on sampled traffic and re-chosen when the dropping ratio moves.

``asc_kernel`` applies a compiled prefilter's ASCs to the query masks of a batch in the current
macro sequence with its micro-arrows; ``AscRuntime`` samples tuples' regions, measures the
dropping ratio per monitoring period and re-chooses the sequence (planner/asc.py) by eq. 5.
planner/reference.py holds the plain reference ``simulate`` the kernel is tested against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from capture.jit import allocating, kernel
from planner.asc import hybrid_arrows, macro_sequence

if TYPE_CHECKING:
    from collector.pipeline.compiled_prefilter import CompiledPrefilter


V4_MAPPED = np.uint64(0xFFFF)  # bits 32-63 of an IPv4-mapped address (its high word is 0)


@allocating
def _regions(a, idx, lo_j, hi_j, ints, ip_hi, ip_lo, ip_ok, asc_is_ip, asc_col, asc_cstart,
             asc_clen, c_int, c_hi, c_lo, asc_tstart, asc_tlen, r_table, asc_bstart, b_table,
             out):
    """out[idx[j]] = region of tuple idx[j] in ASC a, for j in [lo_j, hi_j): 2k + 1 for
    constant k, 2k for the gap below it, 2m + 1 for NULL. The ASC's kind is decided once; the
    table path (small integer domains) is branch-free: the last entry is the region above
    every constant and NULL is a select. An address ASC's IPv4 addresses search only the
    constants of their /16 (``b_table``: where each /16's constants begin, from
    ``asc_bstart[a]``), most often none: no search at all."""
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
        bt = asc_bstart[a]
        for j in range(lo_j, hi_j):
            i = idx[j]
            if not ip_ok[col, i]:
                out[i] = null_r
                continue
            h = ip_hi[col, i]
            low = ip_lo[col, i]
            lo = 0
            hi = m
            if bt >= 0 and h == 0 and (low >> np.uint64(32)) == V4_MAPPED:
                k = bt + np.int64((low >> np.uint64(16)) & np.uint64(0xFFFF))
                lo = np.int64(b_table[k])
                hi = np.int64(b_table[k + 1])
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


@allocating
def asc_kernel(Q, ints, ip_hi, ip_lo, ip_ok, asc_is_ip, asc_col, asc_cstart, asc_clen, c_int,
               c_hi, c_lo, asc_tstart, asc_tlen, r_table, asc_bstart, b_table, qrb, rest_qub,
               first_undone, macro, arrows, stats):
    """AND each tuple's query mask with one region's qrb per ASC, in the (macro or hybrid)
    sequence; a tuple leaves as soon as its mask is 0 or no unevaluated ASC decides a query
    still set. Evaluated in rounds over selection vectors: the live tuples are grouped by
    the ASC they visit next, so every inner loop runs one ASC over many tuples. Without
    micro-arrows (the macro strategy, and the hybrid one when no region gains by an arrow)
    every live tuple visits the macro-sequence's next ASC: a round is that ASC over the live
    tuples, without the sort (bench/README.md, the Spark section's ninth run).

    rest_qub[d]: the queries decided by the ASCs outside the evaluated set d (a bitmask);
    first_undone[d]: the first ASC of the macro-sequence outside d. Adds to ``stats`` the
    tuples that reached the ASCs (a query they decide was set) and, of them, those left with
    none of those queries. Returns ASCs evaluated."""
    n = Q.shape[0]
    return _asc_kernel(Q, ints, ip_hi, ip_lo, ip_ok, asc_is_ip, asc_col, asc_cstart,
                       asc_clen, c_int, c_hi, c_lo, asc_tstart, asc_tlen, r_table, asc_bstart,
                       b_table, qrb, rest_qub, first_undone, macro, arrows, stats,
                       np.empty(n, np.int32), np.empty(n, np.int32), np.empty(n, np.int32),
                       np.empty(n, np.int32), np.empty(n, np.int64),
                       np.empty(macro.shape[0] + 1, np.int64))


@kernel
def _asc_kernel(Q, ints, ip_hi, ip_lo, ip_ok, asc_is_ip, asc_col, asc_cstart, asc_clen, c_int,
                c_hi, c_lo, asc_tstart, asc_tlen, r_table, asc_bstart, b_table, qrb, rest_qub,
                first_undone, macro, arrows, stats, alive, order, done, nxt, reg, counts):
    """``asc_kernel`` on scratch arrays of the batch's length (each entry written before it
    is read: only the live tuples' are)."""
    words = Q.shape[1]
    n_asc = macro.shape[0]
    # counts start as np.int64(0), not 0: numba types a literal 0 as a type of its own first
    # and compiled _regions once per such argument seen while typing (four times, 3 s)
    n_alive = np.int64(0)
    for i in range(Q.shape[0]):
        open_q = False
        for w in range(words):
            open_q |= (Q[i, w] & rest_qub[0, w]) != 0
        alive[n_alive] = i
        n_alive += open_q
    stats[0] += n_alive
    dropped = 0
    evals = 0
    in_sequence = True
    for a in range(n_asc):
        for r in range(arrows.shape[1]):
            in_sequence &= arrows[a, r] < 0
    if in_sequence:  # no micro-arrow: every live tuple visits the macro-sequence's next ASC
        d = 0
        for k in range(n_asc):
            if n_alive == 0:
                break
            a = macro[k]
            _regions(a, alive, np.int64(0), n_alive, ints, ip_hi, ip_lo, ip_ok, asc_is_ip,
                     asc_col, asc_cstart, asc_clen, c_int, c_hi, c_lo, asc_tstart, asc_tlen,
                     r_table, asc_bstart, b_table, reg)
            evals += n_alive
            d |= np.int64(1) << a
            m = np.int64(0)
            for j in range(n_alive):  # without a branch: a third of the tuples stay
                i = alive[j]
                r = reg[i]
                open_q = False
                kept_q = False
                for w in range(words):
                    q = Q[i, w] & qrb[a, r, w]
                    Q[i, w] = q
                    open_q |= (q & rest_qub[d, w]) != 0
                    kept_q |= (q & rest_qub[0, w]) != 0
                alive[m] = i
                m += open_q
                dropped += not (open_q | kept_q)  # it leaves with none of the ASCs' queries
            n_alive = m
        stats[1] += dropped
        return evals
    for j in range(n_alive):
        i = alive[j]
        done[i] = 0
        nxt[i] = macro[0]
    first_round = True
    while n_alive > 0:
        if first_round:  # every live tuple visits the macro-sequence's first ASC: no sort
            first_round = False
            for j in range(n_alive):
                order[j] = alive[j]
            for a in range(n_asc):
                counts[a] = n_alive if a >= macro[0] else 0
        else:
            for a in range(n_asc + 1):
                counts[a] = 0
            for j in range(n_alive):
                counts[nxt[alive[j]] + 1] += 1
            for a in range(n_asc):
                counts[a + 1] += counts[a]
            for j in range(n_alive):  # counting sort of the live tuples by next ASC
                i = alive[j]
                order[counts[nxt[i]]] = i
                counts[nxt[i]] += 1
        start = np.int64(0)
        for a in range(n_asc):
            stop = counts[a]
            if stop > start:
                _regions(a, order, start, stop, ints, ip_hi, ip_lo, ip_ok, asc_is_ip, asc_col,
                         asc_cstart, asc_clen, c_int, c_hi, c_lo, asc_tstart, asc_tlen, r_table,
                         asc_bstart, b_table, reg)
                bit = np.int32(1) << a
                for j in range(start, stop):
                    i = order[j]
                    r = reg[i]
                    for w in range(words):
                        Q[i, w] &= qrb[a, r, w]
                    done[i] |= bit
            evals += stop - start
            start = stop
        m = np.int64(0)
        for j in range(n_alive):
            i = order[j]
            d = done[i]
            open_q = False
            for w in range(words):
                open_q |= (Q[i, w] & rest_qub[d, w]) != 0
            if not open_q:  # it leaves: with none of the ASCs' queries, it was dropped
                kept_q = False
                for w in range(words):
                    kept_q |= (Q[i, w] & rest_qub[0, w]) != 0
                dropped += not kept_q
                continue
            t = arrows[nxt[i], reg[i]]
            if t < 0 or (d >> t) & 1:
                t = first_undone[d]
            nxt[i] = t
            alive[m] = i
            m += 1
        n_alive = m
    stats[1] += dropped
    return evals


@allocating
def asc_regions(rows, ints, ip_hi, ip_lo, ip_ok, asc_is_ip, asc_col, asc_cstart, asc_clen,
                c_int, c_hi, c_lo, asc_tstart, asc_tlen, r_table, asc_bstart, b_table):
    """Region of each listed tuple in every ASC (the sample the sequences are chosen on)."""
    n_asc = asc_col.shape[0]
    n = ints.shape[1] if ints.shape[0] else ip_ok.shape[1]
    out = np.empty((rows.shape[0], n_asc), dtype=np.int64)
    col = np.zeros(n, dtype=np.int64)
    idx = rows.astype(np.int32)  # as asc_kernel's selection vectors: one _regions to compile
    for a in range(n_asc):
        _regions(a, idx, np.int64(0), idx.shape[0], ints, ip_hi, ip_lo, ip_ok, asc_is_ip,
                 asc_col, asc_cstart, asc_clen, c_int, c_hi, c_lo, asc_tstart, asc_tlen, r_table,
                 asc_bstart, b_table, col)
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
        # the queries the ASCs decide (the kernel's rest_qub[0]): the sample and the dropping
        # ratio are over the tuples holding one (a query no ASC constrains, e.g. one without
        # cheap predicates, keeps every tuple and would hide every drop)
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
        adapt = self.strategy != "fixed"
        if adapt and self._kept < self.sample:
            reach = np.flatnonzero((Q & self._decided).any(axis=1))
            take = min(len(reach), self.sample - self._kept, max(64, self.sample // 16))
            if take:
                rows = np.sort(self._rng.choice(reach, take, replace=False))
                self._R.append(asc_regions(rows, ints, ip_hi, ip_lo, ip_ok,
                                           *cp.asc_arrays()))
                self._Q0.append(Q[rows].copy())
                self._kept += take
        if self._tables is None:
            self._tables = sequence_tables(cp.asc_qub, self.macro)
        stats = np.zeros(2, dtype=np.int64)  # reached, dropped
        evals = asc_kernel(Q, ints, ip_hi, ip_lo, ip_ok, *cp.asc_arrays(), cp.asc_qrb,
                           *self._tables, self.macro, self.arrows, stats)
        reached, dropped = int(stats[0]), int(stats[1])
        self.evaluations += evals
        self.reached += reached
        self._p_reached += reached
        self._p_dropped += dropped
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
