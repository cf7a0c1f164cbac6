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

Writes ``results/adaptivity.json``. About 2 minutes.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_result  # noqa: E402
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


def main() -> int:
    t0 = time.perf_counter()
    print("== convergence (cost per tuple against the optimal order)", flush=True)
    conv = convergence()
    print("== adaptivity (selectivities permuted every 100,000 tuples)", flush=True)
    adapt = adaptivity()
    print("== run-time overhead", flush=True)
    over = overhead()
    worst = max(r["a-greedy_ratio"] for r in conv)
    recover = list(adapt["a-greedy"]["windows_to_recover"])
    summary = {"a_greedy_worst_ratio": worst,
               "a_greedy_within_1_1": worst <= 1.1,
               "a_greedy_windows_to_recover": recover,
               "a_greedy_recovers_within_2_windows": all(r is not None and r <= 2
                                                         for r in recover)}
    write_result("adaptivity", {"convergence": conv, "adaptivity": adapt, "overhead": over,
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
