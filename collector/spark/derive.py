"""The HFTA's derivation, on Spark's executors: every query's answer from the partial rows of
one folder (the spool's files, or the rows the streaming merge releases), in one Spark job for
all the folder's queries.

1. **Fan-out** (``mapInArrow``): each partial row's packed key is decoded by its node's layout
   (collector/keys.py) and the row becomes one row per query slot its pattern holds, with the
   query's node-key columns: ``(g, q, window_start, k0…, cnt, measures, hll)``. ``g`` is the
   row's answer: the query, or the joined query of a WITH part.
2. **Answer** (``repartition(g)``, sorted by ``(g, window_start)``, ``mapInArrow``): each
   answer's rows go to one task, which takes them a window at a time: merges them to the
   query's keys, counts distinct values, estimates sketches, applies HAVING and ORDER BY …
   LIMIT, joins a WITH query's parts and projects the outputs (``collector/spark/answers.py``)
   ...
3. ... and **writes** them: a row group per window into the query's part of the job, one
   Parquet file renamed into place when done (``collector/spark/write.py``): a job run again
   (a batch Spark runs again after a crash) replaces its parts. What returns to Spark is a row
   per part written (query, windows, rows), summed per query for the driver's metrics.

The driver plans this; no row of the answers passes through it. With
``spark.answer_engine: sql`` (``compiled_answers``) the same answers come from Spark's own
engine and writer instead: the queries compiled to Spark expressions (``compile.py``), no
Python process on the executors (selection folders keep their Python task).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property, partial
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame

from capture.enrich.dictionary import dictionary
from capture.fields import IP, SKETCH, TEXT_FIELDS, fields, key_field, measures
from collector.spark.answers import spark_type
from collector.spark.write import QUERY, PartWriter, spread_name
from planner.ir import Query

if TYPE_CHECKING:  # compile.py is the driver's: the Python engine's workers import this without it
    from collector.spark.compile import Patterns

TS_US = pa.timestamp("us", tz="UTC")
# what an answer task returns: a row per file it wrote (the starts of its windows: a spread
# answer's files share windows)
WRITTEN = pa.schema([pa.field(QUERY, pa.string()), pa.field("part", pa.string()),
                     pa.field("starts", pa.list_(pa.int64())), pa.field("newest", pa.int64()),
                     pa.field("rows", pa.int64())])


def ddl(schema: pa.Schema) -> str:
    """A Spark DDL string of an Arrow schema."""
    return ", ".join(f"`{f.name}` {spark_type(f.type)}" for f in schema)


@dataclass(frozen=True)
class Folder:
    """What one Spark job derives: the queries of a (stream, folder) by slot, WITH parts
    included, as the driver knows them when it plans the job. Picklable: it travels to the
    executors with the job, so a query registered later never changes a job in flight."""

    stream: str
    folder: str
    slots: tuple[tuple[int, Query], ...]
    dictionary: str = ""  # the texts of text codes (capture/enrich/dictionary.py)

    @cached_property
    def by_slot(self) -> dict[int, Query]:
        return dict(self.slots)

    @cached_property
    def answers(self) -> list[Query]:
        """The queries that have answers (a WITH part's answer is its join's), by slot."""
        out: dict[str, Query] = {}
        for _, q in sorted(self.slots, key=lambda sq: sq[0]):
            top = q.parent or q
            out.setdefault(top.name, top)
        return list(out.values())

    @cached_property
    def group_of(self) -> dict[int, int]:
        """Each slot's answer (an index into ``answers``)."""
        index = {q.name: i for i, q in enumerate(self.answers)}
        return {s: index[(q.parent or q).name] for s, q in self.slots}

    @cached_property
    def keys(self) -> list[str]:
        """The node-key columns the queries read (a sketch key travels in ``hll``)."""
        return list(dict.fromkeys(k for _, q in self.slots for k in q.node_keys
                                  if not k.startswith(SKETCH)))

    @cached_property
    def measures(self) -> list[str]:
        """The measures the queries read, in catalogue order."""
        used = {m for _, q in self.slots for m in q.measures}
        return [m.name for m in measures(self.stream) if m.name in used]

    @cached_property
    def sketches(self) -> bool:
        return any(q.approx for _, q in self.slots)

    @cached_property
    def columns(self) -> list[str]:
        """The spool's columns the fan-out reads."""
        return ["window_start", "node", "key", "cnt",
                *(f"{a}_{m}" for m in self.measures for a in ("sum", "min", "max")),
                *(["hll"] if self.sketches else [])]

    def key_type(self, name: str) -> pa.DataType:
        f = fields(self.stream)[key_field(name)[0]]
        return pa.binary() if f.kind == IP else pa.int64() if f.codec == "text" else \
            f.arrow_type

    @cached_property
    def fan_schema(self) -> pa.Schema:
        cols = [pa.field("g", pa.int32()), pa.field("q", pa.int32()),
                pa.field("window_start", TS_US)]
        cols += [pa.field(f"k{i}", self.key_type(k)) for i, k in enumerate(self.keys)]
        cols += [pa.field(c, pa.binary() if c == "hll" else pa.int64())
                 for c in self.columns[3:]]
        return pa.schema(cols)


