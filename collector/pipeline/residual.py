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


class _Use:
    """One predicate's use of the value cache and what it measured of it."""

    __slots__ = ("on", "values", "hits", "lookup_s", "compute_s", "computed", "off_values",
                 "off_s", "cost", "cost_off", "probes", "trial")

    def __init__(self):
        self.on = True
        self.values = self.hits = self.computed = self.off_values = self.probes = 0
        self.trial = 0  # values the last time on took to decide
        self.lookup_s = self.compute_s = self.off_s = 0.0
        self.cost = 0.0  # seconds a value costs to compute, as last measured
        self.cost_off = 0.0  # and when the cache turned off


class ValueCache:
    """Outcomes of regular expressions and user predicates by (predicate, value), least
    recently used out.

    It pays for a predicate when its hit rate times what a value costs to compute exceeds what
    a look-up costs (a short name's regular expression costs about what the look-up does; a
    user predicate that resolves something costs microseconds), so each predicate's use of it
    is measured and decided by itself (``adaptive``): after at least ``decide`` values looked
    up (a batch's distinct values at a time), it stays on only if ``hits × compute`` exceeded
    the look-ups' own time. Off, the predicate runs on every distinct value with its cost per
    value measured; the cache is tried again after ``probe`` times the values its last trial
    took (so trials cost at most about 1/``probe`` of the look-ups they spare), at once if a
    value has come to cost twice what it did (the names changed, the function slowed down).
    Entries stay while off: the predicates are pure."""

    def __init__(self, size: int, adaptive: bool = True, decide: int = 1024, probe: int = 32,
                 clock: Callable[[], float] = time.perf_counter):
        self.size = size
        self.adaptive = adaptive
        self.decide, self.probe = decide, probe
        self._clock = clock
        self._d: OrderedDict[tuple, bool] = OrderedDict()
        self._uses: dict[tuple, _Use] = {}
        self.hits = self.misses = 0
        self.saved_s = self.spent_s = 0.0  # estimated time hits saved; look-ups' own time
        self.turned = 0  # times a predicate's use turned on or off

    def evaluate(self, pred: tuple, values: list, test: Callable[[object], bool]) -> list[bool]:
        """``test`` on each value (None: false) through the cache, or around it where the cache
        has not paid for this predicate."""
        use = self._uses.get(pred)
        if use is None:
            use = self._uses[pred] = _Use()
        clock = self._clock
        if not use.on:
            t0 = clock()
            out = [v is not None and test(v) for v in values]
            spent = clock() - t0
            use.off_s += spent
            use.off_values += len(values)
            if values:
                use.cost = spent / len(values)
            self._off(use)
            return out
        d, size = self._d, self.size
        hits = computed = 0
        spent = 0.0
        out = []
        t0 = clock()
        for v in values:
            if v is None:
                out.append(False)
                continue
            key = (pred, v)
            hit = d.get(key)
            if hit is None:
                t1 = clock()
                hit = test(v)
                spent += clock() - t1
                computed += 1
                d[key] = hit
                if len(d) > size:
                    d.popitem(last=False)
            else:
                hits += 1
                d.move_to_end(key)
            out.append(hit)
        lookup = clock() - t0 - spent
        self.hits += hits
        self.misses += computed
        use.values += hits + computed
        use.hits += hits
        use.computed += computed
        use.lookup_s += lookup
        use.compute_s += spent
        if computed:
            use.cost = spent / computed
        self.saved_s += hits * use.cost
        self.spent_s += lookup
        if self.adaptive and use.values >= self.decide:
            self._on(use)
        return out

    def _on(self, use: _Use) -> None:
        """After ``decide`` values through the cache: it stays on only if it paid."""
        use.trial = use.values
        per_value = use.compute_s / use.computed if use.computed else use.cost
        if use.hits * per_value <= use.lookup_s:
            use.on = False
            use.cost_off = per_value
            use.off_values, use.off_s = 0, 0.0
            self.turned += 1
        use.values = use.hits = use.computed = 0
        use.lookup_s = use.compute_s = 0.0

    def _off(self, use: _Use) -> None:
        """While off: try the cache again after a while, or at once when values cost twice
        what they did."""
        n = use.off_values
        slower = n >= 64 and use.off_s / n > 2 * use.cost_off > 0
        if slower or n >= self.probe * max(self.decide, use.trial):
            use.on = True
            use.probes += 1
            self.turned += 1

    def state(self) -> dict[str, bool]:
        """Whether the cache is on for each predicate it has seen (its text)."""
        return {_pred_text(p): u.on for p, u in self._uses.items()}


