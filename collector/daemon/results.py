"""Query answers as the Spark HFTA wrote them, read back for the API and the command line.

Spark's answer tasks write ``results/query=<name>/part-<job>.parquet``: each answer job's windows
of the query, a row group per window in window order, each window's rows in the query's order
(collector/spark/write.py). A part appears whole and is replaced whole. This module finds a
query's windows from the files' footers (a row group's ``window_start`` statistics), reads
them a row group at a time in the query's own columns, and cuts pages with cursors that stay
valid while new windows arrive.
"""

from __future__ import annotations

import base64
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from itertools import groupby
from operator import attrgetter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from collector.spark.answers import answer_schema, order_keys, spark_type
from collector.spark.write import QUERY
from planner.ir import Query


def query_dir(root: str | os.PathLike, name: str) -> Path:
    return Path(root) / f"{QUERY}={name}"


def clear_results(root: str | os.PathLike, name: str) -> None:
    shutil.rmtree(query_dir(root, name), ignore_errors=True)


def part_files(root: str | os.PathLike, name: str) -> list[Path]:
    """A query's part files (hidden ones, still being written, left out)."""
    d = query_dir(root, name)
    try:
        return [d / n for n in os.listdir(d) if n.endswith(".parquet")
                and not n.startswith((".", "_"))]
    except (FileNotFoundError, NotADirectoryError):
        return []


@dataclass(frozen=True)
class Piece:
    """A row group of a part file: one window of an aggregate query (its start in µs), or
    rows of a selection (its first tuple's time). ``shared``: the row group holds other
    windows too (Spark's writer cuts row groups by size), whose rows are left out on read."""

    path: Path
    group: int
    start: int
    rows: int
    shared: bool = False


def pieces(root: str | os.PathLike, query: Query) -> list[Piece]:
    """A query's row groups in the order its answer reads: by window (a selection's by first
    tuple time), from the footers alone."""
    out = [p for path in part_files(root, query.name) for p in file_pieces(path, query)]
    return sorted(out, key=lambda p: (p.start, p.path.name, p.group))


def file_pieces(path: Path, query: Query) -> list[Piece]:
    """The row groups of one part file, from its footer ([] if it is gone or torn); a row
    group of several windows is a piece per window (its ``window_start`` column read once
    per file version)."""
    key = "_ts" if query.is_selection else "window_start"
    try:
        st = path.stat()
    except FileNotFoundError:
        return []
    return list(_file_pieces(path, key, st.st_mtime_ns, st.st_size))


@lru_cache(maxsize=4096)
def _file_pieces(path: Path, key: str, _mtime_ns: int, _size: int) -> tuple[Piece, ...]:
    try:
        f = pq.ParquetFile(path)
    except (FileNotFoundError, OSError, pa.ArrowInvalid):  # replaced while read
        return ()
    with f:
        meta = f.metadata
        try:
            col = meta.schema.names.index(key)
        except ValueError:
            return ()
        out = []
        for i in range(meta.num_row_groups):
            rg = meta.row_group(i)
            if not rg.num_rows:
                continue
            stats = rg.column(col).statistics
            known = stats is not None and stats.has_min_max
            lo = _micros(stats.min) if known else 0
            if key == "_ts" or (known and _micros(stats.max) == lo):
                out.append(Piece(path, i, lo, rg.num_rows))
                continue
            try:
                ws = pc.cast(f.read_row_group(i, columns=[key]).column(0), pa.int64())
            except (OSError, pa.ArrowInvalid):
                return ()
            counts = pc.value_counts(ws)
            for c in counts.to_pylist():
                out.append(Piece(path, i, int(c["values"]), int(c["counts"]), shared=True))
        return tuple(out)


def _micros(v) -> int:
    """A timestamp statistic as epoch microseconds."""
    if hasattr(v, "timestamp"):
        return int(round(v.timestamp() * 1_000_000))
    return int(v)


def windows(root: str | os.PathLike, query: Query) -> list[int]:
    """The starts (µs) of an aggregate query's answered windows, oldest first."""
    return sorted({p.start for p in pieces(root, query)})


def read_pieces(query: Query, chosen: list[Piece]) -> Iterator[pa.Table]:
    """Row groups in the query's own columns (``answer_schema``), one at a time; a window
    whose pieces are in several files (a spread answer's) merged into the query's order."""
    files: dict[Path, pq.ParquetFile] = {}
    try:
        # a selection's pieces one by one; an aggregate's by window
        for _, pieces_ in groupby(chosen, key=id if query.is_selection else attrgetter("start")):
            run = list(pieces_)
            if len({p.path for p in run}) > 1:
                yield from _merged(query, run, files)
            else:
                for p in run:
                    yield from _read(query, p, files)
    finally:
        for f in files.values():
            f.close()


def _read(query: Query, p: Piece, files: dict[Path, pq.ParquetFile],
          batch_rows: int | None = None) -> Iterator[pa.Table]:
    """A piece in the query's columns: whole, or in batches of ``batch_rows``; nothing if
    its file was replaced while read."""
    try:
        f = files.get(p.path) or files.setdefault(p.path, pq.ParquetFile(p.path))
        if batch_rows is None:
            tables = [f.read_row_group(p.group)]
        else:
            tables = (pa.Table.from_batches([b]) for b in
                      f.iter_batches(batch_size=batch_rows, row_groups=[p.group]))
        for table in tables:
            if p.shared:
                ws = pc.cast(table.column("window_start"), pa.int64())
                table = table.filter(pc.equal(ws, p.start))
            yield project(query, table)
    except (FileNotFoundError, OSError, pa.ArrowInvalid):  # replaced while read
        return


