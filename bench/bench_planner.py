"""Planner benchmark (issue 3): bits vs optimum, invocations vs budget, CPU per tuple, ASC order.

Run by ``make bench`` (or ``python bench/bench_planner.py [--quick]``). Workloads and traces are
the seeded ones of bench/workloads.py. Writes bench/results/planner.json and prints a summary.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numba as nb
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import median_time  # noqa: E402
from bench.workloads import SEED, gigascope_matrix, gigascope_sql, random_matrix, trace  # noqa: E402
from collector.pipeline.asc_runtime import AscRuntime, asc_regions  # noqa: E402
from collector.pipeline.compiled_prefilter import compile_prefilter  # noqa: E402
from collector.pipeline.prefilter import (  # noqa: E402
    _eval_atom_column,
    in_sorted,
    kernel_inputs,
    prefilter_kernel,
    run_prefilter,
)
from collector.pipeline.residual import Residual, eval_predicate  # noqa: E402
from planner.asc import hybrid_arrows, macro_sequence  # noqa: E402
from planner.cover import (  # noqa: E402
    Matrix,
    cover_matrix,
    eliminate_overlap,
    find_rectangles,
    greedy_cover,
)
from planner.plan import Plan, QueryPlan, build_plan  # noqa: E402
from planner.query import parse_queries  # noqa: E402
from planner.reference import best_fixed_order, exact_cover, simulate  # noqa: E402
from planner.slots import set_bit_rows  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BATCH = 65536
# the ASC measurements give every attribute with two or more constants an ASC (5 on the
# Gigascope-shaped set); the daemon's default (asc.min_constants 16) leaves them to the bits
ASC_MIN = 2


# ------------------------------------------------------------------------- 1. bits vs optimum


def bench_cover(seeds: list[int], random_seeds: int, repeat: int) -> dict:
    rows_out = []

    def one(kind, rows, **extra):
        m = Matrix(rows)
        t_h = median_time(lambda: cover_matrix(rows), repeat)
        bits = len(cover_matrix(rows).bits)
        greedy = len(eliminate_overlap([r.preds for r in greedy_cover(m, find_rectangles(m))]))
        t0 = time.perf_counter()
        opt = exact_cover(m, time_limit=120)
        t_ilp = time.perf_counter() - t0
        rows_out.append({"kind": kind, **extra, "predicates": len(m.pred_ids),
                         "queries": len(m.query_ids), "ones": m.ones, "bits": bits,
                         "greedy_only_bits": greedy, "optimum": len(opt) if opt is not None
                         else None, "heuristic_ms": round(t_h * 1000, 2),
                         "ilp_ms": round(t_ilp * 1000, 1)})

    for s in seeds:
        one("gigascope", gigascope_matrix(s), seed=s)
    for p, n, d in [(20, 20, 0.15), (30, 30, 0.10), (47, 50, 0.05), (60, 60, 0.04)]:
        for s in range(random_seeds):
            one("random", random_matrix(p, n, d, s), seed=s, shape=f"{p}x{n}", density=d)
    gaps = [r["bits"] - r["optimum"] for r in rows_out if r["optimum"] is not None]
    giga = [r for r in rows_out if r["kind"] == "gigascope"]
    return {
        "instances": rows_out,
        "max_gap_bits": max(gaps),
        "gap_histogram": {str(g): gaps.count(g) for g in sorted(set(gaps))},
        "gigascope_max_gap_bits": max(r["bits"] - r["optimum"] for r in giga),
        "gigascope_median_bits": statistics.median(r["bits"] for r in giga),
        "gigascope_median_optimum": statistics.median(r["optimum"] for r in giga),
        "gigascope_predicates": 47,
        "gigascope_median_heuristic_ms": statistics.median(r["heuristic_ms"] for r in giga),
        "gigascope_max_heuristic_ms": max(r["heuristic_ms"] for r in giga),
        "gigascope_median_ilp_ms": statistics.median(r["ilp_ms"] for r in giga),
        "greedy_only_max_gap_bits": max(r["greedy_only_bits"] - r["optimum"] for r in giga),
    }


# ------------------------------------------------------------- shared inputs for parts 2-4


matrices = kernel_inputs  # built once per batch, outside every timing


def batches(tb):
    return [tb.take(np.arange(i, min(i + BATCH, len(tb)))) for i in range(0, len(tb), BATCH)]


def run_bits(cp, inputs):
    """The production prefilter kernel (bits and signatures) over prepared batches."""
    out = []
    for ints, ip_hi, ip_lo, ip_ok in inputs:
        n = ints.shape[1] if ints.shape[0] else ip_ok.shape[1]
        B = np.zeros((0, 1), np.uint64)  # the engine does not pack B
        Q = np.zeros((n, cp.q_words), np.uint64)
        prefilter_kernel(ints, ip_hi, ip_lo, ip_ok, *cp.kernel_arrays(), B, Q)
        out.append(Q)
    return out


def popcount_rows(Q: np.ndarray) -> np.ndarray:
    return np.bitwise_count(Q).astype(np.int64).sum(axis=1)


# ------------------------------------------------------------ 2. invocations vs bit budget


def selectivities(plan, tb) -> dict[str, float]:
    rows = np.arange(len(tb))
    return {i.predicate.text: float(eval_predicate(i.predicate, tb, rows).mean())
            for i in plan.predicates}


def expected(plan, sel: dict[str, float]) -> float:
    """Sum over queries of the product of the selectivities its signature checks."""
    total = 0.0
    for qp in plan.queries:
        covered = {p for b in qp.signature for p in plan.bits[b]}
        total += math.prod(sel[plan.predicates[p].predicate.text] for p in covered)
    return total


def bench_budget(queries, tb, budgets) -> dict:
    base = build_plan(queries, asc_min_constants=None)
    sample = tb.take(np.arange(min(len(tb), 200_000)))
    sel = selectivities(base, sample)
    out = {"budgets": budgets, "bits_needed": len(base.bits), "curves": {}}
    for name, use_sel in (("without_selectivity", False), ("with_selectivity", True)):
        exp_c, meas_c = [], []
        for k in budgets:
            plan = build_plan(queries, bit_budget=k, asc_min_constants=None,
                              selectivity=sel if use_sel else None)
            cp = compile_prefilter(plan, "packets")
            Q = np.concatenate(run_bits(cp, [matrices(cp, b) for b in batches(tb)]))
            meas_c.append(round(float(popcount_rows(Q).mean()), 4))
            exp_c.append(round(expected(plan, sel), 4))
        out["curves"][name] = {"expected": exp_c, "measured": meas_c}
    return out


# --------------------------------------------------------------------- 3. CPU per tuple


@nb.njit(cache=True, inline="always")
def _atom(i, a, ints, ip_hi, ip_lo, ip_ok, a_col, a_op, a_neg, a_v, a_ip, set_vals):
    op = a_op[a]
    c = a_col[a]
    if op == 8:  # address prefix
        if not ip_ok[c, i]:
            return False
        hit = (ip_hi[c, i] & a_ip[a, 2]) == a_ip[a, 0] and (ip_lo[c, i] & a_ip[a, 3]) == a_ip[a, 1]
        return hit != a_neg[a]
    x = ints[c, i]
    if x < 0:  # NULL: every comparison is false, negated or not
        return False
    if op == 0:
        return x == a_v[a, 0]
    if op == 1:
        return x != a_v[a, 0]
    if op == 2:
        return x < a_v[a, 0]
    if op == 3:
        return x <= a_v[a, 0]
    if op == 4:
        return x > a_v[a, 0]
    if op == 5:
        return x >= a_v[a, 0]
    if op == 7:
        return (a_v[a, 0] <= x <= a_v[a, 1]) != a_neg[a]
    return in_sorted(set_vals, a_v[a, 0], a_v[a, 1], x) != a_neg[a]


@nb.njit(cache=True, inline="always")
def _pred(i, p, p_start, p_len, ints, ip_hi, ip_lo, ip_ok, a_col, a_op, a_neg, a_v, a_ip,
          set_vals):
    """Base predicate ``p`` (an OR of atoms) on tuple ``i``."""
    for a in range(p_start[p], p_start[p] + p_len[p]):
        if _atom(i, a, ints, ip_hi, ip_lo, ip_ok, a_col, a_op, a_neg, a_v, a_ip, set_vals):
            return True
    return False


@nb.njit(cache=True, inline="always")
def _pred_column(out, p, p_start, p_len, ints, ip_hi, ip_lo, ip_ok, a_col, a_op, a_neg, a_v,
                 a_ip, set_vals):
    """Base predicate ``p`` over the whole batch, into ``out`` (OR of its atom columns)."""
    for a in range(p_start[p], p_start[p] + p_len[p]):
        _eval_atom_column(out, a, ints, ip_hi, ip_lo, ip_ok, a_col, a_op, a_neg, a_v, a_ip,
                          set_vals)


@nb.njit(cache=True, nogil=True)
def naive_columnar_kernel(ints, ip_hi, ip_lo, ip_ok, a_col, a_op, a_neg, a_v, a_ip, set_vals,
                          p_start, p_len, q_slot, q_start, q_len, q_preds, Q):
    """Naive, but column at a time: each query evaluates each of its predicates over the whole
    batch (no sharing), so the comparison with the prefilter is not a layout comparison."""
    n = Q.shape[0]
    col = np.empty(n, dtype=np.bool_)
    acc = np.empty(n, dtype=np.bool_)
    for q in range(q_slot.shape[0]):
        acc[:] = True
        for k in range(q_start[q], q_start[q] + q_len[q]):
            p = q_preds[k]
            col[:] = False
            _pred_column(col, p, p_start, p_len, ints, ip_hi, ip_lo, ip_ok, a_col, a_op, a_neg,
                         a_v, a_ip, set_vals)
            for i in range(n):
                acc[i] &= col[i]
        set_bit_rows(Q, q_slot[q], acc)
    return 0


@nb.njit(cache=True, nogil=True)
def shared_only_columnar_kernel(ints, ip_hi, ip_lo, ip_ok, a_col, a_op, a_neg, a_v, a_ip,
                                set_vals, p_start, p_len, shared, q_slot, q_start, q_len,
                                q_preds, q_is_shared, Q):
    """GS-lite's split, column at a time: the shared predicates once over the batch, then
    each query ANDs them with its own predicates, evaluated over the batch for it alone."""
    n = Q.shape[0]
    n_pred = p_start.shape[0]
    P = np.zeros((n_pred, n), dtype=np.bool_)
    for k in range(shared.shape[0]):
        p = shared[k]
        _pred_column(P[p], p, p_start, p_len, ints, ip_hi, ip_lo, ip_ok, a_col, a_op, a_neg,
                     a_v, a_ip, set_vals)
    col = np.empty(n, dtype=np.bool_)
    acc = np.empty(n, dtype=np.bool_)
    for q in range(q_slot.shape[0]):
        acc[:] = True
        for k in range(q_start[q], q_start[q] + q_len[q]):
            p = q_preds[k]
            if q_is_shared[k]:
                row = P[p]
            else:
                col[:] = False
                _pred_column(col, p, p_start, p_len, ints, ip_hi, ip_lo, ip_ok, a_col, a_op,
                             a_neg, a_v, a_ip, set_vals)
                row = col
            for i in range(n):
                acc[i] &= row[i]
        set_bit_rows(Q, q_slot[q], acc)
    return 0


@nb.njit(cache=True, nogil=True)
def naive_kernel(ints, ip_hi, ip_lo, ip_ok, a_col, a_op, a_neg, a_v, a_ip, set_vals, p_start,
                 p_len, q_slot, q_start, q_len, q_preds, Q):
    """Every query evaluates its whole WHERE on every tuple (no sharing, early exit)."""
    evals = 0
    for i in range(Q.shape[0]):
        for q in range(q_slot.shape[0]):
            ok = True
            for k in range(q_start[q], q_start[q] + q_len[q]):
                p = q_preds[k]
                evals += 1
                if not _pred(i, p, p_start, p_len, ints, ip_hi, ip_lo, ip_ok, a_col, a_op,
                             a_neg, a_v, a_ip, set_vals):
                    ok = False
                    break
            if ok:
                s = q_slot[q]
                Q[i, s >> 6] |= np.uint64(1) << np.uint64(s & 63)
    return evals


@nb.njit(cache=True, nogil=True)
def shared_only_kernel(ints, ip_hi, ip_lo, ip_ok, a_col, a_op, a_neg, a_v, a_ip, set_vals,
                       p_start, p_len, shared, q_slot, q_start, q_len, q_preds, q_is_shared, Q):
    """GS-lite: each shared predicate once per tuple; a query whose shared predicates hold is
    invoked and evaluates its own predicates. Returns invocations."""
    n_pred = p_start.shape[0]
    val = np.zeros(n_pred, dtype=np.int8)
    invocations = 0
    for i in range(Q.shape[0]):
        for k in range(shared.shape[0]):
            p = shared[k]
            val[p] = 1 if _pred(i, p, p_start, p_len, ints, ip_hi, ip_lo, ip_ok, a_col, a_op,
                                a_neg, a_v, a_ip, set_vals) else 2
        for q in range(q_slot.shape[0]):
            ok = True
            for k in range(q_start[q], q_start[q] + q_len[q]):
                if q_is_shared[k] and val[q_preds[k]] == 2:
                    ok = False
                    break
            if not ok:
                continue
            invocations += 1
            for k in range(q_start[q], q_start[q] + q_len[q]):
                if q_is_shared[k]:
                    continue
                if not _pred(i, q_preds[k], p_start, p_len, ints, ip_hi, ip_lo, ip_ok, a_col,
                             a_op, a_neg, a_v, a_ip, set_vals):
                    ok = False
                    break
            if ok:
                s = q_slot[q]
                Q[i, s >> 6] |= np.uint64(1) << np.uint64(s & 63)
    return invocations


def query_arrays(plan, cp):
    local = {pid: k for k, pid in enumerate(cp.pred_ids)}
    q_slot, q_start, q_len, q_preds = [], [], [], []
    for qp in plan.queries:
        q_slot.append(qp.slot)
        q_start.append(len(q_preds))
        q_len.append(len(qp.predicates))
        q_preds.extend(local[p] for p in qp.predicates)
    return (np.array(q_slot, np.int64), np.array(q_start, np.int64), np.array(q_len, np.int64),
            np.array(q_preds, np.int64))


def shared_only_plan(queries) -> Plan:
    """GS-lite's prefilter inside flowsieve's engine: a bit per shared cheap predicate; every
    other predicate is left to the residual step of the queries the bits invoke."""
    full = build_plan(queries, asc_min_constants=None)
    users: dict[int, int] = {}
    for qp in full.queries:
        for p in qp.predicates:
            users[p] = users.get(p, 0) + 1
    shared = sorted(p for p, u in users.items() if u > 1)
    bits = [(p,) for p in shared]
    qplans = [QueryPlan(qp.query, qp.slot, qp.predicates,
                        [shared.index(p) for p in qp.predicates if p in shared],
                        [p for p in qp.predicates if p not in shared]) for qp in full.queries]
    return Plan(full.version, full.predicates, bits, qplans, full.cheap_cost)


def engine_pass(cp, res, asc, parts, stats) -> list[np.ndarray]:
    """run_prefilter then the residual step over every batch; counts in ``stats``."""
    qs = []
    evaluated = res.evaluated
    stats["invocations"] = 0
    for part in parts:
        _, Q = run_prefilter(cp, part, asc)
        stats["invocations"] += int(popcount_rows(Q).sum())
        res.apply(part, Q)
        qs.append(Q)
    stats["residual"] = res.evaluated - evaluated
    return qs


def bench_engine(queries, tb, repeat: int) -> dict:
    """The engine's selection step as it runs (run_prefilter, then Residual), per tuple."""
    out = {}
    ref = None
    for name, plan in (("shared_only", shared_only_plan(queries)),
                       ("prefilter", build_plan(queries, asc_min_constants=None)),
                       ("prefilter_asc", build_plan(queries, asc_min_constants=ASC_MIN))):
        cp = compile_prefilter(plan, "packets")
        res = Residual(plan, "packets")
        parts = batches(tb)
        asc = AscRuntime(cp, "hybrid", period=100_000, mu=0.1)
        stats: dict = {}
        run = functools.partial(engine_pass, cp, res, asc, parts, stats)
        run()
        secs = median_time(run, repeat)
        Q = np.concatenate(run())
        if ref is None:
            ref = Q
        assert np.array_equal(Q, ref), name
        out[name] = {"ns_per_tuple": round(secs / len(tb) * 1e9, 2),
                     "invocations_per_tuple": round(stats["invocations"] / len(tb), 4),
                     "residual_evaluations_per_tuple": round(stats["residual"] / len(tb), 4),
                     "bits": len(plan.bits), "ascs": len(plan.ascs)}
    out["ratios"] = {
        "cpu_shared_only_over_prefilter": round(
            out["shared_only"]["ns_per_tuple"] / out["prefilter"]["ns_per_tuple"], 3),
        "cpu_shared_only_over_prefilter_asc": round(
            out["shared_only"]["ns_per_tuple"] / out["prefilter_asc"]["ns_per_tuple"], 3),
        "invocations_shared_only_over_prefilter": round(
            out["shared_only"]["invocations_per_tuple"]
            / out["prefilter"]["invocations_per_tuple"], 3),
    }
    return out


