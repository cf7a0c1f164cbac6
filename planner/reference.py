"""Reference implementations for tests and benchmarks, never used by the running collector:
plain and slow, written to be obviously right rather than fast.

- ``simulate``: an ASC evaluation sequence (macro or hybrid) run on a sample in numpy, as the
  numba kernel of collector/pipeline/asc_runtime.py runs it; the kernel is tested against it.
- ``best_fixed_order``: the fixed ASC order with the fewest evaluations, by dynamic programming
  over attribute subsets (the baseline A-Greedy-style orderings are measured against).
- ``maximal_rectangles`` and ``exact_cover``: the minimum rectangle covering of the prefilter
  matrix as an ILP over maximal rectangles (needs scipy, a development dependency); the greedy
  covering of planner/cover.py is compared with it.
"""

from __future__ import annotations

from itertools import combinations

import numpy as np

from planner.cover import Matrix, Rect, bits_of


def _open(grb: np.ndarray, done: np.ndarray, qub: np.ndarray) -> np.ndarray:
    """Tuples with a query still set that some unevaluated ASC decides."""
    rest = np.zeros_like(grb)
    for a in range(qub.shape[0]):
        rest |= np.where(done[:, a, None], np.uint64(0), qub[a][None, :])
    return (grb & rest).any(axis=1)


