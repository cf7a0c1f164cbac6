"""Attribute selection constructs (Lee & Lee): one per attribute whose predicates are ranges or
use many constants, evaluated by region look-up instead of bits.

An ASC splits its attribute's domain at the constants of all predicates on it into 2m + 1
disjoint regions (``(-inf, c1), [c1], (c1, c2), …, [cm], (cm, +inf)``) plus a NULL region; every
predicate is constant on a region, so each region stores the query-result bitmap ``qrb`` (bit i:
slot i can still be satisfied) and the candidate-arrow bitmap ``cab`` (the ASCs that can still
fail a query after this region). A tuple's global result bitmap GRB starts as the prefilter's query
mask and is ANDed with one region's ``qrb`` per ASC; the tuple is dropped as soon as GRB is 0.

The evaluation order is chosen on a sample of tuples (their region per ASC and their mask before
the ASCs): the macro-sequence takes the minimal cover set greedily by conditional selectivity
(eq. 1-2), then the rest by tuple dropping ratio (eq. 3); the hybrid sequence adds micro-arrows
from single regions to the ASC that drops most of the tuples landing there. Sequences are
re-chosen when the dropping ratio moves by ``mu`` (eq. 5). The paper measures one step per
monitoring period; here every step is measured on the same sample, which is what the steps
would see on a stream whose distribution holds over the periods.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from capture.fields import CODE, INT32, INT64, IP, fields
from planner.ir import Predicate
from planner.slots import slot_bit


@dataclass
class ASC:
    """The ASC of one attribute."""

    attribute: str
    stream: str
    kind: str  # "int" or "ip" (128-bit values)
    constants: list[int]  # sorted distinct region boundaries
    predicates: list[int]  # plan predicate ids it decides
    slots: list[int]  # queries using it (the query-usage bitmap)
    qrb: list[int]  # per region (2m + 1, then NULL): bitmask over slots
    cab: list[list[int]] = field(default_factory=list)  # per region: candidate next ASCs

    @property
    def n_regions(self) -> int:
        return 2 * len(self.constants) + 2

    @property
    def null_region(self) -> int:
        return 2 * len(self.constants) + 1

    @property
    def qub(self) -> int:
        return sum(1 << s for s in self.slots)

    def region_of(self, v: int | None) -> int:
        """Region of a value: 2i + 1 for the constant c_i, 2i for the gap below it."""
        if v is None:
            return self.null_region
        lo, hi = 0, len(self.constants)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.constants[mid] < v:
                lo = mid + 1
            else:
                hi = mid
        if lo < len(self.constants) and self.constants[lo] == v:
            return 2 * lo + 1
        return 2 * lo

    def region_text(self, r: int) -> str:
        c = [self._fmt(x) for x in self.constants]
        if r == self.null_region:
            return "NULL"
        if r % 2:
            return f"[{c[r // 2]}]"
        lo = c[r // 2 - 1] if r else "-inf"
        hi = c[r // 2] if r // 2 < len(c) else "+inf"
        return f"({lo}, {hi})"

    def _fmt(self, v: int) -> str:
        if self.kind != "ip":
            return str(v)
        from planner.ir import format_prefix
        return format_prefix(v, 128)

    def to_json(self) -> dict:
        return {"attribute": self.attribute, "stream": self.stream, "regions": self.n_regions,
                "constants": [self._fmt(c) for c in self.constants],
                "predicates": self.predicates, "slots": self.slots,
                "qrb": [format(b, "b") for b in self.qrb]}


def single_attribute(p: Predicate) -> str | None:
    """The one field of a predicate whose atoms all test the same field (None also for a bit
    test: its true set is no few intervals, so it stays a prefilter bit beside an ASC)."""
    fs = p.fields
    return fs[0] if len(fs) == 1 and all(a.op != "mask" for a in p.atoms) else None


def asc_attributes(predicates: list[Predicate], min_constants: int = 16) -> set[str]:
    """DESIGN's "bits or ASC": attributes whose single-field predicates, across all queries,
    use at least ``min_constants`` distinct constants (a range's bounds count as constants).
    An ASC look-up costs about 16 ns a tuple (its sequencing included) against about 1 ns a
    constant for a branch-free comparison in the bits kernel (bench/README.md, planner), so an
    attribute with fewer constants is cheaper as bits, ranges included."""
    consts: dict[str, set] = {}
    for p in predicates:
        f = single_attribute(p)
        if f is None or fields(p.stream)[f].kind not in (INT32, INT64, IP, CODE):
            continue
        for a in p.atoms:
            consts.setdefault(f, set()).update(a.constants())
    return {f for f, c in consts.items() if len(c) >= min_constants}


def _representative(constants: list[int], r: int, kind: str) -> int | None:
    """A value inside region r, or None when the region is empty (integers only)."""
    m = len(constants)
    if r % 2:
        return constants[r // 2]
    lo = constants[r // 2 - 1] + 1 if r else (0 if kind != "ip" else 0)
    hi = constants[r // 2] - 1 if r // 2 < m else (1 << 128) - 1 if kind == "ip" else 2**63 - 1
    if r == 0 and kind != "ip":
        lo = 0  # catalogue integers are non-negative (NULL is its own region)
    return lo if lo <= hi else None


def build_asc(attribute: str, stream: str, preds: dict[int, Predicate],
              uses: dict[int, list[int]]) -> ASC:
    """The ASC of ``attribute`` over predicates (id -> predicate) and, per slot, the ids of its
    predicates on this attribute. Each region's qrb holds the slots whose predicates all hold
    on a value of the region (an empty region, say between two adjacent integers, holds none).

    An atom's truth can change only at its own constants, so it is evaluated once per own
    constant and once per stretch between them, as a bitset over the regions; a predicate is
    the OR of its atoms', a slot the AND of its predicates' (planner/reference.py keeps the
    direct evaluation, region by region, that tests compare against)."""
    kind = "ip" if fields(stream)[attribute].kind == IP else "int"
    constants = sorted({c for p in preds.values() for a in p.atoms for c in a.constants()})
    m = len(constants)
    n_regions = 2 * m + 2
    reps = [_representative(constants, r, kind) for r in range(2 * m + 1)]
    every = (1 << n_regions) - 1
    nonempty = every
    for r, v in enumerate(reps):
        if v is None:
            nonempty &= ~(1 << r)
    position = {c: i for i, c in enumerate(constants)}

    def stretch(lo: int, hi: int, atom) -> int:
        """Regions lo..hi (inclusive) where no own constant of ``atom`` lies: one truth."""
        if lo > hi:
            return 0
        v = next((reps[r] for r in range(lo, hi + 1) if reps[r] is not None), None)
        return ((1 << (hi - lo + 1)) - 1) << lo if v is not None and atom.holds(v) else 0

    def atom_mask(atom) -> int:
        own = sorted({position[c] for c in atom.constants()})
        mask, lo = 0, 0
        for i in own:
            mask |= stretch(lo, 2 * i, atom)
            if atom.holds(constants[i]):
                mask |= 1 << (2 * i + 1)
            lo = 2 * i + 2
        return mask | stretch(lo, 2 * m, atom)  # the NULL region (2m + 1) never holds

    pred_mask = dict.fromkeys(preds, 0)
    for pid, p in preds.items():
        for a in p.atoms:
            pred_mask[pid] |= atom_mask(a)
    # a slot's regions are a few runs (a range predicate: one): its bit is toggled where each
    # run starts and after it ends, and a prefix XOR over the regions gives every qrb
    toggles = [0] * (n_regions + 1)
    slots = sorted(uses)
    for s in slots:
        mask = every & nonempty
        for pid in uses[s]:
            mask &= pred_mask[pid]
        bit = 1 << s
        for edges, shift in ((mask & ~(mask << 1), 0), (mask & ~(mask >> 1), 1)):
            while edges:
                low = edges & -edges
                toggles[low.bit_length() - 1 + shift] ^= bit
                edges ^= low
    qrb, acc = [], 0
    for r in range(n_regions):
        acc ^= toggles[r]
        qrb.append(acc)
    return ASC(attribute, stream, kind, constants, sorted(preds), slots, qrb)


def add_candidate_arrows(ascs: list[ASC], all_slots: int) -> None:
    """cab: from region r of ASC i, the ASCs j that can still fail a query (qrb & qub_j != 0).
    ``all_slots`` is the mask of every slot (queries without the attribute pass region r)."""
    qubs = [a.qub for a in ascs]
    for i, a in enumerate(ascs):
        a.cab = []
        for q in a.qrb:
            passing = q | (all_slots & ~qubs[i])
            a.cab.append([j for j, b in enumerate(qubs) if j != i and passing & b])


# ------------------------------------------------------------------------ sample evaluation


def qrb_words(ascs: list[ASC], words: int) -> np.ndarray:
    """qrb as (n_asc, max regions, words) uint64; queries outside an ASC's qub pass every
    region, so their bits are set (the paper's rule for qub[j] = 0)."""
    n_reg = max((a.n_regions for a in ascs), default=1)
    out = np.zeros((len(ascs), n_reg, words), dtype=np.uint64)
    full = (1 << (64 * words)) - 1
    for i, a in enumerate(ascs):
        outside = full & ~a.qub
        for r, q in enumerate(a.qrb):
            v = q | outside
            for w in range(words):
                out[i, r, w] = (v >> (64 * w)) & 0xFFFFFFFFFFFFFFFF
    return out


def qub_words(ascs: list[ASC], words: int) -> np.ndarray:
    """The query-usage bitmaps as (n_asc, words) uint64."""
    out = np.zeros((len(ascs), words), dtype=np.uint64)
    for i, a in enumerate(ascs):
        for s in a.slots:
            w, bit = slot_bit(s)
            out[i, w] |= bit
    return out


def _popcount(x: np.ndarray) -> np.ndarray:
    return np.bitwise_count(x).astype(np.int64).sum(axis=-1)


def macro_sequence(ascs: list[ASC], qrb: np.ndarray, R: np.ndarray, Q0: np.ndarray
                   ) -> list[int]:
    """Minimal cover set greedily by conditional selectivity, then by dropping ratio; ties go to
    the ASC with the lowest selectivity alone. Without a sample: most queries first."""
    n_asc = len(ascs)
    if n_asc == 0:
        return []
    words = Q0.shape[1]
    qub = qub_words(ascs, words)
    n = len(R)
    if n == 0:
        return sorted(range(n_asc), key=lambda i: (-len(ascs[i].slots), i))
    universe = np.bitwise_or.reduce(qub, axis=0)
    covered = np.zeros(words, dtype=np.uint64)
    grb = Q0.copy()
    rho: list[int] = []
    alone = {}
    remaining = list(range(n_asc))
    while remaining and (universe & ~covered).any():
        rem = universe & ~covered
        k_w = int(_popcount(rem[None, :])[0])
        best, best_key, best_grb = None, None, None
        for a in remaining:
            g = grb & qrb[a, R[:, a]]
            eta = int(_popcount(g & rem).sum())
            s = eta / (k_w * n)
            if not rho:
                alone[a] = s
            key = (s, -len(ascs[a].slots), a)
            if best_key is None or key < best_key:
                best, best_key, best_grb = a, key, g
        rho.append(best)
        remaining.remove(best)
        covered |= qub[best]
        grb = best_grb
    while remaining:
        best, best_key, best_grb = None, None, None
        for a in remaining:
            g = grb & qrb[a, R[:, a]]
            d = float((~(g & universe).any(axis=1)).mean())  # dropped for the ASCs' queries
            key = (-d, alone.get(a, 1.0), a)
            if best_key is None or key < best_key:
                best, best_key, best_grb = a, key, g
        rho.append(best)
        remaining.remove(best)
        grb = best_grb
    return rho


def _next_score(qrb, R, t, g, nexts, universe) -> tuple[float, float]:
    """Filtering capability of evaluating ``nexts`` next: the fraction dropped for the queries
    the ASCs decide (``universe``), then the fewest of their bits left."""
    ok = nexts >= 0
    if not ok.any():
        return (0.0, 0.0)
    g2 = g[ok] & qrb[nexts[ok], R[t[ok], nexts[ok]]] & universe
    return (float((~g2.any(axis=1)).mean()), -float(_popcount(g2).mean()))


def hybrid_arrows(ascs: list[ASC], qrb: np.ndarray, R: np.ndarray, Q0: np.ndarray,
                  macro: list[int]) -> np.ndarray:
    """Micro-arrows: for each region of each ASC (in macro order), the candidate ASC that drops
    the most of the tuples arriving there (then leaves the fewest query bits), established only
    where it beats the macro-sequence's next ASC. -1: follow the macro-sequence."""
    n_asc = len(ascs)
    arrows = np.full((n_asc, qrb.shape[1] if n_asc else 1), -1, dtype=np.int64)
    if n_asc < 2 or not len(R):
        return arrows
    universe = np.bitwise_or.reduce(qub_words(ascs, Q0.shape[1]), axis=0)
    for a in macro:
        # replay the sample under the arrows so far, stopping where each tuple reaches ``a``
        grb = Q0.copy()
        done = np.zeros(R.shape, dtype=bool)
        at_a = np.zeros(len(R), dtype=bool)
        alive = grb.any(axis=1)
        cur = np.full(len(R), macro[0], dtype=np.int64)
        pos = np.arange(len(R))
        for _ in range(n_asc):
            idx = pos[alive & (cur >= 0) & ~at_a]
            if not len(idx):
                break
            c = cur[idx]
            hit = c == a
            at_a[idx[hit]] = True
            idx, c = idx[~hit], c[~hit]
            reg = R[idx, c]
            grb[idx] &= qrb[c, reg]
            done[idx, c] = True
            alive[idx] = grb[idx].any(axis=1)
            cand = arrows[c, reg]
            ok = (cand >= 0) & ~done[idx, np.maximum(cand, 0)]
            first = np.full(len(idx), -1, dtype=np.int64)
            for m in reversed(macro):
                first = np.where(~done[idx, m], m, first)
            cur[idx] = np.where(ok, cand, first)
        here = pos[at_a & alive]
        if not len(here):
            continue
        reg_a = R[here, a]
        g_a = grb[here] & qrb[a, reg_a]
        done[here, a] = True
        survive = g_a.any(axis=1)
        for r in np.unique(reg_a):
            sel = (reg_a == r) & survive
            if not sel.any():
                continue
            t = here[sel]
            g = g_a[sel]
            d = done[t]
            macro_next = np.full(len(t), -1, dtype=np.int64)
            for m in reversed(macro):
                macro_next = np.where(~d[:, m], m, macro_next)
            base = _next_score(qrb, R, t, g, macro_next, universe)
            best, best_score = -1, base
            for j in ascs[a].cab[r] if r < len(ascs[a].cab) else []:
                if d[:, j].all():
                    continue
                nexts = np.where(d[:, j], macro_next, j)
                sc = _next_score(qrb, R, t, g, nexts, universe)
                if sc > best_score:
                    best, best_score = j, sc
            if best >= 0 and (macro_next != best).any():
                arrows[a, r] = best
    return arrows
