"""Answers out, in columns: CSV, JSON lines, a table for people, and Parquet, written with
Arrow's writers and compute functions a part at a time. No Python object is made per row, so
memory stays bounded by the largest window whatever the answer's size.

Formats (DESIGN, "Command line"): times print as ISO 8601 UTC (``2026-11-27T13:00:00Z``), or
as epoch seconds, or not at all beside the query's own bucket column (``TIMES``: a script's old
form); addresses were printed by the HFTA; NULL prints empty in CSV and ``null`` in JSON;
doubles print in the shortest form that reads back the same.
"""

from __future__ import annotations

import csv
import io
import json
import os
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from collector.daemon.results import iter_results
from planner.ir import Query

CSV_OPTIONS = {"delimiter": ","}
# control characters JSON strings escape (besides \\ and ")
_JSON_ESCAPES = [("\\", "\\\\"), ('"', '\\"'), ("\n", "\\n"), ("\r", "\\r"), ("\t", "\\t"),
                 ("\b", "\\b"), ("\f", "\\f")]
_CONTROL = "[\\x00-\\x07\\x0b\\x0e-\\x1f\\x7f]"


# how times print: ISO 8601 text, epoch seconds, or only as the query's own bucket column
# (``time/60 AS t``: window_start and window_end left out)
TIMES = ("iso", "epoch", "bucket")


def columns(query: Query, time: str = "iso") -> list[str]:
    """A query's printed columns: its outputs, then the window's start and end unless times
    print as buckets (a selection: its outputs)."""
    names = [o.name for o in query.outputs]
    if query.is_selection or time == "bucket":
        return names
    return [*names, "window_start", "window_end"]


def printable(table: pa.Table, time: str = "iso") -> pa.Table:
    """Times as ISO 8601 text (whole seconds unless the time has a fraction) or as epoch
    seconds (``time="epoch"``), every other column as it is."""
    convert = epoch_seconds if time == "epoch" else iso_times
    cols = [convert(c) if pa.types.is_timestamp(c.type) else c for c in table.columns]
    return pa.Table.from_arrays(cols, names=table.column_names)


def with_times(table: pa.Table, time: str) -> pa.Table:
    """An answer table for a Parquet download: times kept as timestamps (``iso``), as epoch
    seconds, or the window's columns left out (``bucket``)."""
    if time == "bucket":
        return table.drop_columns([c for c in ("window_start", "window_end")
                                   if c in table.column_names])
    return printable(table, time) if time == "epoch" else table


def epoch_seconds(col: pa.Array | pa.ChunkedArray) -> pa.Array:
    """UTC times as epoch seconds: integers, or doubles where a time has a fraction."""
    us = pc.cast(col, pa.int64())
    whole = pc.all(pc.equal(pc.remainder(us, 1_000_000), 0)).as_py() is not False
    return pc.divide(us, 1_000_000) if whole else pc.divide(pc.cast(us, pa.float64()), 1e6)


def iso_times(col: pa.Array | pa.ChunkedArray) -> pa.Array:
    """UTC times as ISO 8601 text; each distinct time formatted once (a window's start and end
    repeat on every row of it), with numpy's datetime formatting (Arrow's strftime took 5 s for
    2.6M rows)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    codes = pc.dictionary_encode(pc.cast(col, pa.int64()))
    us = codes.dictionary.to_numpy(zero_copy_only=False)
    unit = "s" if (us % 1_000_000 == 0).all() else "us"
    text = np.char.add(np.datetime_as_string(us.astype("datetime64[us]"), unit=unit), "Z")
    return pa.array(text, pa.string()).take(codes.indices)


def _json_string(col: pa.Array) -> pa.Array:
    """Strings as JSON string literals."""
    for a, b in _JSON_ESCAPES:
        col = pc.replace_substring(col, a, b)
    if pc.any(pc.match_substring_regex(col, _CONTROL)).as_py():
        for c in [*range(0, 8), 11, *range(14, 32), 127]:
            col = pc.replace_substring(col, chr(c), f"\\u{c:04x}")
    return pc.binary_join_element_wise('"', col, '"', "")


def _json_value(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    """A column's values as JSON text (``null`` for NULL, and for NaN and infinities)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    t = col.type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        text = _json_string(col)
    elif pa.types.is_floating(t):
        finite = pc.is_finite(col)
        text = pc.if_else(finite, pc.cast(col, pa.string()), pa.scalar(None, pa.string()))
    elif pa.types.is_boolean(t):
        text = pc.if_else(col, "true", "false")
    else:
        text = pc.cast(col, pa.string())
    return pc.fill_null(text, "null")


def json_lines(table: pa.Table, names: list[str], first: dict[str, str] | None = None,
               end: str = "\n", time: str = "iso") -> bytes:
    """Rows as JSON objects, each followed by ``end`` (one per line): ``first`` (constant keys
    and values) then the ``names`` columns of ``table`` (times as ``printable``)."""
    n = table.num_rows
    if not n:
        return b""
    table = printable(table, time)
    pieces: list = []
    head = ",".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in (first or {}).items())
    sep = "{" + (head + "," if head else "")
    for name in names:
        pieces.append(f"{sep}{json.dumps(name)}:")
        pieces.append(_json_value(table.column(name)))
        sep = ","
    pieces.append("}" + end)
    lines = pc.binary_join_element_wise(*(p if isinstance(p, pa.Array) else
                                          pa.scalar(p) for p in pieces), "")
    return _joined(lines)


