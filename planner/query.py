"""The query language of DESIGN: SQL text parsed with sqlglot into a typed IR.

Base predicates are normalised (``53 = dst_port`` and ``dst_port = 53`` are one predicate; NOT is
pushed into the comparison), so equal predicates of different queries are recognised as shared.
Every error names the line, column and reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import sqlglot
from sqlglot import exp
from sqlglot.errors import ParseError, TokenError
from sqlglot.tokens import Tokenizer, TokenType

from capture.fields import (
    BYTES,
    INT32,
    INT64,
    IP,
    SKETCH,
    STRING,
    fields,
    ip_int,
    key_field,
    parse_prefix,
    prefix_network,
)

NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}\Z")
NAME_LINE_RE = re.compile(r"^\s*--\s*name:\s*(\S+)\s*$")
RESIDUAL_OPS = ("table", "call", "contains")  # decided by collector/pipeline/residual.py only
USER_PREDICATE_COST = 50.0  # a Python call per value (cached by value)
MAX_CONJUNCTS = 256  # conditions ANDed in one WHERE or HAVING (1,000 would be no real query)
# sqlglot's expression classes as the operators people wrote (for its "missing" errors)
OPERATORS = {"EQ": "=", "NEQ": "!=", "GT": ">", "GTE": ">=", "LT": "<", "LTE": "<=",
             "Mul": "*", "Div": "/", "Add": "+", "Sub": "-", "Mod": "%", "And": "AND",
             "Or": "OR", "Not": "NOT", "In": "IN", "Between": "BETWEEN", "Like": "LIKE",
             "BitwiseAnd": "&", "BitwiseOr": "|", "Is": "IS", "Alias": "AS"}
AGG_FUNCS = ("count", "sum", "min", "max", "avg")
FLIP = {"=": "=", "!=": "!=", "<": ">", "<=": ">=", ">": "<", ">=": "<="}
NEGATE = {"=": "!=", "!=": "=", "<": ">=", "<=": ">", ">": "<=", ">=": "<"}
CMP_NODES = {exp.EQ: "=", exp.NEQ: "!=", exp.LT: "<", exp.LTE: "<=", exp.GT: ">", exp.GTE: ">="}


class QueryError(ValueError):
    """A query that cannot be accepted: line, column and reason."""

    def __init__(self, reason: str, line: int = 0, col: int = 0, query: str = ""):
        self.reason, self.line, self.col, self.query = reason, line, col, query
        where = f"line {line}, column {col}: " if line else ""
        name = f"query {query}: " if query else ""
        super().__init__(f"{name}{where}{reason}")


@dataclass(frozen=True, order=True)
class Atom:
    """One comparison of a field with constants.

    ``op`` is one of = != < <= > >= in between prefix mask regexp table call. ``values`` holds ints,
    strings, for ``mask`` the bit test ``(field & m) = v`` as (m, v), for ``prefix`` the network as
    (16-byte integer, prefix length over 128 bits), for ``table`` the name of a configured prefix
    table (collector/pipeline/prefix_tables.py), for ``call`` a user predicate's name and its
    constant arguments (collector/pipeline/user_predicates.py). ``negated`` applies to in, between,
    prefix, mask, regexp, table and call (the others fold NOT into ``op``).
    """

    field: str
    op: str
    values: tuple
    negated: bool = False

    def holds(self, v: int | None) -> bool:
        """The atom on one integer value (addresses as 128-bit integers); NULL is false."""
        if v is None:
            return False
        c = self.values
        if self.op in RESIDUAL_OPS:
            raise ValueError(f"{self.text} is evaluated by collector/pipeline/residual.py")
        if self.op == "prefix":
            mask = ((1 << 128) - 1) ^ ((1 << (128 - c[1])) - 1)
            return ((v & mask) == c[0]) != self.negated
        if self.op == "in":
            return (v in c) != self.negated
        if self.op == "mask":
            return ((v & c[0]) == c[1]) != self.negated
        if self.op == "between":
            return (c[0] <= v <= c[1]) != self.negated
        return {"=": v == c[0], "!=": v != c[0], "<": v < c[0], "<=": v <= c[0],
                ">": v > c[0], ">=": v >= c[0]}[self.op]

    def constants(self) -> list[int]:
        """The values where the atom's truth can change (region boundaries of an ASC)."""
        if self.op == "prefix":
            value, length = self.values
            return [value, value | ((1 << (128 - length)) - 1)]
        if self.op in (*RESIDUAL_OPS, "mask"):  # a bit test is no set of intervals: bits only
            return []
        return list(self.values)

    @property
    def text(self) -> str:
        not_ = "NOT " if self.negated else ""
        if self.op == "prefix":
            return f"{not_}in_prefix({self.field}, '{format_prefix(*self.values)}')"
        if self.op == "mask":
            return f"({self.field} & {self.values[0]}) {'!=' if self.negated else '='} " \
                f"{self.values[1]}"
        if self.op == "regexp":
            return f"{not_}regexp({self.field}, {_lit(self.values[0])})"
        if self.op == "contains":
            return f"{not_}contains({self.field}, {_lit(self.values[0])})"
        if self.op == "table":
            return f"{not_}in_table({self.field}, {_lit(self.values[0])})"
        if self.op == "call":
            args = "".join(f", {_lit(v)}" for v in self.values[1:])
            return f"{not_}{self.values[0]}({self.field}{args})"
        if self.op == "in":
            return f"{self.field} {not_}IN ({', '.join(_lit(v) for v in self.values)})"
        if self.op == "between":
            return f"{self.field} {not_}BETWEEN {_lit(self.values[0])} AND {_lit(self.values[1])}"
        return f"{self.field} {self.op} {_lit(self.values[0])}"


