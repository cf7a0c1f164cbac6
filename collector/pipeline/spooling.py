"""The engine's output side: LFTA partials flushed as windows close, age or fill, selection
rows, the spool writes they make (waiting or dropping by the source's policy), punctuation and
heartbeats that close windows in Spark, and a durable source's commits.

``Spooling`` is one side of ``Engine`` (engine.py): it writes what the running plan's tables
flush, under the engine's data lock, and counts through its meters.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from capture.batch import TupleBatch
from capture.fields import fields
from collector.pipeline.compiled_plan import CompiledPlan, FolderPlan
from collector.pipeline.lfta import NodeTable, Partials, PartialTable
from collector.pipeline.spool import (
    DiskFull,
    null_columns,
    punctuation,
    qmask_array,
    select_schema,
)
from planner.slots import slot_mask


class Spooling:
    """Flushes, spool writes, punctuation and commits of an engine."""

    def commit(self, force: bool = False) -> None:
        """A durable engine's commit, when due (``commit_s``) or ``force``d (shutdown)."""
        with self._data:
            if self.checkpoint is not None:
                self._commit(force)

    def _commit(self, force: bool = False) -> None:
        if not (self._dirty or self._held) or self.position is None:
            return
        if not force and time.monotonic() - self._committed_at < self.commit_s:
            return
        snapshot = []
        c = self._c
        for fp in c.folders if c is not None else []:
            parts = [t.to_spool(x.snapshot(), c.plan.version, self.probe)
                     for t in fp.tables for x in t.tables() if len(x)]
            batch = self._concat(parts)
            if batch is not None:
                held = self.spool.write(self.stream, fp.folder, batch, "force", self._stop,
                                        self._waiting, hold=self.checkpoint.tag, kind="snap")
                snapshot.append(held)
        self.checkpoint.commit(self.position, self._held, snapshot, self._stop)
        self._held, self._dirty = [], False
        self._committed_at = time.monotonic()

    def flush_due(self, event_time: int | None, now_ns: int) -> None:
        """Flush what is due by the daemon's time: windows ``event_time`` (the latest of every
        source) has passed, and rows older than the maximum age. The collector calls it
        periodically, so an idle source's partials still reach Spark in time."""
        if self._would_wait():  # its source's thread may hold the tables, waiting for room
            return
        with self._data:
            c = self._c
            if c is not None and not self._would_wait():
                self._close_windows(c, now_ns, event_time)
                if self.checkpoint is not None:
                    self._commit()

    def _would_wait(self) -> bool:
        """A write now would wait for room (policy block, the spool or its disk full): the
        daemon's shared clock thread leaves this engine alone then; the source's own thread
        waits."""
        return self.spool_policy == "block" and (self.spool.full_since is not None or
                                                 not self.spool.has_room())

    def _close_windows(self, c: CompiledPlan, now_ns: int, event_time: int | None = None) -> None:
        """Flush the windows the event time has passed (end + watermark delay), and rows that
        waited longer than the maximum age."""
        times = [t for t in (self.max_time, event_time) if t is not None]
        if not times:
            return
        edge = max(times) - self.watermark_delay_s

        def due(t: NodeTable, x: PartialTable) -> Partials:
            old = x.flush_if_old(now_ns)
            return old if old is not None else x.flush_windows((edge // t.period) * t.period)
        self._flush(c, due)

    def _flush(self, c: CompiledPlan, take) -> None:
        """Write what ``take(node, table)`` flushes from every LFTA table of the plan."""
        for fp in c.folders:
            parts = []
            for t in fp.tables:
                for x in t.tables():
                    p = take(t, x)
                    if len(p):
                        parts.append(t.to_spool(p, c.plan.version, self.probe))
                    self.meters.lfta(x)
                t.prune()
            self._write(fp, self._concat(self._closing(c, fp, parts)))

    def _closing(self, c: CompiledPlan, fp: FolderPlan, parts: list[pa.Table]) -> list[pa.Table]:
        """``parts`` with every table's rows of the windows they close in Spark. A file's
        latest window start less the period and the watermark delay is Spark's watermark
        once it has read the file (SparkJob), and a row of an earlier window that comes after
        it is dropped as late: so when a table flushes early (full, aged) rows of a window
        while the folder's other tables hold windows that far back (a batch spanning more than
        a period), those go in the same file."""
        starts = [pc.max(p.column("window_start")).value for p in parts if p.num_rows]
        if not starts or fp.period is None:
            return parts
        edge = max(starts) // 1_000_000 - fp.period - self.watermark_delay_s
        for t in fp.tables:
            for x in t.tables():
                p = x.flush_windows(edge)
                if len(p):
                    parts.append(t.to_spool(p, c.plan.version, self.probe))
                    self.meters.lfta(x)
        return parts

    @staticmethod
    def _concat(parts: list[pa.Table | None]) -> pa.Table | None:
        parts = [p for p in parts if p is not None and p.num_rows]
        return pa.concat_tables(parts) if parts else None

    def _write(self, fp: FolderPlan, batch: pa.Table | None) -> None:
        if batch is None or not batch.num_rows:
            return
        try:
            written = self._spool(fp.folder, batch)
        except DiskFull:
            if self.spool_policy != "drop":
                raise  # stopped while it waited for room: a durable source reads it again
            self.meters.spooled(fp.folder, batch.num_rows, False, "disk_full")
            return
        self.meters.spooled(fp.folder, batch.num_rows, written is not None)

    def _spool(self, folder: str, batch: pa.Table):
        if self.checkpoint is None:
            return self.spool.write(self.stream, folder, batch, self.spool_policy, self._stop,
                                    self._waiting)
        held = self.spool.write(self.stream, folder, batch,
                                "force" if self.spool_policy == "block" else "drop", self._stop,
                                self._waiting, hold=self.checkpoint.tag)
        if held is not None:
            self._held.append(held)
        return held

    def _select_rows(self, c, fp: FolderPlan, tb: TupleBatch, Q: np.ndarray) -> pa.Table | None:
        schema = select_schema(self.stream)
        q = Q & slot_mask(fp.slots, Q.shape[1])
        rows = np.flatnonzero(q.any(axis=1))
        if not len(rows):
            return None
        sub = tb.take(rows)
        present = {f: sub.arrow(f) for f in fields(self.stream)}
        present["qmask"] = qmask_array(q[rows])
        present["plan_version"] = pa.array(np.full(len(rows), c.plan.version, np.int32))
        return pa.Table.from_arrays(null_columns(schema, len(rows), present), schema=schema)

    def _punctuate(self, ws_of_period, flush_all: bool = False) -> None:
        c = self._current()
        if c is None:
            return
        # the partials of every window the punctuation closes reach the spool before it
        self._flush(c, (lambda t, x: x.flush_all()) if flush_all else
                    (lambda t, x: x.flush_windows(ws_of_period(t.period))))
        for fp in c.folders:
            if fp.period is None:
                continue
            # Spark's watermark lags a folder's latest window start by its period and the
            # delay (SparkJob): closing the windows before ws takes a start a period later
            ws = ws_of_period(fp.period) + fp.period
            self._spool(fp.folder, punctuation(self.stream, ws, c.plan.version, self.probe))

    def finish(self, last: int | None = None, close: bool = True) -> None:
        """End of input: every partial to the spool and, with ``close``, punctuation beyond
        the last window (of ``last`` too: the latest time of the stream's other engines), so
        every window closes. Without: the windows stay open for the engines still reading
        (collector/daemon/service.py: the last engine of a stream to finish closes them)."""
        with self._data:
            times = [t for t in (last, self.max_time) if t is not None]
            if close and times:
                end = max(times)
                self._punctuate(lambda p: (end // p) * p + p + self.watermark_delay_s + 1,
                                flush_all=True)
            elif (c := self._current()) is not None:
                self._flush(c, lambda t, x: x.flush_all())
            if self.checkpoint is not None:
                self._dirty = True
                self._commit(force=True)

    def flush_before(self, now_s: int) -> bool:
        """Flush the windows that end by ``now_s``'s window (what a heartbeat closes): the
        collector does this for every engine before any engine writes its heartbeat. False
        when it did not (a write would wait for room): then no heartbeat may close them."""
        if self._would_wait():  # its source's thread may hold the tables, waiting for room
            return False
        with self._data:
            c = self._current()
            if c is None:
                return True
            if self._would_wait():
                return False
            self._flush(c, lambda t, x: x.flush_windows((now_s // t.period) * t.period))
            return True

    def heartbeat(self, now_s: int) -> None:
        """Live sources: advance the watermark to the current window so quiet windows close."""
        with self._data:
            self._punctuate(lambda p: (now_s // p) * p)
