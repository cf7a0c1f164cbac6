"""OM plan charts (seed 003) against the paper's worked example, hand-worked estimates, and a
simulation of the hash tables the LFTA plans model."""

from __future__ import annotations

import math

import numpy as np
import pytest

from planner.charts import (
    Chart,
    ChartOptions,
    Estimator,
    LftaPlan,
    NodeModel,
    Operator,
    Scheduler,
    Tracker,
    cost,
    fit_groups,
    pipeline,
)

O1, O2 = Operator("o1", 0.5, 500), Operator("o2", 0.1, 50)  # Figure 2's operators
PLANS = {"p1": [O1, O2], "p2": [O2, O1]}


def test_figure_2_costs_and_choices():
    """§3.2's example: p1 (o1 first) has C_r = 5.0 and C_m = 775, p2 has 2.5 and 575; under
    assignment 1 (w_r 0.1, w_m 0.9) the costs are 697.52 and 517.54 and p2 wins, under
    assignment 2 (20000, 2) 5550 and 9150 and p1 wins. Figure 2 itself is not in the text:
    λ = 500 tuples/s and W = 1 s are the values under which §4.1's formulas give those
    figures."""
    assert pipeline(PLANS["p1"], 500, 1) == pytest.approx((5.0, 775.0))
    assert pipeline(PLANS["p2"], 500, 1) == pytest.approx((2.5, 575.0))
    for (w_r, w_m), want, winner in (((0.1, 0.9), (697.52, 517.54), "p2"),
                                     ((20000, 2), (5550, 9150), "p1")):
        got = {p: cost(*pipeline(ops, 500, 1), w_r, w_m) for p, ops in PLANS.items()}
        assert (got["p1"], got["p2"]) == pytest.approx(want)
        assert min(got, key=got.get) == winner


@pytest.mark.parametrize(("w_r", "w_m", "winner"), [(0.1, 0.9, "p2"), (20000, 2, "p1")])
def test_a_chart_on_figure_2_indexes_the_papers_choice(w_r, w_m, winner):
    """Algorithm 1 over (selectivity of o2, λ): with k = 5 and λ up to 1,000/s the region
    G(0, 2) has its centroid at the example's point (0.1, 500), and indexes the paper's plan
    under both weight assignments."""
    names = list(PLANS)

    def estimate(p, sel, lam):
        o2 = Operator("o2", sel, 50)
        return pipeline([O1, o2] if p == "p1" else [o2, O1], lam, 1)
    o = ChartOptions(k=5, w_r=w_r, w_m=w_m, lambda_max=1000, lambda_scale="linear")
    chart = Chart.build(NodeModel(1, 1.0), o, names, estimate)
    assert chart.region(0.1, 500) == (0, 2)
    assert names[chart.grid[0][2]] == winner
    assert names[chart.plan_at(0.1, 500)] == winner
    # every region holds the cheapest plan at its centroid
    for i in range(5):
        for j in range(5):
            sel, lam = (i + 0.5) / 5, (j + 0.5) * 200
            costs = [cost(*estimate(p, sel, lam), w_r, w_m) for p in names]
            assert chart.grid[i][j] == int(np.argmin(costs))


def test_regions_clamp_off_the_chart():
    chart = Chart.build(NodeModel(60, 100.0), ChartOptions(k=4, lambda_max=100,
                                                           lambda_scale="linear"))
    assert chart.region(-0.1, -5) == (0, 0)
    assert chart.region(1.0, 100) == (3, 3)
    assert chart.region(0.26, 10**9) == (1, 3)


def test_log_scale_regions():
    """Rates partitioned regularly in log λ: 100 to 10^6 tuples/s in 4 regions of 10x."""
    o = ChartOptions(k=4, lambda_min=100, lambda_max=1e6)
    chart = Chart.build(NodeModel(60, 100.0), o)
    assert [chart.region(0.5, lam)[1] for lam in (1, 100, 999, 1001, 99_999, 100_001, 1e9)] \
        == [0, 0, 0, 1, 2, 3, 3]
    assert chart.lam_at(0.5) == pytest.approx(10 ** 2.5)


def test_decay_weighted_estimate():
    """§4.3 by hand: with a = ln 2 the last value weighs 1, the one before 1/2, then 1/4."""
    e = Estimator(d=3, a=math.log(2), initial=7.0)
    assert e.estimate() == 7.0
    for x in (8.0, 4.0, 2.0):
        e.observe(x)
    assert e.estimate() == pytest.approx((2 + 4 / 2 + 8 / 4) / (1 + 1 / 2 + 1 / 4))
    e.observe(1.0)  # d = 3: the 8 leaves
    assert e.estimate() == pytest.approx((1 + 2 / 2 + 4 / 4) / (1 + 1 / 2 + 1 / 4))


