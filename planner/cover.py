"""Prefilter bits by rectangle covering (Golab, Johnson, Spatscheck, sections 2.2-2.4).

M is the predicates × queries matrix: M(p, q) = 1 when query q references cheap predicate p.
A rectangle (P, Q) has M(p, q) = 1 for every p in P and q in Q; it becomes one prefilter bit, the
conjunction of P. A covering of every 1 of M by few rectangles gives few bits that avoid exactly
the query invocations one bit per predicate would avoid. The steps:

1. ``find_rectangles``: Figure 4, growing rectangles of i predicates into i + 1 (up to ``max_j``),
   keeping those shared by more than one query, plus every row and column; rectangles contained
   in larger ones are pruned.
2. ``greedy_cover``: the greedy set-cover heuristic (most uncovered ones first), or, when
   selectivities are known, the rectangle that most reduces the expected number of query
   invocations per tuple (section 2.3); a bit budget keeps the first k.
3. ``eliminate_overlap``: a bit whose predicates include another bit's loses them, repeated
   until nothing simplifies (section 2.4, Figure 5).
4. ``signatures``: a query's signature is every bit whose predicates it references.

The exact minimum covering (an ILP) that tests and benchmarks compare with is in
``planner/reference.py``. Sets are Python ints used as bitmasks: bit i of a predicate mask is
predicate index i, bit j of a query mask is query index j.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Rect:
    preds: int  # bitmask over predicate indices
    queries: int  # bitmask over query indices

    @property
    def area(self) -> int:
        return self.preds.bit_count() * self.queries.bit_count()

    def contains(self, other: Rect) -> bool:
        return (other.preds & ~self.preds) == 0 and (other.queries & ~self.queries) == 0


def bits_of(mask: int) -> list[int]:
    """Indices of the set bits of a mask, ascending."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


class Matrix:
    """M over hashable predicate and query ids, with index masks for the algorithms."""

    def __init__(self, rows: Mapping[Hashable, set | frozenset]):
        self.pred_ids = sorted(rows, key=lambda p: (str(type(p)), p))
        queries = sorted({q for qs in rows.values() for q in qs}, key=lambda q: (str(type(q)), q))
        self.query_ids = queries
        qidx = {q: j for j, q in enumerate(queries)}
        self.rows = [sum(1 << qidx[q] for q in rows[p]) for p in self.pred_ids]
        self.cols = [0] * len(queries)
        for i, row in enumerate(self.rows):
            for j in bits_of(row):
                self.cols[j] |= 1 << i

    @property
    def ones(self) -> int:
        return sum(r.bit_count() for r in self.rows)

    def preds(self, mask: int) -> tuple:
        return tuple(self.pred_ids[i] for i in bits_of(mask))

    def queries_of(self, pred_mask: int) -> int:
        """Queries that reference every predicate of the mask."""
        q = (1 << len(self.query_ids)) - 1
        for i in bits_of(pred_mask):
            q &= self.rows[i]
        return q


def find_rectangles(m: Matrix, max_j: int = 4, prune: bool = True) -> list[Rect]:
    """Figure 4: rows, columns, and rectangles of up to ``max_j`` predicates shared by more than
    one query; with ``prune``, rectangles contained in larger ones are removed."""
    rects: dict[tuple[int, int], Rect] = {}

    def add(r: Rect) -> None:
        if r.preds and r.queries:
            rects.setdefault((r.preds, r.queries), r)

    level = []
    for i, row in enumerate(m.rows):
        r = Rect(1 << i, row)
        add(r)
        level.append((i, r))
    for j, col in enumerate(m.cols):
        add(Rect(col, 1 << j))
    for _ in range(1, max_j):
        nxt = []
        for top, r in level:
            for b in range(top + 1, len(m.rows)):
                q = r.queries & m.rows[b]
                if q.bit_count() > 1:  # else it lies inside a column rectangle already
                    r2 = Rect(r.preds | (1 << b), q)
                    add(r2)
                    nxt.append((b, r2))
        if not nxt:
            break
        level = nxt
    out = list(rects.values())
    return prune_contained(out) if prune else out