@dataclass(frozen=True)
class Predicate:
    """A base predicate: one atom, or a parenthesised OR of atoms (canonically sorted)."""

    stream: str
    atoms: tuple[Atom, ...]

    @property
    def text(self) -> str:
        parts = [a.text for a in self.atoms]
        return parts[0] if len(parts) == 1 else "(" + " OR ".join(parts) + ")"

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(sorted({a.field for a in self.atoms}))

    @property
    def cost(self) -> float:
        """Relative evaluation cost: unpack cost of its fields plus the comparisons."""
        cat = fields(self.stream)
        total = 0.0
        for a in self.atoms:
            f = cat[a.field]
            if a.op == "regexp":
                total += 100
            elif a.op == "contains":
                total += 20 + f.cost  # a substring search of variable-length data
            elif a.op == "table":
                total += 30  # a search per prefix length in the table
            elif a.op == "call":
                total += USER_PREDICATE_COST
            elif f.kind == STRING:
                total += 20 * max(1, len(a.values))
            elif a.op == "in":
                total += 1 + len(a.values).bit_length()
            elif a.op == "prefix":
                total += 2
            else:
                total += 1
        return total


@dataclass(frozen=True)
class Output:
    """One output column: the time bucket, a key field, or an aggregate."""

    name: str
    kind: str  # "bucket", "key", "agg"
    field: str | None = None  # key field or aggregated measure (None for count(*))
    func: str | None = None  # count, sum, min, max, avg, count_distinct, approx_distinct


@dataclass(frozen=True)
class Condition:
    """A HAVING comparison of an output column with a number."""

    column: str
    op: str
    value: float


@dataclass
class Query:
    """One registered continuous query."""

    name: str
    stream: str
    text: str
    outputs: tuple[Output, ...]
    predicates: tuple[Predicate, ...]
    period: int | None = None  # seconds; None for selection queries
    keys: tuple[str, ...] = ()  # grouping fields besides the time bucket
    having: tuple[Condition, ...] = ()
    order: tuple[tuple[str, bool], ...] = ()  # (output column, descending)
    limit: int | None = None
    join: Join | None = None  # WITH … SELECT … FROM a [LEFT] JOIN b: its parts are planned
    parent: Query | None = field(default=None, repr=False, compare=False)  # a part's join

    @property
    def parts(self) -> tuple[Query, ...]:
        """What the planner plans of this query: its WITH parts, or itself."""
        return self.join.parts if self.join is not None else (self,)

    @property
    def is_selection(self) -> bool:
        return self.period is None

    @property
    def folder(self) -> str:
        """Spool folder below the stream: the period in seconds, or ``select``."""
        return "select" if self.period is None else str(self.period)

    @property
    def measures(self) -> tuple[str, ...]:
        return tuple(sorted({o.field for o in self.outputs if o.kind == "agg" and o.field
                             and o.func not in ("count_distinct", "approx_distinct")}))

    @property
    def distinct(self) -> tuple[str, ...]:
        """Fields counted by ``count(DISTINCT f)``, in output order."""
        return tuple(dict.fromkeys(o.field for o in self.outputs if o.func == "count_distinct"))

    @property
    def approx(self) -> tuple[str, ...]:
        """Fields counted by ``approx_count_distinct(f)`` (at most one per query)."""
        return tuple(dict.fromkeys(o.field for o in self.outputs if o.func == "approx_distinct"))

    @property
    def node_keys(self) -> tuple[str, ...]:
        """What the query's aggregate-tree node groups by: its keys, then the fields it counts
        distinct values of (an exact distinct count is derived from that finer node: the
        number of its groups per key), then ``~f`` for an approximate count of f (the node's
        rows carry a HyperLogLog sketch of f instead of a row per value)."""
        return tuple(dict.fromkeys((*self.keys, *self.distinct,
                                    *(SKETCH + f for f in self.approx))))


