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
``derive.py`` is what it is checked against. The expressions are Spark SQL text
(``sqltext.py``), handed to Spark a column at a time: PySpark's ``Column`` costs a Py4J call
per function, operator and literal.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from functools import reduce

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from sqlglot import exp

from capture.fields import (
    BYTES,
    CODE,
    INT32,
    INT64,
    IP,
    SKETCH,
    STRING,
    TEXT_FIELDS,
    TS,
    fields,
    key_field,
)
from collector.keys import KeyLayout
from collector.spark import sqltext as S
from collector.spark.sqltext import Expr
from planner.ir import Query

I64_MAX = (1 << 63) - 1  # the LFTA's min of NULL measures only (lfta_kernels)
SQL_OPS = {"=": "==", "!=": "!=", "<": "<", "<=": "<=", ">": ">", ">=": ">="}


class NotCompiled(ValueError):
    """A query whose answer this compiler does not express."""


def compiles(query: Query) -> bool:
    """Whether ``answer_frame`` (``join_frame`` for a WITH … JOIN, ``selection_frame`` for a
    selection) answers ``query``."""
    if query.is_selection:
        return True
    if query.join is not None:
        return all(compiles(p) for p in query.join.parts)
    cat = fields(query.stream)
    return all(cat[key_field(k)[0]].kind in (IP, STRING, CODE, INT32, INT64)
               for k in query.keys)


# -- the packed key (collector/keys.py), read by Spark's expressions

def _word(data: Expr, i: int, network: bool = False) -> Expr:
    """The ``i``-th int64 word of binary ``data``: little-endian (a packed key), or in network
    order (an address's 64-bit halves)."""
    word = S.substring(data, 8 * i + 1, 8)
    return S.conv(S.hex(word if network else S.reverse(word)), 16, -10).cast("bigint")


def decoded(stream: str, label: str, key: Expr) -> dict[str, list[Expr]]:
    """Each packed key of a node layout as typed columns: an address as [high, low] 64-bit
    halves, an integer or code as [value], the string key as [text]; NULL where the tuple had
    none."""
    layout = KeyLayout.parse(stream, label)
    out: dict[str, list[Expr]] = {}
    for name, (at, _) in layout.offsets().items():
        kind = fields(stream)[key_field(name)[0]].kind
        # a flag word: its bytes compared, not converted (conv() is most of a word's read)
        present = S.substring(key, 8 * at + 1, 8) != S.lit(bytearray(8))
        if kind == IP:
            # an IPv4 (-mapped) address's high half is zero: its bytes compared, not converted
            # (half the conversions of a row of two IPv4 addresses)
            zero = S.substring(key, 8 * (at + 1) + 1, 8) == S.lit(bytearray(8))
            hi = S.when(zero, S.lit(0).cast("bigint")).otherwise(_word(key, at + 1))
            out[name] = [S.when(present, hi), S.when(present, _word(key, at + 2))]
        elif kind == STRING:
            tail = S.substring(key, 8 * layout.words + 1, 1 << 30).cast("string")
            out[name] = [S.when(present, tail)]
        else:
            v = _word(key, at)
            out[name] = [S.when(v >= 0, v)]
    return out


