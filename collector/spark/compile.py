"""The HFTA compiled to Spark's own expressions: a query's answer from the merged partial rows
of its folder (``merge.merge_partials``), computed by Spark's engine with no Python on the
executors.

For an aggregate query at slot ``s`` the answer is:

1. **the rows of its node**: of each node layout that carries slot ``s`` (a node label,
   ``collector/keys.py``), the rows whose query-bit pattern holds bit ``s``, their packed key
   decoded into typed columns by the layout's offsets (an address as its two 64-bit halves,
   NULL where the tuple had none);
2. **rolled up** to the query's keys per window: counts and sums added, minima and maxima
   kept, ``count(DISTINCT f)`` over the finer node's values of f, ``approx_count_distinct``
   as the union of the rows' HyperLogLog sketches (DataSketches, as the probes write them);
3. HAVING, then the outputs as users read them: addresses as text (dotted quads for
   IPv4-mapped ones, RFC 5952 for the others), prefixes as networks, letter codes as their
   letters, text codes through the dictionary the probes publish (a broadcast join), the time
   bucket, ``window_start`` and ``window_end``;
4. ORDER BY … LIMIT per window with a window function (ties broken by the key columns, as
   ``answers.order_rows`` does).

``answer_frame`` gives the columns of ``answers.answer_schema``; the Python derivation of
``derive.py`` is what it is checked against.
"""

from __future__ import annotations

from collections.abc import Iterable

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from sqlglot import exp

from capture.fields import CODE, INT32, INT64, IP, SKETCH, STRING, TEXT_FIELDS, fields, key_field
from collector.keys import KeyLayout
from planner.ir import Query

I64_MAX = (1 << 63) - 1  # the LFTA's min of NULL measures only (lfta_kernels)
SQL_OPS = {"=": "==", "!=": "!=", "<": "<", "<=": "<=", ">": ">", ">=": ">="}


class NotCompiled(ValueError):
    """A query whose answer this compiler does not express (a join, a selection)."""


def compiles(query: Query) -> bool:
    """Whether ``answer_frame`` (``join_frame`` for a WITH … JOIN) answers ``query``."""
    if query.is_selection:
        return False
    if query.join is not None:
        return all(compiles(p) for p in query.join.parts)
    cat = fields(query.stream)
    return all(cat[key_field(k)[0]].kind in (IP, STRING, CODE, INT32, INT64)
               for k in query.keys)


# -- the packed key (collector/keys.py), read by Spark's expressions

def _word(key: Column, i: int) -> Column:
    """The ``i``-th little-endian int64 word of a packed key."""
    return F.conv(F.hex(F.reverse(F.substring(key, 8 * i + 1, 8))), 16, -10).cast("bigint")


def decoded(stream: str, label: str, key: Column) -> dict[str, list[Column]]:
    """Each packed key of a node layout as typed columns: an address as [high, low] 64-bit
    halves, an integer or code as [value], the string key as [text]; NULL where the tuple had
    none."""
    layout = KeyLayout.parse(stream, label)
    out: dict[str, list[Column]] = {}
    for name, (at, _) in layout.offsets().items():
        kind = fields(stream)[key_field(name)[0]].kind
        if kind == IP:
            valid = _word(key, at) != 0
            out[name] = [F.when(valid, _word(key, at + 1)), F.when(valid, _word(key, at + 2))]
        elif kind == STRING:
            tail = F.substring(key, 8 * layout.words + 1, 1 << 30).cast("string")
            out[name] = [F.when(_word(key, at) != 0, tail)]
        else:
            v = _word(key, at)
            out[name] = [F.when(v >= 0, v)]
    return out


