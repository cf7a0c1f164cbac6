"""Spark SQL expressions built as text, with the few names of ``pyspark.sql.functions`` and
``Column`` that the HFTA's compiler uses (``compile.py``), handed to Spark whole.

Why not PySpark's ``Column``: every function, operator and literal of a ``Column`` is a Py4J
call, with PySpark's call-site capture around each. The single pass of 50 queries took about
29,000 of them, 8 s in a warm JVM and 20 s in a cold one, on each change of the queries or the
node layouts. Its text is a few hundred kilobytes, parsed by Spark's SQL parser in one call per
column.

An ``Expr`` renders as SQL (``str``). ``select``, ``where``, ``with_column`` and ``column``
hand it to a ``DataFrame``. A function's string argument names a column, as PySpark's do, where
PySpark's takes a column; where it takes a literal (a pattern, a separator), so does this.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F


def quoted(name: str) -> str:
    """A column name as SQL: in backticks (one already in backticks stays as it is)."""
    if len(name) > 1 and name.startswith("`") and name.endswith("`"):
        return name
    return "`" + name.replace("`", "``") + "`"


def _literal(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int):
        return str(value)  # INT when it fits, BIGINT past it: PySpark's lit() alike
    if isinstance(value, float):  # not 1.5: SQL's is a DECIMAL
        text = repr(value) if math.isfinite(value) else \
            ("NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity")
        return f"CAST('{text}' AS DOUBLE)"
    if isinstance(value, (bytes, bytearray)):
        return f"X'{bytes(value).hex()}'"
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    raise TypeError(f"no SQL literal for {type(value).__name__}")


def _arg(value: Any) -> str:
    """An operand: an expression as itself, anything else a literal."""
    return str(value) if isinstance(value, Expr) else _literal(value)


def _cols(value: Any) -> str:
    """A function's column argument: an expression, or a column's name."""
    return quoted(value) if isinstance(value, str) else _arg(value)


class Expr:
    """A Spark SQL expression's text, composed with ``Column``'s operators and methods."""

    __slots__ = ("_sql", "_branches", "_else")
    __hash__ = None  # == builds an expression

    def __init__(self, sql: str, branches: tuple[tuple[str, str], ...] = (),
                 otherwise: str | None = None):
        self._sql, self._branches, self._else = sql, branches, otherwise

    def __str__(self) -> str:
        if not self._branches:
            return self._sql
        whens = " ".join(f"WHEN {c} THEN {v}" for c, v in self._branches)
        tail = f" ELSE {self._else}" if self._else is not None else ""
        return f"CASE {whens}{tail} END"

    def __repr__(self) -> str:
        return f"Expr({str(self)!r})"

    def __bool__(self):
        raise ValueError("an SQL expression has no truth value: use &, | and ~")

    def _op(self, op: str, other: Any) -> Expr:
        return Expr(f"({self} {op} {_arg(other)})")

    def _rop(self, op: str, other: Any) -> Expr:
        return Expr(f"({_arg(other)} {op} {self})")

    def __eq__(self, other): return self._op("=", other)  # type: ignore[override]
    def __ne__(self, other): return self._op("!=", other)  # type: ignore[override]
    def __lt__(self, other): return self._op("<", other)
    def __le__(self, other): return self._op("<=", other)
    def __gt__(self, other): return self._op(">", other)
    def __ge__(self, other): return self._op(">=", other)
    def __and__(self, other): return self._op("AND", other)
    def __or__(self, other): return self._op("OR", other)
    def __invert__(self): return Expr(f"(NOT {self})")
    def __add__(self, other): return self._op("+", other)
    def __sub__(self, other): return self._op("-", other)
    def __mul__(self, other): return self._op("*", other)
    def __truediv__(self, other): return self._op("/", other)
    def __radd__(self, other): return self._rop("+", other)
    def __rsub__(self, other): return self._rop("-", other)
    def __rmul__(self, other): return self._rop("*", other)
    def __rtruediv__(self, other): return self._rop("/", other)
    def __neg__(self): return Expr(f"(- {self})")

    def bitwiseAND(self, other: Any) -> Expr:  # noqa: N802 (Column's name)
        return self._op("&", other)

    def alias(self, name: str) -> Expr:
        return Expr(f"{self} AS {quoted(name)}")

    def cast(self, kind: str) -> Expr:
        return Expr(f"CAST({self} AS {kind})")

    def isin(self, values: Iterable[Any]) -> Expr:
        return Expr(f"({self} IN ({', '.join(_arg(v) for v in values)}))")

    def isNotNull(self) -> Expr:  # noqa: N802
        return Expr(f"({self} IS NOT NULL)")

    def isNull(self) -> Expr:  # noqa: N802
        return Expr(f"({self} IS NULL)")

    def rlike(self, pattern: str) -> Expr:
        return Expr(f"({self} RLIKE {_literal(pattern)})")

    def asc_nulls_last(self) -> Expr:
        return Expr(f"{self} ASC NULLS LAST")

    def desc_nulls_last(self) -> Expr:
        return Expr(f"{self} DESC NULLS LAST")

    def when(self, condition: Expr, value: Any) -> Expr:
        if not self._branches or self._else is not None:
            raise ValueError("when() follows when()")
        return Expr("", (*self._branches, (str(condition), _arg(value))))

    def otherwise(self, value: Any) -> Expr:
        if not self._branches or self._else is not None:
            raise ValueError("otherwise() follows when()")
        return Expr("", self._branches, _arg(value))

    def over(self, window: WindowSpec) -> Expr:
        return Expr(f"{self} OVER ({window})")


class WindowSpec:
    """``Window.partitionBy(…).orderBy(…)``'s text."""

    def __init__(self, by: tuple[str, ...] = (), order: tuple[str, ...] = ()):
        self.by, self.order = by, order

    def partitionBy(self, *cols: Any) -> WindowSpec:  # noqa: N802
        return WindowSpec(tuple(_cols(c) for c in cols), self.order)

    def orderBy(self, *cols: Any) -> WindowSpec:  # noqa: N802
        return WindowSpec(self.by, tuple(_cols(c) for c in cols))

    def __str__(self) -> str:
        parts = []
        if self.by:
            parts.append("PARTITION BY " + ", ".join(self.by))
        if self.order:
            parts.append("ORDER BY " + ", ".join(self.order))
        return " ".join(parts)


