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

import numpy as np

from capture import enrich
from capture.batch import Batch
from capture.enrich import EnrichedBatch
from capture.fields import enriched
from capture.netflow import FlowBatch
from capture.pcap import RawBatch
from capture.sflow import CounterBatch, SflowBatch
from capture.unpack import unpack
from collector.config import AscConfig, LftaConfig, OmConfig, ResidualConfig
from collector.metrics import Metrics
from collector.pipeline.compiled_plan import CompiledPlan, Prepared, compile_plan
from collector.pipeline.durability import Checkpoint
from collector.pipeline.lfta import BatchColumns
from collector.pipeline.meters import EngineMeters
from collector.pipeline.prefilter import run_prefilter
from collector.pipeline.residual import ValueCache
from collector.pipeline.sampling import TupleSampler
from collector.pipeline.selectivity import SelectivityMeter
from collector.pipeline.spool import Held, Spool
from collector.pipeline.spooling import Spooling
from planner.plan import Plan
from planner.slots import slot_counts

# batches that arrive decoded (flow records, sFlow counter samples); the others are unpacked
# with the fields the plan reads (captured packets; sFlow flow samples' headers)
DECODED = (FlowBatch, CounterBatch)


def unpacked(raw: RawBatch | SflowBatch, want) -> Batch:
    return raw.samples(want) if isinstance(raw, SflowBatch) else unpack(raw, want)


MAX_VERSIONS_KEPT = 100_000  # the per-version tuple counts kept (GET /prefilter/versions)