def fan_out(folder: Folder, batches: Iterator[pa.RecordBatch],
            spread: dict[int, int] | None = None) -> Iterator[pa.RecordBatch]:
    """Partial rows as rows per query slot of their pattern (``Folder.fan_schema``), with the
    keys the slot's query reads (NULL the others), and the rows of a batch that then share a
    (slot, window, keys) combined: rows of one group that differ only in their patterns (or
    in keys the query rolls up) become one, before Spark moves them (the CSV bench's 6.5M
    fanned rows: 2.6M). Rows of a slot no query of ``folder`` holds (deleted since they were
    spooled) are left out. Vectorised: a node's rows and its slots become (row, slot) pairs at
    once, and each column is taken once per node. ``spread``: answers (by index) spread over
    that many tasks, each row's ``g`` then its answer's ``task_group`` by the hash of its
    query's keys."""
    from collector.keys import KeyLayout
    schema = folder.fan_schema
    slots = np.array(sorted(folder.by_slot), np.int64)
    groups = np.array([folder.group_of[s] for s in slots], np.int32)
    approx = np.array([bool(folder.by_slot[s].approx) for s in slots])
    reads = {k: np.array([k in folder.by_slot[s].node_keys for s in slots])
             for k in folder.keys}
    for batch in batches:
        if not batch.num_rows:
            continue
        codes = pc.dictionary_encode(batch.column("node"))
        index = codes.indices.to_numpy(zero_copy_only=False)
        order = np.argsort(index, kind="stable")
        bounds = np.searchsorted(index[order], np.arange(len(codes.dictionary) + 1))
        for code, label in enumerate(codes.dictionary.to_pylist()):
            if not label:
                continue  # punctuation
            at = order[bounds[code]:bounds[code + 1]]
            layout = KeyLayout.parse(folder.stream, label)
            cols, pattern = layout.decode(batch.column("key").take(pa.array(at)))
            mine = slots < 64 * pattern.shape[1]
            bits = np.unpackbits(np.ascontiguousarray(pattern).view(np.uint8), axis=1,
                                 bitorder="little")[:, slots[mine]]
            row, j = np.nonzero(bits)  # row-major: each row's slots in order
            if not len(row):
                continue
            take, src = pa.array(row), pa.array(at[row])
            out = {"g": pa.array(groups[mine][j]),
                   "q": pa.array(slots[mine][j].astype(np.int32)),
                   "window_start": batch.column("window_start").take(src)}
            for i, k in enumerate(folder.keys):
                if k not in cols:
                    out[f"k{i}"] = pa.nulls(len(row), schema.field(f"k{i}").type)
                    continue
                col, used = cols[k].take(take), reads[k][mine][j]
                out[f"k{i}"] = col if used.all() else \
                    pc.if_else(pa.array(used), col, pa.scalar(None, col.type))
            for name in folder.columns[3:]:
                col = batch.column(name).take(src)
                if name == "hll" and not approx[mine][j].all():
                    col = pc.if_else(pa.array(approx[mine][j]), col,
                                     pa.scalar(None, pa.binary()))
                out[name] = col
            if spread:
                out["g"] = _spread_groups(folder, spread, out)
            fanned = pa.RecordBatch.from_arrays([out[n] for n in schema.names], schema=schema)
            yield fanned if approx[mine][j].any() else _combined(folder, fanned)


def task_group(folder: Folder, answer: int, bucket: int) -> int:
    """The ``g`` of bucket ``bucket`` of answer ``answer`` (the answer itself: bucket 0)."""
    return answer + len(folder.answers) * bucket


def _spread_groups(folder: Folder, spread: dict[int, int], out: dict[str, pa.Array]
                   ) -> pa.Array:
    """``out``'s ``g`` with each row of a spread answer moved to its bucket's: the hash of
    the row's values of the query's keys, the same in every task (rows of one group meet)."""
    g = out["g"].to_numpy(zero_copy_only=False).astype(np.int64)
    for answer, n in spread.items():
        rows = np.flatnonzero(g == answer)
        if not len(rows):
            continue
        q = folder.answers[answer]
        at = pa.array(rows)
        cols = [out[f"k{i}"].take(at) for i, k in enumerate(folder.keys) if k in q.keys]
        g[rows] = task_group(folder, answer, 0) + len(folder.answers) * (
            (key_hash(cols, len(rows)) >> np.uint64(33)) % np.uint64(n)).astype(np.int64)
    return pa.array(g.astype(np.int32))


_MIX = np.uint64(0x9E3779B97F4A7C15)


