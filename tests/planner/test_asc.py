"""Attribute selection constructs (Lee & Lee): a hand-worked example, sequences against brute
force, and the numba kernel against the reference evaluator on real packets."""

from __future__ import annotations

from itertools import permutations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capture.fields import parse_prefix
from capture.pcap import open_capture
from capture.unpack import unpack
from collector.pipeline.asc_runtime import AscRuntime, asc_regions
from collector.pipeline.compiled_prefilter import compile_prefilter
from collector.pipeline.prefilter import kernel_inputs, run_prefilter
from planner.asc import hybrid_arrows, macro_sequence
from planner.plan import build_plan
from planner.query import parse_queries
from planner.reference import best_fixed_order, simulate
from tests.helpers import capture
from tests.reference import packets

ASC_ALL = 1  # every attribute with a constant gets an ASC, as in the paper's model

EXAMPLE = """
SELECT ts FROM packets WHERE dst_port < 100 AND ttl BETWEEN 32 AND 64;
SELECT ts FROM packets WHERE dst_port = 53;
SELECT ts FROM packets WHERE dst_port > 1000
"""


def test_worked_example():
    """Queries (slots 0-2):  q0: dst_port < 100 AND ttl BETWEEN 32 AND 64
                             q1: dst_port = 53
                             q2: dst_port > 1000
    With ASC_ALL, dst_port (3 constants) and ttl (2) both get an ASC, no bits.

    ASC(dst_port): constants 53, 100, 1000; qub = 111 (q0 q1 q2)
        region         qrb (q0 q1 q2)   cab (ttl decides q0 only)
        (-inf, 53)     1 0 0            ttl
        [53]           1 1 0            ttl
        (53, 100)      1 0 0            ttl
        [100]          0 0 0            -
        (100, 1000)    0 0 0            -
        [1000]         0 0 0            -      (1000 > 1000 is false)
        (1000, +inf)   0 0 1            -
        NULL           0 0 0            -
    ASC(ttl): constants 32, 64; qub = 100 (q0); q1, q2 pass every region
        (-inf, 32) 011   [32] 111   (32, 64) 111   [64] 111   (64, +inf) 011   NULL 011
        cab: dst_port everywhere (q1 and q2 pass every ttl region)

    Macro-sequence dst_port -> ttl; GRB starts at 111 (no prefilter bits):
        t1 = (dst_port 53, ttl 64):    111 & [53] 110 = 110; ttl decides q0, still set:
                                       110 & [64] 111 = 110 -> q0, q1; 2 ASCs evaluated
        t2 = (dst_port 80, ttl 128):   111 & (53,100) 100 = 100; 100 & (64,+inf) 011 = 000
                                       -> dropped after 2 ASCs
        t3 = (dst_port 8080, ttl 10):  111 & (1000,+inf) 001 = 001; ttl decides only q0,
                                       which is clear -> stop: q2; 1 ASC evaluated
    """
    plan = build_plan(parse_queries(EXAMPLE), asc_min_constants=ASC_ALL)
    assert plan.bits == []
    by = {a.attribute: a for a in plan.ascs}
    port, ttl = by["dst_port"], by["ttl"]
    assert port.constants == [53, 100, 1000] and ttl.constants == [32, 64]

    def bits(a, r):
        return "".join("1" if a.qrb[r] >> s & 1 or s not in a.slots else "0" for s in range(3))

    assert [bits(port, r) for r in range(port.n_regions)] == \
        ["100", "110", "100", "000", "000", "000", "001", "000"]
    assert [bits(ttl, r) for r in range(ttl.n_regions)] == \
        ["011", "111", "111", "111", "011", "011"]
    names = [a.attribute for a in plan.ascs]
    assert [[names[j] for j in c] for c in port.cab] == \
        [["ttl"], ["ttl"], ["ttl"], [], [], [], [], []]
    assert all([names[j] for j in c] == ["dst_port"] for c in ttl.cab)

    cp = compile_prefilter(plan, "packets")
    order = [names.index("dst_port"), names.index("ttl")]
    R = np.zeros((3, 2), dtype=np.int64)
    for i, (p, t) in enumerate([(53, 64), (80, 128), (8080, 10)]):
        R[i, names.index("dst_port")] = port.region_of(p)
        R[i, names.index("ttl")] = ttl.region_of(t)
    Q0 = np.full((3, 1), 0b111, dtype=np.uint64)
    evaluated, grb = simulate(cp.asc_qrb, R, Q0, order, qub=cp.asc_qub)
    assert grb[:, 0].tolist() == [0b011, 0b000, 0b100]  # slot i is bit i: q0 q1 | none | q2
    assert evaluated.tolist() == [2, 2, 1]
    assert macro_sequence(cp.ascs, cp.asc_qrb, R, Q0)[0] == names.index("dst_port"), \
        "dst_port alone is the minimal cover set"


