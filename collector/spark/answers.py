"""The answer of one query and one window, from its partial rows: the HFTA's last step, run on
Spark's executors (``collector/spark/derive.py`` hands each (answer, window) group to it).

Partial rows of the query's aggregate-tree node are merged to the query's keys (numba hash
groups, ``grouping.py``), distinct values counted and HyperLogLog sketches estimated,
HAVING and ORDER BY … LIMIT applied; a WITH query's parts are joined; addresses are printed.
Everything is vectorised over Arrow columns: no Python object per row.
"""

from __future__ import annotations

import operator
from collections.abc import Collection

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from sqlglot import exp

from capture.fields import BYTES, IP, SKETCH, TS, fields, ip_text, key_field, measures
from collector.keys import binary_buffers
from collector.pipeline.lfta_kernels import I64_MAX  # the min of NULL measures only
from collector.spark.grouping import group_ids, key_words, list_column, reduce_column
from planner.ir import Query
from planner.where import and_terms

TS_US = pa.timestamp("us", tz="UTC")
CMP = {"=": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le,
       ">": operator.gt, ">=": operator.ge}


_OCTETS = pa.array([str(i) for i in range(256)], pa.string())
_HEXTETS = pa.array([f"{i:x}" for i in range(65536)], pa.string())


def _ipv6_text(b: np.ndarray) -> pa.Array:
    """(n, 16) addresses in RFC 5952 text as Python's ``ipaddress`` writes it (the longest run
    of two or more zero groups, the first of equal ones, as ``::``), with Arrow kernels."""
    n = len(b)
    h = b.reshape(n, 8, 2).astype(np.int64)
    h = h[:, :, 0] << 8 | h[:, :, 1]
    zero = h == 0
    run = np.zeros((n, 8), np.int64)  # length of the zero run ending at each group
    run[:, 0] = zero[:, 0]
    for i in range(1, 8):
        run[:, i] = np.where(zero[:, i], run[:, i - 1] + 1, 0)
    length = run.max(axis=1)
    end = run.argmax(axis=1)  # the first longest run's last group
    start = end - length + 1
    compress = length >= 2
    groups = [_HEXTETS.take(pa.array(h[:, i])) for i in range(8)]
    empty = pa.array([""] * n, pa.string())
    heads, tails = [empty, groups[0]], [empty, groups[7]]  # the first / last k groups
    for k in range(2, 9):
        heads.append(pc.binary_join_element_wise(heads[-1], groups[k - 1], ":"))
        tails.append(pc.binary_join_element_wise(groups[8 - k], tails[-1], ":"))
    head = pc.choose(pa.array(np.where(compress, start, 0)), *heads)
    tail = pc.choose(pa.array(np.where(compress, 7 - end, 0)), *tails)
    short = pc.binary_join_element_wise(head, "::", tail, "")
    return pc.if_else(pa.array(compress), short, heads[8])


