"""The query IR of DESIGN's query language: what ``planner/query.py`` makes of SQL text and
every later stage reads. A predicate is a disjunction of atoms, each one comparison of a field
with constants; a query is a selection or an aggregation over a stream, or a join of two
aggregations (WITH … LEFT JOIN).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlglot import exp

from capture.fields import (
    CODE_FIELDS,
    SKETCH,
    STRING,
    code_text,
    fields,
    prefix_network,
)

RESIDUAL_OPS = ("table", "call", "contains")  # decided by collector/pipeline/residual.py only
USER_PREDICATE_COST = 50.0  # a Python call per value (cached by value)


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
        if self.field in CODE_FIELDS:  # a code as the text it stands for
            vals = [f"'{code_text(v)}'" for v in self.values]
            if self.op == "in":
                return f"{self.field} {not_}IN ({', '.join(vals)})"
            return f"{self.field} {self.op} {vals[0]}"
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
    alert: str | None = field(default=None, compare=False)  # its ``-- alert:`` directive
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