@dataclass(eq=False)
class Join:
    """Two aggregate queries of the same stream and period combined per closed window:
    ``WITH a AS (…), b AS (…) SELECT … FROM a [LEFT] JOIN b ON a.t = b.t AND a.k = b.k
    [WHERE …]``. Each part is an ordinary aggregate query named ``<query>.<alias>`` (its own
    slot, prefilter signature and tree node); the HFTA joins their answers of each window."""

    parts: tuple[Query, ...]  # in WITH order
    left: str  # the alias in FROM
    right: str  # the alias joined
    how: str  # "inner" or "left"
    on: tuple[tuple[str, str], ...]  # (left column, right column) pairs beside the buckets
    select: tuple[tuple[str, exp.Expression], ...]  # (output name, expression over a.col)
    where: exp.Expression | None = None

    def part(self, alias: str) -> Query:
        return next(p for p in self.parts if p.name.rpartition(".")[2] == alias)


def expand(queries) -> list[Query]:
    """The queries the planner plans: joined queries replaced by their parts."""
    return [p for q in queries for p in q.parts]


def _lit(v) -> str:
    return f"'{v}'" if isinstance(v, str) else str(v)


def format_prefix(value: int, length: int) -> str:
    net = prefix_network(value, length)
    if net.prefixlen == net.max_prefixlen:
        return str(net.network_address)
    return str(net)


# ---------------------------------------------------------------------------------- parsing


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


def split_statements(text: str) -> list[tuple[str | None, int, str, int]]:
    """Split a file into (name from ``-- name:``, first line, masked text, first column) per
    statement.

    The masked text keeps the statement at its original line and column (everything before it
    is blanked), so parse errors point into the file.
    """
    try:
        tokens = Tokenizer().tokenize(text)
    except TokenError as e:
        raise QueryError(f"cannot tokenize: {e}") from e
    lines = text.split("\n")
    out: list[tuple[str | None, int, str, int]] = []
    current: list = []
    for tok in [*tokens, None]:
        if tok is None or tok.token_type == TokenType.SEMICOLON:
            if current:
                first, last = current[0], current[-1]
                body = text[first.start:last.end + 1]
                masked = re.sub(r"[^\n]", " ", text[:first.start]) + body
                name = None
                if first.line >= 2:
                    m = NAME_LINE_RE.match(lines[first.line - 2])
                    if m:
                        name = m.group(1)
                out.append((name, first.line, masked, max(1, first.col - len(first.text) + 1)))
            current = []
        else:
            current.append(tok)
    return out


def parse_queries(text: str) -> list[Query]:
    """Parse a file of statements; names from ``-- name:`` or q1, q2, … in order."""
    queries: list[Query] = []
    seen: set[str] = set()
    for i, (name, line, masked, _) in enumerate(split_statements(text), start=1):
        name = name or f"q{i}"
        if not NAME_RE.match(name):
            raise QueryError(f"invalid query name {name!r} (want [A-Za-z_][A-Za-z0-9_]{{0,63}})",
                             line - 1, 1)
        if name in seen:
            raise QueryError(f"duplicate query name {name!r}", line - 1, 1)
        seen.add(name)
        queries.append(parse_query(masked, name=name))
    if not queries:
        raise QueryError("no statement found")
    return queries