def _pred_text(pred: tuple) -> str:
    op, *args = pred
    if op == "call":
        return f"{args[0]}({', '.join(repr(a) for a in args[1:])})"
    return f"{op}({', '.join(repr(a) for a in args)})"


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
            out = cache.evaluate((a.op, *a.values), values, test)
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
    by ``ordering`` (a planner/ordering.py variant, or "cost": catalogue cost only).

    Profiling pays only while the order may move and the moves save more than it costs
    (``adapt``): after a move, the evaluations per tuple the stage does are compared with the
    order's before it, and the difference accrues at the stage's measured time per evaluation
    (``saved_s``), against the time profiling took. (A profile-window estimate of the gain
    would not do: the tuples dropped carry other queries' bits, which the profile does not
    see, and a call's fixed cost spread over the few rows that reach a late position makes a
    late predicate look dear whatever it costs.) Once it has cost
    more than it saved, or half a warm-up's worth of profile tuples after a move moved nothing,
    only one batch in ``FLOOR`` is profiled (a profiled batch pays each predicate's fixed cost
    once, so fewer profiled batches, not fewer tuples per batch); every batch again after a
    move while profiling pays, or when a predicate's drop rate in the running order (known for
    free from the real work) moves by ``DRIFT`` from its rate since the order last moved — the
    profile window of the old stream is then dropped. ``previous``: the stage of the plan
    before, whose learned order, profile window and measured times carry over for the
    predicates both plans have."""

    DRIFT = 0.1  # drop rate moved by this much (absolute) on at least DRIFT_ROWS rows
    DRIFT_ROWS = 512
    FLOOR = 64  # the profiling probability falls to p / FLOOR
    DECAY = 0.9  # weight of a predicate's older calls in its time per tuple

    def __init__(self, plan: Plan, stream: str, ordering: str = "a-greedy", p: float = 0.01,
                 window: int = 1000, alpha: float = 0.9, stage: int = 500,
                 cache: ValueCache | None = None, seed: int = 0, timed: bool = True,
                 budget: float = 0.1, per_batch: int | None = None, adapt: bool = True,
                 previous: Residual | None = None):
        self.plan = plan
        self.users: dict[int, list[int]] = {}  # predicate id -> slots that check it
        for qp in plan.queries:
            if qp.query.stream == stream:
                for pid in qp.residual:
                    self.users.setdefault(pid, []).append(qp.slot)
        self.ids = plan.residual_order(stream)
        self._index = {pid: f for f, pid in enumerate(self.ids)}  # the ordering's filter ids
        self.keys = [plan.predicates[pid].predicate for pid in self.ids]
        self.ordering = ordering
        self.adaptive = AdaptiveOrder(len(self.ids), ordering, p=p, window=window,
                                      alpha=alpha, stage=stage, seed=seed) \
            if ordering != "cost" and len(self.ids) > 1 else None
        self.p = p
        self.every = 1  # profile every this many batches
        self.batches = 0
        self.adapt = adapt
        # profile tuples one predicate takes per batch
        self.per_batch = per_batch or max(1, window // 10)
        self.budget = budget
        self._profile_s = self._filter_s = 0.0  # time spent profiling; in the whole stage
        self.cache = cache
        self.timed = timed  # False: each predicate's time is its catalogue cost (no clock)
        self._rng = np.random.default_rng(seed)
        self.evaluated = 0  # predicate evaluations, for metrics and tests
        self.profile_evaluated = 0  # of them, evaluations only to profile
        self.carried = 0  # predicates whose learned state came from the plan before
        self.drifts = 0  # times a drop rate's move brought profiling back
        self._quiet = 0  # profile tuples since the order last moved
        self._learning = True  # a new stream: profile until the order first moves or holds
        self.saved_s = 0.0  # seconds the moves saved (evaluations spared, at their cost)
        self._was: float | None = None  # evaluations per tuple in the order before the move
        self._now = [0, 0]  # evaluations, tuples in the running order
        self._rates: dict[int, list[int]] = {}  # filter index -> [rows, drops] since then
        self._fits: dict[int, list[float]] = {}  # predicate id -> [seconds, rows], decayed
        if previous is not None:
            self._carry(previous)

    def __bool__(self) -> bool:
        return bool(self.users)

    def _carry(self, old: Residual) -> None:
        """Take the learned state of the predicates ``old`` also ran."""
        if old.cache is not None and self.cache is None:
            self.cache = old.cache
        self._profile_s, self._filter_s = old._profile_s, old._filter_s
        self.saved_s = old.saved_s
        olds = {k: pid for pid, k in zip(old.ids, old.keys, strict=True)}
        self._fits = {pid: old._fits[olds[k]] for pid, k in zip(self.ids, self.keys, strict=True)
                      if k in olds and olds[k] in old._fits}
        self.evaluated, self.profile_evaluated = old.evaluated, old.profile_evaluated
        where = {k: f for f, k in enumerate(self.keys)}
        mapping = {f: where[k] for f, k in enumerate(old.keys) if k in where}
        self.carried = len(mapping)
        if self.adaptive is None or old.adaptive is None or old.ordering != self.ordering:
            return
        self.adaptive.carry(old.adaptive, mapping)
        if self.carried == len(self.keys):  # nothing new to learn about
            self.every, self._quiet, self.drifts = old.every, old._quiet, old.drifts
            self._learning = old._learning
            self._rates = {mapping[f]: r for f, r in old._rates.items()}
            self._was, self._now = old._was, old._now

    def profile_s(self) -> float:
        """Seconds spent profiling and reordering."""
        return self._profile_s

    def filter_s(self) -> float:
        """Seconds of the predicates' real work (the stage's time less profiling)."""
        return self._filter_s - self._profile_s

    def order(self) -> list[int]:
        """Predicate ids in the order they run now."""
        if self.adaptive is None:
            return list(self.ids)
        return [self.ids[f] for f in self.adaptive.order]

    def _eval(self, pid: int, tb: Batch, rows: np.ndarray, real: bool = True
              ) -> tuple[np.ndarray, float]:
        """The predicate on ``rows`` and its time per tuple (measured, or its cost). A call
        costs a fixed part (taking the rows, finding distinct values) and a part per row, so
        a predicate's time is that of its real work, seconds over rows of its recent calls
        (``DECAY``); a profile call on a few tuples costs mostly the fixed part and is not
        counted (its own ratio stands in only before any real call)."""
        t0 = time.perf_counter()
        info = self.plan.predicates[pid]
        ok = eval_predicate(info.predicate, tb, rows, self.cache)
        if not self.timed:
            return ok, info.cost
        seconds = time.perf_counter() - t0
        f = self._fits.get(pid)
        if real:
            if f is None:
                f = self._fits[pid] = [0.0, 0.0]
            f[0] = f[0] * self.DECAY + seconds
            f[1] = f[1] * self.DECAY + len(rows)
        return ok, f[0] / f[1] if f else seconds / len(rows)

    def apply(self, tb: Batch, Q: np.ndarray) -> None:
        """Clear query bits whose residual predicates fail; each predicate once per tuple."""
        order = self.order()
        t0 = time.perf_counter()
        a = self.adaptive
        # profiling's share of the stage's time stays within the budget (measured times only)
        self.batches += 1
        profile = a is not None and self.batches % self.every == 0 and (
            not self.timed or self._profile_s <= self.budget * self._filter_s)
        before = (a.reorders, a.profiled) if a is not None else None
        seen, picks, took = [], [], {}
        for pos, pid in enumerate(order):
            slots = self.users[pid]
            need = np.zeros(len(tb), dtype=bool)
            for s in slots:
                need |= has_slot(Q, s)
            rows = np.flatnonzero(need)
            if not len(rows):
                continue
            ok, took[pid] = self._eval(pid, tb, rows)
            self.evaluated += len(rows)
            fail = rows[~ok]
            seen.append((self._index[pid], len(rows), len(fail)))
            for s in slots:
                clear_slot(Q, fail, s)
            if profile and len(fail):
                k = min(int(self._rng.binomial(len(fail), self.p)), self.per_batch)
                if k:  # one batch never fills the window by itself
                    picks.append((pos, np.sort(fail[self._rng.choice(len(fail), k, False)])))
        if picks:
            t1 = time.perf_counter()
            self._profile(tb, order, picks, took)
            self._profile_s += time.perf_counter() - t1
        self._filter_s += time.perf_counter() - t0
        if before is not None and self.adapt:
            self._tune(before, seen, len(tb))

    def _tune(self, before: tuple[int, int], seen: list[tuple[int, int, int]],
              tuples: int) -> None:
        """Profiling at full rate while it pays and the order may move, at the floor when it
        has cost more than the moves saved or half a warm-up's worth of profile tuples after a
        move moved nothing; back at full rate when a drop rate moves (the profile window of
        the old stream is then dropped)."""
        a = self.adaptive
        evals = sum(n for _, n, _ in seen)
        real = self.evaluated - self.profile_evaluated
        per_eval = (self._filter_s - self._profile_s) / real if real else 0.0
        if self._was is not None:  # evaluations spared against the order before the move
            self.saved_s += (self._was * tuples - evals) * per_eval
        self._now[0] += evals
        self._now[1] += tuples
        moved = a.reorders != before[0]
        if moved:  # this batch ran the old order; the profile after the move tells the rest
            self._was = self._now[0] / self._now[1]
            self._now = [0, 0]
            self._quiet, self._rates = -(a.profiled - before[1]), {}
        drifted = False
        for f, n, dropped in seen:
            r = self._rates.setdefault(f, [0, 0])
            if n >= self.DRIFT_ROWS and r[0] >= self.DRIFT_ROWS and \
                    abs(dropped / n - r[1] / r[0]) > self.DRIFT:
                drifted = True
            r[0] += n
            r[1] += dropped
        if drifted and self.every > 1:  # the stream changed: learn it afresh
            self.drifts += 1
            self.every, self._quiet, self._rates, self._learning = 1, 0, {}, True
            a.forget()
            return
        if len(a.profile) >= a.warmup:  # the reoptimizer had its say on these
            self._quiet += a.profiled - before[1]
        if moved:
            self._learning = False
        if self._quiet >= a.warmup // 2 or (
                not self._learning and self._profile_s > self.saved_s):
            self.every = self.FLOOR
        elif moved:
            self.every = 1

    def _profile(self, tb: Batch, order: list[int], picks: list[tuple[int, np.ndarray]],
                 took: dict[int, float]) -> None:
        """Profile the tuples sampled from those each position dropped (``picks``): the
        positions the variant asks for run on them too (their outcome changes nothing in Q),
        each predicate once on every tuple it is asked about. A predicate's time is its time
        per tuple in the real work of the batch (``took``), where it ran: a call on a few
        profile tuples costs mostly its fixed overhead."""
        a, index = self.adaptive, self._index
        asked: dict[int, list[np.ndarray]] = {}
        wants = [a.profile_positions(pos) for pos, _ in picks]  # before adds move Sweep on
        for (_, picked), later in zip(picks, wants, strict=True):
            for j in later:
                asked.setdefault(j, []).append(picked)
        outcome = {}
        for j, parts in asked.items():
            rows = np.unique(np.concatenate(parts))
            ok, t = self._eval(order[j], tb, rows, real=False)
            self.evaluated += len(rows)
            self.profile_evaluated += len(rows)
            outcome[j] = rows, ok
            took.setdefault(order[j], t)
        times = {index[pid]: t for pid, t in took.items()}
        for n, ((pos, picked), later) in enumerate(zip(picks, wants, strict=True)):
            fails = {}
            for j in later:
                rows, ok = outcome[j]
                fails[index[order[j]]] = ~ok[np.searchsorted(rows, picked)]
            evaluated = {index[pid] for pid in order[:pos + 1]} | set(fails)
            spent = {f: times[f] for f in evaluated if f in times}
            dropped = index[order[pos]]
            last = len(picked) - 1 if n == len(picks) - 1 else -1
            for i in range(len(picked)):
                drops = {dropped} | {f for f, bad in fails.items() if bad[i]}
                a.add(drops, evaluated, spent, check=i == last)

    def describe(self) -> dict:
        """The running order (for GET /prefilter)."""
        a = self.adaptive
        return {"ordering": self.ordering,
                "order": [self.plan.predicates[pid].predicate.text for pid in self.order()],
                "reorders": a.reorders if a else 0, "profile_tuples": a.profiled if a else 0,
                "profile_evaluations": self.profile_evaluated,
                "profile_probability": self.p / self.every if a else 0.0,
                "carried": self.carried, "drifts": self.drifts,
                "cache_hits": self.cache.hits if self.cache else 0,
                "cache_misses": self.cache.misses if self.cache else 0,
                "cache": self.cache.state() if self.cache else {}}
