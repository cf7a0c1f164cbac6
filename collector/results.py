"""Query answers: the final projection of merged partials (buckets, keys, aggregates, HAVING,
ORDER BY … LIMIT per window), their Parquet folders, and the output formats of ``replay``."""

from __future__ import annotations

import base64
import json
import math
import operator
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from sqlglot import exp

from capture.fields import IP, SKETCH, TS, VALUES, fields, ip_text, key_field, measures
from collector.grouping import group_ids, key_words, list_column, reduce_column
from collector.keys import KeyLayout, binary_buffers
from collector.lfta import I64_MAX  # the min of NULL measures only
from collector.spool import TS_US, qmask_words
from planner.query import Query, and_terms
from planner.slots import has_slot, slots_of

ROW, GID = "_row", "_gid"  # a partial row's index; an answer row's group (``needed_rows``)
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


def _ip_strings(arr: pa.Array) -> pa.Array:
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


def _prefix_strings(arr: pa.Array, bits: int) -> pa.Array:
    """Prefix keys as networks: ``a.b.c.0/24``, ``2001:db8::/64``."""
    text = _ip_strings(arr)
    v6 = pc.match_substring(text, ":")
    return pc.if_else(v6, pc.binary_join_element_wise(text, f"/{min(bits, 128)}", ""),
                      pc.binary_join_element_wise(text, f"/{min(bits, 32)}", ""))


Resolve = Callable[[int], Query | None]


def query_partials(stream: str, merged: pa.Table, resolve: Resolve
                   ) -> list[tuple[Query, pa.Table]]:
    """``slot_partials`` in slot order."""
    return [qt for _, qt in sorted(slot_partials(stream, merged, resolve).items())]


def node_runs(parts: Iterable[pa.Table]) -> tuple[pa.Table, dict[str, tuple[int, int]]]:
    """Partial rows of one folder ordered by node: the rows, and each node label's run of them
    (start, stop). The engine writes a node's flushed rows as a batch of their own, so a batch
    of one label is placed whole (no copy); a batch of several (a file read back) is split."""
    runs: dict[str, list[pa.RecordBatch]] = {}
    schema = None
    for t in parts:
        schema = schema or t.schema
        for b in t.to_batches():
            if not b.num_rows:
                continue
            labels = b.column("node")
            first = labels[0].as_py()
            if pc.all(pc.equal(labels, first)).as_py():
                runs.setdefault(first, []).append(b)
                continue
            codes = pc.dictionary_encode(labels)
            index = codes.indices.to_numpy(zero_copy_only=False)
            for code, label in enumerate(codes.dictionary.to_pylist()):
                runs.setdefault(label, []).append(b.take(pa.array(np.flatnonzero(index == code))))
    if schema is None:
        return pa.table({}), {}
    out, at, start = [], {}, 0
    for label in sorted(runs):
        n = sum(b.num_rows for b in runs[label])
        at[label] = (start, start + n)
        out += runs[label]
        start += n
    return pa.Table.from_batches(out, schema=schema), at


def take_rows(table: pa.Table, at: np.ndarray) -> pa.Table:
    """The rows at ascending positions ``at`` of a table of many batches, taken batch by batch
    (Arrow's take of a chunked table concatenates its chunks first: 0.1 s for a few rows of the
    telemetry benchmark's 1.5M)."""
    out, start = [], 0
    for b in table.to_batches():
        lo, hi = np.searchsorted(at, [start, start + b.num_rows])
        if hi > lo:
            out.append(b.take(pa.array(at[lo:hi] - start)))
        start += b.num_rows
    return pa.Table.from_batches(out, schema=table.schema)