def bench_cpu(queries, tb, repeat: int) -> dict:
    full = build_plan(queries, asc_min_constants=None)  # every cheap predicate in the bits
    cp = compile_prefilter(full, "packets")
    assert all(not qp.residual for qp in full.queries)
    inputs = [matrices(cp, b) for b in batches(tb)]
    q_slot, q_start, q_len, q_preds = query_arrays(full, cp)
    users: dict[int, int] = {}
    for qp in full.queries:
        for p in qp.predicates:
            users[p] = users.get(p, 0) + 1
    local = {pid: k for k, pid in enumerate(cp.pred_ids)}
    shared = np.array(sorted(local[p] for p, u in users.items() if u > 1), np.int64)
    q_is_shared = np.array([bool(users[cp.pred_ids[p]] > 1) for p in q_preds], np.bool_)
    atoms = (cp.a_col, cp.a_op, cp.a_neg, cp.a_v, cp.a_ip, cp.set_vals, cp.p_start, cp.p_len)
    n = len(tb)
    results: dict[str, dict] = {}

    def naive():
        qs, ev = [], 0
        for ints, ip_hi, ip_lo, ip_ok in inputs:
            Q = np.zeros((ip_ok.shape[1], cp.q_words), np.uint64)
            ev += naive_kernel(ints, ip_hi, ip_lo, ip_ok, *atoms, q_slot, q_start, q_len,
                               q_preds, Q)
            qs.append(Q)
        return qs, ev

    def shared_only():
        qs, inv = [], 0
        for ints, ip_hi, ip_lo, ip_ok in inputs:
            Q = np.zeros((ip_ok.shape[1], cp.q_words), np.uint64)
            inv += shared_only_kernel(ints, ip_hi, ip_lo, ip_ok, *atoms, shared, q_slot,
                                      q_start, q_len, q_preds, q_is_shared, Q)
            qs.append(Q)
        return qs, inv

    def naive_columnar():
        qs = []
        for ints, ip_hi, ip_lo, ip_ok in inputs:
            Q = np.zeros((ip_ok.shape[1], cp.q_words), np.uint64)
            naive_columnar_kernel(ints, ip_hi, ip_lo, ip_ok, *atoms, q_slot, q_start, q_len,
                                  q_preds, Q)
            qs.append(Q)
        return qs, None

    def shared_only_columnar():
        qs = []
        for ints, ip_hi, ip_lo, ip_ok in inputs:
            Q = np.zeros((ip_ok.shape[1], cp.q_words), np.uint64)
            shared_only_columnar_kernel(ints, ip_hi, ip_lo, ip_ok, *atoms, shared, q_slot,
                                        q_start, q_len, q_preds, q_is_shared, Q)
            qs.append(Q)
        return qs, None

    def prefilter():
        return run_bits(cp, inputs), None

    asc_plan = build_plan(queries, asc_min_constants=ASC_MIN)
    cpa = compile_prefilter(asc_plan, "packets")
    inputs_a = [matrices(cpa, b) for b in batches(tb)]
    runtime = AscRuntime(cpa, "hybrid", period=100_000, mu=0.1, sample=2048)
    for ints, ip_hi, ip_lo, ip_ok in inputs_a:  # warm the adaptive sequence up once
        Q = run_bits(cpa, [(ints, ip_hi, ip_lo, ip_ok)])[0]
        runtime.run(ints, ip_hi, ip_lo, ip_ok, Q)

    def prefilter_asc():
        qs = run_bits(cpa, inputs_a)
        for (ints, ip_hi, ip_lo, ip_ok), Q in zip(inputs_a, qs, strict=True):
            runtime.run(ints, ip_hi, ip_lo, ip_ok, Q)
        return qs, None

    reference = None
    for name, fn in (("naive", naive), ("naive_columnar", naive_columnar),
                     ("shared_only", shared_only), ("shared_only_columnar", shared_only_columnar),
                     ("prefilter", prefilter),
                     ("prefilter_asc", prefilter_asc)):
        fn()  # compile and warm
        secs = median_time(fn, repeat)
        qs, extra = fn()
        Q = np.concatenate(qs)
        if reference is None:
            reference = Q
        assert np.array_equal(Q, reference), f"{name} answers differ from naive"
        matched = float(popcount_rows(Q).mean())
        inv = {"naive": len(full.queries), "naive_columnar": len(full.queries),
               "shared_only": (extra or 0) / n}.get(name, matched)
        if name == "shared_only_columnar":
            inv = results["shared_only"]["invocations_per_tuple"]
        results[name] = {"ns_per_tuple": round(secs / n * 1e9, 2), "invocations_per_tuple":
                         round(inv, 4)}
    results["matches_per_tuple"] = round(float(popcount_rows(reference).mean()), 4)
    results["ratios"] = {
        "invocations_naive_over_prefilter": round(
            results["naive"]["invocations_per_tuple"]
            / max(results["prefilter"]["invocations_per_tuple"], 1e-9), 2),
        "cpu_shared_only_over_prefilter": round(
            results["shared_only"]["ns_per_tuple"] / results["prefilter"]["ns_per_tuple"], 3),
        "cpu_shared_only_over_prefilter_asc": round(
            results["shared_only"]["ns_per_tuple"] / results["prefilter_asc"]["ns_per_tuple"],
            3),
        "cpu_naive_over_prefilter": round(
            results["naive"]["ns_per_tuple"] / results["prefilter"]["ns_per_tuple"], 3),
        "cpu_shared_only_columnar_over_prefilter": round(
            results["shared_only_columnar"]["ns_per_tuple"]
            / results["prefilter"]["ns_per_tuple"], 3),
        "cpu_shared_only_columnar_over_prefilter_asc": round(
            results["shared_only_columnar"]["ns_per_tuple"]
            / results["prefilter_asc"]["ns_per_tuple"], 3),
        "cpu_naive_columnar_over_prefilter": round(
            results["naive_columnar"]["ns_per_tuple"] / results["prefilter"]["ns_per_tuple"],
            3),
    }
    results["bits"] = len(full.bits)
    results["ascs"] = [a.attribute for a in asc_plan.ascs]
    results["asc_plan_bits"] = len(asc_plan.bits)
    return results


