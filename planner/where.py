"""WHERE clauses in SQL (sqlglot's tree) to the IR's predicates and atoms.

Base predicates are normalised (``53 = dst_port`` and ``dst_port = 53`` are one predicate; NOT is
pushed into the comparison), so equal predicates of different queries are recognised as shared.
Every error names the line, column and reason.
"""

from __future__ import annotations

import re

from sqlglot import exp

from capture.fields import (
    BYTES,
    CODE,
    INT32,
    INT64,
    IP,
    STRING,
    code_of,
    ip_int,
    parse_prefix,
)
from planner.ir import Atom, Predicate, QueryError

MAX_CONJUNCTS = 256  # conditions ANDed in one WHERE or HAVING (1,000 would be no real query)


# sqlglot's expression classes as the operators people wrote (for its "missing" errors)
OPERATORS = {"EQ": "=", "NEQ": "!=", "GT": ">", "GTE": ">=", "LT": "<", "LTE": "<=",
             "Mul": "*", "Div": "/", "Add": "+", "Sub": "-", "Mod": "%", "And": "AND",
             "Or": "OR", "Not": "NOT", "In": "IN", "Between": "BETWEEN", "Like": "LIKE",
             "BitwiseAnd": "&", "BitwiseOr": "|", "Is": "IS", "Alias": "AS"}


FLIP = {"=": "=", "!=": "!=", "<": ">", "<=": ">=", ">": "<", ">=": "<="}
NEGATE = {"=": "!=", "!=": "=", "<": ">=", "<=": ">", ">": "<=", ">=": "<"}
CMP_NODES = {exp.EQ: "=", exp.NEQ: "!=", exp.LT: "<", exp.LTE: "<=", exp.GT: ">", exp.GTE: ">="}
NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}\Z")


def _start(meta: dict) -> tuple[int, int]:
    # sqlglot's col is the token's last column; start/end are its character offsets
    return meta["line"], meta["col"] - (meta["end"] - meta["start"])


def _pos(node: exp.Expression) -> tuple[int, int]:
    """Line and column where a node starts (its leftmost token that carries a position)."""
    found = []
    for n in node.walk():
        meta = getattr(n, "meta", None) or {}
        if "line" in meta:
            found.append(_start(meta))
        elif isinstance(n, exp.Column | exp.Identifier) and isinstance(n.this, exp.Expression):
            if "line" in n.this.meta:
                found.append(_start(n.this.meta))
    return min(found, default=(0, 0))