def slot_partials(stream: str, merged: pa.Table, resolve: Resolve,
                  runs: dict[str, tuple[int, int]] | None = None
                  ) -> dict[int, tuple[Query, pa.Table]]:
    """Merged partial rows of a folder (``window_start, node, key, cnt``, measures) as each
    query's rows by slot: ``window_start``, the query's key columns, ``cnt`` and the measures
    the query reads (and a ``_row`` column, when ``merged`` has one). A query's rows come from
    every node whose pattern holds its slot (its node of the aggregate tree, or a node of an
    earlier plan); ``finalize`` merges them to the query's keys. ``runs``: each node's rows
    as a run of ``merged`` (``node_runs``), read as slices."""
    parts: dict[int, list[pa.Table]] = {}
    queries: dict[int, Query | None] = {}
    columns: dict[str, pa.Array] = {}

    def column(name: str) -> pa.Array:  # each column read is made one chunk once
        if name not in columns:
            columns[name] = merged.column(name).combine_chunks()
        return columns[name]
    if runs is None:
        # each node's rows: their positions, grouped by one stable sort of the node labels;
        # only the key (and sketch) columns are taken per node, a query's measures per query
        codes = pc.dictionary_encode(column("node"))
        index = codes.indices.to_numpy(zero_copy_only=False)
        order = np.argsort(index, kind="stable")
        bounds = np.searchsorted(index[order], np.arange(len(codes.dictionary) + 1))
        nodes = {label: pa.array(order[bounds[code]:bounds[code + 1]])
                 for code, label in enumerate(codes.dictionary.to_pylist())}
    else:
        nodes = {label: slice(a, b) for label, (a, b) in runs.items()}

    def node_rows(name: str, pos) -> pa.Array:
        """A node's rows of a column: a run of it in one chunk, or taken."""
        if isinstance(pos, slice):
            return merged.column(name).slice(pos.start, pos.stop - pos.start).combine_chunks()
        return column(name).take(pos)
    for label, pos in nodes.items():
        if not label:
            continue  # punctuation
        layout = KeyLayout.parse(stream, label)
        cols, pattern = layout.decode(node_rows("key", pos))
        if layout.sketch is not None:  # the node's rows carry a sketch of its field
            cols[layout.sketch] = node_rows("hll", pos)
        spread = None
        if layout.values is not None:  # a row per value of each row's set (``value_sets``)
            cols, pattern, spread = _spread_values(layout, cols, pattern, node_rows("vals", pos))
        node: dict[str, pa.Array] = {}  # the node's rows of a column, taken once
        for slot in slots_of(np.bitwise_or.reduce(pattern, axis=0)):
            if slot not in queries:
                queries[slot] = resolve(slot)
            q = queries[slot]
            if q is None:
                continue
            missing = set(q.node_keys) - set(cols)
            if missing:
                raise ValueError(f"node {label} cannot answer {q.name}: it does not group by "
                                 f"{', '.join(sorted(missing))}")
            keep = has_slot(pattern, slot)
            at = pa.array(np.flatnonzero(keep)) if not keep.all() else None
            meas = ["cnt", *(f"{a}_{m}" for m in q.measures for a in ("sum", "min", "max")),
                    *([ROW] if ROW in merged.column_names else [])]
            for k in ["window_start", *meas]:
                if k not in node:
                    node[k] = node_rows(k, pos)
                    if spread is not None:  # a row's counts and measures on its first value
                        repeat, first_only = spread
                        node[k] = node[k].take(repeat if k in ("window_start", ROW)
                                               else first_only)
                        if k == "cnt":
                            node[k] = pc.fill_null(node[k], 0)
            parts.setdefault(slot, []).append(pa.table({
                "window_start": node["window_start"] if at is None else
                node["window_start"].take(at),
                **{k: cols[k] if at is None else cols[k].take(at) for k in q.node_keys},
                **{m: node[m] if at is None else node[m].take(at) for m in meas}}))
    return {s: (queries[s], pa.concat_tables(ts)) for s, ts in parts.items()}


def _spread_values(layout: KeyLayout, cols: dict[str, pa.Array], pattern: np.ndarray,
                   sets: pa.Array
                   ) -> tuple[dict[str, pa.Array], np.ndarray, tuple[pa.Array, pa.Array]]:
    """Rows of value sets as a row per value: the key columns and patterns repeated, the set's
    field decoded; and two take indices for a row's other columns: one that repeats it on
    every value, one that puts it on its first value only (NULL on the others)."""
    lengths = pc.fill_null(pc.list_value_length(sets), 0).to_numpy(zero_copy_only=False)
    rep = np.repeat(np.arange(len(lengths)), lengths)
    first = np.zeros(len(rep), bool)
    first[(np.cumsum(lengths) - lengths)[lengths > 0]] = True
    values, _ = layout.value_layout().decode(pc.list_flatten(sets))
    out = {k: v.take(pa.array(rep)) for k, v in cols.items()}
    out.update(values)
    return out, pattern[rep], (pa.array(rep), pa.array(rep, mask=~first))


