"""The query language of DESIGN: SQL text parsed with sqlglot into the typed IR of
``planner/ir.py``.

``where.py`` translates WHERE clauses; here a statement's shape is read: a selection, an
aggregation (GROUP BY with time buckets, aggregates, HAVING, ORDER BY … LIMIT), or a WITH of two
aggregations joined. Every error names the line, column and reason.
"""

from __future__ import annotations

import re

import sqlglot
from sqlglot import exp
from sqlglot.errors import ParseError, TokenError
from sqlglot.tokens import Tokenizer, TokenType

from capture.fields import (
    BYTES,
    IP,
    STREAMS,
    STRING,
    fields,
    key_field,
)
from planner.ir import Condition, Join, Output, Predicate, Query, QueryError
from planner.where import CMP_NODES, FLIP, NAME_RE, OPERATORS, WhereTranslator, numeric

_FROM = "FROM " + ", ".join(STREAMS)
DIRECTIVE_RE = re.compile(r"^\s*--\s*(name|alert):\s*(.*?)\s*$")


def directives(lines: list[str], first_line: int) -> dict[str, str]:
    """The directives of the comment lines right above a statement starting at line
    ``first_line`` (1-based): ``-- name: <name>`` and ``-- alert: <rule>`` (the nearest of
    each kind wins)."""
    out: dict[str, str] = {}
    i = first_line - 2
    while i >= 0 and lines[i].lstrip().startswith("--"):
        m = DIRECTIVE_RE.match(lines[i])
        if m:
            out.setdefault(m.group(1), m.group(2))
        i -= 1
    return out


def split_statements(text: str) -> list[tuple[dict[str, str], int, str, int]]:
    """Split a file into (directives, first line, masked text, first column) per statement:
    ``-- name:`` and ``-- alert:`` in the comment lines right above it (``directives``).

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
                out.append((directives(lines, first.line), first.line, masked,
                            max(1, first.col - len(first.text) + 1)))
            current = []
        else:
            current.append(tok)
    return out


def parse_queries(text: str) -> list[Query]:
    """Parse a file of statements; names from ``-- name:`` or q1, q2, … in order."""
    queries: list[Query] = []
    seen: set[str] = set()
    for i, (found, line, masked, _) in enumerate(split_statements(text), start=1):
        name = found.get("name") or f"q{i}"
        if not NAME_RE.match(name):
            raise QueryError(f"invalid query name {name!r} (want [A-Za-z_][A-Za-z0-9_]{{0,63}})",
                             line - 1, 1)
        if name in seen:
            raise QueryError(f"duplicate query name {name!r}", line - 1, 1)
        seen.add(name)
        q = parse_query(masked, name=name)
        q.alert = found.get("alert")
        queries.append(q)
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
    name = name or found.get("name") or "q1"
    if not NAME_RE.match(name):
        raise QueryError(f"invalid query name {name!r} (want [A-Za-z_][A-Za-z0-9_]{{0,63}})")
    q = parse_query(masked, name=name)
    q.alert = found.get("alert")
    return q


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


AGG_FUNCS = ("count", "sum", "min", "max", "avg")
IP_LAYERS = ("ip", "l4", "dns", "dns_name")  # catalogue groups NULL on a frame without IP


def _ip_only(preds: tuple[Predicate, ...], cat) -> bool:
    """Whether a WHERE admits IP packets only: some base predicate tests IP-layer fields only
    (a test of NULL is false, negated or not)."""
    return any(all(cat[a.field].group in IP_LAYERS for a in p.atoms) for p in preds)


class _Aggregation(WhereTranslator):
    """A SELECT of one stream: its outputs, groups, aggregates, HAVING, ORDER BY and LIMIT."""

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

    def limit(self, st: exp.Select) -> int | None:
        if st.args.get("limit") is None:
            return None
        lit = st.args["limit"].expression
        if not (isinstance(lit, exp.Literal) and lit.this.isdigit()):
            raise self.err("LIMIT takes a whole number", st.args["limit"])
        return int(lit.this)

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
            n = numeric(args[1])
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
            if numeric(left) is not None and numeric(right) is None:
                left, right, op = right, left, FLIP[op]
            value = numeric(right)
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


class _Builder(_Aggregation):
    """A statement to a Query: a selection, an aggregation, or a WITH of two joined."""

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
            raise self.err(f"FROM is required ({_FROM})", st)
        self.stream = frm.this.name.lower()
        if self.stream not in STREAMS:
            raise self.err(f"unknown stream {frm.this.name!r} ({_FROM})", frm.this)
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
            if node.is_string or numeric(node) is None:
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