def test_moves_switches_and_hits():
    """Algorithm 2 on a 2-plan chart whose two left columns index the same plan: crossing
    between them is a move without a switch; a hit is a round whose plan was the cheapest at
    the values observed in it."""
    def estimate(p, sel, lam):  # plan 0 is cheap below λ = 50, plan 1 above
        return (1.0, 0.0) if (p == 0) == (lam < 50) else (1.0, 1.0)
    o = ChartOptions(k=4, w_r=0.0, w_m=1.0, lambda_max=100, lambda_scale="linear")
    chart = Chart.build(NodeModel(1, 1.0), o, [0, 1], estimate)
    assert [row[:2] for row in chart.grid] == [[0, 0]] * 4
    assert [row[2:] for row in chart.grid] == [[1, 1]] * 4
    s = Scheduler(chart, 0.5, 10, d=1)
    assert s.plan == 0
    assert s.end_round(0.5, 30) == 0  # region (2, 0) -> (2, 1): a move, the same plan
    assert (s.moves, s.switches, s.hits) == (1, 0, 1)
    assert s.end_round(0.5, 80) == 1  # ran plan 0 while λ was 80: a miss; now a switch
    assert (s.moves, s.switches, s.hits, s.rounds) == (2, 1, 1, 2)
    assert s.end_round(0.5, 90) == 1
    assert (s.moves, s.switches, s.hits, s.fidelity) == (2, 1, 2, pytest.approx(2 / 3))


def _simulate(n: int, limit: int, D: int, seed: int) -> tuple[int, int]:
    """Rows flushed and most rows held by a table of ``limit`` groups that empties when full,
    given ``n`` draws among ``D`` equally likely groups."""
    rng = np.random.default_rng(seed)
    held: set[int] = set()
    rows = peak = 0
    for g in rng.integers(0, D, n).tolist():
        if g not in held and len(held) == limit:
            rows += len(held)
            held.clear()
        held.add(g)
        peak = max(peak, len(held))
    return rows + len(held), peak


@pytest.mark.parametrize(("n", "limit", "D"), [(20_000, 100_000, 5_000), (50_000, 1_000, 5_000),
                                               (30_000, 2_048, 100_000)])
def test_table_model_matches_a_simulation(n, limit, D):
    """The rows a table plan sends to Spark and the groups it holds, as ``LftaPlan`` estimates
    them, within 5 % of a simulated table (the mean of 3 seeded runs)."""
    o = ChartOptions(max_load=0.5, spark_rows_per_s=1e12, lfta_tuples_per_s=1e12)
    plan = LftaPlan("table", 2 * limit, "window")
    node = NodeModel(1, float(D))
    c_r, held = plan.estimate(1.0, float(n), node, o)
    runs = [_simulate(n, limit, D, seed) for seed in range(3)]
    rows = np.mean([r for r, _ in runs])
    assert c_r == pytest.approx(n)  # nothing limits it
    assert held == pytest.approx(np.mean([p for _, p in runs]), rel=0.05)
    # Spark at 1 row/s: the tuples per second it accounts for are the tuples per row
    c_r1, _ = plan.estimate(1.0, float(n), node, ChartOptions(max_load=0.5,
                                                             spark_rows_per_s=1.0))
    assert n / c_r1 == pytest.approx(rows, rel=0.05)


def test_passthrough_holds_nothing_and_spark_caps_it():
    o = ChartOptions(spark_rows_per_s=1000)
    node = NodeModel(60, 10.0)
    assert LftaPlan("passthrough").estimate(0.5, 100, node, o) == (50, 0.0)
    assert LftaPlan("passthrough").estimate(0.5, 10_000, node, o) == (1000, 0.0)
    # ten groups: a table turns 5,000 tuples/s into 10 rows per window
    c_r, held = LftaPlan("table", 4096).estimate(0.5, 10_000, node, o)
    assert (c_r, held) == (pytest.approx(5000), pytest.approx(10.0))
    chart = Chart.build(node, ChartOptions(k=10, spark_rows_per_s=1000, lambda_max=10_000))
    assert chart.plans[chart.plan_at(0.5, 100)].kind == "passthrough"
    assert chart.plans[chart.plan_at(0.5, 9_000)].kind == "table"


def test_groups_measured_by_a_window_rebuild_the_chart():
    """A table that held every group counts them (the uniform model inverted: 3,000 tuples
    of 1,000 equally likely groups show about 950); one that overflowed gives the rows it
    emitted as the most groups the window had. A chart built on a population off by more than
    2x is built again, and only then."""
    rng = np.random.default_rng(5)
    seen = len(set(rng.integers(0, 1000, 3000).tolist()))
    assert fit_groups(3000, 4096, seen) == pytest.approx(1000, rel=0.1)
    assert fit_groups(100_000, 2048, 30_000) == 30_000
    assert fit_groups(0, 2048, 0) is None
    o = ChartOptions(spark_rows_per_s=10_000)
    s = Scheduler(Chart.build(NodeModel(60, 100.0), o), 0.5, 1e6)
    assert not s.regroup(150.0) and s.rebuilds == 0
    small = s.chart.plans[s.chart.plan_at(0.5, 1e6)]
    assert s.regroup(200_000.0) and s.rebuilds == 1 and s.chart.node.groups == 200_000
    big = s.chart.plans[s.chart.plan_at(0.5, 1e6)]
    assert small.kind == big.kind == "table" and big.capacity > small.capacity