def simulate(qrb: np.ndarray, R: np.ndarray, Q0: np.ndarray, macro: list[int],
             arrows: np.ndarray | None = None, qub: np.ndarray | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
    """Reference evaluation of a (macro or hybrid) sequence on a sample, as the kernel does it.

    R: (n, n_asc) region per tuple and ASC; Q0: (n, words) mask before the ASCs. Returns the
    number of ASCs each tuple evaluated and the final GRB. Tuples with Q0 == 0 evaluate none;
    with ``qub``, a tuple stops once no unevaluated ASC decides a query still set."""
    n, n_asc = R.shape
    grb = Q0.copy()
    evaluated = np.zeros(n, dtype=np.int64)
    done = np.zeros((n, n_asc), dtype=bool)
    alive = grb.any(axis=1)
    if qub is not None:
        alive &= _open(grb, done, qub)
    pos = np.arange(n)
    cur = np.full(n, macro[0] if macro else -1, dtype=np.int64)
    for _ in range(n_asc):
        idx = pos[alive & (cur >= 0)]
        if not len(idx):
            break
        a = cur[idx]
        reg = R[idx, a]
        grb[idx] &= qrb[a, reg]
        done[idx, a] = True
        evaluated[idx] += 1
        still = grb[idx].any(axis=1)
        if qub is not None:
            still &= _open(grb[idx], done[idx], qub)
        alive[idx] = still
        nxt = np.full(len(idx), -1, dtype=np.int64)
        if arrows is not None:
            cand = arrows[a, reg]
            ok = (cand >= 0) & ~done[idx, np.maximum(cand, 0)]
            nxt[ok] = cand[ok]
        first = np.full(len(idx), -1, dtype=np.int64)
        for m in reversed(macro):  # else the first unevaluated ASC in macro order
            first = np.where(~done[idx, m], m, first)
        nxt = np.where(nxt >= 0, nxt, first)
        cur[idx] = nxt
    return evaluated, grb


def best_fixed_order(qrb: np.ndarray, R: np.ndarray, Q0: np.ndarray,
                     qub: np.ndarray | None = None, worst: bool = False
                     ) -> tuple[list[int], int]:
    """The fixed order with the fewest ASC evaluations on the sample, by dynamic programming
    over attribute subsets: f(S + a) = f(S) + tuples still going after S (mask not 0 and, with
    ``qub``, a query set that an ASC outside S decides). ``worst``: the most evaluations."""
    n, n_asc = R.shape
    if n_asc > 16:
        raise ValueError("best_fixed_order: at most 16 ASCs")
    full = 1 << n_asc
    alive_after = np.zeros(full, dtype=np.int64)
    level = {0: Q0}  # GRB after each subset of the previous size
    going0 = Q0.any(axis=1)
    if qub is not None:
        going0 &= (Q0 & np.bitwise_or.reduce(qub, axis=0)).any(axis=1)
    alive_after[0] = int(going0.sum())
    for size in range(1, n_asc + 1):
        nxt = {}
        for subset in combinations(range(n_asc), size):
            mask = sum(1 << a for a in subset)
            low = subset[0]
            g = level[mask & ~(1 << low)] & qrb[low, R[:, low]]
            nxt[mask] = g
            going = g.any(axis=1)
            if qub is not None:
                rest = np.bitwise_or.reduce(
                    qub[[a for a in range(n_asc) if not mask >> a & 1]], axis=0) \
                    if mask != full - 1 else np.zeros(qub.shape[1], np.uint64)
                going &= (g & rest).any(axis=1)
            alive_after[mask] = int(going.sum())
        level = nxt
    sign = -1 if worst else 1
    unset = np.iinfo(np.int64).max
    cost = np.full(full, unset, dtype=np.int64)
    prev = np.full(full, -1, dtype=np.int64)
    cost[0] = 0
    for mask in range(full):
        if cost[mask] == unset:
            continue
        for a in range(n_asc):
            if mask >> a & 1:
                continue
            nm = mask | (1 << a)
            c = cost[mask] + sign * alive_after[mask]
            if cost[nm] == unset or c < cost[nm]:
                cost[nm], prev[nm] = c, a
    order, mask = [], full - 1
    while mask:
        a = int(prev[mask])
        order.append(a)
        mask &= ~(1 << a)
    return order[::-1], int(sign * cost[full - 1])


def maximal_rectangles(m: Matrix, limit: int = 200_000) -> list[Rect]:
    """Every maximal rectangle of M (closed predicate sets: intersections of columns)."""
    closed: set[int] = {c for c in m.cols if c}
    frontier = set(closed)
    while frontier:
        new = set()
        for a in frontier:
            for c in m.cols:
                x = a & c
                if x and x not in closed:
                    new.add(x)
        closed |= new
        frontier = new
        if len(closed) > limit:
            raise ValueError(f"more than {limit} maximal rectangles")
    return [Rect(p, m.queries_of(p)) for p in sorted(closed)]


def exact_cover(m: Matrix, time_limit: float = 60.0) -> list[Rect] | None:
    """A minimum rectangle covering (ILP over maximal rectangles); None if not solved in time."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    rects = maximal_rectangles(m)
    ones = [(i, j) for i, row in enumerate(m.rows) for j in bits_of(row)]
    if not ones:
        return []
    index = {e: k for k, e in enumerate(ones)}
    a = lil_matrix((len(ones), len(rects)))
    for k, r in enumerate(rects):
        for i in bits_of(r.preds):
            for j in bits_of(r.queries):
                a[index[(i, j)], k] = 1
    res = milp(np.ones(len(rects)), constraints=LinearConstraint(a.tocsr(), lb=1),
               integrality=np.ones(len(rects)), bounds=Bounds(0, 1),
               options={"time_limit": time_limit})
    if res.x is None or res.status not in (0,):
        return None
    return [r for r, x in zip(rects, res.x, strict=True) if x > 0.5]


def build_asc_qrb(attribute: str, stream: str, preds: dict, uses: dict[int, list[int]]
                  ) -> list[int]:
    """qrb of an ASC by direct evaluation: every slot's predicates on a representative value of
    every region (what ``planner.asc.build_asc`` computes with bitsets)."""
    from capture.fields import IP, fields
    from planner.asc import _representative
    kind = "ip" if fields(stream)[attribute].kind == IP else "int"
    constants = sorted({c for p in preds.values() for a in p.atoms for c in a.constants()})
    qrb = []
    for r in range(2 * len(constants) + 2):
        v = None if r == 2 * len(constants) + 1 else _representative(constants, r, kind)
        empty = v is None and r != 2 * len(constants) + 1
        mask = 0
        for s in sorted(uses):
            ok = not empty and all(any(a.holds(v) for a in preds[pid].atoms) for pid in uses[s])
            mask |= ok << s
        qrb.append(mask)
    return qrb