def value_sets(stream: str, rows: pa.Table, need: dict[int, np.ndarray], forced: np.ndarray,
               resolve: Resolve) -> pa.Table:
    """``rows`` (a pruned folder's) with the rows of each count(DISTINCT f) query that no
    other query needs made value-set rows: one per (window, the query's keys), carrying the
    distinct values of f (``vals``; node label ``<keys>,+f``) and its rows' merged counts and
    measures. Spark then merges a row per group, not per value (the attack applications'
    130k pruned rows: the most of Spark's merge). ``need``: each slot's rows; a ``forced``
    row stays as it is."""
    n = rows.num_rows
    if not n or not need or "vals" not in rows.column_names:  # a spool of before value sets
        return rows
    users = np.sum(list(need.values()), axis=0)
    codes = pc.dictionary_encode(rows.column("node").combine_chunks())
    index = codes.indices.to_numpy(zero_copy_only=False)
    labels = codes.dictionary.to_pylist()
    merged = {f"{a}_{m.name}": a for m in measures(stream) for a in ("sum", "min", "max")
              if f"{a}_{m.name}" in rows.column_names}  # column: how a group merges it
    made, done = [], np.zeros(n, bool)
    for slot, m in need.items():
        q = resolve(slot)
        if q is None or len(q.distinct) != 1 or q.approx or q.distinct[0] in q.keys:
            continue
        f = q.distinct[0]
        mine = np.flatnonzero(m & (users == 1) & ~forced)
        for code in np.unique(index[mine]).tolist():  # the nodes of its rows
            label = labels[code]
            if not label:
                continue
            at = mine[index[mine] == code]
            src = KeyLayout.parse(stream, label)
            if src.string or src.sketch or src.values or f not in src.keys or \
                    not set(q.keys) <= set(src.keys):
                continue
            dst = KeyLayout(stream, (*q.keys, VALUES + f), src.q_words)
            # the rows' keys taken together are back to back, each 8 * src.words bytes (an
            # index of every byte took most of this function's time, in fresh memory)
            k_off, k_data = binary_buffers(rows.column("key").take(pa.array(at)))
            words = k_data[k_off[0]:k_off[-1]].view("<i8").reshape(-1, src.words)
            o = src.offsets()
            part = pa.table({
                "window_start": rows.column("window_start").take(at),
                "key": dst.encode(np.concatenate(
                    [words[:, o[k][0]:o[k][0] + o[k][1]] for k in dst.keys]
                    + [words[:, src.field_words:]], axis=1)),
                "v": dst.value_layout().encode(words[:, o[f][0]:o[f][0] + o[f][1]]),
                **{c: rows.column(c).take(at) for c in ("cnt", "plan_version", "probe",
                                                         *merged)}})
            # sorted first: a group's values come out in order, whatever order its rows had
            part = part.sort_by([("window_start", "ascending"), ("key", "ascending"),
                                 ("v", "ascending")])
            g = part.group_by(["window_start", "key"], use_threads=False).aggregate(
                [("cnt", "sum"), ("v", "distinct"), ("plan_version", "max"),
                 ("probe", "first"), *merged.items()])
            k = g.num_rows
            got = {"window_start": g.column("window_start"), "key": g.column("key"),
                   "node": pa.repeat(pa.scalar(dst.label, pa.string()), k),
                   "cnt": g.column("cnt_sum"), "vals": g.column("v_distinct"),
                   "plan_version": g.column("plan_version_max"),
                   "probe": g.column("probe_first"),
                   **{c: g.column(f"{c}_{a}") for c, a in merged.items()}}
            made.append(pa.Table.from_arrays(
                [got[c] if c in got else pa.nulls(k, rows.schema.field(c).type)
                 for c in rows.column_names], schema=rows.schema))
            done[at] = True
    if not made:
        return rows
    return pa.concat_tables([rows.filter(pa.array(~done)), *made])


def selection_parts(rows: pa.Table, resolve: Resolve) -> list[tuple[Query, pa.Table]]:
    """A selection folder's tuples split per query slot (vectorised over ``qmask``)."""
    words = qmask_words(rows.column("qmask"))
    out = []
    for slot in slots_of(np.bitwise_or.reduce(words, axis=0)):
        q = resolve(slot)
        if q is not None:
            out.append((q, rows.filter(pa.array(has_slot(words, slot)))))
    return out


