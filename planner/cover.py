"""Prefilter bits: which conjunction of cheap base predicates each bit stands for.

This is the uncompressed prefilter of the paper's section 1: one bit per distinct cheap base
predicate, shared by every query that references it. Rectangle covering (section 2.2) replaces
``assign_bits`` without changing its contract: a list of bits, each a tuple of predicate ids,
such that every cheap predicate of every query is in some bit of that query's signature.
"""

from __future__ import annotations


def assign_bits(matrix: dict[int, set[str]], budget: int | None = None) -> list[tuple[int, ...]]:
    """One bit per candidate predicate id (``matrix``: predicate id -> queries using it).

    With a ``budget`` smaller than the candidate count, the predicates shared by the most queries
    get bits first; the others stay out of the prefilter (their queries are invoked anyway and
    their residual step checks them).
    """
    order = sorted(matrix, key=lambda p: (-len(matrix[p]), p))
    if budget is not None:
        order = order[:budget]
    return [(p,) for p in sorted(order)]
