"""The engine: unpack → prefilter → residual → LFTA → spool, one batch at a time.

Each aggregate node of a (stream, period) folder has an LFTA hash table
(collector/pipeline/lfta.py): tuples merge into partial aggregates, which reach the spool when their
window closes (the engine's event time passes its end plus the watermark delay), when a table fills,
when rows grow old, and at the end of input. A rebuilt plan is swapped in between batches
(``set_plan``), after the old plan's tables are flushed, so no tuple is processed half under one
plan and half under another, and Spark keeps running.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from capture.batch import Batch, TupleBatch
from capture.fields import fields
from capture.netflow import FlowBatch
from capture.pcap import RawBatch
from capture.unpack import unpack
from collector.config import AscConfig, LftaConfig, OmConfig, ResidualConfig
from collector.metrics import Metrics
from collector.pipeline import user_predicates
from collector.pipeline.asc_runtime import AscRuntime
from collector.pipeline.compiled_prefilter import CompiledPrefilter, compile_prefilter
from collector.pipeline.durability import Checkpoint
from collector.pipeline.lfta import BatchColumns, NodeTable, Partials, PartialTable
from collector.pipeline.prefilter import run_prefilter
from collector.pipeline.residual import Residual, ValueCache
from collector.pipeline.sampling import TupleSampler
from collector.pipeline.selectivity import SelectivityMeter
from collector.pipeline.spool import (
    Held,
    Spool,
    null_columns,
    punctuation,
    qmask_array,
    select_schema,
)
from planner.plan import Plan
from planner.slots import slot_counts, slot_mask

MAX_VERSIONS_KEPT = 100_000  # the per-version tuple counts kept (GET /prefilter/versions)


@dataclass
class FolderPlan:
    """What one spool folder receives: its queries' slots, grouped into aggregate-tree nodes."""

    stream: str
    folder: str
    period: int | None
    slots: list[int]
    tables: list[NodeTable] = field(default_factory=list)  # one per maintained node


@dataclass
class _Compiled:
    plan: Plan
    prefilter: CompiledPrefilter
    asc: AscRuntime
    residual: Residual
    fields: tuple[str, ...]  # what the plan's unpack groups extract
    folders: list[FolderPlan]
    names: dict[int, str]
    keys: tuple[str, ...]  # every field an aggregate query of the stream groups by
    agg_slots: tuple[int, ...]  # the stream's aggregate queries' slots
    # per slot, its query's avoided and matched counters (a labels() look-up per query and
    # batch cost the 50-query replay 4 % of its engine time)
    counters: dict[int, tuple] = field(default_factory=dict)



class Prepared(NamedTuple):
    """A raw batch's tuples unpacked ahead, with the fields they hold."""

    fields: tuple[str, ...]
    tuples: TupleBatch


def maintained_nodes(plan: Plan, stream: str, folder: str
                     ) -> list[tuple[tuple[str, ...], list[int]]]:
    """(keys, slots) of the LFTA tables of a folder: its aggregate tree's maintained nodes, or
    one node per set of group-by fields when the plan has no tree for it."""
    tree = plan.tree(stream, folder)
    if tree is not None:
        return tree.maintained()
    nodes: dict[tuple[str, ...], list[int]] = {}
    for qp in plan.queries:
        if qp.query.stream == stream and qp.query.folder == folder:
            nodes.setdefault(tuple(sorted(qp.query.node_keys)), []).append(qp.slot)
    return sorted(nodes.items())