def _sample(plan, name="ok.pcap"):
    cp = compile_prefilter(plan, "packets")
    tbs = [unpack(raw) for raw in open_capture(capture(name))]
    return cp, tbs


WORKLOAD = """
SELECT ts FROM packets WHERE dst_port IN (53, 80, 443) AND ttl < 64;
SELECT ts FROM packets WHERE src_port BETWEEN 1024 AND 65535 AND ttl >= 128;
SELECT ts FROM packets WHERE protocol = 17 AND in_prefix(dst_ip, '10.0.0.0/8');
SELECT ts FROM packets WHERE dst_port NOT IN (80, 443) AND protocol != 6 AND ttl > 1;
SELECT ts FROM packets WHERE in_prefix(src_ip, '216.58.0.0/16') AND dst_port > 1000;
SELECT ts FROM packets WHERE protocol IN (1, 58) AND ttl <= 255
"""


def test_regions_equal_reference_and_kernel_equals_simulation():
    """Regions from the numba search equal ASC.region_of on dpkt's values; the kernel's
    masks and evaluation counts equal the reference evaluator's under macro and hybrid."""
    plan = build_plan(parse_queries(WORKLOAD), asc_min_constants=ASC_ALL)
    cp, tbs = _sample(plan)
    ref = packets(capture("ok.pcap"))
    tb = tbs[0]
    n = len(tb)
    ints, ip_hi, ip_lo, ip_ok = kernel_inputs(cp, tb)
    R = asc_regions(np.arange(n), ints, ip_hi, ip_lo, ip_ok, *cp.asc_arrays())
    for k, a in enumerate(cp.ascs):
        for i, p in enumerate(ref):
            v = p[a.attribute]
            if a.kind == "ip" and v is not None:
                v = parse_prefix(v)[0]
            assert R[i, k] == a.region_of(v), (a.attribute, i)
    Q0 = np.full((n, 1), (1 << len(plan.queries)) - 1, dtype=np.uint64)
    macro = macro_sequence(cp.ascs, cp.asc_qrb, R, Q0)
    for arrows in (None, hybrid_arrows(cp.ascs, cp.asc_qrb, R, Q0, macro)):
        rt = AscRuntime(cp, "fixed")
        rt.macro = np.array(macro)
        if arrows is not None:  # the kernel's general path (without, its in-sequence one)
            assert (arrows >= 0).any()
            rt.arrows = arrows
        Q = Q0.copy()
        evals = rt.run(ints, ip_hi, ip_lo, ip_ok, Q)
        ev_ref, grb = simulate(cp.asc_qrb, R, Q0, macro, arrows, cp.asc_qub)
        assert np.array_equal(Q, grb)
        assert evals == int(ev_ref.sum())
        # the dropping ratio's counts: the tuples holding a query an ASC decides, and those
        # of them left with none
        decided = np.bitwise_or.reduce(cp.asc_qub, axis=0)
        reached = (Q0 & decided).any(axis=1)
        assert rt.reached == reached.sum()
        assert rt._p_dropped == (reached & ~(grb & decided).any(axis=1)).sum() > 0


def test_dp_best_order_equals_brute_force_and_beats_or_ties_macro():
    plan = build_plan(parse_queries(WORKLOAD), asc_min_constants=ASC_ALL)
    cp, tbs = _sample(plan)
    tb = tbs[0]
    ints, ip_hi, ip_lo, ip_ok = kernel_inputs(cp, tb)
    R = asc_regions(np.arange(len(tb)), ints, ip_hi, ip_lo, ip_ok,
                    *cp.asc_arrays())
    Q0 = np.full((len(tb), 1), (1 << len(plan.queries)) - 1, dtype=np.uint64)
    order, cost = best_fixed_order(cp.asc_qrb, R, Q0, cp.asc_qub)
    brute = min(int(simulate(cp.asc_qrb, R, Q0, list(p), qub=cp.asc_qub)[0].sum())
                for p in permutations(range(len(cp.ascs))))
    assert cost == brute == int(simulate(cp.asc_qrb, R, Q0, order, qub=cp.asc_qub)[0].sum())
    macro = macro_sequence(cp.ascs, cp.asc_qrb, R, Q0)
    assert int(simulate(cp.asc_qrb, R, Q0, macro, qub=cp.asc_qub)[0].sum()) >= cost