Window = WindowSpec()


# -- the functions (PySpark's names and argument kinds)

def _call(name: str, *args: str) -> Expr:
    return Expr(f"{name}({', '.join(args)})")


def col(name: str) -> Expr:
    return Expr(quoted(name))


def lit(value: Any) -> Expr:
    return Expr(_literal(value))


def expr(text: str) -> Expr:
    return Expr(f"({text})")


def when(condition: Expr, value: Any) -> Expr:
    return Expr("", ((str(condition), _arg(value)),))


def substring(c: Any, pos: int, length: int) -> Expr:
    return _call("substring", _cols(c), str(pos), str(length))


def conv(c: Any, from_base: int, to_base: int) -> Expr:
    return _call("conv", _cols(c), str(from_base), str(to_base))


def shiftright(c: Any, n: int) -> Expr:
    return _call("shiftright", _cols(c), str(n))


def shiftrightunsigned(c: Any, n: int) -> Expr:
    return _call("shiftrightunsigned", _cols(c), str(n))


def regexp_replace(c: Any, pattern: str, replacement: str) -> Expr:
    return _call("regexp_replace", _cols(c), _literal(pattern), _literal(replacement))


def translate(c: Any, matching: str, replace: str) -> Expr:
    return _call("translate", _cols(c), _literal(matching), _literal(replace))


def concat_ws(sep: str, *cols: Any) -> Expr:
    return _call("concat_ws", _literal(sep), *(_cols(c) for c in cols))


def get(c: Any, index: int) -> Expr:
    return _call("get", _cols(c), str(index))


def hll_union_agg(c: Any, allow_different_lg_config_k: bool = False) -> Expr:
    return _call("hll_union_agg", _cols(c), _literal(allow_different_lg_config_k))


def count_distinct(*cols: Any) -> Expr:
    return Expr(f"count(DISTINCT {', '.join(_cols(c) for c in cols)})")


def row_number() -> Expr:
    return Expr("row_number()")


def rank() -> Expr:
    return Expr("rank()")


def _function(name: str):
    def call(*cols: Any) -> Expr:
        return _call(name, *(_cols(c) for c in cols))
    call.__name__ = name
    return call


# columns in, a column out: PySpark's function of the same name
array, char, coalesce, concat, explode, floor, greatest, hex, max, min, pmod, reverse, sum, \
    timestamp_seconds, try_divide, unix_seconds, xxhash64, count, count_if, collect_set, \
    struct, create_map, hll_sketch_estimate, inline = (
        _function(n) for n in (
            "array", "char", "coalesce", "concat", "explode", "floor", "greatest", "hex", "max",
            "min", "pmod", "reverse", "sum", "timestamp_seconds", "try_divide", "unix_seconds",
            "xxhash64", "count", "count_if", "collect_set", "struct", "map",
            "hll_sketch_estimate", "inline"))


# -- handed to a DataFrame

def column(e: Expr | str) -> Column:
    """PySpark's column of ``e`` (a name: that column)."""
    return F.expr(_cols(e))


def select(frame: DataFrame, *cols: Expr | str) -> DataFrame:
    """``frame.select`` of expressions and column names, parsed by Spark in one call."""
    return frame.selectExpr(*(_cols(c) for c in cols))


def where(frame: DataFrame, condition: Expr) -> DataFrame:
    return frame.where(str(condition))


def with_column(frame: DataFrame, name: str, e: Expr) -> DataFrame:
    return frame.withColumn(name, column(e))


def local_rows(spark: SparkSession, columns: dict[str, str], rows: Iterable[tuple]
               ) -> DataFrame:
    """A local relation of Spark's own (no Python RDD, nothing on the driver's disk) of
    ``rows`` in ``columns`` (name -> Spark type: ``int``, ``bigint``, ``string`` or
    ``binary``), handed over as one JSON literal: an array of structs of literals is parsed
    and folded a literal at a time (2.7 s for 6,600 rows of four columns, against 0.1 s)."""
    as_json = {n: "string" if t == "binary" else t for n, t in columns.items()}
    text = json.dumps([{n: v.hex() if columns[n] == "binary" and v is not None else v
                        for n, v in zip(columns, r, strict=True)} for r in rows])
    schema = ", ".join(f"{quoted(n)}: {t}" for n, t in as_json.items())
    frame = select(spark.range(1), _call("inline", f"from_json({_literal(text)}, "
                                                   f"{_literal(f'array<struct<{schema}>>')})"))
    return select(frame, *(_call("unhex", quoted(n)).alias(n) if t == "binary" else n
                           for n, t in columns.items()))
