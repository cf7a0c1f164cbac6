"""Adaptive ordering of pipelined filters (issue 15; seed 001, section 9), side by side with the
paper's figures: A-Greedy, Sweep, Independent and LocalSwaps (planner/ordering.py, the code the
residual stage runs) against the optimal order, on the paper's synthetic filters (groups of
Gamma correlated filters, the 80% rule, Table 1's parameters).

- convergence (Figures 9-11, 12-13 shape): cost per tuple once converged, against the optimal
  order (exact, by dynamic programming over subsets of filters on the same tuples);
- adaptivity (Figures 16-18 shape): filters evaluated per 2,000 tuples while the groups'
  selectivities are permuted every 100,000 tuples, and how many profile windows each algorithm
  needs to be back within 1.1x of the optimal order;
- run-time overhead (Figures 13/15 shape): evaluations made only to profile, as a share of all
  evaluations, and the reoptimizer's share of the simulation's time.

- OM (003 Figure 3 shape): fidelity against k of a node's sel-λ chart (planner/charts.py) on
  streams whose selectivity and rate drift with four degrees of noise, with moves, switches and
  the cost of the plans run over the optimal ones, against RAND and a static plan;
- the residual stage in the engine's code (collector/pipeline/residual.py) on the backbone
  trace's DNS names: today's fixed order against A-Greedy's, and A-Greedy with the value cache.

Writes ``results/adaptivity.json``. About 3 minutes.
"""

from __future__ import annotations

import math
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_result  # noqa: E402
from planner.charts import Chart, ChartOptions, NodeModel, Scheduler  # noqa: E402
from planner.charts import cost as om_cost  # noqa: E402
from planner.ordering import VARIANTS, AdaptiveOrder, cost  # noqa: E402

P = {"a-greedy": 0.01, "independent": 0.005, "sweep": 0.01, "localswaps": 0.01}  # Table 1
WINDOW = {"sweep": 500}  # Table 1: 500 profile tuples for Sweep, 1,000 for the others
ALPHA = 0.9
GAMMA = 2