def parse_single(text: str, name: str | None = None) -> Query:
    """One statement (as registered over REST); its name from ``name``, ``-- name:`` or q1."""
    stmts = split_statements(text)
    if not stmts:
        raise QueryError("no statement found")
    if len(stmts) > 1:
        _, line, _, col = stmts[1]
        raise QueryError(f"one statement per query; a second one starts here (found "
                         f"{len(stmts)}: register each on its own)", line, col)
    found, line, masked, _ = stmts[0]
    name = name or found or "q1"
    if not NAME_RE.match(name):
        raise QueryError(f"invalid query name {name!r} (want [A-Za-z_][A-Za-z0-9_]{{0,63}})")
    return parse_query(masked, name=name)


def _parse_error(e: ParseError, name: str) -> QueryError:
    """sqlglot's first error in words a query's author knows (no parser class names)."""
    err = e.errors[0] if e.errors else {}
    desc = str(err.get("description", e)).split(". Line")[0]
    desc = re.sub(r"<Token token_type: TokenType\.\w+, text: ([^,]*),[^>]*>", r"'\1'", desc)
    m = re.match(r"Required keyword: '(\w+)' missing for <class '[\w.]*\.(\w+)'>", desc)
    if m:
        op = OPERATORS.get(m.group(2), m.group(2).lower())
        side = "right" if m.group(1) == "expression" else "left"
        desc = f"incomplete expression: {op!r} lacks its {side}-hand side"
    col = err.get("col", 0)
    if col and err.get("highlight"):  # sqlglot reports the token's last column
        col = max(1, col - len(err["highlight"]) + 1)
    return QueryError(desc, err.get("line", 0), col, name)


def parse_query(text: str, name: str = "q1") -> Query:
    """Parse one statement into a Query."""
    try:
        first = next((t for t in Tokenizer().tokenize(text)), None)
    except TokenError as e:
        raise QueryError(f"cannot tokenize: {e}", query=name) from e
    if first is not None and first.token_type not in (TokenType.SELECT, TokenType.WITH):
        raise QueryError(f"a query starts with SELECT, not {first.text!r}", first.line,
                         max(1, first.col - len(first.text) + 1), name)
    try:
        stmts = [s for s in sqlglot.parse(text) if s is not None]
    except ParseError as e:
        raise _parse_error(e, name) from e
    except TokenError as e:
        raise QueryError(f"cannot tokenize: {e}", query=name) from e
    except RecursionError as e:
        raise QueryError("expression nested too deeply", query=name) from e
    if len(stmts) != 1:
        raise QueryError(f"expected one statement, found {len(stmts)}", query=name)
    try:
        return _Builder(name, text.strip()).build(stmts[0])
    except RecursionError as e:
        raise QueryError("expression nested too deeply", query=name) from e


