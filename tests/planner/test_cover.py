"""Rectangle covering against the paper's worked examples and the exact ILP optimum."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from planner.cover import (
    Matrix,
    cover_matrix,
    eliminate_overlap,
    find_rectangles,
    signatures,
)
from planner.reference import exact_cover

# Golab et al., Figure 3: Q1: p1 p2 p3; Q2: p1 p2 p3 p4; Q3: p1 p4; Q4: p1; Q5: p1 p5 p6;
# Q6: p5 p6 (rows are predicates, the sets are the queries referencing them)
FIG3 = {"p1": {"Q1", "Q2", "Q3", "Q4", "Q5"}, "p2": {"Q1", "Q2"}, "p3": {"Q1", "Q2"},
        "p4": {"Q2", "Q3"}, "p5": {"Q5", "Q6"}, "p6": {"Q5", "Q6"}}


def test_figure_3_four_bits_and_signatures():
    """Four bits p1, (p2 AND p3), p4, (p5 AND p6); L1 = 1100, L2 = 1110, L3 = 1010,
    L4 = 1000, L5 = 1001, L6 = 0001."""
    m = Matrix(FIG3)
    cover = cover_matrix(FIG3)
    assert cover.bits == [("p1",), ("p2", "p3"), ("p4",), ("p5", "p6")]
    masks = [sum(1 << m.pred_ids.index(p) for p in b) for b in cover.bits]
    sig = signatures(masks, m)
    as_bits = ["".join("1" if k in s else "0" for k in range(4)) for s in sig]
    assert dict(zip(m.query_ids, as_bits, strict=True)) == {
        "Q1": "1100", "Q2": "1110", "Q3": "1010", "Q4": "1000", "Q5": "1001", "Q6": "0001"}


def test_figure_5_overlap_simplifies():
    """The overlapping cover p1, (p1 p2 p3), (p1 p4), (p5 p6) simplifies to Figure 3's."""
    m = Matrix(FIG3)
    idx = {p: 1 << i for i, p in enumerate(m.pred_ids)}
    overlapping = [idx["p1"], idx["p1"] | idx["p2"] | idx["p3"], idx["p1"] | idx["p4"],
                   idx["p5"] | idx["p6"]]
    assert [m.preds(b) for b in eliminate_overlap(overlapping)] == \
        [("p1",), ("p2", "p3"), ("p4",), ("p5", "p6")]


def test_repeated_simplification():
    """A simplification can enable another: (a b c) loses (a b) only after (a b d) lost d."""
    a, b, c, d = 1, 2, 4, 8
    assert eliminate_overlap([d, a | b | d, a | b | c]) == [a | b, c, d]


def test_exact_optimum_of_figure_3_is_four():
    assert len(exact_cover(Matrix(FIG3))) == 4


def test_pruning_and_max_j():
    m = Matrix(FIG3)
    assert len(find_rectangles(m)) < len(find_rectangles(m, prune=False))
    # with j = 1 no rectangle of two or more shared predicates is grown (columns remain)
    assert all(r.preds.bit_count() == 1 or r.queries.bit_count() == 1
               for r in find_rectangles(m, max_j=1, prune=False))


def test_selectivity_picks_the_larger_drop_in_invocations():
    """Q1: a AND b (unselective), Q2: c (selective). With one bit, counting ones picks (a b);
    expected invocations 0.81 + 1 > 1 + 0.01, so the selectivity rule picks c."""
    rows = {"a": {"Q1"}, "b": {"Q1"}, "c": {"Q2"}}
    assert cover_matrix(rows, budget=1).bits == [("a", "b")]
    sel = {"a": 0.9, "b": 0.9, "c": 0.01}
    cov = cover_matrix(rows, budget=1, selectivity=sel)
    assert cov.bits == [("c",)] and abs(cov.expected_invocations - 1.01) < 1e-9


matrices = st.dictionaries(st.integers(0, 11), st.frozensets(st.integers(0, 9), min_size=1),
                           min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(matrices, st.one_of(st.none(), st.integers(1, 6)))
def test_cover_properties(rows, budget):
    """Every bit is a rectangle of M; without a budget every 1 of M is covered by a bit in
    its query's signature; the heuristic never beats the ILP and never exceeds the rows."""
    m = Matrix(rows)
    cov = cover_matrix(rows, budget=budget)
    assert len(cov.bits) <= len(rows) and (budget is None or len(cov.bits) <= budget)
    for bit in cov.bits:
        assert m.queries_of(sum(1 << m.pred_ids.index(p) for p in bit)) != 0
    if budget is None:
        for q in m.query_ids:
            preds = {p for p, qs in rows.items() if q in qs}
            covered = set().union(*[set(b) for b in cov.bits if set(b) <= preds])
            assert covered == preds
        best = exact_cover(m)
        assert best is not None and len(best) <= len(cov.rectangles)