def prune_contained(rects: Sequence[Rect]) -> list[Rect]:
    """Drop every rectangle contained in another (the paper's pruning rule)."""
    order = sorted(rects, key=lambda r: (-r.area, -r.preds.bit_count(), r.preds, r.queries))
    kept: list[Rect] = []
    for r in order:
        if not any(k.contains(r) for k in kept):
            kept.append(r)
    return kept


def _gain(r: Rect, uncovered: list[int]) -> int:
    return sum((uncovered[i] & r.queries).bit_count() for i in bits_of(r.preds))


def expected_invocations(bit_masks: Sequence[int], m: Matrix,
                         selectivity: Sequence[float]) -> float:
    """Expected query invocations per tuple: sum over queries of the product of the
    selectivities of the predicates its signature checks (predicates independent)."""
    total = 0.0
    for col in m.cols:
        covered = 0
        for b in bit_masks:
            if b & ~col == 0:
                covered |= b
        total += math.prod(selectivity[i] for i in bits_of(covered))
    return total


def greedy_cover(m: Matrix, rects: Sequence[Rect], budget: int | None = None,
                 selectivity: Sequence[float] | None = None) -> list[Rect]:
    """Greedy set cover of the ones of M, in the order chosen (a budget keeps the first k).

    Without selectivities each step takes the rectangle covering the most uncovered ones; with
    them, the rectangle that most reduces the expected invocations per tuple (ties: most ones)."""
    uncovered = list(m.rows)
    remaining = m.ones
    chosen: list[Rect] = []
    col_cov = [0] * len(m.cols)  # predicates a query's signature checks so far
    while remaining and (budget is None or len(chosen) < budget):
        best, best_key = None, None
        for r in rects:
            g = _gain(r, uncovered)
            if g == 0:
                continue
            if selectivity is not None:
                cut = 0.0
                for j, col in enumerate(m.cols):
                    if r.preds & ~col == 0 and r.preds & ~col_cov[j]:
                        before = math.prod(selectivity[i] for i in bits_of(col_cov[j]))
                        after = math.prod(selectivity[i] for i in bits_of(col_cov[j] | r.preds))
                        cut += before - after
                key = (cut, g, r.queries.bit_count(), r.preds.bit_count(), -r.preds)
            else:
                # ties: the rectangle shared by more queries first (under a small budget its
                # bit saves invocations of more queries), then the larger conjunction
                key = (g, r.queries.bit_count(), r.preds.bit_count(), -r.preds)
            if best_key is None or key > best_key:
                best, best_key = r, key
        if best is None:
            break
        chosen.append(best)
        for i in bits_of(best.preds):
            remaining -= (uncovered[i] & best.queries).bit_count()
            uncovered[i] &= ~best.queries
        for j, col in enumerate(m.cols):
            if best.preds & ~col == 0:
                col_cov[j] |= best.preds
    return chosen


def _ones_of(r: Rect) -> list[tuple[int, int]]:
    return [(i, j) for i in bits_of(r.preds) for j in bits_of(r.queries)]


_KEYS = (
    # most uncovered ones; ties: shared by more queries, then larger conjunctions
    lambda r, u: (_gain(r, u), r.queries.bit_count(), r.preds.bit_count(), -r.preds),
    # most uncovered ones; ties: larger conjunctions first
    lambda r, u: (_gain(r, u), r.preds.bit_count(), r.queries.bit_count(), -r.preds),
    # least waste: uncovered share of the rectangle's ones
    lambda r, u: (_gain(r, u) / r.area, _gain(r, u), -r.preds),
)


def _reduced(m: Matrix, rects: Sequence[Rect], key) -> list[Rect]:
    uncovered = list(m.rows)
    chosen: list[Rect] = []
    live = list(rects)
    while any(uncovered):
        count: dict[tuple[int, int], list[int]] = {}
        for k, r in enumerate(live):
            for i in bits_of(r.preds):
                for j in bits_of(uncovered[i] & r.queries):
                    count.setdefault((i, j), []).append(k)
        forced = sorted({ks[0] for ks in count.values() if len(ks) == 1})
        if forced:
            picks = [live[k] for k in forced]
        else:
            best = max(live, key=lambda r: key(r, uncovered))
            if _gain(best, uncovered) == 0:
                break
            picks = [best]
        for r in picks:
            chosen.append(r)
            for i in bits_of(r.preds):
                uncovered[i] &= ~r.queries
        live = [r for r in live if _gain(r, uncovered)]
    # reverse delete: smallest first, drop a rectangle whose ones the others cover
    cover: dict[tuple[int, int], int] = {}
    for r in chosen:
        for e in _ones_of(r):
            cover[e] = cover.get(e, 0) + 1
    drop = set()
    for k in sorted(range(len(chosen)), key=lambda k: (chosen[k].area, chosen[k].preds)):
        ones = _ones_of(chosen[k])
        if all(cover[e] > 1 for e in ones):
            drop.add(k)
            for e in ones:
                cover[e] -= 1
    return [r for k, r in enumerate(chosen) if k not in drop]