class _Builder:
    def __init__(self, name: str, text: str):
        self.name, self.text = name, text

    def err(self, reason: str, node: exp.Expression | None = None) -> QueryError:
        line, col = _pos(node) if node is not None else (0, 0)
        return QueryError(reason, line, col, self.name)

    def build(self, st: exp.Expression) -> Query:
        if not isinstance(st, exp.Select):
            raise self.err(f"only SELECT is supported, not {st.key.upper()}", st)
        with_ = st.args.get("with_") or st.args.get("with")
        if with_ is not None:
            return self.joined(st, with_)
        for arg in ("joins", "distinct", "windows", "qualify"):
            if st.args.get(arg):
                raise self.err(f"{arg.upper()} is not supported", st)
        frm = st.args.get("from_") or st.args.get("from")
        if frm is None or not isinstance(frm.this, exp.Table):
            raise self.err("FROM packets or FROM flows is required", st)
        self.stream = frm.this.name.lower()
        if self.stream not in ("packets", "flows"):
            raise self.err(f"unknown stream {frm.this.name!r} (FROM packets or FROM flows)",
                           frm.this)
        self.cat = fields(self.stream)
        preds = self.where(st.args.get("where"))
        group = st.args.get("group")
        has_agg = any(isinstance(n, exp.AggFunc) for s in st.expressions for n in s.walk())
        if group is None and not has_agg:
            return self.selection(st, preds)
        return self.aggregate(st, group, preds)

    # -- WITH a AS (…), b AS (…) SELECT … FROM a [LEFT] JOIN b ON …
    def joined(self, st: exp.Select, with_: exp.Expression) -> Query:
        parts: dict[str, Query] = {}
        for cte in with_.expressions:
            alias = cte.alias
            if not NAME_RE.match(alias or ""):
                raise self.err(f"a WITH part is named [A-Za-z_][A-Za-z0-9_]*, not {alias!r}", cte)
            if alias in parts:
                raise self.err(f"WITH names part {alias!r} twice", cte)
            if not isinstance(cte.this, exp.Select) or \
                    (cte.this.args.get("with_") or cte.this.args.get("with")):
                raise self.err(f"WITH part {alias} is one aggregate query", cte)
            part = _Builder(f"{self.name}.{alias}", " ".join(cte.this.sql().split())) \
                .build(cte.this)
            if part.period is None:
                raise self.err(f"WITH part {alias} is an aggregate query (GROUP BY time/N)",
                               cte.this)
            parts[alias] = part
            first = next(iter(parts.values()))
            if part.period != first.period or part.stream != first.stream:
                raise self.err(f"the parts of a join read one stream with one period: "
                               f"{first.name.rpartition('.')[2]} is {first.stream} time/"
                               f"{first.period}, {alias} is {part.stream} time/{part.period}",
                               cte.this.args.get("group") or cte)
        frm = st.args.get("from_") or st.args.get("from")
        joins = st.args.get("joins") or []
        if frm is None or not isinstance(frm.this, exp.Table) or len(joins) != 1 or \
                not isinstance(joins[0].this, exp.Table):
            raise self.err("a query WITH parts reads FROM one part JOIN another", st)
        left, right = frm.this.name, joins[0].this.name
        for name, node in ((left, frm.this), (right, joins[0].this)):
            if name not in parts:
                raise self.err(f"{name!r} is no part of the WITH (parts: "
                               f"{', '.join(parts)})", node)
        if left == right:
            raise self.err("a part joined with itself", joins[0])
        unused = set(parts) - {left, right}
        if unused:
            raise self.err(f"WITH part {sorted(unused)[0]} is not joined", st)
        j = joins[0]
        side = (j.args.get("side") or "").upper()
        if side not in ("", "LEFT") or (j.args.get("kind") or "").upper() not in ("", "INNER",
                                                                                  "OUTER"):
            raise self.err("a join is JOIN or LEFT JOIN", j)
        on = j.args.get("on")
        if on is None:
            raise self.err("a join needs ON a.t = b.t (the time buckets) AND key equalities", j)
        self.join_parts = {left: parts[left], right: parts[right]}
        pairs, bucket = [], False
        for c in self.conjuncts(on, "ON"):
            if not (isinstance(c, exp.EQ) and isinstance(c.this, exp.Column)
                    and isinstance(c.expression, exp.Column)):
                raise self.err("ON takes equalities of a column of each part, joined by AND",
                               c)
            (ta, oa), (tb, ob) = self.part_column(c.this), self.part_column(c.expression)
            if ta == tb:
                raise self.err("an ON equality compares a column of each part", c)
            if ta != left:
                (ta, oa), (tb, ob) = (tb, ob), (ta, oa)
            if oa.kind == "bucket" and ob.kind == "bucket":
                bucket = True
                continue
            for t, o, node in ((ta, oa, c.this), (tb, ob, c.expression)):
                if o.kind != "key":
                    raise self.err(f"join key {t}.{o.name} is not a group key of {t}", node)
            pairs.append((oa.name, ob.name))
        if not bucket:
            raise self.err(f"a join is per window: ON needs {left}.<bucket> = "
                           f"{right}.<bucket> (their time/{first.period} columns)", on)
        select = []
        for item in st.expressions:
            node, alias = (item.this, item.alias) if isinstance(item, exp.Alias) else (item, None)
            self.check_expr(node)
            name = alias or (node.name if isinstance(node, exp.Column) else
                             " ".join(node.sql().split()))
            select.append((name, node))
        names = [n for n, _ in select]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise self.err(f"duplicate output column {sorted(dup)[0]!r}", st)
        where = st.args.get("where")
        if where is not None:
            self.check_expr(where.this, boolean=True)
        if st.args.get("group") or st.args.get("having"):
            raise self.err("a join combines aggregates: GROUP BY and HAVING go in its parts",
                           st)
        outputs = tuple(Output(n, "expr") for n in names)
        order = self.order(st.args.get("order"), outputs)
        limit = self.limit(st)
        join = Join(tuple(parts.values()), left, right, "left" if side == "LEFT" else "inner",
                    tuple(pairs), tuple(select), where.this if where is not None else None)
        q = Query(self.name, first.stream, self.text, outputs, (), first.period, (), (), order,
                  limit, join)
        for p in join.parts:
            p.parent = q
        return q

    def part_column(self, node: exp.Column) -> tuple[str, Output]:
        """``a.col``: the part and its output column."""
        if not node.table:
            raise self.err(f"qualify a column with its part: {', '.join(self.join_parts)}"
                           f".{node.name}", node)
        part = self.join_parts.get(node.table)
        if part is None:
            raise self.err(f"{node.table!r} is no part of the join", node)
        for o in part.outputs:
            if o.name.lower() == node.name.lower():
                return node.table, o
        raise self.err(f"part {node.table} has no column {node.name!r} (it has "
                       f"{', '.join(o.name for o in part.outputs)})", node)

    def check_expr(self, node: exp.Expression, boolean: bool = False) -> None:
        """What a joined query's SELECT and WHERE may compute: its parts' columns, numbers,
        + - * /, coalesce(); comparisons, AND, OR and NOT in the WHERE."""
        if isinstance(node, exp.Paren):
            return self.check_expr(node.this, boolean)
        if boolean:
            if isinstance(node, exp.And | exp.Or):
                self.check_expr(node.this, True)
                return self.check_expr(node.expression, True)
            if isinstance(node, exp.Not):
                return self.check_expr(node.this, True)
            if type(node) in CMP_NODES:
                self.check_expr(node.this)
                return self.check_expr(node.expression)
            raise self.err("a join's WHERE compares its columns: =, !=, <, <=, >, >=, AND, OR, "
                           "NOT", node)
        if isinstance(node, exp.Column):
            self.part_column(node)
        elif isinstance(node, exp.Literal):
            if node.is_string or _number(node) is None:
                raise self.err("a join computes with numbers, not strings", node)
        elif isinstance(node, exp.Neg):
            self.check_expr(node.this)
        elif isinstance(node, exp.Add | exp.Sub | exp.Mul | exp.Div):
            self.check_expr(node.this)
            self.check_expr(node.expression)
        elif isinstance(node, exp.Coalesce):
            for a in [node.this, *node.expressions]:
                self.check_expr(a)
        else:
            raise self.err(f"a join's SELECT computes with its parts' columns, numbers, "
                           f"+ - * / and coalesce(), not {node.sql()!r}", node)

    def limit(self, st: exp.Select) -> int | None:
        if st.args.get("limit") is None:
            return None
        lit = st.args["limit"].expression
        if not (isinstance(lit, exp.Literal) and lit.this.isdigit()):
            raise self.err("LIMIT takes a whole number", st.args["limit"])
        return int(lit.this)

    # -- SELECT lists
    def field_name(self, node: exp.Expression) -> str:
        if not isinstance(node, exp.Column) or node.table:
            raise self.err(f"expected a field name, got {node.sql()!r}", node)
        name = node.name.lower()
        if name not in self.cat:
            raise self.err(f"unknown field {node.name!r} in stream {self.stream}", node)
        return name

    def bucket(self, node: exp.Expression) -> int | None:
        """N for ``time/N``, else None."""
        if isinstance(node, exp.Paren):
            node = node.this
        if isinstance(node, exp.Div | exp.IntDiv) and isinstance(node.this, exp.Column) \
                and node.this.name.lower() == "time":
            lit = node.expression
            if not (isinstance(lit, exp.Literal) and not lit.is_string and lit.this.isdigit()):
                raise self.err("the time bucket must be time/N with N a whole number of seconds",
                               node)
            n = int(lit.this)
            if not 1 <= n <= 86400 * 366:
                raise self.err(f"time bucket period {n} s out of range (1 s to 1 year)", node)
            return n
        return None

    def selection(self, st: exp.Select, preds) -> Query:
        outputs = []
        for item in st.expressions:
            node, alias = (item.this, item.alias) if isinstance(item, exp.Alias) else (item, None)
            if isinstance(node, exp.Star):  # every field but the payload bytes
                outputs.extend(Output(f.name, "key", f.name) for f in self.cat.values()
                               if f.kind != BYTES)
                continue
            f = self.field_name(node)
            outputs.append(Output(alias or f, "key", f))
        for arg in ("having", "order", "limit"):
            if st.args.get(arg):
                raise self.err(f"{arg.upper()} needs an aggregate query (GROUP BY time/N)", st)
        return Query(self.name, self.stream, self.text, tuple(outputs), preds)

    def aggregate(self, st: exp.Select, group, preds) -> Query:
        if group is None:
            raise self.err("an aggregate query needs GROUP BY time/N", st)
        period = None
        keys: list[str] = []
        for g in group.expressions:
            n = self.bucket(g)
            if n is not None:
                if period is not None:
                    raise self.err("GROUP BY has more than one time bucket", g)
                period = n
                continue
            f = self.group_key(g)
            if f not in keys:
                keys.append(f)
        if period is None:
            raise self.err("GROUP BY needs exactly one time bucket time/N", group)
        outputs: list[Output] = []
        for item in st.expressions:
            node, alias = (item.this, item.alias) if isinstance(item, exp.Alias) else (item, None)
            label = alias or " ".join(node.sql().split())
            n = self.bucket(node)
            if n is not None:
                if n != period:
                    raise self.err(f"time/{n} in SELECT differs from time/{period} in GROUP BY",
                                   node)
                outputs.append(Output(label, "bucket"))
            elif isinstance(node, exp.AggFunc):
                func, f = self.agg(node)
                if func == "avg" and f == "ip_len" and not _ip_only(preds, self.cat):
                    raise self.err("avg(ip_len) needs a WHERE that admits IP packets only "
                                   "(e.g. ip_version IN (4, 6) or a protocol test): a frame "
                                   "without IP has no ip_len", node)
                outputs.append(Output(label, "agg", f, func))
            else:
                f = self.group_key(node)
                if f not in keys:
                    shown = f if "/" not in f else label
                    raise self.err(f"{shown!r} must appear in GROUP BY or in an aggregate", node)
                outputs.append(Output(alias or (f if "/" not in f else label), "key", f))
        names = [o.name for o in outputs]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise self.err(f"duplicate output column {sorted(dup)[0]!r}", st)
        approx = {o.field for o in outputs if o.func == "approx_distinct"}
        if len(approx) > 1:
            raise self.err(f"one field per query for approx_count_distinct (a node's rows "
                           f"carry one sketch), not {', '.join(sorted(approx))}; use "
                           "count(DISTINCT f) or a query per field", st)
        counted = [o.field for o in outputs if o.func in ("count_distinct", "approx_distinct")]
        strings = [f for f in dict.fromkeys([*keys, *counted])
                   if self.cat[key_field(f)[0]].kind == STRING]
        if len(strings) > 1:
            raise self.err(f"a query groups by or counts distinct values of at most one text "
                           f"field (a partial row's key holds one), not {', '.join(strings)}",
                           st)
        having = self.having(st.args.get("having"), outputs)
        order = self.order(st.args.get("order"), outputs)
        limit = self.limit(st)
        return Query(self.name, self.stream, self.text, tuple(outputs), preds, period,
                     tuple(keys), having, order, limit)

    def group_key(self, node: exp.Expression) -> str:
        """A groupable field, or ``prefix(address field, bits)`` as the key ``field/bits``."""
        if isinstance(node, exp.Anonymous) and node.name.lower() == "prefix":
            args = node.expressions
            if len(args) != 2:
                raise self.err("prefix() takes an address field and a prefix length, e.g. "
                               "prefix(src_ip, 24)", node)
            f = self.field_name(args[0])
            if self.cat[f].kind != IP:
                raise self.err(f"prefix() needs an address field, not {f}", args[0])
            n = _number(args[1])
            if n is None or n != int(n) or not 1 <= n <= 128:
                raise self.err("a prefix length is a whole number from 1 to 128 (bits of the "
                               "address's own family: prefix(src_ip, 24) cuts IPv4 to /24, "
                               "IPv6 to /24)", args[1])
            return f"{f}/{int(n)}"
        return self.groupable(node, "field {f!r} cannot be grouped by")

    def groupable(self, node: exp.Expression, error: str) -> str:
        """The groupable field ``node`` names; ``error`` (formatted with ``f``) if not."""
        f = self.field_name(node)
        if not self.cat[f].groupable:
            raise self.err(error.format(f=f), node)
        return f

    def agg(self, node: exp.AggFunc) -> tuple[str, str | None]:
        func = node.key.lower()
        if func == "approxdistinct":  # approx_count_distinct(f): HyperLogLog (DataSketches)
            return "approx_distinct", self.groupable(
                node.this, "approx_count_distinct({f}) needs a field that can be grouped by")
        if func not in AGG_FUNCS:
            raise self.err(f"aggregate {func}() is not supported (count, sum, min, max, avg)",
                           node)
        arg = node.this
        if func == "count":
            if isinstance(arg, exp.Star):
                return "count", None
            if isinstance(arg, exp.Distinct) and len(arg.expressions) == 1:
                return "count_distinct", self.groupable(
                    arg.expressions[0], "count(DISTINCT {f}) needs a field that can be grouped by")
            raise self.err("count takes * or DISTINCT and one field: count(*), "
                           "count(DISTINCT dst_ip)", node)
        f = self.field_name(arg)
        if not self.cat[f].measure:
            allowed = ", ".join(m for m, v in self.cat.items() if v.measure)
            raise self.err(f"{func}({f}) is not supported: measures are {allowed}", arg)
        return func, f

    def ref(self, node: exp.Expression, outputs) -> str:
        """An output column named by alias, by field, or by the same aggregate expression."""
        if isinstance(node, exp.Column) and not node.table:
            for o in outputs:
                if o.name.lower() == node.name.lower():
                    return o.name
        if isinstance(node, exp.AggFunc):
            func, f = self.agg(node)
            for o in outputs:
                if o.kind == "agg" and o.func == func and o.field == f:
                    return o.name
            raise self.err(f"{node.sql()} must also appear in SELECT", node)
        raise self.err(f"{node.sql()!r} is not an output column", node)

    def conjuncts(self, node: exp.Expression, clause: str) -> list[exp.Expression]:
        """The conditions ANDed in a WHERE or HAVING, at most MAX_CONJUNCTS of them."""
        terms = and_terms(node)
        if len(terms) > MAX_CONJUNCTS:
            raise self.err(f"{clause} has {len(terms)} conditions joined by AND; a query takes "
                           f"at most {MAX_CONJUNCTS} (condition {MAX_CONJUNCTS + 1} is here)",
                           terms[MAX_CONJUNCTS])
        return terms

    def having(self, node, outputs) -> tuple[Condition, ...]:
        if node is None:
            return ()
        out = []
        for c in self.conjuncts(node.this, "HAVING"):
            op = CMP_NODES.get(type(c))
            if op is None:
                raise self.err("HAVING takes comparisons of an output with a number, "
                               "joined by AND", c)
            left, right = c.this, c.expression
            if _number(left) is not None and _number(right) is None:
                left, right, op = right, left, FLIP[op]
            value = _number(right)
            if value is None:
                raise self.err("HAVING compares an output column with a number", c)
            col = self.ref(left, outputs)
            out.append(Condition(col, op, value))
        return tuple(out)

    def order(self, node, outputs) -> tuple[tuple[str, bool], ...]:
        if node is None:
            return ()
        return tuple((self.ref(o.this, outputs), bool(o.args.get("desc")))
                     for o in node.expressions)

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
                        _number(lit)
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
        m, v = _number(_unparen(lit)), _number(right)
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
        if kind == STRING:
            if not (isinstance(node, exp.Literal) and node.is_string):
                raise self.err(f"{f} is compared with a quoted string", node)
            return node.this.lower()
        v = _number(node)
        if v is None or v != int(v):
            raise self.err(f"{f} is compared with a whole number, got {node.sql()!r}", node)
        lim = 2**31 - 1 if kind == INT32 else 2**63 - 1
        if not -lim <= int(v) <= lim:
            raise self.err(f"constant {int(v)} out of range for {f}", node)
        return int(v)


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


IP_LAYERS = ("ip", "l4", "dns", "dns_name")  # catalogue groups NULL on a frame without IP


def _ip_only(preds: tuple[Predicate, ...], cat) -> bool:
    """Whether a WHERE admits IP packets only: some base predicate tests IP-layer fields only
    (a test of NULL is false, negated or not)."""
    return any(all(cat[a.field].group in IP_LAYERS for a in p.atoms) for p in preds)


def _unparen(node):
    while isinstance(node, exp.Paren):
        node = node.this
    return node


def _number(node) -> float | None:
    if isinstance(node, exp.Neg):
        v = _number(node.this)
        return None if v is None else -v
    if isinstance(node, exp.Literal) and not node.is_string:
        try:
            return float(node.this) if "." in node.this or "e" in node.this.lower() \
                else int(node.this, 0)
        except ValueError:
            return None
    return None