# ------------------------------------------------------------------------- 4. ASC ordering


@nb.njit(cache=True)
def ticket_kernel(R, Q0, qrb, qub, seed):
    """Eddies' ticket routing: the next ASC is drawn in proportion to its tickets; an ASC gains
    a ticket per tuple routed to it and loses one per tuple it returns (passes)."""
    np.random.seed(seed)
    n, n_asc = R.shape
    words = Q0.shape[1]
    tickets = np.ones(n_asc, dtype=np.float64)
    done = np.zeros(n_asc, dtype=np.bool_)
    g = np.zeros(words, dtype=np.uint64)
    evals = 0
    for i in range(n):
        alive = False
        for w in range(words):
            g[w] = Q0[i, w]
            if g[w] != 0:
                alive = True
        done[:] = False
        while alive:
            open_q = False
            for a in range(n_asc):
                if not done[a]:
                    for w in range(words):
                        if g[w] & qub[a, w]:
                            open_q = True
            if not open_q:
                break
            total = 0.0
            for a in range(n_asc):
                if not done[a]:
                    total += max(tickets[a], 1.0)
            x = np.random.random() * total
            pick = -1
            for a in range(n_asc):
                if not done[a]:
                    x -= max(tickets[a], 1.0)
                    pick = a
                    if x <= 0:
                        break
            tickets[pick] += 1
            r = R[i, pick]
            alive = False
            for w in range(words):
                g[w] &= qrb[pick, r, w]
                if g[w] != 0:
                    alive = True
            done[pick] = True
            evals += 1
            if alive:
                tickets[pick] -= 1
    return evals