class Engine:
    """Runs the current plan over batches of one stream and writes the spool."""

    def __init__(self, spool: Spool, stream: str = "packets", metrics: Metrics | None = None,
                 probe: str = "flowsieve", watermark_delay_s: int = 1,
                 meter: SelectivityMeter | None = None, asc: AscConfig | None = None,
                 lfta: LftaConfig | None = None, sampler: TupleSampler | None = None,
                 source: str = "", spool_policy: str | None = None,
                 stop: threading.Event | None = None,
                 waiting: Callable[[float], None] | None = None,
                 checkpoint: Checkpoint | None = None, commit_s: float = 1.0,
                 residual: ResidualConfig | None = None, om: OmConfig | None = None,
                 clock: Callable[[], int] = time.monotonic_ns, finite: bool = False):
        self.spool = spool
        self.asc_config = asc or AscConfig()
        self.residual_config = residual or ResidualConfig()
        # kept across plan versions: a name's outcome does not depend on the plan
        self.value_cache = ValueCache(self.residual_config.value_cache)
        self.lfta_config = lfta or LftaConfig()
        self.om_config = om or OmConfig()
        self._clock = clock  # OM's arrival rates (tests drive it)
        # a finite input (replay) runs no OM: it has no arrival rate to chart (it arrives as
        # fast as it is read, and that rate changes with whatever else the machine does), so
        # every node keeps lfta.capacity, flushed as windows close (bench/README.md)
        self.finite = finite
        self.meter = meter
        self.sampler = sampler
        self.stream = stream
        self.metrics = metrics or Metrics()
        self.probe = probe
        self.watermark_delay_s = watermark_delay_s
        # a full spool: this source waits (block: files) or drops and counts (drop: live);
        # None: the spool's own policy
        self.source, self.spool_policy = source, spool_policy or spool.policy
        self._stop, self._waiting = stop, waiting
        # a durable source (collector/pipeline/durability.py): spool files stay held until a commit
        # publishes them with the read position that follows the tuples they hold
        self.checkpoint, self.commit_s = checkpoint, commit_s
        self.position: dict | None = None  # after the last batch processed
        self._held: list[Held] = []
        self._committed_at = time.monotonic()
        self._order_texts: list[str] = []  # the residual order the gauge shows
        self._dirty = False  # tuples processed since the last commit
        self._lock = threading.Lock()
        # the batch path and the collector's flusher thread both touch the LFTA tables
        self._data = threading.RLock()
        self._pending: Plan | None = None
        self._unpacking: tuple = (None, ())  # (plan, its fields) of the last prepare
        self._c: _Compiled | None = None
        self.max_time: int | None = None
        self.tuples_in = 0
        # tuples processed under each plan version (0: before the first plan), newest last;
        # a batch is processed under one version whole
        self.version_tuples: dict[int, int] = {}

    # -- plan
    def set_plan(self, plan: Plan) -> None:
        """Use ``plan`` from the next batch on."""
        with self._lock:
            self._pending = plan

    def take_plan(self) -> None:
        """Switch to a pending plan now (between batches), flushing the old plan's partials."""
        with self._data:
            self._current()

    def running_version(self) -> int | None:
        """The version of the plan the engine runs (None: it has run none)."""
        c = self._c
        return c.plan.version if c is not None else None

    def _count(self, c: _Compiled | None, n: int) -> None:
        v = c.plan.version if c is not None else 0
        self.version_tuples[v] = self.version_tuples.get(v, 0) + n
        if len(self.version_tuples) > MAX_VERSIONS_KEPT:
            del self.version_tuples[next(iter(self.version_tuples))]

    def _current(self) -> _Compiled | None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            if self._c is not None:
                self._flush(self._c, lambda t, x: x.flush_all())  # the old plan's partials
            self._c = self._compile(pending)
            self.metrics.plan_version.set(pending.version)
        return self._c

    def _compile(self, plan: Plan) -> _Compiled:
        cp = compile_prefilter(plan, self.stream)
        folders = []
        for folder in plan.folders(self.stream):
            qps = [qp for qp in plan.queries
                   if qp.query.stream == self.stream and qp.query.folder == folder]
            period = qps[0].query.period
            fp = FolderPlan(self.stream, folder, period, [qp.slot for qp in qps])
            if period is not None:
                tree, om = plan.tree(self.stream, folder), self.om_config
                charted = bool(tree) and om.enabled and not self.finite
                fp.tables = [NodeTable(self.stream, period, keys, slots, cp.q_words,
                                       self.lfta_config,
                                       tree.chart(keys, slots) if charted else None,
                                       om.history, om.decay,
                                       {m for qp in qps if qp.slot in slots
                                        for m in qp.query.measures})
                             for keys, slots in maintained_nodes(plan, self.stream, folder)]
            folders.append(fp)
            for t in fp.tables:
                if t.scheduler is not None:
                    self.metrics.om_plan.labels(self.stream, t.name, t.scheduler.chart.plans[
                        t.scheduler.plan].name).set(1)
        a = self.asc_config
        runtime = AscRuntime(cp, a.strategy, a.period_tuples, a.mu, a.sample)
        r = self.residual_config
        residual = Residual(plan, self.stream, r.ordering, r.profile_probability,
                            r.profile_window, r.alpha, r.sweep_stage, self.value_cache,
                            budget=r.profile_budget)
        return _Compiled(plan, cp, runtime, residual,
                         plan.unpacking(self.stream).extract, folders,
                         {qp.slot: qp.query.name for qp in plan.queries
                          if qp.query.stream == self.stream},
                         tuple(sorted({k for qp in plan.queries if qp.query.stream == self.stream
                                       and not qp.query.is_selection for k in qp.query.node_keys})),
                         tuple(qp.slot for qp in plan.queries if qp.query.stream == self.stream
                               and not qp.query.is_selection))

    def lfta_usage(self) -> tuple[int, int]:
        """(groups held, bytes) of the running plan's LFTA tables."""
        with self._data:
            c = self._c
            nodes = [t for fp in (c.folders if c else []) for t in fp.tables]
            tables = [x for t in nodes for x in t.tables()]
            return sum(len(t) for t in tables), \
                sum(t.nbytes for t in tables) + sum(t.dense.nbytes for t in nodes if t.dense)

    def residual_state(self) -> dict | None:
        """The running order of the residual predicates (for GET /prefilter)."""
        c = self._c
        if c is None or not c.residual:
            return None
        return {"stream": self.stream, "source": self.source, **c.residual.describe()}

    def om_state(self) -> list[dict]:
        """Each charted node's plan, estimates, fidelity, moves and switches (GET /prefilter)."""
        c = self._c
        if c is None:
            return []
        return [{"stream": self.stream, "source": self.source, "node": t.name,
                 **t.scheduler.state()}
                for fp in c.folders for t in fp.tables if t.scheduler is not None]

    def asc_state(self) -> dict | None:
        """The running ASC sequence (for GET /prefilter)."""
        c = self._c
        return c.asc.describe() if c is not None and c.prefilter.ascs else None

    @property
    def plan(self) -> Plan | None:
        c = self._c
        return self._pending or (c.plan if c else None)

    # -- data
    def prepare(self, raw: RawBatch | FlowBatch) -> Prepared | None:
        """The tuples of a raw batch for the plan running now, unpacked by a reading thread
        ahead of ``process`` (the unpack kernels release the GIL): None when there is nothing
        to unpack. ``process`` unpacks again if another plan runs by then."""
        if isinstance(raw, FlowBatch):
            return None
        with self._lock:
            plan = self._pending  # set, not yet taken: the next batch takes it
        if plan is None:
            c = self._c
            if c is None or not c.folders:
                return None
            plan = c.plan
        if self._unpacking[0] is not plan:
            self._unpacking = (plan, plan.unpacking(self.stream).extract)
        want = self._unpacking[1]
        return Prepared(want, unpack(raw, want))

    def process(self, raw: RawBatch | FlowBatch, source: str = "",
                position: dict | None = None, prepared: Prepared | None = None) -> int:
        """Unpack, prefilter and spool one batch; return the tuples kept. Flow records arrive
        decoded (a FlowBatch from the NetFlow/IPFIX decoder). ``position``: where the source
        is once this batch is read (a durable source commits it); ``prepared``: its tuples,
        unpacked ahead (``prepare``)."""
        if self.checkpoint is not None and self.spool_policy == "block" and \
                not self.spool.has_room():
            # a durable source waits between batches, after a commit: its held files become
            # room (Spark reads them) only once published, so it never waits inside a batch
            self.commit(force=True)
            self.spool.wait_for_room(self._stop, self._waiting)
        with self._data:
            kept = self._process(raw, source, prepared)
            if self.checkpoint is not None:
                self.position, self._dirty = position, True
                self._commit()
            return kept

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
                held = self.spool.write(self.stream, fp.folder, batch, "force",
                                        hold=self.checkpoint.tag, kind="snap")
                snapshot.append(held)
        self.checkpoint.commit(self.position, self._held, snapshot)
        self._held, self._dirty = [], False
        self._committed_at = time.monotonic()

    def _process(self, raw: RawBatch | FlowBatch, source: str = "",
                 prepared: Prepared | None = None) -> int:
        if isinstance(raw, FlowBatch):
            return self.process_flows(raw, source)
        c = self._current()
        self.metrics.packets_in.labels(source).inc(len(raw))
        self.metrics.bytes_in.labels(source).inc(int(raw.caplen.sum()))
        self.tuples_in += len(raw)
        self._count(c, len(raw))
        if len(raw):
            t = int(raw.ts_ns.max() // 1_000_000_000)
            self.max_time = t if self.max_time is None else max(self.max_time, t)
        if c is None or not c.folders:
            self.metrics.prefilter_dropped.labels(self.stream).inc(len(raw))
            return 0
        ready = prepared is not None and prepared.fields == c.fields
        tb = prepared.tuples if ready else unpack(raw, c.fields)
        return self.process_tuples(c, tb)

    def process_flows(self, fb: FlowBatch, source: str = "") -> int:
        """Prefilter and spool one batch of flow records; return the records kept."""
        c = self._current()
        self.metrics.flows_in.labels(source).inc(len(fb))
        self.tuples_in += len(fb)
        self._count(c, len(fb))
        if len(fb):
            t = int(fb.time.max())
            self.max_time = t if self.max_time is None else max(self.max_time, t)
        if c is None or not c.folders:
            self.metrics.prefilter_dropped.labels(self.stream).inc(len(fb))
            return 0
        return self.process_tuples(c, fb)

    def observe(self, raw: RawBatch | FlowBatch) -> None:
        """Measure a batch without spooling it: predicate selectivities and the tuple sample
        of the plan's nodes (``replay`` and ``flowsieve plan --capture`` plan on them)."""
        with self._data:
            c = self._current()
            if c is None:
                return
            tb = raw if isinstance(raw, FlowBatch) else unpack(raw, c.fields)
            if self.meter is not None:
                self.meter.observe(c.plan, tb)
            _, Q = run_prefilter(c.prefilter, tb, c.asc)
            if c.residual:
                c.residual.apply(tb, Q)
            if self.sampler is not None and c.agg_slots:
                self.sampler.observe(self.stream, tb, Q, c.keys, c.agg_slots,
                                     among=np.flatnonzero(Q.any(axis=1)))

    def process_tuples(self, c: _Compiled, tb: Batch) -> int:
        if self.meter is not None:
            self.meter.observe(c.plan, tb)
        evals, moves = c.asc.evaluations, c.asc.rearrangements
        _, Q = run_prefilter(c.prefilter, tb, c.asc)
        # what the prefilter let through, before the residual
        invoked, kept = slot_counts(Q)
        if c.asc.evaluations != evals:
            self.metrics.asc_evaluations.labels(self.stream).inc(c.asc.evaluations - evals)
        if c.asc.rearrangements != moves:
            self.metrics.asc_rearrangements.labels(self.stream).inc(c.asc.rearrangements - moves)
        if c.residual:
            r, cache = c.residual, self.value_cache
            before = (r.evaluated, r.adaptive.reorders if r.adaptive else 0, cache.hits,
                      cache.misses)
            r.apply(tb, Q)
            m, st = self.metrics, self.stream
            m.residual_evals.labels(st).inc(r.evaluated - before[0])
            if r.adaptive and r.adaptive.reorders != before[1]:
                m.residual_reorders.labels(st).inc(r.adaptive.reorders - before[1])
            if cache.hits != before[2]:
                m.residual_cache.labels(st, "hit").inc(cache.hits - before[2])
            if cache.misses != before[3]:
                m.residual_cache.labels(st, "miss").inc(cache.misses - before[3])
            texts = [r.plan.predicates[pid].predicate.text for pid in r.order()]
            if texts != self._order_texts:
                self._show_order(texts)
            for name, n in user_predicates.take_errors().items():
                m.residual_errors.labels(name).inc(n)
        matched, kept = slot_counts(Q) if c.residual else (invoked, kept)
        self.metrics.prefilter_dropped.labels(self.stream).inc(len(tb) - kept)
        for slot, name in c.names.items():
            avoided, hit = c.counters.get(slot) or c.counters.setdefault(slot, (
                self.metrics.query_avoided.labels(name), self.metrics.query_matched.labels(name)))
            if len(tb) > invoked[slot]:
                avoided.inc(len(tb) - int(invoked[slot]))
            if matched[slot]:
                hit.inc(int(matched[slot]))
        if not kept:
            self._rounds(c, tb)
            return 0
        # the LFTA tables pick their rows out of the whole batch (a row no query kept has an
        # empty mask); selection rows take the kept rows, the sample is drawn among them
        sub = rows = None
        sampling = self.sampler is not None and c.agg_slots
        selecting = any(fp.period is None for fp in c.folders)
        if sampling or selecting:
            rows = np.flatnonzero(Q.any(axis=1))
        if selecting:
            sub = (tb, Q) if kept == len(tb) else (tb.take(rows), Q[rows])
        if sampling:
            self.sampler.observe(self.stream, tb, Q, c.keys, c.agg_slots, among=rows)
        now = time.monotonic_ns()
        cols = BatchColumns(tb)  # each column the tables read, made once for all of them
        reads = [t.reads for fp in c.folders if fp.period is not None for t in fp.tables
                 if t.table is not None]
        cols.need([f for r in reads for f in r[0]], [f for r in reads for f in r[1]])
        for fp in c.folders:
            if fp.period is None:
                self._write(fp, self._select_rows(c, fp, *sub))
                continue
            parts = []
            for t in fp.tables:
                parts += t.add(tb, Q, now, c.plan.version, self.probe, cols)
            self._write(fp, self._concat(self._closing(c, fp, parts)))
        self._rounds(c, tb)
        self._close_windows(c, now)
        return kept

    def _rounds(self, c: _Compiled, tb) -> None:
        """OM: each charted node accounts the batch to its round; a node whose chart picked
        another plan for the next round takes it (the old table retires, leaving as its
        windows close)."""
        if not len(tb):
            return
        latest, now = int(tb.time.max()), self._clock()
        m = self.metrics
        for fp in c.folders:
            for t in fp.tables:
                s = t.scheduler
                if s is None:
                    continue
                before = (s.rounds, s.hits, s.moves, s.switches, s.plan)
                switched = t.end_of_batch(latest, len(tb), now)
                if s.rounds == before[0]:
                    continue
                labels = (self.stream, t.name)
                m.om_rounds.labels(*labels).inc()
                m.om_hits.labels(*labels).inc(s.hits - before[1])
                m.om_moves.labels(*labels).inc(s.moves - before[2])
                m.om_switches.labels(*labels).inc(s.switches - before[3])
                m.om_fidelity.labels(*labels).set(s.fidelity)
                if switched:
                    try:
                        m.om_plan.remove(*labels, s.chart.plans[before[4]].name)
                    except KeyError:
                        pass
                    m.om_plan.labels(*labels, s.chart.plans[s.plan].name).set(1)

    # -- LFTA flushes
    def _show_order(self, texts: list[str]) -> None:
        """The residual predicates' positions as a gauge (those of an older order removed)."""
        g = self.metrics.residual_position
        for text in set(self._order_texts) - set(texts):
            try:
                g.remove(self.stream, text)
            except KeyError:
                pass
        for pos, text in enumerate(texts):
            g.labels(self.stream, text).set(pos)
        self._order_texts = texts

    def flush_due(self, event_time: int | None, now_ns: int) -> None:
        """Flush what is due by the daemon's time: windows ``event_time`` (the latest of every
        source) has passed, and rows older than the maximum age. The collector calls it
        periodically, so an idle source's partials still reach Spark in time."""
        with self._data:
            c = self._c
            if c is not None and not self._would_wait():
                self._close_windows(c, now_ns, event_time)
                if self.checkpoint is not None:
                    self._commit()

    def _would_wait(self) -> bool:
        """A write now would wait for room (policy block, spool full): the daemon's shared
        clock thread leaves this engine alone then; the source's own thread waits."""
        return self.spool_policy == "block" and not self.spool.has_room()

    def _close_windows(self, c: _Compiled, now_ns: int, event_time: int | None = None) -> None:
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

    def _flush(self, c: _Compiled, take) -> None:
        """Write what ``take(node, table)`` flushes from every LFTA table of the plan."""
        for fp in c.folders:
            parts = []
            for t in fp.tables:
                for x in t.tables():
                    p = take(t, x)
                    if len(p):
                        parts.append(t.to_spool(p, c.plan.version, self.probe))
                    self._lfta_metrics(x)
                t.prune()
            self._write(fp, self._concat(self._closing(c, fp, parts)))

    def _closing(self, c: _Compiled, fp: FolderPlan, parts: list[pa.Table]) -> list[pa.Table]:
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
                    self._lfta_metrics(x)
        return parts

    def _lfta_metrics(self, table: PartialTable) -> None:
        st, seen = table.stats, table.reported
        m = self.metrics
        m.lfta_rows_in.labels(self.stream).inc(st.rows_in - seen.rows_in)
        m.lfta_rows_out.labels(self.stream).inc(st.rows_out - seen.rows_out)
        if st.evicted > seen.evicted:
            m.lfta_evicted.labels(self.stream).inc(st.evicted - seen.evicted)
        for reason, n in st.flushes.items():
            if n > seen.flushes[reason]:
                m.lfta_flushes.labels(self.stream, reason).inc(n - seen.flushes[reason])
        table.reported = st.copy()

    @staticmethod
    def _concat(parts: list[pa.Table | None]) -> pa.Table | None:
        parts = [p for p in parts if p is not None and p.num_rows]
        return pa.concat_tables(parts) if parts else None

    def _write(self, fp: FolderPlan, batch: pa.Table | None) -> None:
        if batch is None or not batch.num_rows:
            return
        written = self._spool(fp.folder, batch)
        if written is None:
            self.metrics.spool_dropped.labels(self.stream, self.source, "spool_full").inc(
                batch.num_rows)
        else:
            self.metrics.spool_files.labels(self.stream, fp.folder).inc()
            self.metrics.spool_rows.labels(self.stream, fp.folder).inc(batch.num_rows)

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

    # -- time
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