def test_early_plans_only_where_the_watermark_waits_a_period():
    """Pass-through and age-flushed tables send rows of a window before it closes; they are
    candidates only in folders whose period Spark's watermark delay covers."""
    from planner.plan import build_plan
    from planner.query import parse_queries
    queries = parse_queries("SELECT time/60 AS t, dst_port, count(*) AS n FROM packets "
                            "GROUP BY time/60, dst_port;\nSELECT time/1 AS t, protocol, "
                            "count(*) AS n FROM packets GROUP BY time/1, protocol")
    plan = build_plan(queries, charts=ChartOptions(watermark_delay_s=2))
    names = {t.period: {p.name for c in t.charts.values() for p in c.plans} for t in plan.trees}
    assert names[60] == {"table 4096/window", "table 65536/window", "table 1048576/window"}
    assert "passthrough" in names[1] and "table 65536/age" in names[1]


def test_a_refined_chart_holds_the_cheapest_plan_at_each_cell():
    """Regions whose plan changes inside them are split refine x refine, each cell holding the
    cheapest plan at its centroid; the other regions are uniform at the points probed. The
    refined chart looks a point up to the plan of the cell bounding it."""
    o = ChartOptions(k=10, spark_rows_per_s=62_500)
    node = NodeModel(60, 50_000.0)
    chart = Chart.build(node, o)
    assert 0 < len(chart.cells) < o.k * o.k // 2
    m = o.refine
    for (i, j), sub in chart.cells.items():
        for u in range(m):
            for v in range(m):
                sel, lam = (i + (u + 0.5) / m) / o.k, chart.lam_at(j + (v + 0.5) / m)
                assert sub[u][v] == chart.best(sel, lam)
                assert chart.cell(sel, lam) == (i, j, u, v)
                assert chart.plan_at(sel, lam) == chart.best(sel, lam)
    for i in range(o.k):
        for j in range(o.k):
            if (i, j) not in chart.cells:
                assert {chart.best((i + a) / o.k, chart.lam_at(j + b))
                        for a in (0.02, 0.5, 0.98) for b in (0.02, 0.5, 0.98)} == \
                    {chart.grid[i][j]}
    coarse = Chart.build(node, ChartOptions(k=10, spark_rows_per_s=62_500, refine=1))
    assert coarse.grid == chart.grid and not coarse.cells
    # points where the coarse chart indexes a plan that is not the cheapest, the refined one
    # indexes the cheapest (at cell centroids, exactly)
    wrong = [(s, lam) for s in np.linspace(0.01, 0.99, 40) for lam in np.geomspace(200, 1e7, 40)
             if coarse.plan_at(s, lam) != coarse.best(s, lam)]
    assert wrong and sum(chart.plan_at(s, lam) != chart.best(s, lam) for s, lam in wrong) \
        < len(wrong) / 4


def test_the_tracker_uses_the_decay_that_predicted_best():
    """A steady ramp is predicted best by the last value (the heaviest decay): the estimate
    follows it. Values alternating around a level are predicted best by the plain mean: the
    estimate stays between them and its spread is the alternation's."""
    t = Tracker(d=5, a=0.5, initial=1.0)
    for x in range(1, 31):
        t.observe(float(x))
    assert t.estimate() == pytest.approx(30, abs=0.1)
    t = Tracker(d=5, a=0.5, initial=1.0)
    for k in range(30):
        t.observe(10.0 if k % 2 else 20.0)
    assert 13 < t.estimate() < 17 and t.spread() == pytest.approx(5, rel=0.25)


def test_the_spread_runs_the_plan_the_noise_keeps_cheapest():
    """Plan 1 is cheapest only in a narrow band of λ (45 to 55), plan 0 everywhere else. A
    rate alternating between 40 and 62 estimates inside the band: at the point the chart says
    plan 1, which is never the cheapest at the rate observed; spread by the estimate's own
    error most of the weight falls on plan 0, which always is."""
    def estimate(p, sel, lam):
        band = 45 <= lam <= 55
        return (1.0, 0.0) if (p == 1) == band else (1.0, 1.0)
    fidelity = {}
    for spread in (False, True):
        o = ChartOptions(k=4, w_r=0.0, w_m=1.0, lambda_max=100, lambda_scale="linear",
                         spread=spread)
        chart = Chart.build(NodeModel(1, 1.0), o, [0, 1], estimate)
        assert chart.plan_at(0.5, 50) == 1 and chart.plan_at(0.5, 40) == 0
        s = Scheduler(chart, 0.5, 50)
        for k in range(60):
            s.end_round(0.5, 40.0 if k % 2 else 62.0)
        fidelity[spread] = s.fidelity
        assert 45 <= s.lam.estimate() <= 55
    assert fidelity[False] < 0.2 and fidelity[True] > 0.9