def ip_strings(arr: pa.Array) -> pa.Array:
    """16-byte addresses as text: IPv4-mapped ones as dotted quads, others in RFC 5952 form
    (``ip_text``'s), with Arrow kernels."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    n = len(arr)
    if n == 0 or arr.null_count == n:
        return pa.nulls(n, pa.string())
    offsets, data = binary_buffers(arr)
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    if not (np.diff(offsets)[valid] == 16).all():
        return pa.array([ip_text(v) for v in arr.to_pylist()], pa.string())
    at = np.minimum(offsets[:-1], max(len(data) - 16, 0))
    b = data[at[:, None] + np.arange(16)]
    mapped = valid & (b[:, :10] == 0).all(axis=1) & (b[:, 10] == 255) & (b[:, 11] == 255)
    quads = pc.binary_join_element_wise(*(_OCTETS.take(pa.array(b[:, 12 + i]))
                                          for i in range(4)), ".")
    other = valid & ~mapped
    if not other.any():
        return pc.if_else(pa.array(mapped), quads, pa.scalar(None, pa.string()))
    rows = np.ascontiguousarray(b).view(np.dtype((np.void, 16))).reshape(-1)
    uniq, inv = np.unique(rows[other], return_inverse=True)  # hosts repeat: each once
    index = np.zeros(n, np.int64)
    index[other] = inv.reshape(-1)
    v6 = _ipv6_text(np.frombuffer(uniq.tobytes(), np.uint8).reshape(-1, 16)).take(
        pa.array(index, mask=~other))
    return pc.if_else(pa.array(mapped), quads, v6)


_HEX = np.frombuffer(b"".join(f"{i:02x}".encode() for i in range(256)), np.uint8).reshape(256, 2)


def hex_strings(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Binary values as lower-case hex text (a payload's bytes), vectorised."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    arr = pc.cast(arr, pa.large_binary())
    n = len(arr)
    _, off_buf, data_buf = arr.buffers()
    off = np.frombuffer(off_buf, np.int64, n + 1, arr.offset * 8)
    data = np.frombuffer(data_buf, np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    text = _HEX[data[off[0]:off[-1]]].reshape(-1)
    out = pa.Array.from_buffers(pa.large_string(), n, [None, pa.py_buffer(2 * (off - off[0])),
                                                       pa.py_buffer(text.tobytes())])
    if arr.null_count:
        out = pc.if_else(arr.is_valid(), out, pa.scalar(None, pa.large_string()))
    return out.cast(pa.string())


def prefix_strings(arr: pa.Array, bits: int) -> pa.Array:
    """Prefix keys as networks: ``a.b.c.0/24``, ``2001:db8::/64``."""
    text = ip_strings(arr)
    v6 = pc.match_substring(text, ":")
    return pc.if_else(v6, pc.binary_join_element_wise(text, f"/{min(bits, 128)}", ""),
                      pc.binary_join_element_wise(text, f"/{min(bits, 32)}", ""))


def spark_type(dt: pa.DataType) -> str:
    """The Spark SQL type of an Arrow type the HFTA uses."""
    if pa.types.is_timestamp(dt):
        return "timestamp"
    if pa.types.is_list(dt):
        return f"array<{spark_type(dt.value_type)}>"
    return {pa.int32(): "int", pa.int64(): "bigint", pa.binary(): "binary",
            pa.string(): "string", pa.float64(): "double", pa.bool_(): "boolean"}[dt]


def finalize(query: Query, merged: pa.Table) -> pa.Table:
    """Turn merged rows of one query (window_start, keys, cnt, sum_/min_/max_) into its
    answer: the query's output columns plus ``window_start``. Rows of a finer node (more keys
    than the query's, several query-bit patterns) are merged to the query's keys first."""
    return answer_of(query, merge_to_keys(query, merged))


def answer_of(query: Query, merged: pa.Table) -> pa.Table:
    """``finalize`` of rows merged to the query's keys (``merge_to_keys``): HAVING first, then
    the addresses of the groups it keeps printed, then LIMIT per window (``order_rows``). The
    rows of a query without LIMIT stay in their order: whoever reads them orders them."""
    cat = fields(query.stream)
    cols: dict[str, pa.Array] = {}
    ws = merged.column("window_start").combine_chunks()
    epoch = pc.cast(ws, pa.int64()).to_numpy(zero_copy_only=False) // 1_000_000
    cnt = merged.column("cnt").to_numpy(zero_copy_only=False) if merged.num_rows else \
        np.zeros(0, np.int64)
    printed: dict[str, tuple[str, int | None]] = {}  # address outputs: printed after HAVING
    for o in query.outputs:
        if o.kind == "bucket":
            cols[o.name] = pa.array(epoch // query.period, pa.int64())
        elif o.kind == "key":
            cols[o.name] = merged.column(o.field).combine_chunks()
            base, bits = key_field(o.field)
            if cat[base].kind == IP:
                printed[o.name] = (base, bits)
        elif o.func == "count":
            cols[o.name] = pa.array(cnt, pa.int64())
        elif o.func in ("count_distinct", "approx_distinct"):
            name = f"{'distinct' if o.func == 'count_distinct' else 'approx'}_{o.field}"
            cols[o.name] = pc.cast(merged.column(name), pa.int64()) \
                if name in merged.column_names else pa.array([], pa.int64())  # no rows
        elif o.func == "avg":
            s = merged.column(f"sum_{o.field}").to_numpy(zero_copy_only=False)
            cols[o.name] = pa.array(s / np.maximum(cnt, 1), pa.float64())
        else:  # sum, min, max; a min or max of NULL measures only (ip_len) is NULL
            col = merged.column(f"{o.func}_{o.field}").combine_chunks()
            if o.func in ("min", "max"):
                v = col.to_numpy(zero_copy_only=False)
                col = pa.array(v, col.type, mask=(v == I64_MAX) | (v < 0))
            cols[o.name] = col
    cols["window_start"] = ws
    table = pa.table(cols)
    if query.having and table.num_rows:
        keep = np.ones(table.num_rows, dtype=bool)
        for cond in query.having:
            v = table.column(cond.column).to_numpy(zero_copy_only=False)
            keep &= CMP[cond.op](v, cond.value)
        if not keep.all():
            table = table.filter(pa.array(keep))
    for name, (_, bits) in printed.items():
        col = table.column(name)
        table = table.set_column(table.column_names.index(name), name,
                                 ip_strings(col) if bits is None else prefix_strings(col, bits))
    return order_rows(query, table) if query.limit is not None else table


_ARITH = {exp.Add: pc.add, exp.Sub: pc.subtract, exp.Mul: pc.multiply}
_CMP_PC = {exp.EQ: pc.equal, exp.NEQ: pc.not_equal, exp.LT: pc.less, exp.LTE: pc.less_equal,
           exp.GT: pc.greater, exp.GTE: pc.greater_equal}


def _compute(node: exp.Expression, table: pa.Table):
    """A joined query's expression (checked by the parser) over the joined table, whose
    columns are named ``alias.column``; SQL's NULL rules (Arrow's)."""
    if isinstance(node, exp.Paren):
        return _compute(node.this, table)
    if isinstance(node, exp.Column):
        return table.column(f"{node.table}.{node.name}")
    if isinstance(node, exp.Literal):
        return pa.scalar(float(node.this) if "." in node.this or "e" in node.this.lower()
                         else int(node.this))
    if isinstance(node, exp.Neg):
        return pc.negate(_compute(node.this, table))
    if isinstance(node, exp.Div):
        return pc.divide(pc.cast(_compute(node.this, table), pa.float64()),
                         pc.cast(_compute(node.expression, table), pa.float64()))
    if type(node) in _ARITH:
        return _ARITH[type(node)](_compute(node.this, table), _compute(node.expression, table))
    if isinstance(node, exp.Coalesce):
        return pc.coalesce(*(_compute(a, table) for a in [node.this, *node.expressions]))
    if type(node) in _CMP_PC:
        return _CMP_PC[type(node)](_compute(node.this, table), _compute(node.expression, table))
    if isinstance(node, exp.And):
        return pc.and_kleene(_compute(node.this, table), _compute(node.expression, table))
    if isinstance(node, exp.Or):
        return pc.or_kleene(_compute(node.this, table), _compute(node.expression, table))
    if isinstance(node, exp.Not):
        return pc.invert(_compute(node.this, table))
    raise ValueError(f"cannot compute {node.sql()}")


def _output_type(query: Query, o) -> pa.DataType:
    """The Arrow type ``finalize`` gives an output column."""
    if o.kind == "bucket" or o.func in ("count", "count_distinct", "approx_distinct"):
        return pa.int64()
    if o.func == "avg":
        return pa.float64()
    if o.kind == "key":
        base = fields(query.stream)[key_field(o.field)[0]]
        return pa.string() if base.kind in (IP, BYTES) else base.arrow_type
    return pa.int64()


def join_answer(query: Query, answers: dict[str, pa.Table]) -> pa.Table:
    """A joined query's answer from its parts' answers of the same windows (``answers`` by
    part name; a part without rows may be missing): the parts joined per window on the ON
    keys, the WHERE kept, the SELECT computed, ORDER BY … LIMIT per window."""
    j = query.join
    sides = {}
    for alias in (j.left, j.right):
        t = answers.get(j.part(alias).name)
        sides[alias] = t if t is not None and t.num_rows else None
    names = [n for n, _ in j.select]
    left, right = sides[j.left], sides[j.right]
    if left is None or (right is None and j.how == "inner"):
        return pa.table({**{n: pa.array([], pa.int64()) for n in names},
                         "window_start": pa.array([], TS_US)})
    left = left.rename_columns([f"{j.left}.{c}" for c in left.column_names])
    lkeys = [f"{j.left}.window_start"] + [f"{j.left}.{a}" for a, _ in j.on]
    if right is not None:
        right = right.rename_columns([f"{j.right}.{c}" for c in right.column_names])
    # the WHERE's conditions on one side's columns filter that side before the join (the
    # right's only in an inner join: in a LEFT JOIN its rows decide which left rows meet NULL)
    rest = []
    for cond in and_terms(j.where) if j.where is not None else []:
        side = {c.table for c in cond.find_all(exp.Column)}
        if side == {j.left} and left.num_rows:
            left = left.filter(pc.fill_null(_compute(cond, left), False))
        elif side == {j.right} and j.how == "inner" and right is not None and right.num_rows:
            right = right.filter(pc.fill_null(_compute(cond, right), False))
        else:
            rest.append(cond)
    where = exp.and_(*rest, copy=False) if rest else None
    if right is None:  # LEFT JOIN a window the right part has no row of: NULLs
        part = j.part(j.right)
        joined = left
        for o in part.outputs:
            joined = joined.append_column(f"{j.right}.{o.name}",
                                          pa.nulls(left.num_rows, _output_type(part, o)))
    else:
        rkeys = [f"{j.right}.window_start"] + [f"{j.right}.{b}" for _, b in j.on]
        joined = left.join(right, keys=lkeys, right_keys=rkeys, coalesce_keys=False,
                           join_type="left outer" if j.how == "left" else "inner",
                           use_threads=False)
    if where is not None and joined.num_rows:
        joined = joined.filter(pc.fill_null(_compute(where, joined), False))
    cols = {}
    for name, node in j.select:
        v = _compute(node, joined)
        cols[name] = v if not isinstance(v, pa.Scalar) else pa.array([v.as_py()] *
                                                                     joined.num_rows)
    cols["window_start"] = joined.column(f"{j.left}.window_start")
    table = pa.table(cols)
    return order_rows(query, table) if query.limit is not None else table


def merge_to_keys(query: Query, rows: pa.Table) -> pa.Table:
    """Partial rows merged per (window_start, the query's keys) (``grouping``: hash groups in
    numba); the distinct values of each ``count(DISTINCT f)`` field counted per group. Columns:
    the keys, ``cnt``, each measure's ``sum_``, ``min_`` and ``max_``, ``distinct_f`` and
    ``approx_f``."""
    return group_rows(query, rows)[0] if rows.num_rows else rows


def group_rows(query: Query, rows: pa.Table) -> tuple[pa.Table, np.ndarray]:
    """``merge_to_keys``, and each row's group (its row in the merged rows)."""
    keys = ["window_start", *query.keys]
    gid, first = group_ids(key_words([rows.column(k) for k in keys], rows.num_rows))
    groups = len(first)
    at = pa.array(first)
    out = {k: rows.column(k).take(at) for k in keys}
    out["cnt"] = reduce_column(rows.column("cnt"), gid, groups, "sum")
    for m in measures(query.stream):
        if f"sum_{m.name}" in rows.column_names:
            for a in ("sum", "min", "max"):
                out[f"{a}_{m.name}"] = reduce_column(rows.column(f"{a}_{m.name}"), gid,
                                                     groups, a)
    # count(DISTINCT f): the rows come from a node that also groups by f (one row per value and
    # query-bit pattern), so the count is the number of distinct values of f (NULL not counted)
    for f in query.distinct:
        col = rows.column(f)
        if col.null_count:  # NULL is not a value
            at = np.flatnonzero(col.is_valid().to_numpy(zero_copy_only=False))
            _, firsts = group_ids(key_words([gid[at], col.take(pa.array(at))], len(at)))
            firsts = at[firsts]
        else:
            _, firsts = group_ids(key_words([gid, col], rows.num_rows))
        out[f"distinct_{f}"] = pa.array(np.bincount(gid[firsts], minlength=groups), pa.int64())
    # approx_count_distinct(f): the node's rows carry sketches of f (column ~f), united per
    # group
    for f in query.approx:
        lists = list_column(rows.column(SKETCH + f), gid, groups)
        out[f"approx_{f}"] = pa.array(estimates(lists.to_pylist()), pa.int64())
    return pa.table(out), gid


