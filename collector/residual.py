"""Residual predicates: what the prefilter did not decide (expensive predicates such as regexp on
``dns_qname``, and cheap ones left out by a bit budget), evaluated only on tuples whose query bit
is set. A predicate shared by several queries is evaluated once per tuple (the paper's
expensive-predicate cache).
"""

from __future__ import annotations

import re
from functools import lru_cache

import numpy as np

from capture.fields import IP, STRING, fields, prefix_mask, split128
from capture.unpack import TupleBatch
from collector.prefilter import ip_words
from planner.plan import Plan
from planner.query import Atom, Predicate
from planner.slots import clear_slot, has_slot


@lru_cache(maxsize=1024)
def _regex(pattern: str) -> re.Pattern:
    return re.compile(pattern)


def eval_atom(a: Atom, stream: str, tb: TupleBatch, rows: np.ndarray) -> np.ndarray:
    """The atom on the given rows (NULL is false, negated or not)."""
    kind = fields(stream)[a.field].kind
    if kind == STRING:
        col = tb.strings[a.field].take(rows).to_pylist()
        if a.op == "regexp":
            rx = _regex(a.values[0])
            hit = np.array([v is not None and rx.search(v) is not None for v in col], bool)
        elif a.op in ("=", "in", "!="):
            vals = set(a.values)
            hit = np.array([v is not None and v in vals for v in col], bool)
            if a.op == "!=":
                hit = np.array([v is not None and v not in vals for v in col], bool)
                return hit
        else:
            raise ValueError(f"operator {a.op} on a string field")
        valid = np.array([v is not None for v in col], bool)
        return (hit != a.negated) & valid
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
    }[a.op]()
    if a.op in ("in", "between"):
        hit = hit != a.negated
    return hit & valid


def eval_predicate(p: Predicate, tb: TupleBatch, rows: np.ndarray) -> np.ndarray:
    """A base predicate (an OR of atoms) on the given rows."""
    out = np.zeros(len(rows), dtype=bool)
    for a in p.atoms:
        out |= eval_atom(a, p.stream, tb, rows)
    return out


class Residual:
    """Residual predicates of one stream's queries, applied to Q in place."""

    def __init__(self, plan: Plan, stream: str):
        self.plan = plan
        self.users: dict[int, list[int]] = {}  # predicate id -> slots that check it
        for qp in plan.queries:
            if qp.query.stream == stream:
                for p in qp.residual:
                    self.users.setdefault(p, []).append(qp.slot)
        self.evaluated = 0  # predicate evaluations, for metrics and tests

    def __bool__(self) -> bool:
        return bool(self.users)

    def apply(self, tb: TupleBatch, Q: np.ndarray) -> None:
        """Clear query bits whose residual predicates fail; each predicate once per tuple."""
        # cheapest first: a failed cheap predicate spares the expensive ones
        for pid in sorted(self.users, key=lambda p: self.plan.predicates[p].cost):
            slots = self.users[pid]
            need = np.zeros(len(tb), dtype=bool)
            for s in slots:
                need |= has_slot(Q, s)
            rows = np.flatnonzero(need)
            if not len(rows):
                continue
            ok = eval_predicate(self.plan.predicates[pid].predicate, tb, rows)
            self.evaluated += len(rows)
            fail = rows[~ok]
            for s in slots:
                clear_slot(Q, fail, s)