def bench_asc(queries, tb, train: int, test: int, drift_tb) -> dict:
    plan = build_plan(queries, asc_min_constants=ASC_MIN)
    cp = compile_prefilter(plan, "packets")

    def sample(t, lo, hi):
        sub = t.take(np.arange(lo, hi))
        ints, ip_hi, ip_lo, ip_ok = matrices(cp, sub)
        Q0 = run_bits(cp, [(ints, ip_hi, ip_lo, ip_ok)])[0]
        R = asc_regions(np.arange(len(sub)), ints, ip_hi, ip_lo, ip_ok, *cp.asc_arrays())
        return R, Q0

    R_tr, Q_tr = sample(tb, 0, train)
    R_te, Q_te = sample(tb, train, train + test)
    reach = int(Q_te.any(axis=1).sum())
    macro = macro_sequence(cp.ascs, cp.asc_qrb, R_tr, Q_tr)
    arrows = hybrid_arrows(cp.ascs, cp.asc_qrb, R_tr, Q_tr, macro)

    def cost(order, arr=None):
        return int(simulate(cp.asc_qrb, R_te, Q_te, order, arr, cp.asc_qub)[0].sum())

    best_order, best = best_fixed_order(cp.asc_qrb, R_te, Q_te, cp.asc_qub)
    _, worst = best_fixed_order(cp.asc_qrb, R_te, Q_te, cp.asc_qub, worst=True)
    tickets = int(ticket_kernel(R_te, Q_te, cp.asc_qrb, cp.asc_qub, 7))
    names = [a.attribute for a in cp.ascs]
    per = {"macro": cost(macro), "hybrid": cost(macro, arrows), "ticket_routing": tickets,
           "best_fixed": best, "worst_fixed": worst, "plan_order": cost(list(range(len(names))))}
    out = {"ascs": names, "train_tuples": train, "test_tuples": test,
           "tuples_reaching_ascs": reach,
           "macro_sequence": [names[a] for a in macro],
           "micro_arrows": int((arrows >= 0).sum()),
           "best_fixed_sequence": [names[a] for a in best_order],
           "evaluations_per_tuple": {k: (round(v / test, 4) if v is not None else None)
                                     for k, v in per.items()}}

    # Figure 9's shape: a trace whose mix changes half way; sequence chosen on the first
    # 50k tuples and kept, vs the adaptive runtime (period 100k, mu 0.1)
    cpd = compile_prefilter(plan, "packets")
    static = AscRuntime(cpd, "fixed")
    R0, Q00 = sample(drift_tb, 0, train)
    static.macro = np.array(macro_sequence(cpd.ascs, cpd.asc_qrb, R0, Q00))
    static.arrows = hybrid_arrows(cpd.ascs, cpd.asc_qrb, R0, Q00, list(static.macro))
    adaptive = AscRuntime(cpd, "hybrid", period=100_000, mu=0.1, sample=4096)
    every = AscRuntime(cpd, "hybrid", period=100_000, mu=0.0, sample=4096)
    halves = {"static": [0, 0], "adaptive": [0, 0], "adaptive_mu0": [0, 0]}
    for k, b in enumerate(batches(drift_tb)):
        half = 0 if (k + 1) * BATCH <= len(drift_tb) // 2 else 1
        ins = matrices(cpd, b)
        for name, rt in (("static", static), ("adaptive", adaptive), ("adaptive_mu0", every)):
            Q = run_bits(cpd, [ins])[0]
            halves[name][half] += rt.run(*ins, Q)
    half_n = [sum(len(b) for k, b in enumerate(batches(drift_tb))
                  if ((k + 1) * BATCH <= len(drift_tb) // 2) == (h == 0)) for h in (0, 1)]
    out["drift"] = {name: [round(v[h] / half_n[h], 4) for h in (0, 1)]
                    for name, v in halves.items()}
    out["drift"]["rearrangements"] = adaptive.rearrangements
    out["drift"]["rearrangements_mu0"] = every.rearrangements
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small trace, few repeats")
    args = ap.parse_args()
    n = 200_000 if args.quick else 1_000_000
    repeat = 3 if args.quick else 5
    t0 = time.perf_counter()
    queries = parse_queries(gigascope_sql(SEED))
    tb = trace(n, SEED)
    res = {
        "seed": SEED,
        "trace_tuples": n,
        "cover": bench_cover([SEED] + list(range(20)), 10, repeat),
        "budget": bench_budget(queries, tb, [0, 1, 2, 4, 6, 8, 12, 16, 20, 24, 28, 32, 36,
                                             40, 48, 56, 64]),
        "cpu": bench_cpu(queries, tb, repeat),
        "engine": bench_engine(queries, tb, repeat),
        "asc": bench_asc(queries, tb, 50_000, min(200_000, n - 50_000),
                         trace(n, SEED + 1, drift=True)),
    }
    res["seconds"] = round(time.perf_counter() - t0, 1)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "planner.json").write_text(json.dumps(res, indent=1) + "\n")
    c, cpu, a = res["cover"], res["cpu"], res["asc"]
    print(f"cover: gigascope 47x50 median {c['gigascope_median_bits']} bits "
          f"(optimum {c['gigascope_median_optimum']}), max gap {c['gigascope_max_gap_bits']} "
          f"(all instances {c['max_gap_bits']}), heuristic median "
          f"{c['gigascope_median_heuristic_ms']} ms (max {c['gigascope_max_heuristic_ms']})")
    print(f"cpu ns/tuple: naive {cpu['naive']['ns_per_tuple']}, shared-only "
          f"{cpu['shared_only']['ns_per_tuple']}, prefilter {cpu['prefilter']['ns_per_tuple']}, "
          f"prefilter+asc {cpu['prefilter_asc']['ns_per_tuple']}; ratios {cpu['ratios']}")
    e = res["engine"]
    print(f"engine ns/tuple: shared-only {e['shared_only']['ns_per_tuple']}, prefilter "
          f"{e['prefilter']['ns_per_tuple']}, prefilter+asc {e['prefilter_asc']['ns_per_tuple']};"
          f" ratios {e['ratios']}")
    print(f"asc evaluations/tuple: {a['evaluations_per_tuple']}; drift {a['drift']}")
    print(f"wrote {RESULTS / 'planner.json'} in {res['seconds']} s")


if __name__ == "__main__":
    main()