def finalize(query: Query, merged: pa.Table) -> pa.Table:
    """Turn merged rows of one query (window_start, keys, cnt, sum_/min_/max_) into its
    answer: the query's output columns plus ``window_start``. Rows of a finer node (more keys
    than the query's, several query-bit patterns) are merged to the query's keys first."""
    return answer_of(query, merge_to_keys(query, merged))


def answer_of(query: Query, merged: pa.Table, ties: bool = False, printed: bool = True,
              ordered: bool = True) -> pa.Table:
    """``finalize`` of rows merged to the query's keys (``merge_to_keys``). For
    ``needed_rows``: a ``_gid`` column of ``merged`` (each row's group) is kept; with
    ``ties``, LIMIT keeps the rows tied with the last one it keeps; without ``printed``,
    address keys no ORDER BY reads stay binary; without ``ordered``, the rows of a query
    without LIMIT stay in their order (a set of groups)."""
    cat = fields(query.stream)
    cols: dict[str, pa.Array] = {}
    ws = merged.column("window_start").combine_chunks()
    epoch = pc.cast(ws, pa.int64()).to_numpy(zero_copy_only=False) // 1_000_000
    cnt = merged.column("cnt").to_numpy(zero_copy_only=False) if merged.num_rows else \
        np.zeros(0, np.int64)
    for o in query.outputs:
        if o.kind == "bucket":
            cols[o.name] = pa.array(epoch // query.period, pa.int64())
        elif o.kind == "key":
            col = merged.column(o.field).combine_chunks()
            base, bits = key_field(o.field)
            cols[o.name] = col if cat[base].kind != IP or not printed and \
                o.name not in dict(query.order) else \
                _ip_strings(col) if bits is None else _prefix_strings(col, bits)
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
    if GID in merged.column_names:
        cols[GID] = merged.column(GID)
    table = pa.table(cols)
    if query.having and table.num_rows:
        keep = np.ones(table.num_rows, dtype=bool)
        for cond in query.having:
            v = table.column(cond.column).to_numpy(zero_copy_only=False)
            keep &= CMP[cond.op](v, cond.value)
        table = table.filter(pa.array(keep))
    return order_rows(query, table, ties) if ordered or query.limit is not None else table


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
        return pa.string() if base.kind == IP else base.arrow_type
    return pa.int64()


def join_answer(query: Query, answers: dict[str, pa.Table], ties: bool = False) -> pa.Table:
    """A joined query's answer from its parts' answers of the same windows (``answers`` by
    part name; a part without rows may be missing): the parts joined per window on the ON
    keys, the WHERE kept, the SELECT computed, ORDER BY … LIMIT per window. Parts' answers
    with a ``_gid`` column give ``<alias>._gid`` columns (``needed_rows``)."""
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
        if f"{j.left}.{GID}" in joined.column_names:
            joined = joined.append_column(f"{j.right}.{GID}",
                                          pa.nulls(left.num_rows, pa.int64()))
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
    for alias in (j.left, j.right):
        if f"{alias}.{GID}" in joined.column_names:
            cols[f"{alias}.{GID}"] = joined.column(f"{alias}.{GID}")
    return order_rows(query, pa.table(cols), ties)


def merge_to_keys(query: Query, rows: pa.Table) -> pa.Table:
    """Partial rows merged per (window_start, the query's keys) (``grouping``: hash groups in
    numba); the distinct values of each ``count(DISTINCT f)`` field counted per group. Columns:
    the keys, ``cnt``, each measure's ``sum_``, ``min_`` and ``max_``, ``distinct_f`` and
    ``approx_f``."""
    return group_rows(query, rows)[0] if rows.num_rows else rows


def group_rows(query: Query, rows: pa.Table, bounded: bool = False
               ) -> tuple[pa.Table, np.ndarray]:
    """``merge_to_keys``, and each row's group (its row in the merged rows). ``bounded``: a
    group whose rows are fewer than a HAVING on its ``count(DISTINCT f)`` requires (it
    cannot have more values than rows) fails the HAVING without its values counted; it gets
    its row count, which fails it too (``needed_rows``: the groups of an answer only)."""
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
    least = _least_distinct(query) if bounded else {}
    per = np.bincount(gid, minlength=groups) if least else None  # each group's rows
    for f in query.distinct:
        col = rows.column(f)
        at = None  # the rows whose values are counted (None: all)
        if f in least:
            at = np.flatnonzero(per[gid] >= least[f])
        if col.null_count:  # NULL is not a value
            valid = col.is_valid().to_numpy(zero_copy_only=False)
            at = np.flatnonzero(valid) if at is None else at[valid[at]]
        if at is None:
            _, firsts = group_ids(key_words([gid, col], rows.num_rows))
        else:
            _, firsts = group_ids(key_words([gid[at], col.take(pa.array(at))], len(at)))
            firsts = at[firsts]
        count = np.bincount(gid[firsts], minlength=groups)
        if f in least:
            count = np.where(per >= least[f], count, per)
        out[f"distinct_{f}"] = pa.array(count, pa.int64())
    # approx_count_distinct(f): the node's rows carry sketches of f (column ~f), united per
    # group
    for f in query.approx:
        lists = list_column(rows.column(SKETCH + f), gid, groups)
        out[f"approx_{f}"] = pa.array(estimates(lists.to_pylist()), pa.int64())
    return pa.table(out), gid


def _least_distinct(query: Query) -> dict[str, int]:
    """Per ``count(DISTINCT f)`` of the query, the fewest values its HAVING lets a group
    have (its lower bounds: >, >= and =)."""
    fields_of = {o.name: o.field for o in query.outputs if o.func == "count_distinct"}
    out: dict[str, int] = {}
    for c in query.having:
        f = fields_of.get(c.column)
        if f is None or c.op not in (">", ">=", "="):
            continue
        v = math.floor(c.value) + 1 if c.op == ">" else math.ceil(c.value)
        out[f] = max(out.get(f, 0), v)
    return out


def answers_of(stream: str, folder: str, rows: pa.Table, resolve: Resolve
               ) -> list[tuple[Query, pa.Table]]:
    """Every query's answer of a folder's merged rows (vectorised): a selection's tuples, an
    aggregate query's finalized groups, a joined query's parts joined."""
    if folder == "select":
        return [(q, project_selection(q, part)) for q, part in selection_parts(rows, resolve)]
    answers = []
    joined: dict[str, tuple[Query, dict[str, pa.Table]]] = {}
    for q, part in query_partials(stream, rows, resolve):
        answer = finalize(q, part)
        if q.parent is not None:  # a WITH part: its answer goes into the join
            joined.setdefault(q.parent.name, (q.parent, {}))[1][q.name] = answer
        else:
            answers.append((q, answer))
    # a join's parts have the same period, so their windows close in the same batch
    return answers + [(jq, join_answer(jq, got)) for jq, got in joined.values()]


def needed_rows(stream: str, rows: pa.Table, resolve: Resolve,
                forced: np.ndarray | None = None,
                runs: dict[str, tuple[int, int]] | None = None) -> dict[int, np.ndarray]:
    """Per query slot, the partial rows of closed windows its answer needs, when ``rows`` are
    all the rows of their windows (every writer done; ``forced``: rows that reach Spark
    whatever this says, as they are). A row kept carries only the slots that need it
    (``prune_rows``), so a slot's rows are always whole groups of its query and each group
    Spark sees has its exact value. A slot needs: every row of a query without HAVING or
    LIMIT; the groups of its answer (with the groups tied with its LIMIT's last) or of its
    join's answer; the groups of a part with a LIMIT in its own answer; the groups of a
    forced row; and in a LEFT JOIN, the right part's groups that meet a left group Spark sees
    (or Spark would join it to NULL). Spark's answer of the rows kept is then the answer of
    all of them: a HAVING keeps the same groups, a LIMIT ranks a set of groups holding the
    answer's, a join meets the same partners. ``runs``: as ``slot_partials``."""
    n = rows.num_rows
    forced = np.zeros(n, bool) if forced is None else forced
    by_slot = slot_partials(stream, rows.append_column(ROW, pa.array(np.arange(n))), resolve,
                            runs)
    groups: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}  # slot -> rows, groups, count
    need: dict[int, np.ndarray] = {}
    answers: dict[str, pa.Table] = {}
    slot_of = {q.name: s for s, (q, _) in by_slot.items()}

    def take(slot: int, sel: np.ndarray) -> None:
        """Every row of the slot's selected groups."""
        idx, gid, _ = groups[slot]
        need[slot][idx[sel[gid]]] = True

    def take_groups(name: str, gids) -> None:
        if name not in slot_of:
            return
        slot = slot_of[name]
        sel = np.zeros(groups[slot][2], bool)
        sel[pc.drop_null(gids).to_numpy(zero_copy_only=False)] = True
        take(slot, sel)

    def present(slot: int) -> np.ndarray:
        """The slot's groups that Spark sees."""
        idx, gid, count = groups[slot]
        sel = np.zeros(count, bool)
        sel[gid[need[slot][idx]]] = True
        return sel

    joins: dict[str, Query] = {}
    for slot, (q, part) in by_slot.items():
        need[slot] = np.zeros(n, bool)
        if q.parent is None and not q.having and q.limit is None:
            need[slot][part.column(ROW).to_numpy()] = True  # every group
            continue
        m, gid = group_rows(q, part, bounded=True)
        m = m.append_column(GID, pa.array(np.arange(m.num_rows)))
        idx = part.column(ROW).to_numpy()
        groups[slot] = (idx, gid, m.num_rows)
        need[slot][idx[forced[idx]]] = True
        take(slot, present(slot))  # a forced row's group, whole
        if q.parent is not None:
            joins[q.parent.name] = q.parent
            # a join that orders nothing meets its parts' binary keys as well as their text
            answers[q.name] = a = answer_of(q, m, ties=True, printed=bool(q.parent.order),
                                                 ordered=False)
            if q.limit is not None:
                take_groups(q.name, a.column(GID))
        else:
            take_groups(q.name, answer_of(q, m, ties=True, printed=False, ordered=False)
                        .column(GID))
    for jq in joins.values():
        j = jq.join
        got = {p.name: answers[p.name] for p in j.parts if p.name in answers}
        out = join_answer(jq, got, ties=True)
        for alias in (j.left, j.right):
            if f"{alias}.{GID}" in out.column_names:
                take_groups(j.part(alias).name, out.column(f"{alias}.{GID}"))
        left, right = j.part(j.left).name, j.part(j.right).name
        if j.how == "left" and left in got and right in got:
            # the right groups that meet a left group Spark sees: those left groups only
            # joined, without the WHERE
            every = replace(jq, join=replace(j, where=None), order=(), limit=None)
            seen = present(slot_of[left])
            lt = got[left]
            lt = lt.filter(pa.array(seen[lt.column(GID).to_numpy(zero_copy_only=False)]))
            if lt.num_rows:
                pairs = join_answer(every, {left: lt, right: got[right]})
                take_groups(right, pairs.column(f"{j.right}.{GID}"))
    return need