def correlated(n: int, gamma: int, drop: list[float], m: int, rnd: random.Random
               ) -> list[frozenset]:
    """Section 9.1's model: filters in groups of ``gamma``; a filter gives its group's result
    on 80% of tuples, an independent one otherwise; a filter of group g drops with
    probability ``drop[g]``. Each tuple: the set of filters that drop it."""
    out = []
    for _ in range(m):
        base = [rnd.random() < d for d in drop]
        out.append(frozenset(
            i for i in range(n)
            if (base[i // gamma] if rnd.random() < 0.8 else rnd.random() < drop[i // gamma])))
    return out


def optimal(n: int, tuples: list[frozenset], times: list[float]) -> tuple[float, list[int]]:
    """The optimal order's cost per tuple on ``tuples`` and the order: dynamic programming
    over subsets (C(S) = min over f in S of C(S - f) + t_f * surviving(S - f))."""
    counts: dict[int, int] = {}
    for d in tuples:
        m = sum(1 << f for f in d)
        counts[m] = counts.get(m, 0) + 1
    full = (1 << n) - 1
    surv = [sum(c for m, c in counts.items() if not m & s) / len(tuples) for s in range(full + 1)]
    best = [0.0] * (full + 1)
    last = [-1] * (full + 1)
    for s in range(1, full + 1):
        best[s] = float("inf")
        for f in range(n):
            if s >> f & 1:
                c = best[s ^ (1 << f)] + times[f] * surv[s ^ (1 << f)]
                if c < best[s]:
                    best[s], last[s] = c, f
    order, s = [], full
    while s:
        order.append(last[s])
        s ^= 1 << last[s]
    return best[full], order[::-1]


def make(variant: str, n: int, seed: int) -> AdaptiveOrder:
    return AdaptiveOrder(n, variant, p=P[variant], window=WINDOW.get(variant, 1000),
                         alpha=ALPHA, stage=500, seed=seed)


def convergence() -> list[dict]:
    """Cost per tuple after convergence (uniform and mixed costs, equal and spread
    selectivities) for n = 3..8."""
    rows = []
    for n in (3, 4, 6, 8):
        groups = -(-n // GAMMA)
        for sel in ("table1", "spread"):
            drop = [0.5] * groups if sel == "table1" else \
                [0.2 + 0.6 * g / max(1, groups - 1) for g in range(groups)]
            for costs in ("uniform", "mixed"):
                rnd = random.Random(1000 * n + (sel == "spread") * 10 + (costs == "mixed"))
                times = [1.0] * n if costs == "uniform" else \
                    [rnd.choice((1.0, 1.0, 4.0, 8.0)) for _ in range(n)]
                warm = correlated(n, GAMMA, drop, 150_000, rnd)
                test = correlated(n, GAMMA, drop, 30_000, rnd)
                opt, opt_order = optimal(n, test, times)
                row = {"n": n, "selectivities": sel, "costs": costs, "drop": drop,
                       "times": times, "optimal": opt, "optimal_order": opt_order}
                for v in VARIANTS:
                    o = make(v, n, seed=n)
                    for d in warm:
                        o.process(d, times)
                    row[v] = cost(o.order, test, times)
                    row[f"{v}_ratio"] = row[v] / opt
                rows.append(row)
                print(f"  n={n} {sel:7} {costs:7} optimal {opt:6.3f}  " + "  ".join(
                    f"{v} {row[f'{v}_ratio']:.3f}x" for v in VARIANTS), flush=True)
    return rows


def adaptivity() -> dict:
    """Filters evaluated per 2,000 tuples across permutations of the groups' selectivities
    (every ``period`` tuples), for each algorithm and the optimal order of each segment; and
    the profile windows each needs after a change to be back within 1.1x of optimal."""
    n, period, changes, block = 6, 100_000, 4, 2000
    rnd = random.Random(16)
    drop = [0.15, 0.5, 0.85]
    segments = []
    for k in range(changes + 1):
        if k:
            while True:
                perm = drop[:]
                rnd.shuffle(perm)
                if perm != drop:
                    break
            drop = perm
        segments.append((list(drop), correlated(n, GAMMA, drop, period, rnd)))
    times = [1.0] * n
    out: dict = {"n": n, "period_tuples": period, "block_tuples": block, "segments": [],
                 "series": {}}
    for drop, seg in segments:
        opt, order = optimal(n, seg[-20000:], times)
        out["segments"].append({"drop": drop, "optimal": opt, "optimal_order": order})
    for v in VARIANTS:
        o = make(v, n, seed=16)
        series, recovery = [], []
        for k, (_, seg) in enumerate(segments):
            opt = out["segments"][k]["optimal"]
            start, back = o.profiled, None
            for b in range(0, len(seg), block):
                w0 = o.work
                for d in seg[b:b + block]:
                    o.process(d, times)
                series.append((o.work - w0) / block)
                if back is None and cost(o.order, seg[-20000:], times) <= 1.1 * opt:
                    back = (o.profiled - start) / o.window
            recovery.append(back)
        out["series"][v] = series
        out[v] = {"windows_to_recover": recovery[1:], "reorders": o.reorders}
        print(f"  {v:11} profile windows to be within 1.1x after each change: "
              + ", ".join("never" if r is None else f"{r:.2f}" for r in recovery[1:]),
              flush=True)
    out["optimal_series"] = [s["optimal"] for s in out["segments"]]
    return out


def overhead() -> list[dict]:
    """Evaluations made only to profile, as a share of all, and the reoptimizer's share of
    the simulation's time (n = 3 and 8, drop-profiling probability 0.01 and 0.05)."""
    rows = []
    for n in (3, 8):
        rnd = random.Random(13 + n)
        tuples = correlated(n, GAMMA, [0.5] * (-(-n // GAMMA)), 100_000, rnd)
        for p in (0.01, 0.05):
            row = {"n": n, "p": p}
            for v in VARIANTS:
                o = AdaptiveOrder(n, v, p=p, window=WINDOW.get(v, 1000), alpha=ALPHA,
                                  stage=500, seed=n)
                spent = [0.0]
                add = o.add

                def timed(*a, add=add, spent=spent, **k):
                    t0 = time.perf_counter()
                    r = add(*a, **k)
                    spent[0] += time.perf_counter() - t0
                    return r
                o.add = timed
                t0 = time.perf_counter()
                for d in tuples:
                    o.process(d)
                total = time.perf_counter() - t0
                row[v] = {"profile_share": o.profile_work / (o.work + o.profile_work),
                          "reoptimizer_time_share": spent[0] / total}
            rows.append(row)
            print(f"  n={n} p={p}: " + "  ".join(
                f"{v} {row[v]['profile_share'] * 100:.1f}% profiling, "
                f"{row[v]['reoptimizer_time_share'] * 100:.1f}% time" for v in VARIANTS),
                flush=True)
    return rows


# ------------------------------------------------------------------ OM plan charts (seed 003)
OM_NODE = NodeModel(60, 50_000.0)  # a (src_ip) node: 50,000 groups a window may hold
OM_SHARE = 250_000.0 / 4  # its share of Spark's merge rate (FACTS), four nodes
OM_ROUNDS = 600  # the paper's 10 minutes of 1 s rounds; here 600 windows


def drifting(rounds: int, cv: float, seed: int) -> list[tuple[float, float]]:
    """Observed (selectivity, tuples/s) per round: the rate follows two daily-like cycles
    between 60,000 and 1.5M tuples/s with bursts (1 % of rounds start 5-20 rounds at twice the
    rate), the node's selectivity drifts between 5 % and 55 %; both with multiplicative noise
    of coefficient of variation ``cv`` (Figure 3(b)'s erratic streams)."""
    rng = np.random.default_rng(seed)
    out, burst = [], 0
    for r in range(rounds):
        phase = 2 * math.pi * r / rounds
        lam = 60_000 + 700_000 * (1 - math.cos(2 * phase))
        sel = 0.3 + 0.25 * math.sin(3 * phase + 1)
        if burst == 0 and rng.random() < 0.01:
            burst = int(rng.integers(5, 20))
        if burst:
            lam, burst = lam * 2, burst - 1
        lam *= max(0.05, 1 + cv * rng.standard_normal())
        sel = min(1.0, max(0.001, sel * (1 + cv * rng.standard_normal())))
        out.append((sel, lam))
    return out


def om_run(chart: Chart, stream: list[tuple[float, float]], seed: int) -> dict:
    """OM (Algorithm 2), RAND (a random candidate each round) and a static plan (the first
    round's, as the paper's RATE) on one stream: fidelity, and the mean cost of the plan run
    over the cost of the optimal one (each round at the values observed in it)."""
    o = chart.options
    rng = random.Random(seed)
    sched = Scheduler(chart, *stream[0])
    static = sched.plan
    costs = [[om_cost(*chart.estimate(p, *x), o.w_r, o.w_m) for p in chart.plans]
             for x in stream]
    best = [min(range(len(c)), key=c.__getitem__) for c in costs]
    ran, rand = [], []
    for x in stream:
        ran.append(sched.plan)
        rand.append(rng.randrange(len(chart.plans)))
        sched.end_round(*x)

    def regret(plans):
        return float(np.mean([c[p] / c[b] for c, p, b in zip(costs, plans, best, strict=True)]))
    n = len(stream)
    return {"fidelity": sched.fidelity, "moves": sched.moves, "switches": sched.switches,
            "optimal_switches": sum(a != b for a, b in zip(best, best[1:], strict=False)),
            "rand_fidelity": sum(p == b for p, b in zip(rand, best, strict=True)) / n,
            "static_fidelity": sum(static == b for b in best) / n,
            "cost_over_optimal": regret(ran), "rand_cost_over_optimal": regret(rand),
            "static_cost_over_optimal": regret([static] * n),
            "plans_optimal_somewhere": len(set(best))}


CANDIDATES = {  # the paper's experiment has 2 candidate plans; flowsieve's full set has 7
    "7 plans (all candidates)": {},
    "2 plans (pass-through, table 65,536)": {"capacities": (65536,), "age_fraction": 1.0},
}
CHARTS = {  # the shipped chart and scheduler; the paper's k x k chart and point estimate
    "shipped (refined where plans change, spread)": {},
    "paper (k x k chart, point estimate)": {"refine": 1, "spread": False},
}
NOISE = (0.02, 0.05, 0.1, 0.2)


def oracle(chart: Chart, cv: float) -> float:
    """The fidelity of a scheduler that knew each round's noise-free selectivity and rate and
    ran the plan cheapest there: where the noise crosses a boundary, no plan chosen before the
    round can hit."""
    clean, noisy = drifting(OM_ROUNDS, 0.0, 7), drifting(OM_ROUNDS, cv, 7)
    return sum(chart.best(*c) == chart.best(*x) for c, x in zip(clean, noisy, strict=True)) \
        / len(clean)


def om() -> list[dict]:
    """Fidelity against k on drifting streams of four degrees of noise (Figure 3 shape), for
    flowsieve's plan set and the paper's number of candidate plans, with the shipped chart and
    scheduler and with the paper's, beside the noise-free oracle's bound."""
    rows = []
    for plans, extra in CANDIDATES.items():
        for chart_name, how in CHARTS.items():
            for cv in NOISE:
                stream = drifting(OM_ROUNDS, cv, 7)
                line = []
                for k in (2, 5, 10, 20, 40):
                    o = ChartOptions(k=k, spark_rows_per_s=OM_SHARE, **extra, **how)
                    chart = Chart.build(OM_NODE, o)
                    r = {"plans": plans, "chart": chart_name, "cv": cv, "k": k,
                         "refined_regions": len(chart.cells), **om_run(chart, stream, k)}
                    if k == 10:
                        r["oracle_fidelity"] = oracle(chart, cv)
                    rows.append(r)
                    line.append(f"k {k} {r['fidelity'] * 100:.0f}%")
                bound = next(r["oracle_fidelity"] for r in rows[-5:] if r["k"] == 10)
                print(f"  {plans}, {chart_name}, cv {cv:.2f}: " + "  ".join(line)
                      + f"  (noise-free oracle {bound * 100:.0f}%, RAND "
                      f"{rows[-1]['rand_fidelity'] * 100:.0f}%, static "
                      f"{rows[-1]['static_fidelity'] * 100:.0f}%)", flush=True)
    return rows


N_RUN = 4_000_000  # tuples a window may have for its plans to be run here


def run_plan(p, n: int, D: int, o: ChartOptions, seed: int) -> tuple[int, int, float]:
    """One window of ``n`` tuples of ``D`` equally likely groups (a 1 s period) through the
    LFTA's own table code under plan ``p``: (rows it sent to the spool, most rows it held,
    seconds its merges took)."""
    from collector.pipeline.lfta import Partials, PartialTable
    if p.kind == "passthrough":
        return n, 0, 0.0
    age = o.age_fraction if p.flush == "age" else 1e9
    t = PartialTable(2, 1, p.capacity, o.max_load, age)
    rng = np.random.default_rng(seed)
    keys = np.zeros((n, 2), np.int64)
    keys[:, 1] = rng.integers(0, D, n)
    meas = np.zeros((n, 1), np.int64)
    rows = peak = 0
    spent = 0.0
    step = min(65536, max(1024, n // 64))  # the window in 64 steps: age flushes on time
    for b in range(0, n, step):
        now = int(b / n * 1e9)  # the window's second, spread over its tuples
        part = Partials.of_tuples(keys[b:b + step], meas[b:b + step])
        t0 = time.perf_counter()
        out = t.merge(part, now)
        spent += time.perf_counter() - t0
        rows += sum(len(x) for x in out)
        peak = max(peak, t.limit if out else len(t))
        old = t.flush_if_old(now)
        if old is not None:
            rows += len(old)
    return rows + len(t.flush_all()), peak, spent


def om_model_check() -> dict:
    """The cost model against the plans run: at the centroids of the shipped chart's regions
    (k = 10, and four cells of each refined region) on a node of 50,000 groups and a 1 s
    window, every pair of plans the model separates by at least 10 % is run through the
    LFTA's table code on a window of that many tuples; the measured cost takes the rows it
    sent (tuples per row under Spark's merge rate), the most rows it held and its own merge
    rate. Reported: how often the measured order agrees with the model's."""
    o = ChartOptions(k=10, spark_rows_per_s=OM_SHARE)
    node = NodeModel(1, 50_000.0)
    chart = Chart.build(node, o)
    points = [((i + 0.5) / o.k, chart.lam_at(j + 0.5)) for i in range(o.k) for j in range(o.k)]
    for (i, j) in chart.cells:
        points += [((i + (u + 0.5) / o.refine) / o.k, chart.lam_at(j + (v + 0.5) / o.refine))
                   for u in (1, 5) for v in (2, 6)]
    runs: dict = {}

    def measured(p, n):
        if (p, n) not in runs:
            rows, held, spent = run_plan(p, n, int(node.groups), o, n)
            lfta = n / spent if spent > 0 else math.inf
            c_r = min(float(n), lfta, o.spark_rows_per_s * n / rows) if rows else float(n)
            runs[p, n] = (c_r, float(held), om_cost(c_r, held, o.w_r, o.w_m))
        return runs[p, n]
    pairs = agree = skipped = 0
    misses = []
    for sel, lam in points:
        n = int(sel * lam)
        model = [om_cost(*p.estimate(sel, lam, node, o), o.w_r, o.w_m) for p in chart.plans]
        b = min(range(len(model)), key=model.__getitem__)
        apart = [q for q in range(len(model)) if q != b and model[q] >= 1.1 * model[b]]
        if not apart or n < 1:
            continue
        if n > N_RUN:
            skipped += 1
            continue
        for q in apart:
            pairs += 1
            mb, mq = measured(chart.plans[b], n)[2], measured(chart.plans[q], n)[2]
            if mb < mq:
                agree += 1
            else:
                misses.append({"selectivity": sel, "lambda": lam, "model_best":
                               chart.plans[b].name, "other": chart.plans[q].name,
                               "model_ratio": model[q] / model[b], "measured_ratio": mq / mb})
    out = {"cells": len(points), "cells_not_run": skipped, "window_tuples_max": N_RUN,
           "pairs_apart_10pct": pairs, "agree": agree,
           "agreement": agree / pairs if pairs else None, "disagreements": misses[:20],
           "plans_run": len(runs)}
    print(f"  cost model: {agree}/{pairs} pairs of plans the model separates by >= 10 % "
          f"ordered the same when run ({out['agreement'] * 100:.1f} %); {skipped} of "
          f"{len(points)} cells have windows over {N_RUN:,} tuples, not run", flush=True)
    return out


# ------------------------------------------------------- the residual stage on DNS names
DNS_QUERIES = """-- name: cdn_lookups
SELECT time/60 AS t, src_ip, count(*) AS n FROM packets
WHERE dst_port = 53 AND regexp(dns_qname, '[.](com|net|org)$')
  AND regexp(dns_qname, 'jsdelivr|github')
GROUP BY time/60, src_ip;
-- name: root_lookups
SELECT time/60 AS t, src_ip, count(*) AS n FROM packets
WHERE dst_port = 53 AND regexp(dns_qname, '^[a-z0-9.-]+$') AND regexp(dns_qname, 'root-servers')
GROUP BY time/60, src_ip;
-- name: ntp_lookups
SELECT time/60 AS t, dst_port, count(*) AS n FROM packets
WHERE protocol = 17 AND regexp(dns_qname, '(^|[.])(ntp|time)[.]') AND regexp(dns_qname, 'ubuntu')
GROUP BY time/60, dst_port;
-- name: root_only
SELECT time/60 AS t, dst_ip, count(*) AS n FROM packets
WHERE dst_port = 53 AND regexp(dns_qname, '[a-z]') AND regexp(dns_qname, '[.]')
  AND regexp(dns_qname, '^[^_]+$') AND regexp(dns_qname, 'root-servers')
GROUP BY time/60, dst_ip;
"""


def flood(tb, seed: int):
    """The batch with each DNS name replaced by a random-subdomain flood's ("water torture":
    a fresh random label under one of a few victims' domains per query), the drift a resolver
    sees when it starts: names that never repeat, which no query's regexp looks for."""
    import dataclasses

    import pyarrow as pa
    names = tb.strings["dns_qname"]
    valid = names.is_valid().to_numpy(zero_copy_only=False)
    rng = np.random.default_rng(seed)
    alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz0123456789", np.uint8)
    labels = alphabet[rng.integers(0, len(alphabet), (len(tb), 10))].view("S10").ravel()
    victims = np.array([b"victim-bank.com", b"shop.example.net", b"mail.example.org"])
    made = [(lb + b"." + victims[i % 3]).decode() if ok else None
            for i, (lb, ok) in enumerate(zip(labels.tolist(), valid, strict=True))]
    return dataclasses.replace(tb, strings={**tb.strings, "dns_qname": pa.array(made)})


RESIDUAL_MODES = {  # name: (ordering, value cache, adapt)
    "fixed order, no cache": ("cost", 0, False),
    "default (a-greedy + value cache, adaptive)": ("a-greedy", 65536, True),
    "a-greedy + value cache, always on (before)": ("a-greedy", 65536, False),
}


def dns_residual(packets: int = 2_000_000, runs: int = 5) -> dict:
    """The residual stage on the DNS names of the backbone trace, and on the same trace whose
    second half is a random-subdomain flood: the fixed order (catalogue cost, no cache), the
    default configuration (A-Greedy and the value cache, each measuring what it saves and
    turning itself down where it does not pay), and both always on as they were. CPU per
    stream tuple of the stage, median of ``runs`` runs alternating the modes, the spread
    (min-max over runs), and the same query bits from all."""
    from bench.traces import trace
    from capture.pcap import open_capture
    from capture.unpack import unpack
    from collector.pipeline.compiled_prefilter import compile_prefilter
    from collector.pipeline.prefilter import run_prefilter
    from collector.pipeline.residual import Residual, ValueCache
    from planner.plan import build_plan
    from planner.query import parse_queries
    path, _ = trace("backbone", 6_000_000, Path(__file__).resolve().parent / ".cache")
    plan = build_plan(parse_queries(DNS_QUERIES), cheap_cost=10)
    cp = compile_prefilter(plan, "packets")
    batches, seen = [], 0
    for raw in open_capture(path, batch_size=65536):
        tb = unpack(raw)
        _, Q = run_prefilter(cp, tb)
        batches.append((tb, Q))
        seen += len(tb)
        if seen >= packets:
            break
    half = len(batches) // 2
    streams = {"trace": batches,
               "trace, then a random-subdomain flood": batches[:half] + [
                   (flood(tb, k), Q) for k, (tb, Q) in enumerate(batches[half:])]}
    out: dict = {"packets": seen, "runs": runs, "streams": {}}
    for stream, bs in streams.items():
        times = {m: [] for m in RESIDUAL_MODES}
        last = {}
        for _ in range(runs):
            for name, (ordering, cache, adapt) in RESIDUAL_MODES.items():
                res = Residual(plan, "packets", ordering, adapt=adapt,
                               cache=ValueCache(cache, adapt) if cache else None)
                bits, spent = [], 0.0
                for tb, Q in bs:
                    q = Q.copy()
                    t0 = time.perf_counter()
                    res.apply(tb, q)
                    spent += time.perf_counter() - t0
                    bits.append(q)
                times[name].append(spent / seen * 1e9)
                last[name] = res, np.concatenate(bits)
        reference = last["fixed order, no cache"][1]
        modes = {}
        for name, (res, got) in last.items():
            d = res.describe()
            t = times[name]
            modes[name] = {"ns_per_tuple": float(np.median(t)), "runs_ns": t,
                           "spread_ns": [min(t), max(t)], "evaluations": res.evaluated,
                           "profile_evaluations": res.profile_evaluated,
                           "reorders": d["reorders"], "drifts": d["drifts"],
                           "profile_probability": d["profile_probability"],
                           "cache": d["cache"], "cache_hits": d["cache_hits"],
                           "cache_misses": d["cache_misses"], "order": d["order"],
                           "same_bits": bool(np.array_equal(got, reference))}
            print(f"  {stream}: {name}: {modes[name]['ns_per_tuple']:.1f} ns per tuple "
                  f"(runs {min(t):.1f}-{max(t):.1f}), {res.evaluated:,} evaluations, "
                  f"{d['reorders']} reorders, cache on for "
                  f"{sum(d['cache'].values())}/{len(d['cache'])}", flush=True)
        fixed = modes["fixed order, no cache"]["ns_per_tuple"]
        for m in modes.values():
            m["over_fixed"] = m["ns_per_tuple"] / fixed
        out["streams"][stream] = modes
    return out


def main() -> int:
    t0 = time.perf_counter()
    print("== convergence (cost per tuple against the optimal order)", flush=True)
    conv = convergence()
    print("== adaptivity (selectivities permuted every 100,000 tuples)", flush=True)
    adapt = adaptivity()
    print("== run-time overhead", flush=True)
    over = overhead()
    print("== OM plan charts (fidelity against k, drifting streams)", flush=True)
    charts = om()
    print("== OM's cost model against the plans run", flush=True)
    model = om_model_check()
    print("== the residual stage on the backbone trace's DNS names, then a flood", flush=True)
    dns = dns_residual()
    worst = max(r["a-greedy_ratio"] for r in conv)
    recover = list(adapt["a-greedy"]["windows_to_recover"])
    summary = {"a_greedy_worst_ratio": worst,
               "a_greedy_within_1_1": worst <= 1.1,
               "a_greedy_windows_to_recover": recover,
               "a_greedy_recovers_within_2_windows": all(r is not None and r <= 2
                                                         for r in recover)}
    shipped = next(iter(CHARTS))
    summary["om_shipped_k10"] = {
        f"{r['plans']}, cv {r['cv']}": {"fidelity": r["fidelity"],
                                        "oracle_fidelity": r["oracle_fidelity"]}
        for r in charts if r["k"] == 10 and r["chart"] == shipped}
    summary["om_fidelity"] = {f"{r['plans']}, {r['chart']}, cv {r['cv']}, k {r['k']}":
                              r["fidelity"] for r in charts if r["k"] in (10, 20, 40)}
    summary["om_smallest_k_at_90"] = {
        f"{plans}, {c}, cv {cv}": min((r["k"] for r in charts if r["plans"] == plans
                                       and r["chart"] == c and r["cv"] == cv
                                       and r["fidelity"] >= 0.9), default=None)
        for plans in CANDIDATES for c in CHARTS for cv in NOISE}
    summary["om_model_agreement"] = model["agreement"]
    summary["dns_residual_over_fixed"] = {
        f"{st}: {m}": v["over_fixed"] for st, modes in dns["streams"].items()
        for m, v in modes.items()}
    write_result("adaptivity", {"convergence": conv, "adaptivity": adapt, "overhead": over,
                                "om": charts, "om_model": model, "dns_residual": dns,
                                "summary": summary,
                                "parameters": {"p": P, "window": WINDOW, "alpha": ALPHA,
                                               "gamma": GAMMA}})
    print(f"== A-Greedy: worst {worst:.3f}x optimal after convergence (target <= 1.1); back "
          f"within 1.1x after "
          + ", ".join("never" if r is None else f"{r:.2f}" for r in recover)
          + f" profile windows (target <= 2); {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