def estimates(groups: list[list[bytes | None]], lg_max_k: int = 21) -> list[int]:
    """The distinct-count estimate of each group's HyperLogLog sketches united (DataSketches),
    rounded as Spark's approx_count_distinct is."""
    import datasketches as ds
    out = []
    for blobs in groups:
        u = ds.hll_union(lg_max_k)
        for b in blobs or ():
            if b is not None:
                u.update(ds.hll_sketch.deserialize(b))
        out.append(int(round(u.get_estimate())))
    return out


def order_keys(query: Query, columns: Collection[str]) -> list[tuple[str, str]]:
    """A window's rows' order (pyarrow sort keys): ORDER BY, then the key columns among
    ``columns``."""
    keys = [(c, "descending" if desc else "ascending") for c, desc in query.order]
    return keys + [(o.name, "ascending") for o in query.outputs if o.kind != "agg"
                   and o.name in columns and o.name not in dict(query.order)]


def order_rows(query: Query, table: pa.Table) -> pa.Table:
    """Sort by window, then ORDER BY, then the key columns (so that rows tied on ORDER BY come
    in one order whatever the order of the input, and LIMIT keeps the same ones); LIMIT n per
    window."""
    if not table.num_rows:
        return table
    table = table.sort_by([("window_start", "ascending")] +
                          order_keys(query, table.column_names))
    if query.limit is not None:
        ws = pc.cast(table.column("window_start"), pa.int64()).to_numpy(zero_copy_only=False)
        # rank within each window's run of rows (sorted by window first)
        starts = np.flatnonzero(np.r_[True, ws[1:] != ws[:-1]])
        first = np.repeat(starts, np.diff(np.r_[starts, len(ws)]))
        rank = np.arange(len(ws)) - first
        table = table.filter(pa.array(rank < query.limit))
    return table