def test_adaptive_rearrangement_follows_eq_5():
    """After the first period the sequence is chosen and d_init recorded; later periods
    re-choose it exactly when |d_cur - d_init| / d_init >= mu (eq. 5)."""
    plan = build_plan(parse_queries(WORKLOAD), asc_min_constants=ASC_ALL)
    cp, ok = _sample(plan, "ok.pcap")
    rt = AscRuntime(cp, "hybrid", period=10**9, mu=0.5, sample=512)
    run_prefilter(cp, ok[0], rt)  # fills the period's sample; the period has not ended
    assert rt.rearrangements == 0 and rt.d_init is None
    rt._end_period()
    assert rt.rearrangements == 1 and rt.d_init == pytest.approx(
        rt_dropped(cp, ok[0]) / rt_reached(cp, ok[0]))
    for d_cur, moved in [(0.6 * rt.d_init, False), (1.4 * rt.d_init, False),
                         (0.49 * rt.d_init, True)]:
        before, d_init = rt.rearrangements, rt.d_init
        run_prefilter(cp, ok[0], rt)
        rt._p_reached, rt._p_dropped = 1000, round(1000 * d_cur)
        rt._end_period()
        assert (rt.rearrangements == before + 1) == moved
        assert rt.d_init == (pytest.approx(round(1000 * d_cur) / 1000) if moved else d_init)


def rt_reached(cp, tb) -> int:
    _, Q = run_prefilter(cp, tb, AscRuntime(cp, "fixed"))
    return int(Q0_of(cp, tb).any(axis=1).sum())


def rt_dropped(cp, tb) -> int:
    _, Q = run_prefilter(cp, tb, AscRuntime(cp, "fixed"))
    reach = Q0_of(cp, tb).any(axis=1)
    return int((reach & ~Q.any(axis=1)).sum())


def Q0_of(cp, tb):
    """The query mask before the ASCs (this workload has no bits: every slot)."""
    return np.full((len(tb), cp.q_words), (1 << cp.n_slots) - 1, dtype=np.uint64)


def test_region_bitsets_equal_direct_evaluation():
    """build_asc's bitsets (an atom evaluated once per own constant and stretch) give the qrb
    of evaluating every slot's predicates on every region's representative, over seeded random
    predicate sets: points, sets, ranges, negations, IP prefixes, adjacent integers (empty
    gaps), slots with several predicates and NULL."""
    from planner.asc import build_asc
    from planner.query import parse_queries
    from planner.reference import build_asc_qrb
    rng = np.random.default_rng(7)

    def int_atom():
        c = sorted(int(x) for x in rng.choice(40, 3, replace=False))
        return str(rng.choice([
            f"dst_port = {c[0]}", f"dst_port != {c[0]}", f"dst_port < {c[0]}",
            f"dst_port <= {c[0]}", f"dst_port > {c[0]}", f"dst_port >= {c[0]}",
            f"dst_port IN ({c[0]}, {c[1]}, {c[2]})", f"dst_port NOT IN ({c[0]}, {c[1]})",
            f"dst_port BETWEEN {c[0]} AND {c[2]}", f"dst_port NOT BETWEEN {c[0]} AND {c[1]}"]))

    def ip_atom():
        n = int(rng.integers(0, 4))
        length = int(rng.choice([8, 16, 24, 32]))
        neg = "NOT " if rng.random() < 0.2 else ""
        return f"{neg}in_prefix(dst_ip, '10.{n}.{n * 3 % 4}.0/{length}')" if length < 32 \
            else str(rng.choice([f"dst_ip = '10.0.0.{n}'", f"dst_ip != '10.0.0.{n}'"]))

    for trial in range(60):
        make = int_atom if trial % 2 else ip_atom
        field = "dst_port" if trial % 2 else "dst_ip"
        wheres = []
        for _ in range(int(rng.integers(1, 9))):
            preds = [" OR ".join(make() for _ in range(int(rng.integers(1, 3))))
                     for _ in range(int(rng.integers(1, 3)))]
            wheres.append(" AND ".join(f"({p})" for p in preds))
        queries = parse_queries(";".join(f"SELECT ts FROM packets WHERE {w}" for w in wheres))
        preds, uses = {}, {}
        for slot, q in enumerate(queries):
            for p in q.predicates:
                assert p.fields == (field,) or list(p.fields) == [field]
                pid = len(preds)
                preds[pid] = p
                uses.setdefault(slot, []).append(pid)
        uses[len(queries)] = []  # a query without a predicate on the attribute
        asc = build_asc(field, "packets", preds, uses)
        assert asc.qrb == build_asc_qrb(field, "packets", preds, uses), wheres