def holds_slot(label: str, stream: str, key: Column, slot: int) -> Column | None:
    """Whether a row of the layout carries query slot ``slot`` (None: the layout has no room
    for it)."""
    layout = KeyLayout.parse(stream, label)
    if slot >= 64 * layout.q_words:
        return None
    word = _word(key, layout.field_words + slot // 64)
    return F.shiftright(word, slot % 64).bitwiseAND(F.lit(1)) == 1


# -- text

def _v6_plain(hi: Column, lo: Column) -> Column:
    """The eight groups of an address in hex, uncompressed."""
    groups = [F.shiftrightunsigned(half, 48 - 16 * j).bitwiseAND(F.lit(0xFFFF))
              for half in (hi, lo) for j in range(4)]
    return F.format_string(":".join(["%x"] * 8), *groups)


def _v6_compressed(padded: Column) -> Column:
    """RFC 5952 text from ``:<groups>:`` (the groups padded with a colon at each end), as
    Python's ``ipaddress`` writes it: the first of the longest runs of two or more zero groups
    as ``::``. ``padded`` should be a column of its own (it is read 14 times)."""
    out = F.regexp_replace(F.regexp_replace(padded, "^:", ""), ":$", "")
    for k in range(2, 9):  # the longest run wins: the CASE tries 8 first
        run = f"(:0){{{k}}}:"
        cut = F.regexp_replace(padded, f"^(.*?){run}(.*)$", "$1::$3")
        # the padding's colons go, not those of a leading or trailing ::
        text = F.regexp_replace(F.regexp_replace(cut, "^:(?!:)", ""), "(?<!:):$", "")
        out = F.when(padded.rlike(run), text).otherwise(out)
    return out


def with_address_text(frame: DataFrame, column: str, hi: str, lo: str,
                      bits: int | None = None) -> DataFrame:
    """``frame`` with ``column`` the text of the address in columns ``hi`` and ``lo`` (its
    64-bit halves; NULL stays NULL): a dotted quad when IPv4-mapped, RFC 5952 otherwise; with
    ``bits``, a network (``a.b.c.0/24``, ``2001:db8::/64``). The steps are projections of
    their own, so that Spark generates a small method for each (one expression of them all
    outgrew the JVM's method size: no code generation)."""
    h, w = F.col(hi), F.col(lo)
    mapped = (h == 0) & (F.shiftright(w, 32) == 0xFFFF)
    quad = F.format_string("%d.%d.%d.%d", *(F.shiftright(w, s).bitwiseAND(F.lit(255))
                                            for s in (24, 16, 8, 0)))
    pad = f"_{column}_padded"
    frame = frame.withColumn(pad, F.when(h.isNotNull() & ~mapped, F.concat(
        F.lit(":"), _v6_plain(h, w), F.lit(":"))))
    text = F.when(mapped, quad).otherwise(_v6_compressed(F.col(pad)))
    if bits is not None:
        text = F.concat(text, F.when(mapped, F.lit(f"/{min(bits, 32)}"))
                        .otherwise(F.lit(f"/{min(bits, 128)}")))
    return frame.withColumn(column, F.when(h.isNotNull(), text)).drop(pad)


def letters_text(code: Column) -> Column:
    """A two-letter code as its letters."""
    return F.when(code >= 0, F.concat(F.char(F.shiftright(code, 8).bitwiseAND(F.lit(255))),
                                      F.char(code.bitwiseAND(F.lit(255)))))


# -- a query's answer

def node_rows(merged: DataFrame, query: Query, slot: int, labels: Iterable[str]) -> DataFrame:
    """The merged rows of ``query``'s node (every layout in ``labels`` that carries its
    slot), its node keys decoded: ``window_start``, ``k<i>_<j>`` (key i's parts), ``cnt``,
    the measures' ``sum_``/``min_``/``max_`` and ``hll``."""
    keys = [k for k in query.node_keys if not k.startswith(SKETCH)]
    parts = []
    for label in sorted(set(labels)):
        layout = KeyLayout.parse(query.stream, label)
        if not set(keys) <= set(layout.keys):
            continue
        test = holds_slot(label, query.stream, F.col("key"), slot)
        if test is None:
            continue
        cols = decoded(query.stream, label, F.col("key"))
        select = [F.col("window_start")]
        for i, k in enumerate(keys):
            select += [c.alias(f"k{i}_{j}") for j, c in enumerate(cols[k])]
        select.append(F.col("cnt"))
        for m in query.measures:
            select += [F.col(f"{a}_{m}") for a in ("sum", "min", "max")]
        if query.approx:
            select.append(F.col("hll"))
        parts.append(merged.where((F.col("node") == label) & test).select(*select))
    if not parts:  # no row of these layouts holds the slot: no row, in the same columns
        cat = fields(query.stream)
        select = [F.col("window_start")]
        for i, k in enumerate(keys):
            kind = cat[key_field(k)[0]].kind
            select += [F.lit(None).cast("bigint").alias(f"k{i}_{j}") for j in range(2)] \
                if kind == IP else [F.lit(None).cast("string" if kind == STRING else "bigint")
                                    .alias(f"k{i}_0")]
        select.append(F.col("cnt"))
        for m in query.measures:
            select += [F.col(f"{a}_{m}") for a in ("sum", "min", "max")]
        if query.approx:
            select.append(F.col("hll"))
        return merged.where(F.lit(False)).select(*select)
    out = parts[0]
    for p in parts[1:]:
        out = out.unionByName(p)
    return out


def _key_parts(query: Query, i: int, key: str) -> list[str]:
    kind = fields(query.stream)[key_field(key)[0]].kind
    return [f"k{i}_0", f"k{i}_1"] if kind == IP else [f"k{i}_0"]


def answer_frame(merged: DataFrame, query: Query, slot: int, labels: Iterable[str],
                 dictionary: DataFrame | None = None) -> DataFrame:
    """The answer of aggregate ``query`` (slot ``slot``) from its folder's merged rows, in
    ``answers.answer_schema``'s columns, a window's rows in the query's order when it has
    one. ``labels``: the node layouts the rows may have; ``dictionary``: (code, text) of the
    text codes, when the query groups by one."""
    if query.join is not None or not compiles(query):
        raise NotCompiled(f"query {query.name}: a join or a selection")
    cat = fields(query.stream)
    rows = node_rows(merged, query, slot, labels)
    node_keys = [k for k in query.node_keys if not k.startswith(SKETCH)]
    parts = {k: _key_parts(query, i, k) for i, k in enumerate(node_keys)}
    group = ["window_start", *(p for k in query.keys for p in parts[k])]
    aggs = [F.sum("cnt").alias("cnt")]
    for m in query.measures:
        aggs += [F.sum(f"sum_{m}").alias(f"sum_{m}"), F.min(f"min_{m}").alias(f"min_{m}"),
                 F.max(f"max_{m}").alias(f"max_{m}")]
    for f in query.distinct:  # NULL is not a value: countDistinct skips it
        aggs.append(F.count_distinct(*(F.col(p) for p in parts[f])).alias(f"distinct_{f}"))
    for f in query.approx:
        aggs.append(F.hll_sketch_estimate(F.hll_union_agg("hll", True)).alias(f"approx_{f}"))
    merged_keys = rows.groupBy(*group).agg(*aggs)

    cols: dict[str, Column] = {}
    epoch = F.unix_seconds("window_start")
    for o in query.outputs:
        if o.kind == "bucket":
            cols[o.name] = F.floor(epoch / query.period).cast("bigint")
        elif o.kind == "key":
            base, bits = key_field(o.field)
            f = cat[base]
            p = [F.col(c) for c in parts[o.field]]
            if f.kind == IP:  # the halves here, the text below
                cols[f"_{o.name}_hi"], cols[f"_{o.name}_lo"] = p
            elif f.kind == CODE and base in TEXT_FIELDS:
                cols[o.name] = p[0]  # a code until the dictionary's join below
            elif f.kind == CODE:
                cols[o.name] = letters_text(p[0])
            elif f.kind == INT32:
                cols[o.name] = p[0].cast("int")
            else:
                cols[o.name] = p[0]
        elif o.func == "count":
            cols[o.name] = F.col("cnt")
        elif o.func == "count_distinct":
            cols[o.name] = F.col(f"distinct_{o.field}")
        elif o.func == "approx_distinct":
            cols[o.name] = F.col(f"approx_{o.field}").cast("bigint")
        elif o.func == "avg":
            cols[o.name] = F.col(f"sum_{o.field}").cast("double") / \
                F.greatest(F.col("cnt"), F.lit(1)).cast("double")
        elif o.func in ("min", "max"):  # a min or max of NULL measures only is NULL
            v = F.col(f"{o.func}_{o.field}")
            cols[o.name] = F.when((v != I64_MAX) & (v >= 0), v)
        else:
            cols[o.name] = F.col(f"{o.func}_{o.field}")
    out = merged_keys.select(*(c.alias(n) for n, c in cols.items()), "window_start")
    for cond in query.having:
        out = out.where(F.expr(f"`{cond.column}` {SQL_OPS[cond.op]} {cond.value!r}"))
    for o in query.outputs:
        if o.kind != "key":
            continue
        base, bits = key_field(o.field)
        if cat[base].kind == IP:
            out = with_address_text(out, o.name, f"_{o.name}_hi", f"_{o.name}_lo", bits)
        elif base in TEXT_FIELDS:
            out = _texts(out, o.name, dictionary)
    return _finished(out, query)


RANK = "_rank"  # a row's place in its window, in the query's order (ORDER BY queries)


def _finished(frame: DataFrame, query: Query) -> DataFrame:
    """An answer's outputs in ``answers.answer_schema``'s columns and types (``window_end``
    added); a query with ORDER BY also has ``RANK``, LIMIT per window applied."""
    from collector.spark.answers import answer_schema, spark_type
    frame = frame.withColumn("window_end", F.col("window_start") +
                             F.expr(f"INTERVAL {query.period} SECONDS"))
    out = frame.select(*(F.col(f"`{f.name}`").cast(spark_type(f.type)).alias(f.name)
                         for f in answer_schema(query)))
    return _ranked(out, query) if query.order or query.limit is not None else out


_ARITH = {exp.Add: "__add__", exp.Sub: "__sub__", exp.Mul: "__mul__"}
_CMP = {exp.EQ: "__eq__", exp.NEQ: "__ne__", exp.LT: "__lt__", exp.LTE: "__le__",
        exp.GT: "__gt__", exp.GTE: "__ge__"}


def _column(node: exp.Expression) -> Column:
    """A joined query's expression (checked by the parser) over the joined columns, named
    ``alias.column`` (``answers._compute``'s, in Spark). A division is of doubles, NULL when
    dividing by zero."""
    if isinstance(node, exp.Paren):
        return _column(node.this)
    if isinstance(node, exp.Column):
        return F.col(f"`{node.table}.{node.name}`")
    if isinstance(node, exp.Literal):
        t = node.this
        return F.lit(float(t) if "." in t or "e" in t.lower() else int(t))
    if isinstance(node, exp.Neg):
        return -_column(node.this)
    if isinstance(node, exp.Div):
        return F.try_divide(_column(node.this).cast("double"),
                            _column(node.expression).cast("double"))
    if type(node) in _ARITH:
        return getattr(_column(node.this), _ARITH[type(node)])(_column(node.expression))
    if isinstance(node, exp.Coalesce):
        return F.coalesce(*(_column(a) for a in [node.this, *node.expressions]))
    if type(node) in _CMP:
        return getattr(_column(node.this), _CMP[type(node)])(_column(node.expression))
    if isinstance(node, exp.And):
        return _column(node.this) & _column(node.expression)
    if isinstance(node, exp.Or):
        return _column(node.this) | _column(node.expression)
    if isinstance(node, exp.Not):
        return ~_column(node.this)
    raise NotCompiled(f"cannot compile {node.sql()}")


def join_frame(merged: DataFrame, query: Query, slots: dict[str, int], labels: Iterable[str],
               dictionary: DataFrame | None = None) -> DataFrame:
    """The answer of a WITH … [LEFT] JOIN query: its parts' answers (``answer_frame``, each
    at its slot in ``slots`` by part name) joined per window on the ON keys, the WHERE kept
    (SQL's: a row whose condition is NULL goes), the SELECT computed, ORDER BY … LIMIT per
    window; ``answers.answer_schema``'s columns."""
    j = query.join
    sides = {}
    for alias in (j.left, j.right):
        part = j.part(alias)
        frame = answer_frame(merged, part, slots[part.name], labels, dictionary)
        sides[alias] = frame.select(*(F.col(f"`{c}`").alias(f"{alias}.{c}")
                                      for c in frame.columns))
    left, right = sides[j.left], sides[j.right]
    on = [left[f"`{j.left}.window_start`"] == right[f"`{j.right}.window_start`"]]
    on += [left[f"`{j.left}.{a}`"] == right[f"`{j.right}.{b}`"] for a, b in j.on]
    joined = left.join(right, on, "left" if j.how == "left" else "inner")
    if j.where is not None:
        joined = joined.where(_column(j.where))
    out = joined.select(*(_column(node).alias(name) for name, node in j.select),
                        F.col(f"`{j.left}.window_start`").alias("window_start"))
    return _finished(out, query)


def _texts(frame: DataFrame, column: str, dictionary: DataFrame | None) -> DataFrame:
    """A text-code column as its texts (NULL where the dictionary has no text)."""
    if dictionary is None:
        return frame.withColumn(column, F.lit(None).cast("string"))
    d = F.broadcast(dictionary.select(F.col("code").alias("_code"),
                                      F.col("text").alias("_text")))
    return (frame.join(d, frame[column] == d["_code"], "left")
            .withColumn(column, F.col("_text")).drop("_code", "_text"))


def order_columns(query: Query) -> list[Column]:
    """ORDER BY, then the key columns ascending (rows tied on ORDER BY in one order); NULLs
    last, as Arrow sorts them."""
    by = dict(query.order)
    out = [F.col(c).desc_nulls_last() if desc else F.col(c).asc_nulls_last()
           for c, desc in query.order]
    out += [F.col(o.name).asc_nulls_last() for o in query.outputs
            if o.kind != "agg" and o.name not in by]
    return out


def _ranked(frame: DataFrame, query: Query) -> DataFrame:
    """Each row's ``RANK`` in its window in the query's order; with LIMIT, the first
    ``query.limit`` rows of each window only."""
    rank = F.row_number().over(Window.partitionBy("window_start")
                               .orderBy(*order_columns(query)))
    out = frame.withColumn(RANK, rank)
    return out.where(F.col(RANK) <= query.limit) if query.limit is not None else out