def key_hash(columns: list[pa.Array], n: int) -> np.ndarray:
    """A hash (uint64) of each of ``n`` rows' values of ``columns`` that depends on the values
    alone (not on the batch: no dictionary of values), NULL hashed as 0."""
    h = np.zeros(n, np.uint64)
    with np.errstate(over="ignore"):
        for a in columns:
            for w in _hash_words(a):
                h = (h ^ w) * _MIX
                h ^= h >> np.uint64(29)
    return h


def _hash_words(a: pa.Array) -> list[np.ndarray]:
    """A column as uint64 words for ``key_hash``: integers as they are, other values a
    polynomial hash of their bytes."""
    from collector.keys import binary_buffers
    t = a.type
    if pa.types.is_integer(t) or pa.types.is_timestamp(t):
        return [pc.fill_null(a.cast(pa.int64()), 0).to_numpy(zero_copy_only=False)
                .view(np.uint64)]
    if not pa.types.is_binary(t):  # (large) strings, large binaries: the same bytes
        a = a.cast(pa.binary())
    off, data = binary_buffers(pc.fill_null(a, b"") if a.null_count else a)
    lens, starts = np.diff(off), off[:-1] - off[0]
    body = data[off[0]:off[-1]].astype(np.uint64)
    width = int(lens.max(initial=0))
    sums = np.zeros(len(lens), np.uint64)
    full = lens > 0
    with np.errstate(over="ignore"):  # FNV's prime to the power of the place
        powers = np.cumprod(np.full(max(width, 1), 1099511628211, np.uint64))
        if full.all() and (lens == width).all():  # fixed width (addresses): row by row
            sums = (body.reshape(len(lens), width) * powers).sum(axis=1, dtype=np.uint64)
        elif full.any():
            pos = np.arange(len(body)) - np.repeat(starts, lens)  # each byte's place
            sums[full] = np.add.reduceat(body * powers[pos], starts[full])
    return [sums, lens.astype(np.uint64)]


def _combined(folder: Folder, rows: pa.RecordBatch) -> pa.RecordBatch:
    """Rows of one (slot, window, keys) merged into one: counts and sums added, minima and
    maxima kept (rows without sketches)."""
    from collector.spark.grouping import group_ids, key_words, reduce_column
    keys = ["q", "window_start", *(f"k{i}" for i in range(len(folder.keys)))]
    gid, first = group_ids(key_words([rows.column(k) for k in keys], rows.num_rows))
    n = len(first)
    if n == rows.num_rows:
        return rows
    at = pa.array(first)
    out = []
    for name in rows.schema.names:
        col = rows.column(name)
        how = "sum" if name == "cnt" else name[:3] if name[:4] in ("sum_", "min_", "max_") \
            else None
        out.append(reduce_column(col, gid, n, how) if how else col.take(at))
    return pa.RecordBatch.from_arrays(out, schema=rows.schema)


def answer_of_group(folder: Folder, table: pa.Table) -> tuple[Query, pa.Table]:
    """The answer of one answer (``Folder.answers[g]``) in windows from their fanned-out rows:
    the query and its rows in its own columns (``answers.answer_schema``), by window."""
    from collector.spark.answers import answer_table, finalize, join_answer, order_rows
    top = folder.answers[table.column("g")[0].as_py() % len(folder.answers)]
    slot_col = table.column("q").to_numpy()
    present = np.unique(slot_col).tolist()
    parts: dict[str, pa.Table] = {}
    for slot in present:
        q = folder.by_slot[slot]
        rows = table if len(present) == 1 else table.filter(pa.array(slot_col == slot))
        cols = {"window_start": rows.column("window_start")}
        for i, k in enumerate(folder.keys):
            if k in q.node_keys:
                cols[k] = rows.column(f"k{i}")
                if k in TEXT_FIELDS:  # grouped by code: the answer shows the text
                    cols[k] = dictionary(folder.dictionary).lookup(cols[k])
        cols["cnt"] = rows.column("cnt")
        for m in q.measures:
            for a in ("sum", "min", "max"):
                cols[f"{a}_{m}"] = rows.column(f"{a}_{m}")
        for f in q.approx:
            cols[SKETCH + f] = rows.column("hll")
        parts[q.name] = finalize(q, pa.table(cols))
    answer = join_answer(top, parts) if top.join is not None else parts[top.name]
    return top, answer_table(top, order_rows(top, answer))


def _written(query: Query, part: str, starts: list[int], newest: int, rows: int
             ) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({QUERY: [query.name], "part": [part],
                                       "starts": [starts], "newest": [newest],
                                       "rows": [rows]}, schema=WRITTEN)


def _task_meta() -> dict[str, str]:
    """Which Spark task wrote a part (kept in its file: the cluster test checks the workers
    wrote them; anyone may trace a part to its task in Spark's event log)."""
    from pyspark import TaskContext
    tc = TaskContext.get()
    return {"flowsieve.task": str(tc.taskAttemptId()) if tc else "",
            "flowsieve.stage": str(tc.stageId()) if tc else ""}


ANSWER_ROWS = 1 << 16  # rows of an answer's windows an answer task answers together