def project_selection(query: Query, rows: pa.Table) -> pa.Table:
    """Matching tuples of a selection query, projected to its outputs."""
    cat = fields(query.stream)
    cols = {}
    for o in query.outputs:
        col = rows.column(o.field).combine_chunks()
        kind = cat[o.field].kind
        cols[o.name] = ip_strings(col) if kind == IP else hex_strings(col) if kind == BYTES \
            else col
    ts = next(f.name for f in cat.values() if f.kind == TS)  # packets: ts; flows: first_switched
    cols["_ts"] = rows.column(ts).combine_chunks()  # answers are read back in time order
    return pa.table(cols)


def output_schema(query: Query) -> pa.Schema:
    """The Arrow types of a query's output columns, as ``finalize`` and ``join_answer`` give
    them (a joined query's SELECT computed over its parts' empty answers)."""
    if query.join is None:
        return pa.schema([pa.field(o.name, _output_type(query, o)) for o in query.outputs])
    j = query.join
    empty = {}
    for alias in (j.left, j.right):
        part = j.part(alias)
        for o in part.outputs:
            empty[f"{alias}.{o.name}"] = pa.array([], _output_type(part, o))
    table = pa.table(empty)
    return pa.schema([pa.field(name, _compute(node, table).type) for name, node in j.select])


def answer_schema(query: Query) -> pa.Schema:
    """The columns of a query's answer as written: its outputs, then ``window_start`` and
    ``window_end`` (a selection: ``_ts``, the tuple's time)."""
    extra = [pa.field("_ts", TS_US)] if query.is_selection else \
        [pa.field("window_start", TS_US), pa.field("window_end", TS_US)]
    return pa.schema([*output_schema(query), *extra])


def answer_table(query: Query, answer: pa.Table) -> pa.Table:
    """An answer (its outputs and ``window_start``) in ``answer_schema``'s columns: the
    window's end added."""
    want = answer_schema(query)
    ws = answer.column("window_start")
    cols = {"window_start": ws,
            "window_end": pc.cast(pc.add(pc.cast(ws, pa.int64()), query.period * 1_000_000),
                                  TS_US)}
    return pa.Table.from_arrays([pc.cast(cols[f.name] if f.name in cols else
                                         answer.column(f.name), f.type) for f in want],
                                schema=want)
