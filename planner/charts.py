"""OM plan charts (seed 003): physical plans of each maintained LFTA node, chosen by a utility of
output rate and memory, indexed over a sel-λ chart built once with the plan and switched at
window boundaries as the stream drifts.

Cost model (§3.2, §4.1). A plan's cost is ``w_r / C_r + w_m · C_m``: ``C_r`` its output rate,
``C_m`` its memory. On a pipeline of operators (``pipeline``) each operator emits
``sel × min(input rate, tpr)`` (it cannot emit faster than it processes); its intermediate queue
holds what passes it in a window, ``sel × input rate × W``; the first operator's input buffer
holds the tuples arriving while it processes a window, ``λ · λW / tpr``, at most one window
(§3.1: an operator reads one window per round). These are the readings under which the paper's
Figure 2 example (λ = 500 tuples/s, W = 1 s) gives the figures its text quotes.

An LFTA node's candidate plans (``LftaPlan``) are pass-through (each tuple a spool row of its
own), and hash tables of several capacities flushed when their window closes or at a fraction of
it (``age``). Their output rate is in tuples per second accounted for in answers: the node's
arrival rate, capped by the LFTA's processing rate and by the node's share of Spark's merge rate
times the tuples each row carries; their memory is in rows held between batches (a table's
groups, up to its load limit; none for a pass-through, whose rows go to the spool with their
batch). Groups per window follow ``D · (1 − (1 − 1/D)^n)`` for ``n``
tuples of a population of ``D`` equally likely groups (planner/sizes.py's model), ``D`` solved
from the aggregate tree's node size; a full table empties itself (rows ``L · n / n_L`` where
``n_L`` tuples fill ``L`` groups).

The chart (Algorithm 1) splits selectivity [0, 1] and arrival rate into k regular partitions
each and stores the cheapest plan at each region's centroid. Beyond the paper, a region whose
plan changes inside it (probed near its corners, edge middles and centre) is split into
``refine`` × ``refine`` cells, each with the plan at its centroid: a plan diagram is uniform over
most of its area, and a coarse chart's misses are at its boundaries (with seven plans at
k = 10, a fifth of the rounds ran the plan of a region's centroid where another was cheaper),
so resolution is spent only there. A region is probed when a look-up first reaches it (a
plan rebuild builds a chart per node: probing every region up front cost it 20x). (A plan's
region narrower than the probes' spacing, wholly inside one region, is missed as the k × k
chart misses it.) Rates are partitioned regularly in
log λ over [λ_min, λ_max] by default (``lambda_scale``): they span five orders of magnitude,
and regular partitions of [0, λ_max] would put every rate below λ_max / k in one region (the
paper's linear partitions remain an option; the Figure 2 test uses them). The scheduler
(Algorithm 2) estimates both by a decay-weighted mean of the last d observed rounds (§4.3,
``G(r) = e^{-a·r}``; beyond the paper, of several decays the one that predicted best lately),
looks the estimate's region (cell) up and runs its plan for the next round (beyond the paper,
the plan indexed most often over the estimate spread by its own error); a *move* is a change
of cell, a *switch* a change of plan, a *hit* a round whose plan was the cheapest at the values
then observed (the paper's fidelity). Beyond the paper, a table plan's
window also measures the node's group population (the rows it emitted and still holds, fitted
to the model); a chart built on a population off by more than 2x is built again.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from planner.sizes import distinct_in_population

EDGE = (0.02, 0.5, 0.98)  # where a region is probed for a plan change: near its edges, middle


def cost(c_r: float, c_m: float, w_r: float, w_m: float) -> float:
    """The utility of §3.2: lower is better."""
    return (math.inf if c_r <= 0 else w_r / c_r) + w_m * c_m


@dataclass(frozen=True)
class Operator:
    name: str
    sel: float  # output tuples per input tuple
    tpr: float  # tuples per second it processes


def pipeline(ops: list[Operator], lam: float, window_s: float) -> tuple[float, float]:
    """(C_r, C_m) of operators run in this order on a stream of ``lam`` tuples/s (§4.1)."""
    if not ops:
        return lam, 0.0
    first = ops[0]
    c_m = lam * min(lam * window_s / first.tpr, window_s)  # the input buffer
    rate = free = lam
    for o in ops:
        rate = o.sel * min(rate, o.tpr)
        free *= o.sel
        c_m += free * window_s  # its intermediate queue
    return rate, c_m


@dataclass(frozen=True)
class ChartOptions:
    """The OM settings (config ``om``) the planner builds charts with."""

    k: int = 10
    w_r: float = 1e9  # per (tuple/s)^-1: 1e9 / 250k tuples/s = 4,000
    w_m: float = 0.05  # per row held: 65,536 rows = 3,277
    lambda_max: float = 2e7  # tuples/s at the chart's top
    lambda_min: float = 100.0  # and at its bottom (a log scale starts there)
    lambda_scale: str = "log"  # log | linear (the paper's)
    capacities: tuple[int, ...] = (4096, 65536, 1 << 20)
    max_load: float = 0.5
    age_fraction: float = 0.25  # an age-flushed table empties every this much of its window
    passthrough: bool = True
    spark_rows_per_s: float = 250_000.0  # this node's share of Spark's merge rate
    lfta_tuples_per_s: float = 20e6
    spool_rows_per_s: float = 2e6
    watermark_delay_s: float = math.inf  # Spark's: early plans only for periods within it
    refine: int = 8  # a region whose plan changes inside it is split into refine x refine cells
    spread: bool = True  # the plan most often cheapest under the estimates' own error

    def plans(self) -> list[LftaPlan]:
        out = [LftaPlan("passthrough")] if self.passthrough else []
        for c in self.capacities:
            out.append(LftaPlan("table", c, "window"))
            if self.age_fraction < 1:
                out.append(LftaPlan("table", c, "age"))
        return out


@dataclass(frozen=True)
class NodeModel:
    """What the estimates need to know of a node: its window, group population, and the
    selectivity and arrival rate the plan was built with (the scheduler's first estimate)."""

    period: int
    groups: float  # D: distinct groups (key, query-bit pattern) a window may hold
    sel: float = 1.0
    lam: float = 0.0


@dataclass(frozen=True)
class LftaPlan:
    """A physical plan of one LFTA node."""

    kind: str  # passthrough | table
    capacity: int = 0
    flush: str = "window"  # window | age

    @property
    def name(self) -> str:
        if self.kind == "passthrough":
            return "passthrough"
        return f"table {self.capacity}/{self.flush}"

    def estimate(self, sel: float, lam: float, node: NodeModel, o: ChartOptions
                 ) -> tuple[float, float]:
        """(C_r tuples/s, C_m rows held) at selectivity ``sel`` and ``lam`` tuples/s."""
        rate = max(sel * lam, 0.0)
        n = rate * node.period  # the node's tuples per window
        if self.kind == "passthrough":
            return min(rate, o.spool_rows_per_s, o.spark_rows_per_s), 0.0
        limit = max(1, int(self.capacity * o.max_load))
        pieces = 1 if self.flush == "window" else max(1, round(1 / o.age_fraction))
        rows, held = _table(n / pieces, limit, node.groups)
        rows *= pieces
        per_row = n / rows if rows > 0 else 1.0
        return min(rate, o.lfta_tuples_per_s, o.spark_rows_per_s * per_row), held


def _groups(n: float, D: float) -> float:
    """Expected distinct groups among ``n`` tuples of ``D`` equally likely ones."""
    if n <= 0 or D <= 0:
        return 0.0
    if D <= 1:
        return 1.0
    return D * -math.expm1(n * math.log1p(-1.0 / D))


def _table(n: float, limit: int, D: float) -> tuple[float, float]:
    """(rows flushed, rows held at most) by a table of ``limit`` groups given ``n`` tuples."""
    g = _groups(n, D)
    if g <= limit:
        return g, g
    n_fill = math.log1p(-limit / D) / math.log1p(-1.0 / D)  # tuples to fill the table
    return limit * n / n_fill, float(limit)


def fit_groups(n: float, limit: int, rows: float) -> float | None:
    """The group population a window of ``n`` tuples showed a table of ``limit`` groups that
    emitted or held ``rows`` rows; None when the rows say nothing (no tuples). A table that
    held them all counted its groups exactly. One that overflowed emptied itself whole each
    time, so a hot group came out again after each flush: the window had between ``limit``
    and ``rows`` groups, and the upper bound is taken (skewed traffic fills a table slowly
    with its hot groups, which the uniform model would read as few groups); the next window,
    under a larger table, counts them."""
    if n <= 0 or rows <= 0:
        return None
    if rows <= limit:
        return max(1.0, distinct_in_population(rows, n, n * 1e6))
    return float(rows)


def node_model(period: int, size: float, tuples: float, stream_tuples: float) -> NodeModel:
    """A node the aggregate tree sized at ``size`` rows per period from ``tuples`` of the
    stream's ``stream_tuples``."""
    D = distinct_in_population(size, tuples, max(size, tuples) * 1e6) if tuples > 0 else size
    sel = min(1.0, tuples / stream_tuples) if stream_tuples > 0 else 1.0
    return NodeModel(period, max(1.0, D), sel, stream_tuples / period)


@dataclass
class Chart:
    """A k×k sel-λ chart (Algorithm 1): ``grid[i][j]`` is the plan index of region G(i, j)."""

    plans: list[LftaPlan]
    k: int
    grid: list[list[int]]
    node: NodeModel
    options: ChartOptions = field(repr=False, default_factory=ChartOptions)
    estimate: Callable[[object, float, float], tuple[float, float]] | None = field(
        default=None, repr=False)  # (plan, sel, λ) -> (C_r, C_m)
    # each region probed so far: its refine x refine cells' plans where the plan changes
    # inside it, else None (regions are probed when first looked up: a plan rebuild builds a
    # chart per node, and probing all k x k regions would cost it 20x Algorithm 1's time)
    _probed: dict[tuple[int, int], list[list[int]] | None] = field(
        default_factory=dict, repr=False)

    @classmethod
    def build(cls, node: NodeModel, o: ChartOptions, plans: list | None = None,
              estimate=None) -> Chart:
        """Algorithm 1: each region's centroid priced under every plan."""
        plans = plans if plans is not None else o.plans()
        chart = cls(plans, o.k, [], node, o,
                    estimate or (lambda p, s, lam: p.estimate(s, lam, node, o)))
        for i in range(o.k):
            sel = (i + 0.5) / o.k
            chart.grid.append([chart.best(sel, chart.lam_at(j + 0.5)) for j in range(o.k)])
        return chart

    def _sub(self, i: int, j: int) -> list[list[int]] | None:
        """Region (i, j)'s cells where its plan changes inside it (None: uniform at the probes,
        or no refinement)."""
        if (i, j) in self._probed:
            return self._probed[i, j]
        k, m, sub = self.k, self.options.refine, None
        if m > 1 and len({self.best((i + a) / k, self.lam_at(j + b))
                          for a in EDGE for b in EDGE}) > 1:
            sub = [[self.best((i + (u + 0.5) / m) / k, self.lam_at(j + (v + 0.5) / m))
                    for v in range(m)] for u in range(m)]
        self._probed[i, j] = sub
        return sub

    @property
    def cells(self) -> dict[tuple[int, int], list[list[int]]]:
        """Every refined region's cells (probes the regions not looked up yet)."""
        return {(i, j): sub for i in range(self.k) for j in range(self.k)
                if (sub := self._sub(i, j)) is not None}

    def _log(self) -> bool:
        return self.options.lambda_scale == "log"

    def lam_at(self, x: float) -> float:
        """λ at ``x`` partitions from the chart's bottom (x + 0.5: a region's centroid)."""
        o = self.options
        if self._log():
            lo, hi = math.log(o.lambda_min), math.log(o.lambda_max)
            return math.exp(lo + (hi - lo) * x / self.k)
        return x * o.lambda_max / self.k

    def best(self, sel: float, lam: float) -> int:
        """The cheapest plan at exactly (sel, λ) (ties: the first)."""
        o = self.options
        costs = [cost(*self.estimate(p, sel, lam), o.w_r, o.w_m) for p in self.plans]
        return min(range(len(costs)), key=costs.__getitem__)

    def _at(self, sel: float, lam: float) -> tuple[float, float]:
        """(sel, λ) in partitions from the chart's corner, clamped to the chart."""
        o = self.options
        if self._log():
            lo, hi = math.log(o.lambda_min), math.log(o.lambda_max)
            x = (math.log(max(lam, o.lambda_min)) - lo) / (hi - lo)
        else:
            x = lam / o.lambda_max
        top = self.k * (1 - 1e-12)
        return min(top, max(0.0, sel * self.k)), min(top, max(0.0, x * self.k))

    def region(self, sel: float, lam: float) -> tuple[int, int]:
        """The region bounding (sel, λ); values off the chart fall in its edge regions."""
        a, b = self._at(sel, lam)
        return int(a), int(b)

    def cell(self, sel: float, lam: float) -> tuple[int, int, int, int]:
        """The region and, in a refined one, the cell bounding (sel, λ) (0, 0 elsewhere)."""
        a, b = self._at(sel, lam)
        i, j = int(a), int(b)
        if self._sub(i, j) is None:
            return i, j, 0, 0
        m = self.options.refine
        return i, j, min(m - 1, int((a - i) * m)), min(m - 1, int((b - j) * m))

    def plan_of(self, cell: tuple[int, int, int, int]) -> int:
        i, j, u, v = cell
        sub = self._sub(i, j)
        return self.grid[i][j] if sub is None else sub[u][v]

    def plan_at(self, sel: float, lam: float) -> int:
        return self.plan_of(self.cell(sel, lam))

    def start(self) -> tuple[float, float]:
        """The point a node starts at before any window was observed: the selectivity the plan
        was built with, and the chart's top rate, so the first window runs the plan that bounds
        Spark's load most (a table: a replayed file arrives far faster than it was captured,
        and the plan's own rate is the capture's)."""
        return self.node.sel, self.options.lambda_max

    def to_json(self) -> dict:
        o = self.options
        return {"k": self.k, "selectivity": [0.0, 1.0],
                "lambda": [o.lambda_min if self._log() else 0.0, o.lambda_max],
                "lambda_scale": o.lambda_scale,
                "plans": [p.name for p in self.plans], "groups": self.node.groups,
                "measured": {"selectivity": self.node.sel, "lambda": self.node.lam},
                "initial": self.plans[self.plan_at(*self.start())].name,
                "spark_rows_per_s": self.options.spark_rows_per_s, "grid": self.grid,
                "refine": o.refine,
                # of the regions looked up so far (a copy: the engine may probe one meanwhile)
                "cells": {f"{i},{j}": sub for (i, j), sub in sorted(dict(self._probed).items())
                          if sub is not None}}

    def explain(self, indent: str = "      ") -> list[str]:
        """The chart as rows of plan letters, selectivity down, λ across."""
        letters = "abcdefghijklmnopqrstuvwxyz"
        used = sorted({x for row in self.grid for x in row}
                      | {x for sub in self.cells.values() for row in sub for x in row})
        o = self.options
        lo = o.lambda_min if self._log() else 0
        lines = [f"{indent}chart {self.k}x{self.k} (sel 0..1 down, λ {lo:,.0f}..{o.lambda_max:,.0f}"
                 f"/s across, {o.lambda_scale}): " + ", ".join(f"{letters[x]} {self.plans[x].name}"
                                                              for x in used)]
        if self.cells:
            lines[0] += f"; {len(self.cells)} regions where the plan changes split " \
                f"{o.refine}x{o.refine}"
        if self.k <= 20:
            for row in self.grid:
                lines.append(indent + "  " + "".join(letters[x] for x in row))
        return lines


class Estimator:
    """The decay-weighted mean of the last ``d`` observations (§4.3)."""

    def __init__(self, d: int = 5, a: float = 0.5, initial: float | None = None):
        self.d, self.a = d, a
        self.seen: deque[float] = deque(maxlen=d)
        self.initial = initial

    def observe(self, x: float) -> None:
        self.seen.append(x)

    def estimate(self) -> float | None:
        if not self.seen:
            return self.initial
        num = den = 0.0
        for r, x in enumerate(reversed(self.seen)):
            g = math.exp(-self.a * r)
            num += x * g
            den += g
        return num / den


class Tracker:
    """The estimate of one statistic for the next round: decay-weighted means (§4.3) of the last
    ``d`` observations under several decays (``a`` and multiples, and none); the one whose
    one-round-ahead predictions erred least over the last ``memory`` rounds is used (a smooth
    stream wants little smoothing, an erratic one more), and its root-mean-square error is
    the estimate's spread. ``log``: tracked as its logarithm (arrival rates vary by
    factors)."""

    DECAYS = (0.0, 1.0, 2.0, 4.0, 16.0)  # multiples of a

    def __init__(self, d: int = 5, a: float = 0.5, initial: float | None = None,
                 log: bool = False, memory: int = 20):
        self.log = log
        first = self._in(initial) if initial is not None else None
        self.ests = [Estimator(d, a * m, first) for m in self.DECAYS]
        self.errors = [deque(maxlen=memory) for _ in self.DECAYS]

    def _in(self, x: float) -> float:
        return math.log(max(x, 1e-9)) if self.log else x

    def observe(self, x: float) -> None:
        v = self._in(x)
        for e, q in zip(self.ests, self.errors, strict=True):
            if e.seen:
                q.append((e.estimate() - v) ** 2)
            e.observe(v)

    def _best(self) -> int:
        return min(range(len(self.ests)),
                   key=lambda i: (sum(self.errors[i]) / len(self.errors[i])
                                  if self.errors[i] else math.inf, i))

    def estimate(self) -> float | None:
        v = self.ests[self._best()].estimate()
        return None if v is None else math.exp(v) if self.log else v

    def spread(self) -> float:
        """Root-mean-square error of the estimate used (in log units when ``log``)."""
        q = self.errors[self._best()]
        return math.sqrt(sum(q) / len(q)) if q else 0.0

    def at(self, z: float) -> float:
        """The estimate ``z`` spreads away."""
        v = self.ests[self._best()].estimate() + z * self.spread()
        return math.exp(v) if self.log else v


SPREAD = ((-2.0, 0.054), (-1.0, 0.242), (0.0, 0.399), (1.0, 0.242), (2.0, 0.054))  # z, weight


class Scheduler:
    """Algorithm 2 for one node: the plan of each round from the chart and the estimates.

    Beyond the paper: each statistic's estimate is its best-predicting decay (``Tracker``),
    and, with ``options.spread``, the round runs the plan the chart indexes most often over the
    estimates spread by their own error (a normal's five points per dimension), not at the
    point estimate alone: next to a boundary, or in a plan's narrow band, the point misses
    whenever the noise crosses it. (A scheduler that knew each round's noise-free values
    would still miss where the noise crosses a boundary: bench/README gives that bound.)"""

    def __init__(self, chart: Chart, sel: float, lam: float, d: int = 5, a: float = 0.5,
                 plan: int | None = None):
        """``plan``: the one to run before any round was observed (default: the chart's at
        (sel, λ))."""
        self.chart = chart
        self.sel = Tracker(d, a, sel)
        self.lam = Tracker(d, a, lam, log=True)
        self.where = chart.cell(sel, lam)
        self.plan = chart.plan_of(self.where) if plan is None else plan
        self.rounds = self.hits = self.moves = self.switches = self.rebuilds = 0

    def regroup(self, groups: float) -> bool:
        """The node's group population as a window measured it: the chart is built again
        (Algorithm 1 on the same options) when it is off by more than 2x from the one the chart
        was built with (a sample underestimates the rare groups of skewed traffic). Returns
        whether it was."""
        old = self.chart.node
        if old.groups / 2 <= groups <= old.groups * 2:
            return False
        self.chart = Chart.build(replace(old, groups=groups), self.chart.options)
        self.rebuilds += 1
        return True

    def choose(self) -> int:
        """The plan for the next round."""
        chart = self.chart
        if not chart.options.spread or not (self.sel.spread() or self.lam.spread()):
            return chart.plan_of(self.where)
        votes: dict[int, float] = {}
        for zs, ws in SPREAD:
            sel = self.sel.at(zs)
            for zl, wl in SPREAD:
                p = chart.plan_at(sel, self.lam.at(zl))
                votes[p] = votes.get(p, 0.0) + ws * wl
        here = chart.plan_of(self.where)  # ties: the point estimate's
        return max(votes, key=lambda p: (votes[p], p == here))

    def end_round(self, sel_o: float, lam_o: float) -> int:
        """Account the round just run (its observed selectivity and rate) and return the plan
        of the next one."""
        self.rounds += 1
        self.hits += self.plan == self.chart.best(sel_o, lam_o)
        self.sel.observe(sel_o)
        self.lam.observe(lam_o)
        where = self.chart.cell(self.sel.estimate(), self.lam.estimate())
        if where != self.where:
            self.moves += 1
            self.where = where
        plan = self.choose()
        if plan != self.plan:
            self.switches += 1
            self.plan = plan
        return plan

    @property
    def fidelity(self) -> float | None:
        return self.hits / self.rounds if self.rounds else None

    def state(self) -> dict:
        return {"plan": self.chart.plans[self.plan].name, "region": list(self.where[:2]),
                "cell": list(self.where), "selectivity": self.sel.estimate(),
                "lambda": self.lam.estimate(), "spread": {"selectivity": self.sel.spread(),
                                                          "log_lambda": self.lam.spread()},
                "rounds": self.rounds, "hits": self.hits, "fidelity": self.fidelity,
                "moves": self.moves, "switches": self.switches, "groups": self.chart.node.groups,
                "chart_rebuilds": self.rebuilds}
