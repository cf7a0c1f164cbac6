"""Adaptive ordering of commutative pipelined filters (seed 001, Babu et al., "Adaptive Ordering
of Pipelined Stream Filters"): A-Greedy and its variants Sweep, Independent and LocalSwaps.

Pure: no I/O, no clock. The caller runs the filters in ``order`` on each tuple and, for a
dropped tuple the profiler picks (``wants_profile``, probability ``p``), also evaluates the
positions ``profile_positions`` names and hands the outcome to ``add``. The profile is a
tuple-based sliding window of ``window`` profile tuples; the reoptimizer keeps the matrix view V
over it (Figure 3), detects violations of the variant's invariant with the thrashing-avoidance
parameter ``alpha`` (Figure 4, equation 4) and corrects them (Figure 5).

- ``a-greedy``: every filter after the one that dropped the tuple is evaluated; V is kept whole
  (upper triangular); the Greedy Invariant ``V[i,i]/a_f(i) >= V[i,j]/a_f(j)`` for all i <= j.
- ``sweep``: one position j is profiled per stage (j = 2..n, round robin): V's diagonal and
  column j; a stage ends at a violation (the filter at j moves up to where it belongs) or after
  ``stage`` profile tuples without one. A new stage starts with an empty profile.
- ``independent``: first row of V only (unconditional drop rates): filters sorted by
  ``V[1,j]/a_f(j)``; like Eddies, blind to correlation.
- ``localswaps``: V's diagonal and first super-diagonal: adjacent filters swap when the later
  one drops more of what the earlier one passes. The profile restarts after a swap.

Processing times ``a_i`` are running averages over the profile window of the times the caller
measured (or 1 when it gives none).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

VARIANTS = ("a-greedy", "sweep", "independent", "localswaps")


@dataclass
class Profile:
    """One profile tuple: which filters (by index) dropped it among those evaluated, and the
    time each evaluated filter took."""

    drops: frozenset[int]
    evaluated: frozenset[int]
    times: dict[int, float] = field(default_factory=dict)


class AdaptiveOrder:
    """The ordering of ``n`` filters maintained online by one of ``VARIANTS``."""

    def __init__(self, n: int, variant: str = "a-greedy", *, p: float = 0.01,
                 window: int = 500, alpha: float = 1.0, stage: int = 500, seed: int = 0,
                 order: list[int] | None = None, warmup: int = 100):
        if variant not in VARIANTS:
            raise ValueError(f"ordering variant is one of {', '.join(VARIANTS)}")
        if not 0 < alpha <= 1:
            raise ValueError("alpha (thrashing avoidance) is in (0, 1]")
        self.n, self.variant, self.p, self.window, self.alpha = n, variant, p, window, alpha
        self.stage_len = stage
        # the reoptimizer acts once the profile can be trusted (section 4.1.1: statistics
        # estimated with high confidence), not on the first few profile tuples
        self.warmup = min(warmup, window, stage)
        self.order = list(order) if order is not None else list(range(n))
        self.profile: deque[Profile] = deque()
        self.V = [[0] * n for _ in range(n)]  # V[r][c], positions, 0-based
        self._time_sum = [0.0] * n  # by filter index, over the window
        self._time_n = [0] * n
        self._rng = random.Random(seed)
        self.profiled = 0  # profile tuples added
        self.reorders = 0  # times the ordering changed
        self.violations = 0  # invariant violations detected
        self.sweep_j = 1  # Sweep: the profiled position
        self._stage_seen = 0
        self.work = 0.0  # time spent evaluating filters in order (``process``)
        self.profile_work = 0.0  # time spent evaluating filters only to profile

    def process(self, drops: frozenset[int], times: list[float] | None = None) -> bool:
        """Run one tuple, whose outcome is known (``drops``: the filters that drop it),
        through the ordering as the residual stage would, profiling it when it is dropped and
        picked; returns whether it passed every filter. ``times[f]`` is filter f's cost."""
        for pos, f in enumerate(self.order):
            self.work += times[f] if times else 1.0
            if f in drops:
                if self.wants_profile():
                    extra = [self.order[k] for k in self.profile_positions(pos)]
                    self.profile_work += sum(times[g] if times else 1.0 for g in extra)
                    evaluated = set(self.order[:pos + 1]) | set(extra)
                    self.add(drops & evaluated, evaluated,
                             {g: times[g] for g in evaluated} if times else None)
                return False
        return True

    def carry(self, old: AdaptiveOrder, mapping: dict[int, int]) -> None:
        """Take what ``old`` learned for the filters both have (``mapping``: old index -> this
        one's): their order first, as ``old`` ran them, then this one's new filters in their
        order (later positions are profiled on every profile tuple, so new filters are
        learned about first); the profile window restricted to the kept filters, their
        measured times, and the counters. A filter ``old`` had and this one has not is
        forgotten: a profile tuple it alone dropped now passes every filter it saw."""
        kept = [mapping[f] for f in old.order if f in mapping]
        fresh = set(kept)
        self.order = kept + [f for f in self.order if f not in fresh]
        self.profile.clear()
        self._time_sum, self._time_n = [0.0] * self.n, [0] * self.n
        for t in old.profile:
            self.profile.append(Profile(
                frozenset(mapping[f] for f in t.drops if f in mapping),
                frozenset(mapping[f] for f in t.evaluated if f in mapping),
                {mapping[f]: x for f, x in t.times.items() if f in mapping}))
        while len(self.profile) > self.window:
            self.profile.popleft()
        for t in self.profile:
            for f, x in t.times.items():
                self._time_sum[f] += x
                self._time_n[f] += 1
        self.profiled, self.reorders, self.violations = old.profiled, old.reorders, \
            old.violations
        self.work, self.profile_work = old.work, old.profile_work
        self._recompute()

    # -- the profiler
    def wants_profile(self) -> bool:
        """Whether to profile the tuple just dropped (drop-profiling probability ``p``)."""
        return self._rng.random() < self.p

    def profile_positions(self, dropped_at: int) -> list[int]:
        """Positions, after ``dropped_at`` (the position whose filter dropped the tuple), that
        the profiler evaluates too."""
        n = self.n
        if self.variant in ("a-greedy", "independent"):
            return list(range(dropped_at + 1, n))
        if self.variant == "sweep":
            return [self.sweep_j] if self.sweep_j > dropped_at else []
        return [dropped_at + 1] if dropped_at + 1 < n else []  # localswaps

    def a(self, f: int) -> float:
        """Average processing time of filter ``f`` over the window (1 without samples)."""
        return self._time_sum[f] / self._time_n[f] if self._time_n[f] else 1.0

    def timed(self, f: int) -> bool:
        """Whether the window holds a measured time of filter ``f``."""
        return self._time_n[f] > 0

    def forget(self) -> None:
        """Empty the profile window (the stream it described is gone); the order stays."""
        self._reset()

    # -- the matrix view
    def _dropped_at(self, t: Profile) -> int:
        for pos, f in enumerate(self.order):
            if f in t.drops:
                return pos
        return self.n

    def _update(self, t: Profile, delta: int) -> None:
        """Figure 3 (insert with +1, delete with -1), limited to the entries this variant
        keeps."""
        dc = self._dropped_at(t)
        if dc >= self.n:
            return
        for c in range(dc, self.n):
            if self.order[c] not in t.drops:
                continue
            for r in range(0, dc + 1):
                if self._kept(r, c):
                    self.V[r][c] += delta

    def _kept(self, r: int, c: int) -> bool:
        v = self.variant
        if v == "a-greedy":
            return r <= c
        if v == "independent":
            return r == 0
        if v == "sweep":
            return r == c or (c == self.sweep_j and r < c)
        return c == r or c == r + 1  # localswaps

    def add(self, drops: set[int] | frozenset[int], evaluated: set[int] | frozenset[int],
            times: dict[int, float] | None = None, check: bool = True) -> bool:
        """Insert a profile tuple (``drops`` and ``evaluated`` are filter indexes); returns
        whether the ordering changed. ``check=False`` defers the reoptimizer to a later
        profile tuple (the residual stage checks once per batch's profile tuples, not after
        each: the reoptimizer costs more than the tuples' updates)."""
        t = Profile(frozenset(drops), frozenset(evaluated), dict(times or {}))
        self.profiled += 1
        self.profile.append(t)
        self._update(t, +1)
        for f, x in t.times.items():
            self._time_sum[f] += x
            self._time_n[f] += 1
        if len(self.profile) > self.window:
            old = self.profile.popleft()
            self._update(old, -1)
            for f, x in old.times.items():
                self._time_sum[f] -= x
                self._time_n[f] -= 1
        changed = False
        for _ in range(self.n if check and len(self.profile) >= self.warmup else 0):
            # a correction may uncover the next violation
            if not self._reoptimize():
                break
            changed = True
            if self.variant in ("sweep", "localswaps"):
                break  # a fresh profile decides the next move
        if self.variant == "sweep" and not changed:
            self._stage_seen += 1
            if self._stage_seen >= self.stage_len:
                self._next_stage()
        return changed

    # -- the reoptimizer
    def _ratio(self, r: int, c: int) -> float:
        return self.V[r][c] / self.a(self.order[c])

    def _violation(self) -> int | None:
        """Figure 4: the first position i with a later position j whose ratio beats it by
        more than the thrashing-avoidance margin (equation 4); None when the invariant
        holds."""
        n, v = self.n, self.variant
        for i in range(n - 1):
            if v == "independent" or v == "a-greedy":
                row = 0 if v == "independent" else i
                cols = range(i + 1, n)
            elif v == "sweep":
                if i >= self.sweep_j:
                    break
                row, cols = i, [self.sweep_j]
            else:
                row, cols = i, [i + 1]
            left = self._ratio(row, i)
            if any(left < self.alpha * self._ratio(row, j) for j in cols):
                return i
        return None

    def _reoptimize(self) -> bool:
        i = self._violation()
        if i is None:
            return False
        self.violations += 1
        before = list(self.order)
        v = self.variant
        if v == "a-greedy":
            self._correct(i)
        elif v == "independent":  # V's first row counts each filter's drops
            drops = {f: self.V[0][c] for c, f in enumerate(self.order)}
            self.order.sort(key=lambda f: -drops[f] / self.a(f))
            self._recompute()
        elif v == "sweep":  # Figure 5's step for row i: the profiled filter takes position i
            j = self.sweep_j
            self.order[i], self.order[j] = self.order[j], self.order[i]
            self._next_stage()
        else:  # localswaps
            self.order[i], self.order[i + 1] = self.order[i + 1], self.order[i]
            self._reset()
        if self.order != before:
            self.reorders += 1
            return True
        return False

    def _correct(self, i: int) -> None:
        """Figure 5: from position i on, recompute each row from the profile window and bring
        the filter with the highest ratio to the row's position, until the invariant holds
        at every position up to the last one moved."""
        maxr = i
        r = i
        while r <= maxr and r < self.n:
            self.V[r] = [0] * self.n
            for t in self.profile:
                if any(self.order[k] in t.drops for k in range(r)):
                    continue
                for c in range(r, self.n):
                    if self.order[c] in t.drops:
                        self.V[r][c] += 1
            maxc = r
            for c in range(r + 1, self.n):
                if self._ratio(r, c) > self._ratio(r, maxc):
                    maxc = c
                    maxr = max(maxr, maxc)
            if maxc != r:
                self.order[r], self.order[maxc] = self.order[maxc], self.order[r]
                for k in range(r + 1):
                    self.V[k][r], self.V[k][maxc] = self.V[k][maxc], self.V[k][r]
            r += 1
        self._recompute()  # rows below r refer to the new positions

    def _recompute(self) -> None:
        """V from the profile window for the current order (after a reorder)."""
        self.V = [[0] * self.n for _ in range(self.n)]
        for t in self.profile:
            self._update(t, +1)

    def _reset(self) -> None:
        self.profile.clear()
        self.V = [[0] * self.n for _ in range(self.n)]
        self._time_sum = [0.0] * self.n
        self._time_n = [0] * self.n

    def _next_stage(self) -> None:
        """Sweep: profile the next position, from an empty profile."""
        self.sweep_j = self.sweep_j + 1 if self.sweep_j + 1 < self.n else 1
        self._stage_seen = 0
        self._reset()


def greedy_order(profile: list[Profile] | deque[Profile], n: int,
                 times: list[float] | None = None) -> list[int]:
    """Static Greedy (section 4) on a profile: the filter with the highest drop rate per unit
    of time first, then the highest among the tuples it passes, and so on."""
    t = times or [1.0] * n
    left = list(range(n))
    rest = list(profile)
    order: list[int] = []
    while left:
        best = max(left, key=lambda f: (sum(1 for x in rest if f in x.drops) / t[f], -f))
        order.append(best)
        left.remove(best)
        rest = [x for x in rest if best not in x.drops]
    return order


def cost(order: list[int], tuples: list[frozenset[int]], times: list[float]) -> float:
    """Equation 1 measured: the mean time to process a tuple (the filters that drop it given),
    each tuple running filters in ``order`` until the first that drops it."""
    total = 0.0
    for drops in tuples:
        for f in order:
            total += times[f]
            if f in drops:
                break
    return total / len(tuples) if tuples else 0.0