def and_terms(node: exp.Expression) -> list[exp.Expression]:
    """The terms of a chain of ANDs, left to right (iterative: a long chain is a deep tree)."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        if isinstance(n, exp.And):
            stack += [n.expression, n.this]
        elif isinstance(n, exp.Paren) and isinstance(n.this, exp.And):
            stack.append(n.this)
        else:
            out.append(n)
    return out


def _unparen(node):
    while isinstance(node, exp.Paren):
        node = node.this
    return node


def numeric(node) -> float | None:
    if isinstance(node, exp.Neg):
        v = numeric(node.this)
        return None if v is None else -v
    if isinstance(node, exp.Literal) and not node.is_string:
        try:
            return float(node.this) if "." in node.this or "e" in node.this.lower() \
                else int(node.this, 0)
        except ValueError:
            return None
    return None


class WhereTranslator:
    """A query's WHERE clause to predicates; the errors of a query's text, placed."""

    def __init__(self, name: str, text: str):
        self.name, self.text = name, text

    def err(self, reason: str, node: exp.Expression | None = None) -> QueryError:
        line, col = _pos(node) if node is not None else (0, 0)
        return QueryError(reason, line, col, self.name)

    # -- SELECT lists
    def field_name(self, node: exp.Expression) -> str:
        if not isinstance(node, exp.Column) or node.table:
            raise self.err(f"expected a field name, got {node.sql()!r}", node)
        name = node.name.lower()
        if name not in self.cat:
            raise self.err(f"unknown field {node.name!r} in stream {self.stream}", node)
        return name

    def conjuncts(self, node: exp.Expression, clause: str) -> list[exp.Expression]:
        """The conditions ANDed in a WHERE or HAVING, at most MAX_CONJUNCTS of them."""
        terms = and_terms(node)
        if len(terms) > MAX_CONJUNCTS:
            raise self.err(f"{clause} has {len(terms)} conditions joined by AND; a query takes "
                           f"at most {MAX_CONJUNCTS} (condition {MAX_CONJUNCTS + 1} is here)",
                           terms[MAX_CONJUNCTS])
        return terms

    # -- WHERE
    def where(self, node) -> tuple[Predicate, ...]:
        if node is None:
            return ()
        preds: list[Predicate] = []
        for c in self.conjuncts(node.this, "WHERE"):
            atoms = tuple(sorted(set(self.atoms(c))))
            p = Predicate(self.stream, atoms)
            if p not in preds:
                preds.append(p)
        return tuple(preds)

    def atoms(self, node: exp.Expression, negated: bool = False) -> list[Atom]:
        """The atoms of a base predicate (a disjunction, possibly under NOT)."""
        if isinstance(node, exp.Paren):
            return self.atoms(node.this, negated)
        if isinstance(node, exp.Not):
            return self.atoms(node.this, not negated)
        if isinstance(node, exp.Or):
            if negated:
                raise self.err("NOT over an OR is not a base predicate; write the conjunction "
                               "of negations", node)
            return self.atoms(node.this) + self.atoms(node.expression)
        if isinstance(node, exp.And):
            raise self.err("AND inside a parenthesised OR is not supported: a base predicate "
                           "is a comparison or an OR of comparisons", node)
        return [self.atom(node, negated)]

    def atom(self, node: exp.Expression, negated: bool) -> Atom:
        op = CMP_NODES.get(type(node))
        if op is not None:
            left, right = node.this, node.expression
            if isinstance(_unparen(right), exp.BitwiseAnd):
                left, right, op = right, left, FLIP[op]
            if isinstance(_unparen(left), exp.BitwiseAnd):
                return self.bit_test(_unparen(left), op, right, negated)
            if not isinstance(left, exp.Column) and isinstance(right, exp.Column):
                left, right, op = right, left, FLIP[op]
            f = self.field_name(left)
            if negated:
                op = NEGATE[op]
            kind = self.cat[f].kind
            if kind == IP:
                if op not in ("=", "!="):
                    raise self.err(f"{f} supports =, !=, IN and in_prefix(), not {op}", node)
                return Atom(f, "prefix", (ip_int(self.ip_literal(right)), 128), op == "!=")
            if kind == CODE and op not in ("=", "!="):
                raise self.err(f"{f} supports =, != and IN, not {op}", node)
            return Atom(f, op, (self.value(f, right),))
        if isinstance(node, exp.In):
            f = self.field_name(node.this)
            if node.args.get("query") or not node.expressions:
                raise self.err("IN takes a list of constants", node)
            if self.cat[f].kind == IP:
                raise self.err(f"{f} IN (...) is not supported; use in_prefix() or an OR of "
                               "equalities", node)
            vals = tuple(sorted({self.value(f, v) for v in node.expressions}))
            if len(vals) == 1:
                return Atom(f, "!=" if negated else "=", vals)
            return Atom(f, "in", vals, negated)
        if isinstance(node, exp.Between):
            f = self.field_name(node.this)
            if self.cat[f].kind not in (INT32, INT64):
                raise self.err(f"BETWEEN needs an integer field, not {f}", node)
            lo, hi = self.value(f, node.args["low"]), self.value(f, node.args["high"])
            return Atom(f, "between", (min(lo, hi), max(lo, hi)), negated)
        if isinstance(node, exp.Anonymous | exp.Func):
            fname = (node.name if isinstance(node, exp.Anonymous) else node.key).lower()
            args = node.expressions if isinstance(node, exp.Anonymous) else \
                [a for a in (node.this, node.args.get("expression")) if a is not None]
            if fname == "contains" and len(args) == 2:
                f = self.field_name(args[0])
                lit = args[1]
                if self.cat[f].kind not in (STRING, BYTES):
                    raise self.err(f"contains() tests text in payload or a string field, not "
                                   f"{f}", args[0])
                if not (isinstance(lit, exp.Literal) and lit.is_string and lit.this):
                    raise self.err("contains() takes a non-empty quoted string as its second "
                                   "argument", lit)
                return Atom(f, "contains", (lit.this,), negated)
            if fname in ("in_prefix", "in_table", "regexp", "regexplike", "regexp_like") and \
                    len(args) == 2:
                f = self.field_name(args[0])
                lit = args[1]
                if not (isinstance(lit, exp.Literal) and lit.is_string):
                    raise self.err(f"{fname}() takes a quoted string as its second argument",
                                   lit)
                if fname == "in_table":
                    if self.cat[f].kind != IP:
                        raise self.err(f"in_table() needs an address field, not {f}", node)
                    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", lit.this):
                        raise self.err(f"a prefix table's name is letters, digits, '_' or '-', "
                                       f"not {lit.this!r}", lit)
                    return Atom(f, "table", (lit.this,), negated)
                if fname == "in_prefix":
                    if self.cat[f].kind != IP:
                        raise self.err(f"in_prefix() needs an address field, not {f}", node)
                    try:
                        return Atom(f, "prefix", parse_prefix(lit.this), negated)
                    except ValueError as e:
                        raise self.err(f"bad prefix {lit.this!r}: {e}", lit) from e
                if self.cat[f].kind != STRING:
                    raise self.err(f"regexp() needs a string field, not {f}", node)
                try:
                    re.compile(lit.this)
                except re.error as e:
                    raise self.err(f"bad regular expression {lit.this!r}: {e}", lit) from e
                return Atom(f, "regexp", (lit.this,), negated)
            if args and isinstance(args[0], exp.Column) and NAME_RE.match(fname):
                # a user predicate (pipeline/user_predicates.py checks the name when registered)
                f = self.field_name(args[0])
                consts = []
                for lit in args[1:]:
                    v = lit.this if isinstance(lit, exp.Literal) and lit.is_string else \
                        numeric(lit)
                    if v is None or (not isinstance(v, str) and v != int(v)):
                        raise self.err(f"{fname}() takes a field, then quoted strings or whole "
                                       "numbers", lit)
                    consts.append(v if isinstance(v, str) else int(v))
                return Atom(f, "call", (fname, *consts), negated)
            raise self.err(f"unknown function {fname}() (in_prefix, in_table, regexp, "
                           "contains, or a user predicate on a field)", node)
        raise self.err(f"not a base predicate: {node.sql()!r}", node)

    def bit_test(self, band: exp.BitwiseAnd, op: str, right, negated: bool) -> Atom:
        """``(field & m) = v`` or ``!= v``: a cheap fixed-offset test of some of a field's bits.
        A one-bit mask is written canonically as ``= m`` or ``= 0`` so equal tests are shared."""
        col, lit = band.this, band.expression
        if isinstance(_unparen(col), exp.Literal):
            col, lit = lit, col
        f = self.field_name(_unparen(col))
        if self.cat[f].kind not in (INT32, INT64):
            raise self.err(f"a bit test needs an integer field, not {f}", band)
        m, v = numeric(_unparen(lit)), numeric(right)
        if m is None or m != int(m) or not 0 < m < 2**63:
            raise self.err("a bit test masks with a positive whole number, e.g. "
                           "(tcp_flags & 18) = 18", lit)
        if v is None or v != int(v) or v < 0:
            raise self.err("a bit test compares with a whole number, e.g. (tcp_flags & 18) = 18",
                           right)
        if op not in ("=", "!="):
            raise self.err(f"a bit test compares with = or !=, not {op}", band)
        m, v = int(m), int(v)
        if v & ~m:
            raise self.err(f"({f} & {m}) = {v} never holds: {v} has bits outside the mask {m}",
                           band)
        neg = (op == "!=") != negated
        if m & (m - 1) == 0 and neg:  # one bit: (f & 4) != 0 is (f & 4) = 4
            v, neg = m - v, False
        return Atom(f, "mask", (m, v), neg)

    def ip_literal(self, node) -> str:
        if not (isinstance(node, exp.Literal) and node.is_string):
            raise self.err("an address is written as a quoted string, e.g. '10.0.0.1'", node)
        try:
            ip_int(node.this)
        except ValueError as e:
            raise self.err(f"bad address {node.this!r}", node) from e
        return node.this

    def value(self, f: str, node) -> int | str:
        kind = self.cat[f].kind
        if kind == CODE:  # text held as its code: 'NL' is 0x4E4C (fields.code_of)
            if not (isinstance(node, exp.Literal) and node.is_string):
                raise self.err(f"{f} is compared with quoted text, e.g. "
                               f"{'NL' if self.cat[f].codec == 'letters' else 'Google LLC'!r}",
                               node)
            try:
                return code_of(node.this, self.cat[f].codec)
            except ValueError as e:
                raise self.err(f"{f}: {e}", node) from e
        if kind == STRING:
            if not (isinstance(node, exp.Literal) and node.is_string):
                raise self.err(f"{f} is compared with a quoted string", node)
            return node.this.lower()
        v = numeric(node)
        if v is None or v != int(v):
            raise self.err(f"{f} is compared with a whole number, got {node.sql()!r}", node)
        lim = 2**31 - 1 if kind == INT32 else 2**63 - 1
        if not -lim <= int(v) <= lim:
            raise self.err(f"constant {int(v)} out of range for {f}", node)
        return int(v)