def reduced_cover(m: Matrix, rects: Sequence[Rect]) -> list[Rect]:
    """A cover for the unbudgeted case: set-cover reductions around the greedy step.

    A 1 of M that only one candidate covers forces that candidate (a predicate used by one
    query forces its column); forced rectangles are taken first, then one greedy step, then
    forced ones again; finally a rectangle whose ones the others cover is dropped (reverse
    delete). The greedy step is run with three tie-break rules and the cover with the fewest
    bits (after overlap elimination) is kept: on the Gigascope-shaped matrices of
    bench/bench_planner.py this reaches the ILP optimum where one rule alone is 1-2 bits off,
    at a few milliseconds each."""
    best, best_bits = None, None
    for key in _KEYS:
        cover = _reduced(m, rects, key)
        n_bits = len(eliminate_overlap([r.preds for r in cover]))
        if best_bits is None or n_bits < best_bits:
            best, best_bits = cover, n_bits
    return best or []


def eliminate_overlap(bit_masks: Sequence[int]) -> list[int]:
    """Remove from every composite bit the predicates of any other bit it strictly contains,
    until nothing simplifies; duplicates merge; order follows the lowest predicate."""
    bits = list(dict.fromkeys(b for b in bit_masks if b))
    changed = True
    while changed:
        changed = False
        for i, b in enumerate(bits):
            for a in bits:
                if a != b and a & ~b == 0 and a & b:
                    b &= ~a
                    changed = True
            bits[i] = b
        bits = list(dict.fromkeys(b for b in bits if b))
    return sorted(bits, key=lambda b: (bits_of(b)[0], b))


def signatures(bit_masks: Sequence[int], m: Matrix) -> list[list[int]]:
    """Per query (matrix column): the bits all of whose predicates it references."""
    return [[k for k, b in enumerate(bit_masks) if b & ~col == 0] for col in m.cols]


@dataclass
class Cover:
    """The outcome of covering M: what ``flowsieve plan`` explains."""

    rectangles: list[tuple[tuple, tuple]]  # chosen (predicates, queries), in greedy order
    bits: list[tuple]  # after overlap elimination: each a conjunction of predicate ids
    candidates: int  # rectangles found (after pruning)
    expected_invocations: float | None  # per tuple, when selectivities are known
    by_selectivity: bool


def cover_matrix(rows: Mapping[Hashable, set | frozenset], budget: int | None = None,
                 selectivity: Mapping[Hashable, float | None] | None = None, max_j: int = 4
                 ) -> Cover:
    """Rectangle covering of M (predicate id -> queries referencing it) into prefilter bits.

    Selectivities, when every candidate has one, give the expected invocations per tuple; they
    choose the rectangles (section 2.3) only under a bit budget, where the choice matters."""
    if not rows:
        return Cover([], [], 0, None, False)
    m = Matrix(rows)
    sel = None
    if selectivity is not None and all(selectivity.get(p) is not None for p in m.pred_ids):
        sel = [float(selectivity[p]) for p in m.pred_ids]
    rects = find_rectangles(m, max_j)
    by_sel = sel is not None and budget is not None
    chosen = reduced_cover(m, rects)
    if budget is not None and budget < len(chosen):
        # under a budget the order matters: the first k of the greedy order (section 2.3)
        chosen = greedy_cover(m, rects, budget, sel if by_sel else None)
    else:
        by_sel = False
    bits = eliminate_overlap([r.preds for r in chosen])
    expected = expected_invocations(bits, m, sel) if sel is not None else None
    return Cover([(m.preds(r.preds), tuple(m.query_ids[j] for j in bits_of(r.queries)))
                  for r in chosen], [m.preds(b) for b in bits], len(rects), expected, by_sel)