def _answer_task(folder: Folder, root: str, part: str,
                 batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """An answer task: fanned-out rows sorted by (answer, window); an answer's consecutive
    windows answered together (up to ``ANSWER_ROWS`` rows, or one window however large: memory
    bounded either way; small windows cost one pass, not one each) and written, a row group per
    window, into the answer's part of the results (``write.PartWriter``; a spread answer's
    bucket ``b`` into the part's ``write.spread_name(part, b)``); a row per file written."""
    from collector.spark.answers import answer_schema
    meta = _task_meta()
    writer: PartWriter | None = None
    query: Query | None = None
    group = None  # the (answer, bucket) being written
    starts: list[int] = []
    newest = 0
    pending: list[pa.RecordBatch] = []
    held = 0  # rows pending
    key = None

    def done() -> Iterator[pa.RecordBatch]:
        nonlocal writer
        if writer is not None:
            writer.close()
            yield _written(query, writer.final.name, starts, newest, writer.rows)
            writer = None

    def answer(rows: list[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        nonlocal writer, query, group, starts, newest
        g = rows[0].column("g")[0].as_py()
        q, table = answer_of_group(folder, pa.Table.from_batches(rows))
        if g != group:
            yield from done()
            query, group, starts = q, g, []
        if not table.num_rows:  # no group passed its HAVING
            return
        if writer is None:
            bucket = g // len(folder.answers)
            writer = PartWriter(root, q.name, spread_name(part, bucket) if bucket else part,
                                answer_schema(q), meta)
        ws = pc.cast(table.column("window_start"), pa.int64()).to_numpy()  # sorted by window
        cut = np.flatnonzero(ws[1:] != ws[:-1]) + 1
        for lo, hi in zip(np.r_[0, cut], np.r_[cut, len(ws)], strict=True):
            writer.write(table.slice(lo, hi - lo))
        starts += (ws[np.r_[0, cut]] // 1_000_000).tolist()
        newest = max(newest, int(ws[-1]) // 1_000_000)

    try:
        for b in batches:
            if not b.num_rows:
                continue
            g = b.column("g").to_numpy().astype(np.int64)
            ws = pc.cast(b.column("window_start"), pa.int64()).to_numpy()
            cut = np.flatnonzero((g[1:] != g[:-1]) | (ws[1:] != ws[:-1])) + 1
            for lo, hi in zip(np.r_[0, cut], np.r_[cut, len(g)], strict=True):
                k = (int(g[lo]), int(ws[lo]))
                if k != key and pending and (k[0] != key[0] or held >= ANSWER_ROWS):
                    yield from answer(pending)
                    pending, held = [], 0
                key = k
                pending.append(b.slice(lo, hi - lo))
                held += hi - lo
        if pending:
            yield from answer(pending)
        yield from done()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise


def selected(folder: Folder, batches: Iterator[pa.RecordBatch]
             ) -> Iterator[tuple[Query, pa.Table]]:
    """A selection folder's tuples as each query's projected rows (vectorised over
    ``qmask``)."""
    from collector.pipeline.spool import qmask_words
    from collector.spark.answers import project_selection
    from planner.slots import has_slot, slots_of
    for b in batches:
        if not b.num_rows:
            continue
        words = qmask_words(b.column("qmask"))
        for slot in slots_of(np.bitwise_or.reduce(words, axis=0)):
            q = folder.by_slot.get(slot)
            if q is not None:
                rows = pa.Table.from_batches([b]).filter(pa.array(has_slot(words, slot)))
                yield q, project_selection(q, rows)


def _select_task(folder: Folder, root: str, part: str,
                 batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """A selection task: each query's matching tuples written into a part of its own for
    this task (named by the job and the task's partition, so a batch run again writes the
    same names); a row per part written."""
    from pyspark import TaskContext

    from collector.spark.answers import answer_schema
    name = part.replace(".parquet", f"-{TaskContext.get().partitionId():05d}.parquet")
    writers: dict[str, tuple[Query, PartWriter]] = {}
    try:
        for q, rows in selected(folder, batches):
            if q.name not in writers:
                writers[q.name] = (q, PartWriter(root, q.name, name, answer_schema(q),
                                                 _task_meta()))
            writers[q.name][1].write(rows.select(answer_schema(q).names))
        for q, w in writers.values():
            w.close()
            yield _written(q, name, [], 0, w.rows)
    except BaseException:
        for _, w in writers.values():
            w.abort()
        raise


def part_name(job: str) -> str:
    """The file an answer job writes into each query's results: ``part-<job>.parquet``."""
    return f"part-{job}.parquet"


def answers(rows: DataFrame, folder: Folder, root: str, job: str, partitions: int,
            task_rows: int | None = None, layouts: Iterable[str] = (), reuse: bool = True,
            at_most: int | None = None, held: Patterns | None = None) -> list[dict]:
    """The job that answers a folder's partial rows (or a selection folder's tuples) and
    writes the answers under ``root``, each query's as its part ``part_name(job)``; what it
    wrote, a row per query (its windows, its newest window's start, rows). ``partitions``:
    the answer tasks (a query's rows go to one of them). In a folder of fewer answers than
    Spark's cores, a query without ORDER BY, LIMIT or a join whose merged rows outnumber
    ``task_rows`` (default ``ANSWER_TASK_ROWS``; counted from the batch's query-bit
    patterns, one small job) is spread over as many tasks (at most the cores) by the hash of
    its keys, a file each (``write.spread_name``), as Spark's engine spreads it.
    ``reuse``: ``rows`` are a streaming batch's merge, kept for the two jobs that read them;
    ``layouts``: node layouts the rows may hold (the plan's); ``at_most``: how many rows
    ``rows`` has at most, when known (no count is needed when no query can outnumber
    ``task_rows``)."""
    part = part_name(job)
    per_task = task_rows or ANSWER_TASK_ROWS
    if folder.folder == "select":
        cols = [f.name for f in fields(folder.stream).values()] + ["qmask"]
        return _summed(rows.select(*cols).mapInArrow(
            partial(_select_task, folder, root, part), ddl(WRITTEN)).collect(), root, part)
    # no more tasks than Spark runs at once: a task's rows are numpy's, not held in the JVM,
    # and a reader merges the files of a window (8 tasks on 2 cores: 3.6 s more to read 4M
    # rows back, for 4 s less answering); a folder with as many answers as that already
    # fills them, and is spared the job that counts its rows per query (the 11 telemetry
    # applications in a fresh JVM: 9.35 s answering with it, 8.1 s without)
    most = rows.sparkSession.sparkContext.defaultParallelism
    spreadable = {i: q for i, q in enumerate(folder.answers)
                  if q.join is None and not q.order and q.limit is None} \
        if len(folder.answers) < most and (at_most is None or at_most > per_task) else {}
    if reuse and spreadable:
        rows = rows.persist()
    try:
        spread = {}
        if spreadable:
            from collector.spark.compile import slot_rows
            slot = {q.name: s for s, q in folder.slots}
            counts = slot_rows(held_patterns(rows, folder, layouts, held),
                               [slot[q.name] for q in spreadable.values()])
            spread = {i: min(-(-counts[slot[q.name]] // per_task), most)
                      for i, q in spreadable.items() if counts[slot[q.name]] > per_task}
            spread = {i: n for i, n in spread.items() if n > 1}
        fan = rows.select(*folder.columns).mapInArrow(partial(fan_out, folder, spread=spread),
                                                      ddl(folder.fan_schema))
        tasks = max(partitions, *spread.values()) if spread else partitions
        written = (placed(fan, _tasks_of(folder, spread, tasks), tasks)
                   .sortWithinPartitions("g", "window_start")
                   .mapInArrow(partial(_answer_task, folder, root, part), ddl(WRITTEN)))
        return _summed(written.collect(), root, part)
    finally:
        if reuse and spreadable:
            rows.unpersist()


def _tasks_of(folder: Folder, spread: dict[int, int], tasks: int) -> dict[int, int]:
    """Which of ``tasks`` answers each ``g``: a spread answer's buckets on tasks of their own
    (as far as there are tasks), then the other answers in turn."""
    gs = [task_group(folder, a, b) for a, n in spread.items() for b in range(n)]
    gs += [a for a in range(len(folder.answers)) if a not in spread]
    return {g: i % tasks for i, g in enumerate(gs)}


def placed(frame: DataFrame, task_of: dict[int, int], tasks: int) -> DataFrame:
    """``frame`` in ``tasks`` partitions, its rows of each ``g`` in partition
    ``task_of[g]``. ``repartition(tasks, "g")`` hashes ``g`` (Murmur3, seed 42) modulo the
    tasks: two answers' ``g`` often met in one task while another had none (``hash(0)`` and
    ``hash(1)`` are both odd); here each ``g`` is given a value that hashes to its task."""
    from pyspark.sql import functions as F
    value = {t: next(v for v in range(1 << 20) if spark_partition(v, tasks) == t)
             for t in set(task_of.values())}
    cases = " ".join(f"WHEN {g} THEN {value[t]}" for g, t in sorted(task_of.items()))
    to = F.expr(f"CASE g {cases} ELSE g END") if cases else F.col("g")
    return frame.withColumn("_task", to).repartition(tasks, "_task").drop("_task")


def spark_partition(value: int, partitions: int) -> int:
    """The partition Spark's hash partitioning gives an int ``value`` among ``partitions``:
    ``pmod(hash(value), partitions)``, Murmur3 x86 32-bit of the int with seed 42."""
    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF
    k = rotl(((value & 0xFFFFFFFF) * 0xCC9E2D51) & 0xFFFFFFFF, 15) * 0x1B873593 & 0xFFFFFFFF
    h = (rotl(42 ^ k, 13) * 5 + 0xE6546B64) & 0xFFFFFFFF
    h ^= 4
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    signed = h - (1 << 32) if h >= 1 << 31 else h
    return signed % partitions  # Python's % is pmod


def _summed(written: list, root: str, part: str) -> list[dict]:
    """What the answer tasks wrote (a row per file) as a row per query; the files of an
    earlier run of the same job (a batch Spark runs again) that this run did not write
    again (it spread a query over fewer) removed."""
    from pathlib import Path

    from collector.spark.write import drop_others
    out: dict[str, dict] = {}
    files: dict[str, set[str]] = {}
    for r in written:
        q = out.setdefault(r[QUERY], {"query": r[QUERY], "rows": 0, "newest": 0, "starts": set()})
        q["rows"] += r["rows"]
        q["newest"] = max(q["newest"], r["newest"])
        q["starts"].update(r["starts"])
        files.setdefault(r[QUERY], set()).add(r["part"])
    for name, kept in files.items():
        drop_others(Path(root) / f"{QUERY}={name}", part, kept)
    return [{**{k: v for k, v in q.items() if k != "starts"}, "windows": len(q["starts"])}
            for q in out.values()]


def held_patterns(rows: DataFrame, folder: Folder, layouts: Iterable[str] = (),
                  known: Patterns | None = None) -> Patterns:
    """``compile.patterns`` of ``rows``: the rows of each (node layout, query-bit pattern),
    read by the layouts the folder's batches held before and ``layouts`` (one more job when
    a new one appears); ``known``: those counts, already known (no job)."""
    from collector.spark.compile import patterns
    if known is not None:
        _labels(rows.sparkSession, folder, {n for n, _ in known})
        return known
    held = patterns(rows, folder.stream, _labels(rows.sparkSession, folder, set(layouts)))
    if any(p is None for _, p in held):
        held = patterns(rows, folder.stream, _labels(
            rows.sparkSession, folder, {n for n, _ in held}))
    return held


# a row group of Spark's answer parts: whoever reads an answer back holds one at a time (a
# window of 4M rows read with 1M-row groups peaked at 1.1 GiB in the Python driver)
ANSWER_GROUP_ROWS = 1 << 18
ANSWER_GROUP_BYTES = 64 << 20
# merged rows of a node layout per answer task of Spark's engine: a query without ORDER BY
# or LIMIT over more is spread across tasks (4M groups in one task: its aggregation and
# sort spilled with a 512 MiB driver)
ANSWER_TASK_ROWS = 500_000
# Spark's writer of the answers on a local file system (``file:``) without a checksum file
# beside each part: Hadoop forks ``chmod`` for every file and directory it creates there (5-7
# ms each from the JVM), three per query with the ``.crc`` (its directory, its part, the
# checksum), 155 forks an answer job for the 50 backbone queries (106 without); ``promote``
# and every reader take the parts alone. A Hadoop setting of this write alone, its own
# file-system instance (not the cached one of the spool's reads)
RAW_LOCAL_FILES = {"fs.file.impl": "org.apache.hadoop.fs.RawLocalFileSystem",
                   "fs.file.impl.disable.cache": "true"}


def compiled(folder: Folder) -> bool:
    """Whether Spark's engine answers every query of ``folder`` (``compiled_answers``): no
    output named as the job's own columns."""
    from collector.spark.answers import answer_schema
    from collector.spark.compile import RANK, SLOT, compiles
    return all(
        compiles(q) and not {QUERY, RANK, SLOT} & set(answer_schema(q).names)
        for q in folder.answers)


def compiled_answers(rows: DataFrame, folder: Folder, root: str, job: str, partitions: int,
                     reuse: bool = True, task_rows: int | None = None,
                     layouts: Iterable[str] = (), held: Patterns | None = None) -> list[dict]:
    """The answer job of ``answers`` with every answer computed and written by Spark's engine
    (``compile.py``, Spark's Parquet writer): no Python process on the executors. The queries'
    answers go in one job, each query's rows to one writer task (its part is one file),
    a window's rows in the query's order, then ``write.promote`` moves the parts into place.
    What it wrote, a row per query (the queries' observed metrics: rows, windows, newest
    window start). A column of a name that another query of the folder has with another
    type is written as ``<name>__<type>`` (``results.project`` reads it back). ``reuse``:
    the rows are a streaming batch's merge, kept (persisted) for the two jobs that read them
    (the node layouts they hold, then the answers), instead of merged twice; a batch read of
    the spool's files is read twice. ``task_rows``: a query without ORDER BY or LIMIT whose
    node layouts hold more merged rows than this is answered by several tasks, a part each
    (``compile.shared_pass``; default ``ANSWER_TASK_ROWS``). ``layouts``: node layouts the
    rows may hold (the plan's), so that one job finds those they do hold."""
    from functools import reduce

    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    from collector.spark.compile import (
        BUCKET,
        RANK,
        SLOT,
        answer_frame,
        join_frame,
        key_columns,
        plain,
        selection_frame,
        slot_rows,
    )
    from collector.spark.write import file_rows, promote, stage_dir
    if reuse:
        rows = rows.persist()
    try:
        tuples = folder.folder == "select"  # a selection folder's tuples, not partial rows
        # the rows of each (node layout, query-bit pattern), by the layouts seen before (one
        # more job when a new one appears)
        held = {} if tuples else held_patterns(rows, folder, layouts, held)
        labels = sorted({n for n, _ in held})
        texts = None if tuples else dictionary_frame(rows.sparkSession, folder)
        slots = {q.name: s for s, q in folder.slots}
        frames, seen, observed = [], {}, {}
        tag = f"flowsieve_{folder.stream}_{folder.folder}_{job}"
        # a window's rows are written sorted by the key columns (answers.order_rows) of all
        # the queries, in their first query's order; a query whose keys come in another
        # order is ranked by its own (so is one with ORDER BY)
        keys: list[str] = []
        for q in folder.answers:
            keys += [c for c in key_columns(q) if c not in keys]
        in_order = {q.name: sorted(keys.index(c) for c in key_columns(q)) ==
                    [keys.index(c) for c in key_columns(q)] for q in folder.answers}
        # a query whose keys come in another order than the folder's is ranked by its own
        together = [(slots[q.name], q) for q in folder.answers if plain(q)]
        built = _shared_pass(rows.sparkSession, folder, together, labels, seen,
                             [s for s, q in together if not in_order[q.name]])
        # each query's rows in one task (its part one file), the shared pass's in as many
        # tasks as its queries allow; a query of more rows than a task's in several
        per_task = task_rows or ANSWER_TASK_ROWS
        buckets = {s: -(-n // per_task) for s, n in slot_rows(
            held, [s for s, _ in together]).items() if n > per_task}
        shared = None if built is None else (
            built[0](rows, texts, min(len(together), partitions), held, buckets), *built[1:])
        if shared is None:
            together = []
        alone = [q for q in folder.answers if all(q is not t for _, t in together)]
        written_as: dict[str, list[str]] = {}  # a key column -> its names as written
        if shared is not None:
            frame, names, measured, name = shared
            for s, _ in together:
                for c, as_ in names[s].items():
                    if c in keys and as_ not in written_as.setdefault(c, []):
                        written_as[c].append(as_)
            obs = Observation(f"{tag}_shared")
            frame = frame.observe(obs, *measured)
            frames.append(frame.select(*(F.col(f"`{c}`") for c in frame.columns
                                         if c not in (SLOT, BUCKET)),
                                       name[F.col(SLOT)].alias(QUERY)))
            for s, q in together:
                observed[q.name] = (obs, s)
        for i, q in enumerate(alone):
            obs = Observation(f"{tag}_{i}")
            if q.is_selection:  # its tuples, in time order; no window
                frame = selection_frame(rows, q, slots[q.name]).observe(
                    obs, F.count(F.lit(1)).alias("rows"))
            else:
                ranked = not in_order[q.name]
                frame = join_frame(rows, q, slots, labels, texts, ranked) \
                    if q.join is not None \
                    else answer_frame(rows, q, slots[q.name], labels, texts, ranked)
                frame = frame.observe(obs, F.count(F.lit(1)).alias("rows"),
                                      F.max("window_start").alias("newest"),
                                      F.approx_count_distinct("window_start", 0.01)
                                      .alias("windows"))
            observed[q.name] = (obs, None)
            renamed = []
            for name, kind in frame.dtypes:
                name_as = name if seen.setdefault(name, kind) == kind else f"{name}__{kind}"
                renamed.append(F.col(f"`{name}`").alias(name_as))
                if name in keys and name_as not in written_as.setdefault(name, []):
                    written_as[name].append(name_as)
            if RANK not in frame.columns:
                renamed.append(F.lit(None).cast("int").alias(RANK))
            frames.append(frame.select(*renamed, F.lit(q.name).alias(QUERY)).repartition(1))
        union = reduce(lambda a, b: a.unionByName(b, allowMissingColumns=True), frames)
        order = [QUERY, "_ts"] if tuples else [QUERY, "window_start", RANK, *(
            F.col(f"`{n}`").asc_nulls_last() for c in keys for n in written_as.get(c, ()))]
        out = union.sortWithinPartitions(*order).drop(RANK)
        rows.sparkSession.sparkContext.setJobDescription(
            f"flowsieve answers {folder.stream}/{folder.folder} (Spark SQL)")
        (out.write.mode("overwrite").partitionBy(QUERY)
         .option("parquet.block.size", str(ANSWER_GROUP_BYTES))
         .options(**RAW_LOCAL_FILES)
         .option("parquet.block.row.count.limit", str(ANSWER_GROUP_ROWS))
         .parquet(str(stage_dir(root, job))))
    finally:
        if reuse:
            rows.unpersist()
    parts = promote(root, job, part_name(job))
    written, got = [], {}
    for name, (obs, slot) in observed.items():
        # the shared pass's one observation is read once (each read converts it: 50 ms)
        m = got[id(obs)] = got.get(id(obs)) or obs.get
        if slot is None:
            newest, rows_ = m.get("newest"), int(m.get("rows") or 0)
            windows = int(m.get("windows") or 0)
        else:
            starts = [r[1] for r in m.get("windows") or () if r[0] == slot]
            newest, rows_, windows = max(starts, default=None), file_rows(parts.get(name, [])), \
                len(starts)
        written.append({QUERY: name, "rows": rows_, "windows": windows,
                        "newest": int(newest.timestamp()) if newest is not None else 0})
    return written


_PASSES: dict[tuple, tuple] = {}  # compile.shared_pass's recent results (a daemon's triggers)
_PASSES_LOCK = threading.Lock()  # each folder's streaming query answers on a thread of its own
PASSES_KEPT = 16

_LABELS: dict[tuple, set[str]] = {}  # the node layouts each folder's batches held so far


def _labels(spark, folder: Folder, new: set[str] = frozenset()) -> set[str]:
    """The node layouts the folder's batches have held in this Spark application, ``new``
    added."""
    key = (spark.sparkContext.applicationId, folder.stream, folder.folder)
    with _PASSES_LOCK:
        known = _LABELS.setdefault(key, set())
        known |= new
        return set(known)


def _shared_pass(spark, folder: Folder, together: list[tuple[int, Query]], labels: list[str],
                 seen: dict[str, str], ranked: list[int]):
    """``compile.shared_pass`` of these queries and node layouts, built once per Spark
    application: a daemon's next trigger of the same folder applies the same expressions to
    its batch (building them for 50 queries takes about a second, and Spark generates and
    compiles the code of a new plan again). It is built for every node layout the folder's
    batches have held so far, not just this batch's (a layout a batch lacks is a branch its
    rows never take): a batch without some node's rows reuses it. ``seen`` is left as the pass
    left it. With the pass: what the job observes of it, and the slots' query names (a map
    column)."""
    from collector.spark import sqltext as S
    from collector.spark.compile import SLOT, shared_pass
    key = (spark.sparkContext.applicationId, folder.stream, folder.folder,
           tuple((s, q.name, q.text) for s, q in together), tuple(ranked),
           tuple(sorted(seen.items())))
    with _PASSES_LOCK:
        found = _PASSES.get(key)
    if found is not None and not set(labels) <= found[0]:
        labels = sorted(found[0] | set(labels))  # a layout new to this folder: built again
        found = None
    if found is None:
        after = dict(seen)
        built = shared_pass(together, labels, after, ranked)
        # what the job observes of the pass (the (slot, window) pairs: a set as small as the
        # windows; an HLL per slot on every row cost more than the answers' addresses; the
        # rows come from the parts' footers: a count per slot was 50 tests on every row)
        # and each slot's query name
        observed = [S.column(S.collect_set(S.struct(SLOT, "window_start")).alias("windows"))]
        name = S.column(S.create_map(*(c for s, q in together for c in (S.lit(s), S.lit(q.name)))))
        found = (frozenset(labels), None if built is None else (*built, observed, name),
                 after)
        with _PASSES_LOCK:
            _PASSES.pop(key, None)
            while len(_PASSES) >= PASSES_KEPT:
                _PASSES.pop(next(iter(_PASSES)))
            _PASSES[key] = found
    _, built, after = found
    seen.update(after)
    return built


def dictionary_frame(spark, folder: Folder) -> DataFrame | None:
    """The (code, text) pairs the probes published, read by Spark (None: no file yet)."""
    from pathlib import Path

    from capture.enrich.dictionary import SCHEMA as TEXTS
    d = Path(folder.dictionary) if folder.dictionary else None
    if d is None or not any(p.suffix == ".parquet" and not p.name.startswith(".")
                            for p in d.glob("*.parquet")):
        return None
    return spark.read.schema(ddl(TEXTS)).parquet(str(d))


def answer_locally(rows: pa.Table, folder: Folder) -> dict[str, pa.Table]:
    """The answer job's steps run in this process on partial rows (or a selection's tuples)
    held in memory, without writing: what Spark's executors compute on their shares, grouped
    here by Arrow. Each answer's rows in its own columns (tests compare them with Spark's; no
    daemon path uses this)."""
    out: dict[str, list[pa.Table]] = {}
    if folder.folder == "select":
        for q, t in selected(folder, iter(rows.to_batches())):
            out.setdefault(q.name, []).append(t)
    else:
        fanned = pa.Table.from_batches(list(fan_out(folder, iter(rows.select(
            folder.columns).to_batches()))), schema=folder.fan_schema)
        for k in fanned.group_by(["g", "window_start"]).aggregate([]).to_pylist():
            q, t = answer_of_group(folder, fanned.filter(
                (pc.field("g") == k["g"]) & (pc.field("window_start") == k["window_start"])))
            out.setdefault(q.name, []).append(t)
    return {name: pa.concat_tables(ts) for name, ts in out.items()}