def prune_rows(stream: str, rows: pa.Table, resolve: Resolve,
               forced: np.ndarray | None = None,
               runs: dict[str, tuple[int, int]] | None = None, sets: bool = True) -> pa.Table:
    """The rows ``needed_rows`` keeps, each with the query bits of the slots that need it
    (a ``forced`` row as it is); with ``sets``, a distinct count's rows as value sets
    (``value_sets``). ``runs``: as ``slot_partials``."""
    n = rows.num_rows
    forced = np.zeros(n, bool) if forced is None else forced
    need = needed_rows(stream, rows, resolve, forced, runs)
    keep = forced.copy()
    for m in need.values():
        keep |= m
    kept = np.flatnonzero(keep)
    out = take_rows(rows, kept)  # few rows: what follows reads and writes only those
    need = {slot: m[kept] for slot, m in need.items()}
    forced = forced[kept]
    keys = out.column("key").combine_chunks()
    off, data = binary_buffers(keys)
    data = data.copy()
    codes = pc.dictionary_encode(out.column("node").combine_chunks())
    index = codes.indices.to_numpy(zero_copy_only=False)
    for code, label in enumerate(codes.dictionary.to_pylist()):
        if not label:
            continue  # punctuation
        layout = KeyLayout.parse(stream, label)
        q_words = layout.words - layout.field_words
        at = np.flatnonzero((index == code) & ~forced)
        pattern = np.zeros((len(at), q_words), np.uint64)
        for slot, m in need.items():
            if slot // 64 < q_words:
                pattern[m[at], slot // 64] |= np.uint64(1) << np.uint64(slot % 64)
        start = off[at] + 8 * layout.field_words
        data[(start[:, None] + np.arange(8 * q_words)).reshape(-1)] = \
            pattern.astype("<u8").view(np.uint8).reshape(-1)
    key = pa.Array.from_buffers(pa.binary(), len(keys),
                                [*keys.buffers()[:2], pa.py_buffer(data)], offset=keys.offset)
    out = out.set_column(out.column_names.index("key"), "key", key)
    return value_sets(stream, out, need, forced, resolve) if sets else out


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


def order_rows(query: Query, table: pa.Table, ties: bool = False) -> pa.Table:
    """Sort by window, then ORDER BY (or the key columns); LIMIT n per window (and, with
    ``ties``, the rows whose ORDER BY values equal the last kept row's: an answer's rows
    are those whatever the order of its input)."""
    if not table.num_rows:
        return table
    if query.order:
        keys = [(c, "descending" if desc else "ascending") for c, desc in query.order]
    else:
        keys = [(o.name, "ascending") for o in query.outputs if o.kind != "agg"
                and o.name in table.column_names]
    table = table.sort_by([("window_start", "ascending")] + keys)
    if query.limit is not None:
        ws = pc.cast(table.column("window_start"), pa.int64()).to_numpy(zero_copy_only=False)
        # rank within each window's run of rows (sorted by window first)
        starts = np.flatnonzero(np.r_[True, ws[1:] != ws[:-1]])
        first = np.repeat(starts, np.diff(np.r_[starts, len(ws)]))
        rank = np.arange(len(ws)) - first
        keep = rank < query.limit
        if ties and query.order:
            # each row past the LIMIT against its window's last kept row (NULLs tie)
            at = np.flatnonzero(rank >= query.limit)
            if len(at):
                same = np.ones(len(at), bool)
                for c, _ in query.order:
                    col = table.column(c)
                    x, y = col.take(pa.array(at)), col.take(pa.array(first[at] + query.limit - 1))
                    eq = pc.fill_null(pc.equal(x, y), False)
                    same &= pc.or_(eq, pc.and_(pc.is_null(x), pc.is_null(y))).to_numpy(
                        zero_copy_only=False)
                keep[at[same]] = True
        table = table.filter(pa.array(keep))
    return table


def project_selection(query: Query, rows: pa.Table) -> pa.Table:
    """Matching tuples of a selection query, projected to its outputs."""
    cat = fields(query.stream)
    cols = {}
    for o in query.outputs:
        col = rows.column(o.field).combine_chunks()
        cols[o.name] = _ip_strings(col) if cat[o.field].kind == IP else col
    ts = next(f.name for f in cat.values() if f.kind == TS)  # packets: ts; flows: first_switched
    cols["_ts"] = rows.column(ts).combine_chunks()  # answers are read back in time order
    return pa.table(cols)


def results_dir(root: str | os.PathLike, name: str) -> Path:
    return Path(root) / name


def write_results(root: str | os.PathLike, name: str, part: str, table: pa.Table) -> Path:
    """Write one part file atomically (a replayed Spark batch overwrites its own part)."""
    d = results_dir(root, name)
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"{part}.parquet"
    tmp = d / f".{part}.parquet.tmp"
    pq.write_table(table, tmp)
    os.replace(tmp, final)
    return final


def clear_results(root: str | os.PathLike, name: str) -> None:
    shutil.rmtree(results_dir(root, name), ignore_errors=True)


def read_results(root: str | os.PathLike, query: Query, last_windows: int | None = None
                 ) -> pa.Table:
    """A query's answers so far, in order; optionally only its latest closed windows."""
    d = results_dir(root, query.name)
    files = sorted(d.glob("*.parquet")) if d.exists() else []
    return results_table(query, [pq.read_table(f) for f in files], last_windows)


def results_table(query: Query, parts: list[pa.Table], last_windows: int | None = None
                  ) -> pa.Table:
    """A query's result parts (in part-name order) as one answer, in order; optionally only
    its latest closed windows."""
    tables = [t for t in parts if t.num_rows]
    if not tables:
        return pa.table({o.name: pa.array([], pa.null()) for o in query.outputs})
    table = pa.concat_tables(tables, promote_options="permissive")
    if query.is_selection:
        return table.sort_by("_ts") if "_ts" in table.column_names else table
    if last_windows is not None:
        ws = pc.unique(table.column("window_start")).to_pylist()
        keep = sorted(ws)[-last_windows:] if last_windows else []
        table = table.filter(pc.is_in(table.column("window_start"),
                                      pa.array(keep, table.column("window_start").type)))
    return order_rows(query, table)


class CursorError(ValueError):
    pass


def _time_key(table: pa.Table) -> str | None:
    """The column a page is cut by: an aggregate's window, a selection's tuple time."""
    return next((c for c in ("window_start", "_ts") if c in table.column_names), None)


def page(table: pa.Table, start_s: float | None = None, end_s: float | None = None,
         newest_first: bool = True, limit: int = 1000, cursor: str | None = None
         ) -> tuple[pa.Table, str | None]:
    """One page of a query's answers (``read_results``' order): windows starting in
    [start_s, end_s), newest window first (or oldest), rows within a window in the query's
    order, at most ``limit`` rows, and the cursor of the next page (None: no more). A cursor
    names the last window served and how many of its rows were; closed windows never change,
    so paging is stable while new windows arrive."""
    key = _time_key(table)
    if key is None or not table.num_rows:
        return table.slice(0, limit), None
    ws = pc.cast(table.column(key), pa.int64()).to_numpy(zero_copy_only=False)
    keep = np.ones(len(ws), bool)
    if start_s is not None:
        keep &= ws >= int(start_s * 1_000_000)
    if end_s is not None:
        keep &= ws < int(end_s * 1_000_000)
    idx = np.flatnonzero(keep)
    if newest_first:  # windows descending, each window's rows in their order
        idx = idx[np.argsort(-ws[idx], kind="stable")]
    if cursor is not None:
        w, served, direction = _decode_cursor(cursor)
        if direction != ("n" if newest_first else "o"):
            raise CursorError("the cursor belongs to the other order")
        beyond = ws[idx] < w if newest_first else ws[idx] > w
        same = np.flatnonzero(ws[idx] == w)[served:]
        idx = np.concatenate([idx[same], idx[beyond]])
    out = idx[:limit]
    nxt = None
    if len(idx) > limit:
        last = ws[out[-1]]
        done = int((ws[out] == last).sum())
        if cursor is not None and w == last:
            done += served
        nxt = _encode_cursor(int(last), done, "n" if newest_first else "o")
    return table.take(pa.array(out, pa.int64())), nxt


def _encode_cursor(w: int, served: int, direction: str) -> str:
    return base64.urlsafe_b64encode(f"{w}:{served}:{direction}".encode()).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[int, int, str]:
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        w, served, direction = text.split(":")
        if direction not in ("n", "o") or int(served) < 0:
            raise ValueError(text)
        return int(w), int(served), direction
    except (ValueError, UnicodeDecodeError) as e:
        raise CursorError(f"not a cursor of this API: {cursor[:40]!r}") from e


# ------------------------------------------------------------------------------ output formats


def _jsonable(v):
    if isinstance(v, float) and v == int(v):
        return v
    if hasattr(v, "timestamp"):
        return v.timestamp()
    if isinstance(v, bytes):
        return ip_text(v)
    return v


def rows_of(query: Query, table: pa.Table) -> list[dict]:
    """A query's rows as dicts of its own output columns."""
    names = [o.name for o in query.outputs]
    out = []
    for row in table.select([n for n in names if n in table.column_names]).to_pylist():
        out.append({k: _jsonable(row.get(k)) for k in names})
    return out


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v)
    return str(v)


def format_results(results: Iterable[tuple[Query, list[dict]]], fmt: str) -> str:
    """``replay``'s output: csv (header ``query`` + union of columns), json lines, or table."""
    results = list(results)
    lines: list[str] = []
    if fmt == "json":
        for q, rows in results:
            for r in rows:
                lines.append(json.dumps({"query": q.name, **r}))
    elif fmt == "csv":
        import csv
        import io
        header: list[str] = []
        for q, _ in results:
            for o in q.outputs:
                if o.name not in header:
                    header.append(o.name)
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["query", *header])
        for q, rows in results:
            for r in rows:
                w.writerow([q.name] + [_cell(r.get(h)) for h in header])
        return buf.getvalue()
    else:
        for q, rows in results:
            names = [o.name for o in q.outputs]
            table = [names] + [[_cell(r.get(n)) for n in names] for r in rows]
            widths = [max(len(row[i]) for row in table) for i in range(len(names))]
            lines.append(f"== {q.name} ({len(rows)} rows)")
            for k, row in enumerate(table):
                lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
                if k == 0:
                    lines.append("  ".join("-" * w for w in widths))
            lines.append("")
    return "\n".join(lines) + ("\n" if lines else "")