def _joined(lines: pa.Array) -> bytes:
    """The text of a string array's values back to back (its data buffer, no copy per row)."""
    if isinstance(lines, pa.ChunkedArray):
        lines = lines.combine_chunks()
    lines = pc.cast(lines, pa.large_string())
    _, offsets, data = lines.buffers()
    off = np.frombuffer(offsets, np.int64, len(lines) + 1, lines.offset * 8)
    return data.to_pybytes()[off[0]:off[-1]] if data is not None else b""


def csv_rows(table: pa.Table, names: list[str], header: list[str] | None = None,
             first: dict[str, str] | None = None, time: str = "iso") -> bytes:
    """Rows as CSV (``header`` columns, empty where the table has none; ``first``: constant
    columns before them), without a header row."""
    table = printable(table, time)
    n = table.num_rows
    cols, out_names = [], []
    for k, v in (first or {}).items():
        cols.append(pa.repeat(pa.scalar(v, pa.string()), n))
        out_names.append(k)
    for name in header or names:
        cols.append(table.column(name) if name in names else pa.nulls(n, pa.string()))
        out_names.append(name)
    return _csv(pa.Table.from_arrays(cols, names=out_names), header=False)


def csv_header(names: list[str]) -> bytes:
    """The header row (one row: Python's csv module quotes a name only where it must)."""
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(names)
    return buf.getvalue().encode()


def _csv(table: pa.Table, header: bool) -> bytes:
    """CSV that quotes a value only where it must (as Python's csv module does): unquoted,
    unless a value holds a comma, a quote or a line break; then strings are quoted."""
    for quoting in ("none", "needed"):
        buf = io.BytesIO()
        try:
            pacsv.write_csv(table, buf, pacsv.WriteOptions(include_header=header,
                                                           quoting_style=quoting,
                                                           **CSV_OPTIONS))
        except pa.ArrowInvalid:  # a value that needs quotes
            continue
        return buf.getvalue()
    raise AssertionError("unreachable: quoting_style needed always writes")


def text_table(table: pa.Table, names: list[str], widths: dict[str, int],
               time: str = "iso") -> bytes:
    """Rows right-aligned in columns of ``widths`` (two spaces apart), as ``replay``'s table."""
    table = printable(table, time)
    cells = []
    for name in names:
        col = table.column(name)
        text = col if pa.types.is_string(col.type) else pc.cast(col, pa.string())
        cells.append(pc.utf8_lpad(pc.fill_null(text, ""), widths[name]))
    if not table.num_rows:
        return b""
    lines = pc.binary_join_element_wise(*cells, pa.scalar("  "))
    return _joined(pc.binary_join_element_wise(lines, "\n", ""))


def widths_of(table: pa.Table, names: list[str], time: str = "iso") -> dict[str, int]:
    """Each column's widest printed value (at least its name's width)."""
    table = printable(table, time)
    out = {}
    for name in names:
        col = table.column(name)
        text = col if pa.types.is_string(col.type) else pc.cast(col, pa.string())
        widest = pc.max(pc.utf8_length(pc.fill_null(text, ""))).as_py() if len(text) else 0
        out[name] = max(len(name), widest or 0)
    return out


def parquet_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def write_answers(out: BinaryIO, fmt: str, root: str | os.PathLike,
                  queries: list[Query], time: str = "iso") -> None:
    """``replay``'s output of every query's answer as Spark wrote it under ``root``, a part at
    a time: csv (a header ``query`` + the union of every query's columns in first-seen order,
    then one row per answer row), json (one object per line: ``query`` and the query's
    columns) or table (per query, aligned columns under a ``== name (N rows)`` line); times
    as ``printable``."""
    header: list[str] = []
    for q in queries:
        for name in columns(q, time):
            if name not in header:
                header.append(name)
    if fmt == "csv":
        out.write(csv_header(["query", *header]))
    for q in queries:
        names = columns(q, time)
        if fmt == "table":  # the widths first, a part at a time; then the rows
            widths = {n: len(n) for n in names}
            rows = 0
            for t in iter_results(root, q):
                rows += t.num_rows
                for n, w in widths_of(t, names, time).items():
                    widths[n] = max(widths[n], w)
            out.write(f"== {q.name} ({rows} rows)\n".encode())
            out.write(("  ".join(n.rjust(widths[n]) for n in names) + "\n").encode())
            out.write(("  ".join("-" * widths[n] for n in names) + "\n").encode())
            for t in iter_results(root, q):
                out.write(text_table(t, names, widths, time))
            out.write(b"\n")
            continue
        for t in iter_results(root, q):
            if fmt == "csv":
                out.write(csv_rows(t, names, header, {"query": q.name}, time))
            else:
                out.write(json_lines(t, names, {"query": q.name}, time=time))