def holds_slot(label: str, stream: str, key: Expr, slot: int) -> Expr | None:
    """Whether a row of the layout carries query slot ``slot`` (None: the layout has no room
    for it)."""
    layout = KeyLayout.parse(stream, label)
    if slot >= 64 * layout.q_words:
        return None
    word = _word(key, layout.field_words + slot // 64)
    return S.shiftright(word, slot % 64).bitwiseAND(S.lit(1)) == 1


# -- text

def _v6_plain(hi: Expr, lo: Expr) -> Expr:
    """The eight groups of an address in hex, uncompressed."""
    groups = [S.shiftrightunsigned(half, 48 - 16 * j).bitwiseAND(S.lit(0xFFFF))
              for half in (hi, lo) for j in range(4)]
    # hex() and concat_ws, not format_string: java.util.Formatter costs a microsecond a call
    return S.concat_ws(":", *(lower_hex(g) for g in groups))


def lower_hex(value: Expr) -> Expr:
    """``value`` (a number or binary) in lower-case hex. Not ``lower()``: Spark's case mapping
    goes through ICU, whose first use costs a fresh JVM about half a second of class set-up."""
    return S.translate(S.hex(value), "ABCDEF", "abcdef")


def _v6_compressed(padded: Expr) -> Expr:
    """RFC 5952 text from ``:<groups>:`` (the groups padded with a colon at each end), as
    Python's ``ipaddress`` writes it: the first of the longest runs of two or more zero groups
    as ``::``. ``padded`` should be a column of its own (it is read 14 times)."""
    out = S.regexp_replace(S.regexp_replace(padded, "^:", ""), ":$", "")
    for k in range(2, 9):  # the longest run wins: the CASE tries 8 first
        run = f"(:0){{{k}}}:"
        cut = S.regexp_replace(padded, f"^(.*?){run}(.*)$", "$1::$3")
        # the padding's colons go, not those of a leading or trailing ::
        text = S.regexp_replace(S.regexp_replace(cut, "^:(?!:)", ""), "(?<!:):$", "")
        out = S.when(padded.rlike(run), text).otherwise(out)
    return out


def with_address_text(frame: DataFrame, column: str, hi: str, lo: str,
                      bits: int | None = None) -> DataFrame:
    """``frame`` with ``column`` the text of the address in columns ``hi`` and ``lo`` (its
    64-bit halves; NULL stays NULL): a dotted quad when IPv4-mapped, RFC 5952 otherwise; with
    ``bits``, a network (``a.b.c.0/24``, ``2001:db8::/64``). The steps are projections of
    their own, so that Spark generates a small method for each (one expression of them all
    outgrew the JVM's method size: no code generation)."""
    return _address_text(column, hi, lo, bits)(frame)


def _address_text(column: str, hi: str, lo: str, bits: int | None = None
                  ) -> Callable[[DataFrame], DataFrame]:
    """``with_address_text``'s steps, their expressions built once."""
    h, w = S.col(hi), S.col(lo)
    mapped = (h == 0) & (S.shiftright(w, 32) == 0xFFFF)
    quad = S.concat_ws(".", *(S.shiftright(w, s).bitwiseAND(S.lit(255)).cast("string")
                              for s in (24, 16, 8, 0)))
    pad = f"_{column}_padded"
    padded = S.when(h.isNotNull() & ~mapped, S.concat(S.lit(":"), _v6_plain(h, w), S.lit(":")))
    text = S.when(mapped, quad).otherwise(_v6_compressed(S.col(pad)))
    if bits is not None:
        text = S.concat(text, S.when(mapped, S.lit(f"/{min(bits, 32)}"))
                        .otherwise(S.lit(f"/{min(bits, 128)}")))
    text = S.when(h.isNotNull(), text)
    return lambda frame: S.with_column(S.with_column(frame, pad, padded), column, text).drop(pad)


def letters_text(code: Expr) -> Expr:
    """A two-letter code as its letters."""
    return S.when(code >= 0, S.concat(S.char(S.shiftright(code, 8).bitwiseAND(S.lit(255))),
                                      S.char(code.bitwiseAND(S.lit(255)))))


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
        test = holds_slot(label, query.stream, S.col("key"), slot)
        if test is None:
            continue
        cols = decoded(query.stream, label, S.col("key"))
        select = [S.col("window_start")]
        for i, k in enumerate(keys):
            select += [c.alias(f"k{i}_{j}") for j, c in enumerate(cols[k])]
        select.append(S.col("cnt"))
        for m in query.measures:
            select += [S.col(f"{a}_{m}") for a in ("sum", "min", "max")]
        if query.approx:
            select.append(S.col("hll"))
        parts.append(S.select(S.where(merged, (S.col("node") == label) & test), *select))
    if not parts:  # no row of these layouts holds the slot: no row, in the same columns
        cat = fields(query.stream)
        select = [S.col("window_start")]
        for i, k in enumerate(keys):
            kind = cat[key_field(k)[0]].kind
            select += [S.lit(None).cast("bigint").alias(f"k{i}_{j}") for j in range(2)] \
                if kind == IP else [S.lit(None).cast("string" if kind == STRING else "bigint")
                                    .alias(f"k{i}_0")]
        select.append(S.col("cnt"))
        for m in query.measures:
            select += [S.col(f"{a}_{m}") for a in ("sum", "min", "max")]
        if query.approx:
            select.append(S.col("hll"))
        return S.select(S.where(merged, S.lit(False)), *select)
    out = parts[0]
    for p in parts[1:]:
        out = out.unionByName(p)
    return out


def _key_parts(query: Query, i: int, key: str) -> list[str]:
    kind = fields(query.stream)[key_field(key)[0]].kind
    return [f"k{i}_0", f"k{i}_1"] if kind == IP else [f"k{i}_0"]


def rollup(measures: Iterable[str]) -> list[Expr]:
    """Partial rows merged: counts and sums added, minima and maxima kept."""
    out = [S.sum("cnt").alias("cnt")]
    for m in measures:
        out += [S.sum(f"sum_{m}").alias(f"sum_{m}"), S.min(f"min_{m}").alias(f"min_{m}"),
                S.max(f"max_{m}").alias(f"max_{m}")]
    return out


def _output(query: Query, o, parts: dict[str, list[Expr]], epoch: Expr
            ) -> tuple[str, Expr | tuple[Expr, Expr]]:
    """An output over rolled-up rows (``cnt``, ``sum_``/``min_``/``max_``, ``distinct_``,
    ``approx_``; a key's ``parts``): ("value", its column), ("address", its 64-bit halves, to
    be written as text) or ("code", a text code, to be looked up in the dictionary)."""
    if o.kind == "bucket":
        return "value", S.floor(epoch / query.period).cast("bigint")
    if o.kind == "key":
        base, _ = key_field(o.field)
        f, p = fields(query.stream)[base], parts[o.field]
        if f.kind == IP:
            return "address", (p[0], p[1])
        if f.kind == CODE and base in TEXT_FIELDS:
            return "code", p[0]
        if f.kind == CODE:
            return "value", letters_text(p[0])
        return "value", p[0].cast("int") if f.kind == INT32 else p[0]
    if o.func == "count":
        return "value", S.col("cnt")
    if o.func == "count_distinct":
        return "value", S.col(f"distinct_{o.field}")
    if o.func == "approx_distinct":
        return "value", S.col(f"approx_{o.field}").cast("bigint")
    if o.func == "avg":
        return "value", S.col(f"sum_{o.field}").cast("double") / \
            S.greatest(S.col("cnt"), S.lit(1)).cast("double")
    if o.func in ("min", "max"):  # a min or max of NULL measures only is NULL
        v = S.col(f"{o.func}_{o.field}")
        return "value", S.when((v != I64_MAX) & (v >= 0), v)
    return "value", S.col(f"{o.func}_{o.field}")


def answer_frame(merged: DataFrame, query: Query, slot: int, labels: Iterable[str],
                 dictionary: DataFrame | None = None, ranked: bool = False) -> DataFrame:
    """The answer of aggregate ``query`` (slot ``slot``) from its folder's merged rows, in
    ``answers.answer_schema``'s columns, a window's rows in the query's order when it has
    one. ``labels``: the node layouts the rows may have; ``dictionary``: (code, text) of the
    text codes, when the query groups by one; ``ranked``: ``RANK`` even without ORDER BY (the
    key columns' order)."""
    if query.join is not None or query.is_selection or not compiles(query):
        raise NotCompiled(f"query {query.name}: a join or a selection")
    cat = fields(query.stream)
    rows = node_rows(merged, query, slot, labels)
    node_keys = [k for k in query.node_keys if not k.startswith(SKETCH)]
    parts = {k: _key_parts(query, i, k) for i, k in enumerate(node_keys)}
    group = ["window_start", *(p for k in query.keys for p in parts[k])]
    aggs = rollup(query.measures)
    for f in query.distinct:  # NULL is not a value: countDistinct skips it
        aggs.append(S.count_distinct(*(S.col(p) for p in parts[f])).alias(f"distinct_{f}"))
    for f in query.approx:
        aggs.append(S.hll_sketch_estimate(S.hll_union_agg("hll", True)).alias(f"approx_{f}"))
    merged_keys = rows.groupBy(*group).agg(*map(S.column, aggs))

    cols: dict[str, Expr] = {}
    epoch = S.unix_seconds("window_start")
    columns = {k: [S.col(c) for c in p] for k, p in parts.items()}
    for o in query.outputs:
        kind, c = _output(query, o, columns, epoch)
        if kind == "address":  # the halves here, the text below
            cols[f"_{o.name}_hi"], cols[f"_{o.name}_lo"] = c
        else:  # a text code is a code until the dictionary's join below
            cols[o.name] = c
    out = S.select(merged_keys, *(c.alias(n) for n, c in cols.items()), "window_start")
    for cond in query.having:
        out = S.where(out, S.expr(f"`{cond.column}` {SQL_OPS[cond.op]} {cond.value!r}"))
    if query.limit is not None:  # the rows LIMIT drops go before their texts are made
        codes = {o.name for o in query.outputs
                 if o.kind == "key" and key_field(o.field)[0] in TEXT_FIELDS}
        lead = _lead(query, {n: S.col(f"`{n}`") for n in cols if n not in codes})
        if lead:
            place = S.rank().over(S.Window.partitionBy("window_start").orderBy(
                *(_sort_term(c, desc) for c, desc in lead)))
            out = S.where(S.with_column(out, PLACE, place),
                          S.col(PLACE) <= query.limit).drop(PLACE)
    for o in query.outputs:
        if o.kind != "key":
            continue
        base, bits = key_field(o.field)
        if cat[base].kind == IP:
            out = with_address_text(out, o.name, f"_{o.name}_hi", f"_{o.name}_lo", bits)
        elif base in TEXT_FIELDS:
            out = _texts(out, o.name, dictionary)
    return _finished(out, query, ranked)


def selection_frame(tuples: DataFrame, query: Query, slot: int) -> DataFrame:
    """The answer of selection ``query`` (slot ``slot``) from its folder's tuples: those whose
    ``qmask`` holds its bit (a shorter mask, of an older plan, does not), projected to its
    outputs (addresses as text, bytes as lower-case hex) and ``_ts``, the tuple's time:
    ``answers.answer_schema``'s columns."""
    from collector.spark.answers import answer_schema, spark_type
    cat = fields(query.stream)
    word = S.get(S.col("qmask"), slot // 64)  # NULL past the mask's end
    mine = S.where(tuples, S.shiftright(word, slot % 64).bitwiseAND(S.lit(1)) == 1)
    cols, addresses = [], []
    for o in query.outputs:
        kind, c = cat[o.field].kind, S.col(o.field)
        if kind == IP:
            cols += [_word(c, 0, network=True).alias(f"_{o.name}_hi"),
                     _word(c, 1, network=True).alias(f"_{o.name}_lo")]
            addresses.append(o.name)
        else:
            cols.append((lower_hex(c) if kind == BYTES else c).alias(o.name))
    ts = next(f.name for f in cat.values() if f.kind == TS)  # packets: ts; flows: first_switched
    out = S.select(mine, *cols, S.col(ts).alias("_ts"))
    for name in addresses:
        out = with_address_text(out, name, f"_{name}_hi", f"_{name}_lo")
    return S.select(out, *(S.col(f"`{f.name}`").cast(spark_type(f.type)).alias(f.name)
                           for f in answer_schema(query)))


def plain(query: Query) -> bool:
    """Whether ``shared_frame`` answers ``query``: an aggregate without distinct counts,
    sketches or a join, whose HAVING compares numbers (aggregates, the bucket, integer keys);
    ORDER BY … LIMIT ranks it there. The others are answered one by one (``answer_frame``,
    ``join_frame``)."""
    if query.join is not None or query.is_selection or not compiles(query) or query.distinct \
            or query.approx:
        return False
    cat = fields(query.stream)
    kinds = {o.name: cat[key_field(o.field)[0]].kind for o in query.outputs if o.kind == "key"}
    return all(kinds.get(c.column) in (None, INT32, INT64) for c in query.having)


_OPS = {"=": "__eq__", "!=": "__ne__", "<": "__lt__", "<=": "__le__", ">": "__gt__",
        ">=": "__ge__"}
SLOT = "_slot"


def _case(by_slot: dict[int, Expr], every: Collection[int]) -> Expr:
    """One column that is ``by_slot[s]`` on a row of slot ``s`` (NULL for other slots): slots
    of one expression share a branch, and an expression of every slot in ``every`` needs no
    CASE (50 branches of one key's decoding outgrew the JVM's method size: no code
    generation, 20 µs a row)."""
    branches: dict[str, tuple[Expr, list[int]]] = {}
    for s, c in by_slot.items():
        branches.setdefault(str(c), (c, []))[1].append(s)
    if len(branches) == 1 and set(by_slot) >= set(every):
        return next(iter(branches.values()))[0]
    out = None
    for c, slots in branches.values():
        test = S.col(SLOT) == slots[0] if len(slots) == 1 else S.col(SLOT).isin(slots)
        out = S.when(test, c) if out is None else out.when(test, c)
    return out


def shared_frame(merged: DataFrame, queries: list[tuple[int, Query]], labels: Iterable[str],
                 dictionary: DataFrame | None, seen: dict[str, str],
                 ranked: Collection[int] = ()
                 ) -> tuple[DataFrame, dict[int, dict[str, str]]] | None:
    """``shared_pass`` applied to ``merged`` at once (see there), in as many tasks as
    queries."""
    built = shared_pass(queries, labels, seen, ranked)
    if built is None:
        return None
    held = patterns(merged, queries[0][1].stream, labels)
    return built[0](merged, dictionary, len(queries), held), built[1]


# (merged rows, dictionary, tasks, their patterns, buckets by slot) -> the answers
Pass = Callable[..., DataFrame]
Patterns = dict[tuple[str, bytes | None], int]  # (node layout, query-bit pattern) -> rows


def _pattern(stream: str, labels: Iterable[str]) -> Expr:
    """A merged row's query-bit pattern: the bytes of its key that hold it, by its node
    layout (NULL for a layout not in ``labels``)."""
    key, node, pat = S.col("key"), S.col("node"), None
    for label in sorted(set(labels)):
        lay = KeyLayout.parse(stream, label)
        v = S.substring(key, 8 * lay.field_words + 1, 8 * lay.q_words)
        pat = S.when(node == label, v) if pat is None else pat.when(node == label, v)
    return S.lit(None).cast("binary") if pat is None else pat


def patterns(merged: DataFrame, stream: str, labels: Iterable[str]) -> Patterns:
    """How many merged rows have each (node layout, query-bit pattern), in one small job:
    the layouts a batch holds, which queries its rows carry and how many rows each query
    has (a query's answer has at most as many). A layout not in ``labels`` is counted with
    pattern None."""
    rows = S.select(merged, "node", _pattern(stream, labels).alias("_pat"))
    return {(r["node"], r["_pat"]): r["count"]
            for r in rows.groupBy("node", "_pat").count().collect() if r["node"]}


def slot_rows(held: Patterns, slots: Iterable[int]) -> dict[int, int]:
    """The merged rows that carry each of ``slots`` (``patterns``' counts)."""
    out = dict.fromkeys(slots, 0)
    for (_, pat), n in held.items():
        bits = int.from_bytes(pat or b"", "little")  # bit 64·w + i: slot 64·w + i
        for s in out:
            if bits >> s & 1:
                out[s] += n
    return out
BUCKET = "_bucket"  # which of its query's tasks a row of a spread answer goes to


def shared_pass(queries: list[tuple[int, Query]], labels: Iterable[str], seen: dict[str, str],
                ranked: Collection[int] = ()) -> tuple[Pass, dict[int, dict[str, str]]] | None:
    """The answers of the ``plain`` queries (slot, query) of one folder in one pass over its
    merged rows, with one aggregation: each row goes out once per slot its query-bit pattern
    holds, its key cut to that query's keys (bytes of the packed key, not decoded), and the
    rows of every query are rolled up together by (window, slot, key); then the keys are
    decoded, the outputs computed per slot, and HAVING kept per slot. An output's column is
    shared by every query that has it with one type; with another type it is
    ``<name>__<type>`` (``seen``: name -> the Spark type that keeps the bare name, updated).
    The frame's columns: ``SLOT``, ``window_start``, the outputs and ``RANK``: a row's place in
    its window in its query's order (``order_columns``), for the queries with ORDER BY or
    LIMIT (LIMIT applied) and the slots in ``ranked``, else NULL; and each slot's column names
    by output name. None when no node layout of ``labels`` holds a slot of them.

    Its expressions are built once, as SQL text (``sqltext.py``): what ``shared_pass``
    returns applies them to each batch's merged rows, their ``patterns`` and dictionary, in a
    number of tasks. The rows are shuffled once, by slot: the aggregation, the ranking and
    the writer find each query's rows in one task (a shuffle by key, then by window, then by
    query cost two more). A large answer is spread: given ``buckets`` (slot -> n > 1), the
    rows of such a query without ORDER BY or LIMIT are shuffled by (slot, a hash of the key
    into n buckets), so that n tasks answer it, each writing its own part (the frame then has
    ``BUCKET``); a ranked query's windows stay in one task."""
    from collector.spark.answers import answer_schema, spark_type
    if not queries:
        return None
    stream = queries[0][1].stream
    cat = fields(stream)
    layouts = {label: KeyLayout.parse(stream, label) for label in sorted(set(labels))}
    key = S.col("key")
    # 1. each row's query-bit pattern: the bytes of its key that hold it, by its layout
    index = {label: i for i, label in enumerate(layouts)}
    pat = _pattern(stream, layouts)
    # 2. the slots of each distinct (layout, pattern) (``patterns``, a batch's few), a local
    # table joined to every row (a broadcast hash join: a row goes out once per slot its
    # pattern holds); the slots tested on every row, an explode of every slot then a filter,
    # cost 6 µs a row. Each slot's key is cut to its query's keys (bytes of the packed key)
    layout = S.col("_layout")
    eligible: dict[str, list[int]] = {}  # layout -> the slots whose node it may be
    cuts, packed = {}, {}
    for s, q in queries:
        packed[s] = KeyLayout(stream, q.keys, 0)
        nk = {k for k in q.node_keys if not k.startswith(SKETCH)}
        for label, lay in layouts.items():
            if not nk <= set(lay.keys) or s >= 64 * lay.q_words:
                continue
            eligible.setdefault(label, []).append(s)
            at = lay.offsets()
            runs: list[list[int]] = []  # [first word, words]: adjacent fields in one run
            for k in packed[s].keys:  # sorted, as the layout's are
                if runs and sum(runs[-1]) == at[k][0]:
                    runs[-1][1] += at[k][1]
                else:
                    runs.append(list(at[k]))
            # one substring a run (a concat of adjacent ones cost 3x the grouping)
            cut = [S.substring(key, 8 * a + 1, 8 * n) for a, n in runs]
            if packed[s].string is not None:
                cut.append(S.substring(key, 8 * lay.words + 1, 1 << 30))
            value = (cut[0] if len(cut) == 1 else S.concat(*cut)) if cut else \
                S.lit(bytearray())
            cuts.setdefault((label, str(value)), (value, []))[1].append(s)
    if not eligible:
        return None
    cut_key = None
    for (label, _), (value, mine) in cuts.items():
        test = S.col(SLOT).isin(mine)
        if len(layouts) > 1:
            test = (layout == index[label]) & test
        if len(cuts) == 1 and len(layouts) == 1:
            cut_key = value  # every slot cuts alike
        else:
            cut_key = S.when(test, value) if cut_key is None else cut_key.when(test, value)
    measures = sorted({m for _, q in queries for m in q.measures})
    values = ["cnt", *(f"{a}_{m}" for m in measures for a in ("sum", "min", "max"))]
    every = [s for s, _ in queries]
    agg_of = [S.column(a) for a in rollup(measures)]
    with_pat = [S.col(c) for c in ("window_start", *values, "key", "node")] + [pat.alias("_pat")]
    cut_as = cut_key.alias("_key")
    # 3. each slot's outputs: numbers at once, addresses and text codes by staging columns
    epoch = S.unix_seconds("window_start")
    numbers: dict[int, dict[str, Expr]] = {}
    addresses: dict[tuple[str, int | None], dict[int, tuple[Expr, Expr]]] = {}
    codes: dict[str, dict[int, Expr]] = {}
    parts_of: dict[str, dict[str, list[Expr]]] = {}  # a cut's layout, decoded once
    for s, q in queries:
        label = packed[s].label
        parts = parts_of.get(label) or parts_of.setdefault(
            label, decoded(stream, label, S.col("_key")))
        mine = numbers[s] = {}
        for o in q.outputs:
            kind, c = _output(q, o, parts, epoch)
            if kind == "address":
                addresses.setdefault((o.name, key_field(o.field)[1]), {})[s] = c
            elif kind == "code":
                codes.setdefault(o.name, {})[s] = c
            else:
                mine[o.name] = c
    if any(q.having for _, q in queries):  # a comparison with NULL drops the row, as SQL's
        keep = {s: S.coalesce(reduce(lambda a, b: a & b, [
            getattr(numbers[s][c.column], _OPS[c.op])(S.lit(c.value)) for c in q.having]),
            S.lit(False)) if q.having else S.lit(True) for s, q in queries}
        having = _case(keep, every)
    else:
        having = None
    staged = [S.col(SLOT), S.col("window_start"), S.col("_key"), *(S.col(v) for v in values)]
    as_text: dict[tuple[str, int | None], str] = {}  # (output, bits) -> its text column
    for i, ((name, bits), by_slot) in enumerate(addresses.items()):
        as_text[(name, bits)] = f"_a{i}"
        staged += [_case({s: hl[0] for s, hl in by_slot.items()}, every).alias(f"_a{i}_hi"),
                   _case({s: hl[1] for s, hl in by_slot.items()}, every).alias(f"_a{i}_lo")]
    coded = {name: f"_c{i}" for i, name in enumerate(codes)}  # output -> its text column
    staged += [_case(by_slot, every).alias(coded[name]) for name, by_slot in codes.items()]
    texts = [_address_text(column, f"{column}_hi", f"{column}_lo", bits)
             for (_, bits), column in as_text.items()]
    # 4. the outputs' columns, each the CASE of the slots that have it
    columns: dict[str, dict[int, Expr]] = {}
    names: dict[int, dict[str, str]] = {}
    typed: dict[int, dict[str, Expr]] = {}  # a slot's outputs that are not text to be made
    for s, q in queries:
        mine = dict(numbers[s])
        for o in q.outputs:
            if o.kind == "key":
                base, bits = key_field(o.field)
                if cat[base].kind == IP:
                    mine[o.name] = S.col(as_text[(o.name, bits)])
                elif s in codes.get(o.name, {}):
                    mine[o.name] = S.col(coded[o.name])
        mine["window_end"] = S.timestamp_seconds(epoch + S.lit(q.period))
        names[s] = {}
        for f in answer_schema(q):
            if f.name == "window_start":
                continue
            kind = spark_type(f.type)
            as_ = f.name if seen.setdefault(f.name, kind) == kind else f"{f.name}__{kind}"
            names[s][f.name] = as_
            columns.setdefault(as_, {})[s] = mine[f.name].cast(kind)
            if f.name in numbers[s]:
                typed.setdefault(s, {})[f.name] = columns[as_][s]
    outputs = [S.col(SLOT), S.col("window_start"),
               *(_case(by_slot, every).alias(name) for name, by_slot in columns.items())]
    rank, spread_rank = (_ranked_slots(queries, names, ranked, over) for over in
                         ([SLOT], [SLOT, BUCKET]))
    precut, spread_precut = (_limit_precut(queries, typed, over) for over in
                             ([SLOT], [SLOT, BUCKET]))
    whole = {s for s, q in queries if q.order or q.limit is not None or s in ranked}

    def run(merged: DataFrame, dictionary: DataFrame | None, tasks: int, held: Patterns,
            buckets: dict[int, int] | None = None) -> DataFrame:
        rows = S.select(merged, *with_pat)
        table = [(label, pat, index[label], s) for (label, pat), _ in held.items()
                 if label in eligible and pat is not None
                 for s in eligible[label] if int.from_bytes(pat, "little") >> s & 1]
        # a local relation of Spark's own (createDataFrame of a list would be a Python RDD:
        # Python workers on the answer path)
        slot_of = S.local_rows(merged.sparkSession, {"node": "string", "_pat": "binary",
                                                     "_layout": "int", SLOT: "int"}, table)
        joined = S.select(rows.join(F.broadcast(slot_of), ["node", "_pat"]),
                          "window_start", *values, SLOT, cut_as)
        spread: dict[int, list[int]] = {}  # buckets -> the slots spread over as many
        for s, n in (buckets or {}).items():
            if n > 1 and s not in whole:
                spread.setdefault(n, []).append(s)
        if spread:
            bucket = None
            for n, slots_n in spread.items():
                b = S.pmod(S.xxhash64("_key"), S.lit(n)).cast("int")
                test = S.col(SLOT).isin(slots_n)
                bucket = S.when(test, b) if bucket is None else bucket.when(test, b)
            rolled = (S.with_column(joined, BUCKET, bucket.otherwise(S.lit(0)))
                      .repartition(max(1, tasks, *spread), SLOT, BUCKET)
                      .groupBy("window_start", SLOT, BUCKET, "_key").agg(*agg_of))
        else:
            rolled = (joined.repartition(max(1, tasks), SLOT)
                      .groupBy("window_start", SLOT, "_key").agg(*agg_of))
        if having is not None:
            rolled = S.where(rolled, having)
        extra = [BUCKET] if spread else []
        # the rows LIMIT drops go before their addresses and codes are read and made text
        frame = (spread_precut if spread else precut)(S.select(
            rolled, SLOT, "window_start", "_key", *values, *extra))
        frame = S.select(frame, *staged, *extra)
        for text in texts:
            frame = text(frame)
        for column in coded.values():
            frame = _texts(frame, column, dictionary)
        return (spread_rank if spread else rank)(S.select(frame, *outputs, *extra))
    return run, names


def _ranked_slots(queries: list[tuple[int, Query]], names: dict[int, dict[str, str]],
                  ranked: Collection[int], over: list[str]
                  ) -> Callable[[DataFrame], DataFrame]:
    """``shared_frame``'s rows with ``RANK`` for the slots ranked (ORDER BY, LIMIT or in
    ``ranked``), each by its query's order in one window function over ``over`` and the window:
    the i-th term of a slot's order is a column of its own per (i, output column, direction),
    NULL on the other slots' rows (a window's rows are all one slot's: the others' terms tie);
    LIMIT kept per slot."""
    order = {s: q for s, q in queries if q.order or q.limit is not None or s in ranked}
    if not order:
        unranked = S.lit(None).cast("int")
        return lambda frame: S.with_column(frame, RANK, unranked)
    terms: dict[tuple[int, str, bool], list[int]] = {}
    for s, q in order.items():
        by = dict(q.order)
        items = [*q.order, *((c, False) for c in key_columns(q) if c not in by)]
        for i, (c, desc) in enumerate(items):
            terms.setdefault((i, names[s][c], desc), []).append(s)
    cols = []
    for (_, name, desc), slots in sorted(terms.items(), key=lambda t: t[0][0]):
        c = S.when(S.col(SLOT).isin(slots), S.col(f"`{name}`"))
        cols.append(_sort_term(c, desc))
    rank = S.when(S.col(SLOT).isin(list(order)), S.row_number().over(
        S.Window.partitionBy(*over, "window_start").orderBy(*cols)))
    past = None  # a row past its query's LIMIT
    for s, q in order.items():
        if q.limit is not None:
            c = (S.col(SLOT) == s) & (S.col(RANK) > q.limit)
            past = c if past is None else past | c
    if past is None:
        return lambda frame: S.with_column(frame, RANK, rank)
    kept = ~past
    return lambda frame: S.where(S.with_column(frame, RANK, rank), kept)


def _limit_precut(queries: list[tuple[int, Query]], typed: dict[int, dict[str, Expr]],
                  over: list[str]) -> Callable[[DataFrame], DataFrame]:
    """Before ``shared_pass`` makes its texts (addresses, codes: most of a row's cost), the
    rows of a query with LIMIT n that cannot be in its window's first n: those after n
    others by the leading terms of its ORDER BY that are not such texts (``typed``: a slot's
    outputs by name, as written). A row ``rank()`` puts past n has n rows before it by those
    terms, which stay before it in the query's whole order (ties broken by the key columns,
    texts among them): the cut keeps every row ``_ranked_slots`` may keep, in one window
    function over numbers. A query whose ORDER BY starts with a text is not cut."""
    terms: dict[tuple[int, str, bool], tuple[Expr, list[int]]] = {}
    limits: dict[int, int] = {}
    for s, q in queries:
        lead = _lead(q, typed.get(s, {})) if q.limit is not None else []
        if lead:
            limits[s] = q.limit
        for i, (c, desc) in enumerate(lead):
            terms.setdefault((i, str(c), desc), (c, []))[1].append(s)
    if not limits:
        return lambda frame: frame
    cols = []
    for (_, _, desc), (c, slots) in sorted(terms.items(), key=lambda t: t[0][0]):
        cols.append(_sort_term(S.when(S.col(SLOT).isin(slots), c), desc))
    place = S.rank().over(S.Window.partitionBy(*over, "window_start").orderBy(*cols))
    past = reduce(lambda a, b: a | b, [(S.col(SLOT) == s) & (S.col(PLACE) > n)
                                       for s, n in limits.items()])
    kept = ~past
    return lambda frame: S.where(S.with_column(frame, PLACE, place), kept).drop(PLACE)


def _lead(query: Query, typed: dict[str, Expr]) -> list[tuple[Expr, bool]]:
    """The leading terms of ``query``'s ORDER BY (expression, descending) that are outputs in
    ``typed``: the others are texts still to be made."""
    lead = []
    for c, desc in query.order:
        if c not in typed:
            break
        lead.append((typed[c], desc))
    return lead


def _sort_term(c: Expr, desc: bool) -> Expr:
    return c.desc_nulls_last() if desc else c.asc_nulls_last()


PLACE = "_place"  # a row's place in its window by its query's leading ORDER BY terms
RANK = "_rank"  # a row's place in its window, in the query's order (ORDER BY queries)


def _finished(frame: DataFrame, query: Query, ranked: bool = False) -> DataFrame:
    """An answer's outputs in ``answers.answer_schema``'s columns and types (``window_end``
    added); a query with ORDER BY also has ``RANK``, LIMIT per window applied."""
    from collector.spark.answers import answer_schema, spark_type
    frame = S.with_column(frame, "window_end", S.col("window_start") +
                          S.expr(f"INTERVAL {query.period} SECONDS"))
    out = S.select(frame, *(S.col(f"`{f.name}`").cast(spark_type(f.type)).alias(f.name)
                            for f in answer_schema(query)))
    return _ranked(out, query) if ranked or query.order or query.limit is not None else out


_ARITH = {exp.Add: "__add__", exp.Sub: "__sub__", exp.Mul: "__mul__"}
_CMP = {exp.EQ: "__eq__", exp.NEQ: "__ne__", exp.LT: "__lt__", exp.LTE: "__le__",
        exp.GT: "__gt__", exp.GTE: "__ge__"}


def _column(node: exp.Expression) -> Expr:
    """A joined query's expression (checked by the parser) over the joined columns, named
    ``alias.column`` (``answers._compute``'s, in Spark). A division is of doubles, NULL when
    dividing by zero."""
    if isinstance(node, exp.Paren):
        return _column(node.this)
    if isinstance(node, exp.Column):
        return S.col(f"`{node.table}.{node.name}`")
    if isinstance(node, exp.Literal):
        t = node.this
        return S.lit(float(t) if "." in t or "e" in t.lower() else int(t))
    if isinstance(node, exp.Neg):
        return -_column(node.this)
    if isinstance(node, exp.Div):
        return S.try_divide(_column(node.this).cast("double"),
                            _column(node.expression).cast("double"))
    if type(node) in _ARITH:
        return getattr(_column(node.this), _ARITH[type(node)])(_column(node.expression))
    if isinstance(node, exp.Coalesce):
        return S.coalesce(*(_column(a) for a in [node.this, *node.expressions]))
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
               dictionary: DataFrame | None = None, ranked: bool = False) -> DataFrame:
    """The answer of a WITH … [LEFT] JOIN query: its parts' answers (``answer_frame``, each
    at its slot in ``slots`` by part name) joined per window on the ON keys, the WHERE kept
    (SQL's: a row whose condition is NULL goes), the SELECT computed, ORDER BY … LIMIT per
    window; ``answers.answer_schema``'s columns."""
    j = query.join
    sides = {}
    for alias in (j.left, j.right):
        part = j.part(alias)
        frame = answer_frame(merged, part, slots[part.name], labels, dictionary)
        sides[alias] = S.select(frame, *(S.col(f"`{c}`").alias(f"{alias}.{c}")
                                      for c in frame.columns))
    left, right = sides[j.left], sides[j.right]
    on = [left[f"`{j.left}.window_start`"] == right[f"`{j.right}.window_start`"]]
    on += [left[f"`{j.left}.{a}`"] == right[f"`{j.right}.{b}`"] for a, b in j.on]
    joined = left.join(right, on, "left" if j.how == "left" else "inner")
    if j.where is not None:
        joined = S.where(joined, _column(j.where))
    out = S.select(joined, *(_column(node).alias(name) for name, node in j.select),
                        S.col(f"`{j.left}.window_start`").alias("window_start"))
    return _finished(out, query, ranked)


def _texts(frame: DataFrame, column: str, dictionary: DataFrame | None) -> DataFrame:
    """A text-code column as its texts (NULL where the dictionary has no text)."""
    if dictionary is None:
        return S.with_column(frame, column, S.lit(None).cast("string"))
    d = F.broadcast(S.select(dictionary, S.col("code").alias("_code"),
                             S.col("text").alias("_text")))
    return (frame.join(d, frame[column] == d["_code"], "left")
            .withColumn(column, F.col("_text")).drop("_code", "_text"))


def key_columns(query: Query) -> list[str]:
    """The outputs an answer's rows are sorted by after its window and ORDER BY
    (``answers.order_rows``): the bucket and the keys, in the SELECT's order."""
    return [o.name for o in query.outputs if o.kind != "agg"]


def order_columns(query: Query) -> list[Expr]:
    """ORDER BY, then the key columns ascending (rows tied on ORDER BY in one order); NULLs
    last, as Arrow sorts them."""
    by = dict(query.order)
    out = [_sort_term(S.col(c), desc) for c, desc in query.order]
    out += [S.col(c).asc_nulls_last() for c in key_columns(query) if c not in by]
    return out


def _ranked(frame: DataFrame, query: Query) -> DataFrame:
    """Each row's ``RANK`` in its window in the query's order; with LIMIT, the first
    ``query.limit`` rows of each window only."""
    rank = S.row_number().over(S.Window.partitionBy("window_start")
                               .orderBy(*order_columns(query)))
    out = S.with_column(frame, RANK, rank)
    return S.where(out, S.col(RANK) <= query.limit) if query.limit is not None else out