def _v4(x: int) -> str:
    return ".".join(str(x >> s & 255) for s in (24, 16, 8, 0))


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(st.lists(st.tuples(st.integers(0, 2**32 - 1), st.sampled_from([32, 24, 16, 12, 8])),
                min_size=1, max_size=12),
       st.lists(st.integers(-3, 3), min_size=1, max_size=20), st.data())
def test_address_regions_equal_the_reference_at_every_edge(constants, steps, data):
    """An address ASC's region of IPv4 addresses (found by their /16's constants alone) and of
    IPv6 ones (a search of every constant) equals ``ASC.region_of``: addresses at, next to,
    and between the constants and their /16 boundaries, IPv6 addresses around the IPv4-mapped
    block, and NULL."""
    def where(a: int, n: int) -> str:
        if n == 32:
            return f"src_ip = '{_v4(a)}'"
        return f"in_prefix(src_ip, '{_v4(a >> (32 - n) << (32 - n))}/{n}')"
    sql = "\n".join(f"SELECT ts FROM packets WHERE {where(a, n)};" for a, n in constants)
    plan = build_plan(parse_queries(sql + "\nSELECT ts FROM packets WHERE "
                                    "src_ip = '2001:db8::1'"), asc_min_constants=ASC_ALL)
    cp = compile_prefilter(plan, "packets")
    (k, asc), = [(k, a) for k, a in enumerate(cp.ascs) if a.attribute == "src_ip"]
    base = 0xFFFF << 32
    pool = [base + (a >> (32 - n) << (32 - n)) for a, n in constants]
    pool += [c for a, n in constants for c in (base + (a >> 16 << 16), base + (a | 0xFFFF))]
    addrs = [data.draw(st.sampled_from(pool)) + s for s in steps]
    addrs += [base - 1, base, base + 2**32 - 1, base + 2**32, parse_prefix("2001:db8::1")[0],
              parse_prefix("2001:db8::2")[0]]
    ok = np.ones((1, len(addrs) + 1), np.bool_)
    ok[0, -1] = False  # NULL
    hi = np.array([[x >> 64 for x in addrs] + [0]], np.uint64)
    lo = np.array([[x & (2**64 - 1) for x in addrs] + [0]], np.uint64)
    cols = len(cp.ip_cols)
    R = asc_regions(np.arange(len(addrs) + 1), np.zeros((len(cp.int_cols), len(addrs) + 1),
                                                       np.int64),
                    np.repeat(hi, cols, 0), np.repeat(lo, cols, 0), np.repeat(ok, cols, 0),
                    *cp.asc_arrays())
    assert R[:, k].tolist() == [asc.region_of(x) for x in addrs] + [asc.region_of(None)]


@pytest.mark.parametrize("hosts", [4, 9])
def test_address_regions_of_a_crowded_16_equal_the_reference(hosts):
    """IPv4 addresses whose /16 holds few constants (at most 4: counted in fixed steps) and
    many (a search), around every constant, equal ``ASC.region_of``."""
    sql = [f"SELECT ts FROM packets WHERE src_ip = '10.1.{k}.{3 * k}'" for k in range(hosts)]
    sql += ["SELECT ts FROM packets WHERE in_prefix(src_ip, '10.2.16.0/20')",
            "SELECT ts FROM packets WHERE src_ip = '2001:db8::1'"]
    plan = build_plan(parse_queries(";".join(sql)), asc_min_constants=ASC_ALL)
    cp = compile_prefilter(plan, "packets")
    (k, asc), = [(k, a) for k, a in enumerate(cp.ascs) if a.attribute == "src_ip"]
    addrs = sorted({c + d for c in asc.constants for d in (-2, -1, 0, 1, 2)})
    hi = np.array([[x >> 64 for x in addrs]], np.uint64)
    lo = np.array([[x & (2**64 - 1) for x in addrs]], np.uint64)
    cols = len(cp.ip_cols)
    R = asc_regions(np.arange(len(addrs)), np.zeros((len(cp.int_cols), len(addrs)), np.int64),
                    np.repeat(hi, cols, 0), np.repeat(lo, cols, 0),
                    np.ones((cols, len(addrs)), np.bool_), *cp.asc_arrays())
    assert R[:, k].tolist() == [asc.region_of(x) for x in addrs]