MERGE_ROWS = 1 << 16  # rows of each file a merge holds at a time


def _merged(query: Query, run: list[Piece], files: dict[Path, pq.ParquetFile]
            ) -> Iterator[pa.Table]:
    """One window's pieces from several files, each file's rows in the query's order,
    merged into that order, holding ``MERGE_ROWS`` of each file at a time: the rows of all
    buffers up to the first buffer end of a file with more rows to come are in their final
    order (what follows in any file sorts after its own buffer's end)."""
    by_file: dict[Path, list[Piece]] = {}
    for p in run:
        by_file.setdefault(p.path, []).append(p)
    sources = [(b for p in pieces_ for b in _read(query, p, files, MERGE_ROWS) if b.num_rows)
               for pieces_ in by_file.values()]
    keys = order_keys(query, answer_schema(query).names)
    buffers = [next(src, None) for src in sources]
    ahead = [next(src, None) for src in sources]  # whether a file has more rows to come
    while True:
        live = [k for k, b in enumerate(buffers) if b is not None and b.num_rows]
        if not live:
            return
        table = pa.concat_tables([buffers[k] for k in live])
        which = np.repeat(np.arange(len(live)), [buffers[k].num_rows for k in live])
        at = np.concatenate([np.arange(buffers[k].num_rows) for k in live])
        order = pc.sort_indices(table.append_column("_file", pa.array(which))
                                .append_column("_at", pa.array(at)),
                                keys + [("_file", "ascending"), ("_at", "ascending")]
                                ).to_numpy()
        place = np.empty(len(order), np.int64)
        place[order] = np.arange(len(order))
        ends = np.cumsum([buffers[k].num_rows for k in live]) - 1
        bounds = [place[ends[n]] for n, k in enumerate(live) if ahead[k] is not None]
        cut = min(bounds) + 1 if bounds else len(order)
        yield table.take(order[:cut])
        taken = np.bincount(which[order[:cut]], minlength=len(live))
        for n, k in enumerate(live):
            rest = buffers[k].slice(int(taken[n]))
            while not rest.num_rows and ahead[k] is not None:
                rest, ahead[k] = ahead[k], next(sources[k], None)
            buffers[k] = rest


def project(query: Query, table: pa.Table) -> pa.Table:
    """Answer rows as written in the query's own columns (``answer_schema``; a column it lacks,
    written before the query had it, reads as NULL)."""
    want = answer_schema(query)
    names = set(table.column_names)

    def column(f: pa.Field):
        # Spark's writer: a name another query of the folder has with another type is
        # written with this query's type after it (derive.compiled_answers)
        typed = f"{f.name}__{spark_type(f.type)}"
        name = typed if typed in names else f.name if f.name in names else None
        if name is None:
            return pa.nulls(table.num_rows, f.type)
        return pc.cast(table.column(name), f.type)
    return pa.Table.from_arrays([column(f) for f in want], schema=want)


def _latest(query: Query, found: list[Piece], last_windows: int | None) -> list[Piece]:
    if last_windows is None or query.is_selection:
        return found
    keep = set(sorted({p.start for p in found})[-last_windows:]) if last_windows else set()
    return [p for p in found if p.start in keep]


def iter_results(root: str | os.PathLike, query: Query,
                 last_windows: int | None = None) -> Iterator[pa.Table]:
    """A query's answer a row group at a time, oldest window first (optionally its latest
    windows only): memory bounded by a row group whatever the answer's size."""
    yield from read_pieces(query, _latest(query, pieces(root, query), last_windows))


def read_results(root: str | os.PathLike, query: Query, last_windows: int | None = None
                 ) -> pa.Table:
    """A query's answers so far, in order; optionally only its latest closed windows."""
    tables = list(iter_results(root, query, last_windows))
    return pa.concat_tables(tables) if tables else answer_schema(query).empty_table()


class CursorError(ValueError):
    pass


def page_windows(root: str | os.PathLike, query: Query, start_s: float | None = None,
                 end_s: float | None = None, newest_first: bool = True, limit: int = 1000,
                 cursor: str | None = None, last_windows: int | None = None) -> pa.Table:
    """The windows of an aggregate query that a ``page`` can reach, read: those in
    [start_s, end_s) from the cursor's on, in the page's order, until they hold more than
    ``limit`` rows (counted from the files' footers). A selection's rows are all read."""
    found = _latest(query, pieces(root, query), last_windows)
    if query.is_selection:
        tables = list(read_pieces(query, found))
        return pa.concat_tables(tables) if tables else answer_schema(query).empty_table()
    lo = None if start_s is None else int(start_s * 1_000_000)
    hi = None if end_s is None else int(end_s * 1_000_000)
    by_window: dict[int, list[Piece]] = {}
    for p in found:
        if (lo is None or p.start >= lo) and (hi is None or p.start < hi):
            by_window.setdefault(p.start, []).append(p)
    order = sorted(by_window, reverse=newest_first)
    rows = 0
    if cursor is not None:
        w, served, direction = _decode_cursor(cursor)
        order = [x for x in order if (x <= w if direction == "n" else x >= w)]
        rows = -served  # the cursor's window: its rows served before do not count
    chosen: list[int] = []
    for w in order:
        chosen.append(w)
        rows += sum(p.rows for p in by_window[w])
        if rows > limit:  # the page ends inside the windows read: its next cursor is known
            break
    tables = list(read_pieces(query, [p for w in sorted(chosen) for p in by_window[w]]))
    return pa.concat_tables(tables) if tables else answer_schema(query).empty_table()


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
