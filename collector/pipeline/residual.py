"""Residual predicates: what the prefilter did not decide (expensive predicates such as regexp on
``dns_qname``, and cheap ones left out by a bit budget), evaluated only on tuples whose query bit
is set. A predicate shared by several queries is evaluated once per tuple (the paper's
expensive-predicate cache); a regular expression's outcome is also kept by value (LRU), since
DNS names repeat.

The predicates are commutative pipelined filters (seed 001): a tuple leaves a predicate's work
once no query that checks it still holds the tuple. Their order starts by catalogue cost and is
kept by A-Greedy (or a variant, ``residual.ordering``): dropped tuples are profiled with a
probability (at most a tenth of the profile window per predicate and batch, so a 65,536-tuple
batch neither fills the window alone nor spends more on profiling than on filtering), every
later predicate run on them apart from the real work (while profiling stays within
``residual.profile_budget`` of the stage's time: predicates that run by distinct value cost
nanoseconds per tuple, a profile tuple microseconds of Python), and the ordering moves
when a later predicate drops more of what reaches an earlier one per unit of measured time
(planner/ordering.py). A tuple a predicate was not needed for counts as passing it.
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from collections.abc import Callable
from functools import lru_cache

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from capture.batch import Batch, ip_words
from capture.fields import BYTES, IP, STRING, fields, prefix_mask, split128
from collector.pipeline import prefix_tables, user_predicates
from planner.ir import Atom, Predicate
from planner.ordering import AdaptiveOrder
from planner.plan import Plan
from planner.slots import clear_slot, has_slot


class ValueCache:
    """Outcomes of regular expressions and user predicates by (predicate, value), least
    recently used out."""

    def __init__(self, size: int):
        self.size = size
        self._d: OrderedDict[tuple, bool] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, pred: tuple, value, compute: Callable[[], bool]) -> bool:
        key = (pred, value)
        hit = self._d.get(key)
        if hit is not None:
            self.hits += 1
            self._d.move_to_end(key)
            return hit
        self.misses += 1
        hit = compute()
        self._d[key] = hit
        if len(self._d) > self.size:
            self._d.popitem(last=False)
        return hit

    def search(self, rx: re.Pattern, value: str) -> bool:
        return self.get(("regexp", rx.pattern), value, lambda: rx.search(value) is not None)


@lru_cache(maxsize=1024)
def _regex(pattern: str) -> re.Pattern:
    return re.compile(pattern)


def _value_test(a: Atom, kind: str) -> Callable[[object], bool]:
    """The atom on one non-NULL value (a string, or any value of a user predicate)."""
    if a.op == "call":
        name, args = a.values[0], tuple(a.values[1:])
        return lambda v: user_predicates.call(name, args, v)
    if a.op == "regexp":
        rx = _regex(a.values[0])
        return lambda v: rx.search(v) is not None
    if a.op == "contains":
        needle = a.values[0]
        return lambda v: needle in v
    if a.op in ("=", "in"):
        vals = set(a.values)
        return vals.__contains__
    if a.op == "!=":
        vals = set(a.values)
        return lambda v: v not in vals
    raise ValueError(f"operator {a.op} on a {kind} field")


def eval_atom(a: Atom, stream: str, tb: Batch, rows: np.ndarray,
              cache: ValueCache | None = None) -> np.ndarray:
    """The atom on the given rows (NULL is false, negated or not)."""
    kind = fields(stream)[a.field].kind
    if kind == BYTES:  # contains(payload, …): one vectorised search (payloads rarely repeat)
        col = tb.arrow(a.field).take(pa.array(rows))
        hit = pc.match_substring(col, a.values[0]).fill_null(False)
        valid = col.is_valid().to_numpy(zero_copy_only=False)
        return (hit.to_numpy(zero_copy_only=False) != a.negated) & valid
    if a.op == "call" or kind == STRING:
        values, idx = user_predicates.distinct(stream, a.field, tb, rows)
        test = _value_test(a, kind)
        if cache is not None and cache.size and a.op in ("regexp", "call"):
            key = (a.op, *a.values)
            out = [v is not None and cache.get(key, v, lambda v=v: test(v)) for v in values]
        else:
            out = [v is not None and test(v) for v in values]
        hit = np.array(out, bool)[idx]
        valid = np.array([v is not None for v in values], bool)[idx]
        if a.op == "!=":
            return hit
        return (hit != a.negated) & valid
    if kind == IP and a.op == "table":
        hi, lo = ip_words(tb.column(a.field)[rows])
        hit = prefix_tables.lookup(a.values[0], hi, lo)
        return (hit != a.negated) & tb.ip_valid(a.field)[rows]
    if kind == IP:
        value, length = a.values
        (v_hi, v_lo), (m_hi, m_lo) = split128(value), split128(prefix_mask(length))
        hi, lo = ip_words(tb.column(a.field)[rows])
        hit = ((hi & np.uint64(m_hi)) == np.uint64(v_hi)) & \
            ((lo & np.uint64(m_lo)) == np.uint64(v_lo))
        return (hit != a.negated) & tb.ip_valid(a.field)[rows]
    x = tb.column(a.field)[rows].astype(np.int64)
    valid = x >= 0
    v = a.values
    hit = {
        "=": lambda: x == v[0], "!=": lambda: x != v[0], "<": lambda: x < v[0],
        "<=": lambda: x <= v[0], ">": lambda: x > v[0], ">=": lambda: x >= v[0],
        "in": lambda: np.isin(x, np.array(v, np.int64)),
        "between": lambda: (x >= v[0]) & (x <= v[1]),
        "mask": lambda: (x & v[0]) == v[1],
    }[a.op]()
    if a.op in ("in", "between", "mask"):
        hit = hit != a.negated
    return hit & valid


def eval_predicate(p: Predicate, tb: Batch, rows: np.ndarray,
                   cache: ValueCache | None = None) -> np.ndarray:
    """A base predicate (an OR of atoms) on the given rows."""
    out = np.zeros(len(rows), dtype=bool)
    for a in p.atoms:
        out |= eval_atom(a, p.stream, tb, rows, cache)
    return out


class Residual:
    """Residual predicates of one stream's queries, applied to Q in place, in an order kept
    by ``ordering`` (a planner/ordering.py variant, or "cost": catalogue cost only)."""

    def __init__(self, plan: Plan, stream: str, ordering: str = "a-greedy", p: float = 0.01,
                 window: int = 1000, alpha: float = 0.9, stage: int = 500,
                 cache: ValueCache | None = None, seed: int = 0, timed: bool = True,
                 budget: float = 0.1, per_batch: int | None = None):
        self.plan = plan
        self.users: dict[int, list[int]] = {}  # predicate id -> slots that check it
        for qp in plan.queries:
            if qp.query.stream == stream:
                for pid in qp.residual:
                    self.users.setdefault(pid, []).append(qp.slot)
        self.ids = plan.residual_order(stream)
        self._index = {pid: f for f, pid in enumerate(self.ids)}  # the ordering's filter ids
        self.ordering = ordering
        self.adaptive = AdaptiveOrder(len(self.ids), ordering, p=p, window=window,
                                      alpha=alpha, stage=stage, seed=seed) \
            if ordering != "cost" and len(self.ids) > 1 else None
        self.p = p
        # profile tuples one predicate takes per batch
        self.per_batch = per_batch or max(1, window // 10)
        self.budget = budget
        self._profile_s = self._filter_s = 0.0  # time spent profiling; in the whole stage
        self.cache = cache
        self.timed = timed  # False: each predicate's time is its catalogue cost (no clock)
        self._rng = np.random.default_rng(seed)
        self.evaluated = 0  # predicate evaluations, for metrics and tests
        self.profile_evaluated = 0  # of them, evaluations only to profile

    def __bool__(self) -> bool:
        return bool(self.users)

    def order(self) -> list[int]:
        """Predicate ids in the order they run now."""
        if self.adaptive is None:
            return list(self.ids)
        return [self.ids[f] for f in self.adaptive.order]

    def _eval(self, pid: int, tb: Batch, rows: np.ndarray) -> tuple[np.ndarray, float]:
        """The predicate on ``rows`` and its time per tuple (measured, or its cost)."""
        t0 = time.perf_counter()
        info = self.plan.predicates[pid]
        ok = eval_predicate(info.predicate, tb, rows, self.cache)
        return ok, (time.perf_counter() - t0) / len(rows) if self.timed else info.cost

    def apply(self, tb: Batch, Q: np.ndarray) -> None:
        """Clear query bits whose residual predicates fail; each predicate once per tuple."""
        order = self.order()
        t0 = time.perf_counter()
        # profiling's share of the stage's time stays within the budget (measured times only)
        profile = self.adaptive is not None and (
            not self.timed or self._profile_s <= self.budget * self._filter_s)
        for pos, pid in enumerate(order):
            slots = self.users[pid]
            need = np.zeros(len(tb), dtype=bool)
            for s in slots:
                need |= has_slot(Q, s)
            rows = np.flatnonzero(need)
            if not len(rows):
                continue
            ok, per_tuple = self._eval(pid, tb, rows)
            self.evaluated += len(rows)
            fail = rows[~ok]
            for s in slots:
                clear_slot(Q, fail, s)
            if profile and len(fail):
                t1 = time.perf_counter()
                self._profile(tb, order, pos, fail, per_tuple)
                self._profile_s += time.perf_counter() - t1
        self._filter_s += time.perf_counter() - t0

    def _profile(self, tb: Batch, order: list[int], pos: int, fail: np.ndarray,
                 per_tuple: float) -> None:
        """Profile a sample of the tuples the predicate at ``pos`` dropped: the positions the
        variant asks for run on them too (their outcome changes nothing in Q)."""
        picked = fail[self._rng.random(len(fail)) < self.p]
        if not len(picked):
            return
        if len(picked) > self.per_batch:  # one batch never fills the window by itself
            picked = np.sort(self._rng.choice(picked, self.per_batch, replace=False))
        index = self._index
        extra = [order[k] for k in self.adaptive.profile_positions(pos)]
        outcomes = {}
        times = {index[order[pos]]: per_tuple}
        for pid in extra:
            ok, t = self._eval(pid, tb, picked)
            self.evaluated += len(picked)
            self.profile_evaluated += len(picked)
            outcomes[index[pid]] = ok
            times[index[pid]] = t
        evaluated = {index[pid] for pid in order[:pos + 1]} | set(outcomes)
        last = len(picked) - 1
        for i in range(len(picked)):
            drops = {index[order[pos]]} | {f for f, ok in outcomes.items() if not ok[i]}
            self.adaptive.add(drops, evaluated, times, check=i == last)

    def describe(self) -> dict:
        """The running order (for GET /prefilter)."""
        a = self.adaptive
        return {"ordering": self.ordering,
                "order": [self.plan.predicates[pid].predicate.text for pid in self.order()],
                "reorders": a.reorders if a else 0, "profile_tuples": a.profiled if a else 0,
                "profile_evaluations": self.profile_evaluated,
                "cache_hits": self.cache.hits if self.cache else 0,
                "cache_misses": self.cache.misses if self.cache else 0}