class Engine(Spooling):
    """Runs the current plan over batches of one stream and writes the spool (spooling.py: the
    output side; meters.py: its counters; compiled_plan.py: what a plan becomes for it)."""

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
        self.value_cache = ValueCache(self.residual_config.value_cache,
                                      self.residual_config.adapt)
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
        self.meters = EngineMeters(self.metrics, stream, source)
        self._stop, self._waiting = stop, waiting
        # a durable source (collector/pipeline/durability.py): spool files stay held until a commit
        # publishes them with the read position that follows the tuples they hold
        self.checkpoint, self.commit_s = checkpoint, commit_s
        self.position: dict | None = None  # after the last batch processed
        self._held: list[Held] = []
        self._committed_at = time.monotonic()
        self._dirty = False  # tuples processed since the last commit
        self._lock = threading.Lock()
        # the batch path and the collector's flusher thread both touch the LFTA tables
        self._data = threading.RLock()
        self._pending: Plan | None = None
        # (plan, its fields, its enrichment fields) of the last prepare
        self._unpacking: tuple = (None, (), ())
        self._c: CompiledPlan | None = None
        self.max_time: int | None = None
        self.tuples_in = 0
        # tuples processed under each plan version (0: before the first plan), newest last;
        # a batch is processed under one version whole
        self.version_tuples: dict[int, int] = {}

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

    def _count(self, c: CompiledPlan | None, n: int) -> None:
        v = c.plan.version if c is not None else 0
        self.version_tuples[v] = self.version_tuples.get(v, 0) + n
        if len(self.version_tuples) > MAX_VERSIONS_KEPT:
            del self.version_tuples[next(iter(self.version_tuples))]

    def _current(self) -> CompiledPlan | None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            if self._c is not None:
                self._flush(self._c, lambda t, x: x.flush_all())  # the old plan's partials
            self._c = compile_plan(pending, self.stream, self.asc_config, self.residual_config,
                                   self.lfta_config, self.om_config, self.value_cache,
                                   self.finite, self._c)
            self.meters.plan(pending.version, self._c.node_tables())
        return self._c

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

    def prepare(self, raw: RawBatch | FlowBatch) -> Prepared | None:
        """The tuples of a raw batch for the plan running now, unpacked by a reading thread
        ahead of ``process`` (the unpack kernels release the GIL): None when there is nothing
        to unpack. ``process`` unpacks again if another plan runs by then."""
        if isinstance(raw, DECODED):
            return None
        with self._lock:
            plan = self._pending  # set, not yet taken: the next batch takes it
        if plan is None:
            c = self._c
            if c is None or not c.folders:
                return None
            plan = c.plan
        if self._unpacking[0] is not plan:
            want = plan.unpacking(self.stream).extract
            self._unpacking = (plan, want, tuple(f for f in want if f in enriched(self.stream)))
        _, want, extra = self._unpacking
        tuples = unpacked(raw, want)
        if extra:  # enriched on this thread too: its core's caches keep the tables warm
            tuples = self._enrich(tuples, extra)
        return Prepared(want, tuples)

    def _enrich(self, tb: Batch, names: tuple[str, ...]) -> Batch:
        """``tb`` with enrichment fields ``names``, by the databases of now (one version for
        the whole batch); a batch enriched already (read ahead) as it is."""
        if isinstance(tb, EnrichedBatch) and all(n in tb.cols for n in names):
            return tb
        with self.meters.enrich():
            out = enrich.current().apply(tb, names)
        self.meters.enriched(len(tb))
        return out

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

    def _process(self, raw: RawBatch | FlowBatch, source: str = "",
                 prepared: Prepared | None = None) -> int:
        if isinstance(raw, DECODED):
            return self.process_flows(raw, source)
        c = self._current()
        self.meters.packets_in(source, len(raw), int(raw.caplen.sum()))
        self.tuples_in += len(raw)
        self._count(c, len(raw))
        if len(raw):
            t = int(raw.ts_ns.max() // 1_000_000_000)
            self.max_time = t if self.max_time is None else max(self.max_time, t)
        if c is None or not c.folders:
            self.meters.dropped(len(raw))
            return 0
        ready = prepared is not None and prepared.fields == c.fields
        tb = prepared.tuples if ready else unpacked(raw, c.fields)
        return self.process_tuples(c, tb)

    def process_flows(self, fb: FlowBatch, source: str = "") -> int:
        """Prefilter and spool one batch of flow records; return the records kept."""
        c = self._current()
        self.meters.flows_in(source, len(fb))
        self.tuples_in += len(fb)
        self._count(c, len(fb))
        if len(fb):
            t = int(fb.time.max())
            self.max_time = t if self.max_time is None else max(self.max_time, t)
        if c is None or not c.folders:
            self.meters.dropped(len(fb))
            return 0
        return self.process_tuples(c, fb)

    def observe(self, raw: RawBatch | FlowBatch) -> None:
        """Measure a batch without spooling it: predicate selectivities and the tuple sample
        of the plan's nodes (``replay`` and ``flowsieve plan --capture`` plan on them)."""
        with self._data:
            c = self._current()
            if c is None:
                return
            tb = raw if isinstance(raw, DECODED) else unpacked(raw, c.fields)
            if c.enriched:
                tb = self._enrich(tb, c.enriched)
            if self.meter is not None:
                self.meter.observe(c.plan, tb)
            _, Q = run_prefilter(c.prefilter, tb, c.asc)
            if c.residual:
                c.residual.apply(tb, Q)
            if self.sampler is not None and c.agg_slots:
                self.sampler.observe(self.stream, tb, Q, c.keys, c.agg_slots,
                                     among=np.flatnonzero(Q.any(axis=1)))

    def process_tuples(self, c: CompiledPlan, tb: Batch) -> int:
        if c.enriched:
            tb = self._enrich(tb, c.enriched)
        if self.meter is not None:
            self.meter.observe(c.plan, tb)
        with self.meters.asc(c.asc):
            _, Q = run_prefilter(c.prefilter, tb, c.asc)
        invoked, kept = slot_counts(Q)  # what the prefilter let through, before the residual
        if c.residual:
            with self.meters.residual(c.residual, self.value_cache):
                c.residual.apply(tb, Q)
        matched, kept = slot_counts(Q) if c.residual else (invoked, kept)
        self.meters.dropped(len(tb) - kept)
        self.meters.queries(c.names, len(tb), invoked, matched)
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

    def _rounds(self, c: CompiledPlan, tb) -> None:
        """OM: each charted node accounts the batch to its round; a node whose chart picked
        another plan for the next round takes it (the old table retires, leaving as its
        windows close)."""
        if not len(tb):
            return
        latest, now = int(tb.time.max()), self._clock()
        for t in c.node_tables():
            if t.scheduler is not None:
                self.meters.om_round(t, latest, len(tb), now)

