"""The collector: registry, planner, engine, capture sources and the Spark job, wired together.

The constructor does no I/O; ``start()`` opens everything and ``stop()`` closes it. Registering
or deleting a query rebuilds the plan (new version), which the engine takes between batches
while Spark keeps running.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from capture import enrich
from collector.config import Settings, SourceConfig
from collector.daemon.alerts.service import AlertService
from collector.daemon.alerts.store import AlertStore
from collector.daemon.cluster import (
    PublishedRegistry,
)
from collector.daemon.process import freeze_startup_heap, no_huge_pages
from collector.daemon.queries import QueryService
from collector.daemon.registry import Registry
from collector.daemon.snmp import SnmpPoller
from collector.daemon.source_metrics import FlowCounters, stats_callback
from collector.daemon.sources import Source, make_source
from collector.daemon.supervision import Supervision
from collector.metrics import Metrics
from collector.pipeline import enrichment, prefix_tables, user_predicates
from collector.pipeline.engine import Engine
from collector.pipeline.sampling import TupleSampler
from collector.pipeline.selectivity import SelectivityMeter
from collector.pipeline.spool import Spool
from planner.ir import Query
from planner.plan import Plan
from planner.query import parse_queries

log = logging.getLogger("flowsieve.collector")

class Collector(QueryService, Supervision):
    """The daemon's services, for the CLI and the API: made without I/O, opened by ``start``,
    closed by ``stop``; its queries' side in queries.py, its sources' and Spark's in
    supervision.py."""

    def __init__(self, settings: Settings, spark=None):
        self.settings = settings
        self.metrics = Metrics()
        self.meter = SelectivityMeter()
        self.sampler = TupleSampler()
        self._spark = spark
        self.spark = None
        self.job = None
        self.registry: Registry | None = None
        self.alerts: AlertService | None = None
        self.engines: list[Engine] = []
        self.plan: Plan | None = None
        self._slot_queries: dict[int, Query] = {}
        # a deleted query's slot -> (spool high-water marks, event time) once every engine
        # runs a plan without it (release_slots)
        self._slot_marks: dict[int, tuple[dict, int]] = {}
        self._rebuild_lock = threading.Lock()
        # registry changes counted, and the count the current plan was built from: a change
        # made while a rebuild runs waits for the next, which serves every change made by then
        self._changes = self._built = 0
        self._changes_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.source_errors: list[str] = []
        self.source_state: dict[str, str] = {}  # name -> running, finished or failed: why
        self._waited_at: dict[str, float] = {}  # name -> when it last waited, all read
        self._finish_lock = threading.Lock()
        self._finished: set[int] = set()  # engines whose source ended (ids)
        self.plan_overrides: dict = {}  # POST /prefilter/rebuild's options
        self.sources: list = []
        self.flow_counters = FlowCounters(self.metrics)
        self._retention_due = 0.0  # when retention runs next (time.monotonic)
        self._jvm_metrics = False  # the JVM's collector registered (once: it reads any JVM)
        self._enrich_reloader: enrich.Reloader | None = None
        self.snmp: SnmpPoller | None = None
        self.started = False
        self.stop_requested: float | None = None  # when a stop was asked (time.monotonic)
        self.stopped_cleanly = False  # stop() ended within its deadline, nothing killed

    def _initial_queries(self, path: Path) -> None:
        """Register the initial queries into a new registry. Resumed after a crash part way
        (those registered are kept, the rest added); a registry that held queries before the
        mark was kept is left as it is."""
        state = self.registry.meta("initial_queries")
        if state == "done" or (state is None and self.registry.entries()):
            return
        self.registry.set_meta("initial_queries", "loading")
        have = {q.name for q, _ in self.registry.entries()}
        for q in parse_queries(path.read_text()):
            rule = self._rule(q, None)  # its -- alert: directive
            if q.name not in have:
                self.registry.add(q.name, q.text)
            if rule is not None:
                self.alerts.set_rule(q, rule)
        self.registry.set_meta("initial_queries", "done")

    def start(self, with_sources: bool = True, with_spark: bool = True) -> None:
        s = self.settings
        prefix_tables.configure(s.tables)
        user_predicates.configure(s.predicates)
        self._enrich(s)
        for d in (s.var_dir, s.spool_dir, s.results_dir, s.checkpoint_dir):
            Path(d).mkdir(parents=True, exist_ok=True)
        probe = s.role == "capture"
        self.registry = PublishedRegistry(s.spool_dir) if probe else Registry(s.registry_path)
        with_spark = with_spark and not probe
        self.spool = Spool(s.spool_dir, s.spool.max_bytes, "drop", format=s.spool.format,
                           probe=s.probe)
        self.spool.sweep()
        self.metrics.spool_bytes.set_function(self.spool.size)  # walked when scraped
        self.metrics.spool_disk_full.set_function(lambda: self.spool.full_since is not None)
        self.metrics.spool_max_bytes.set(s.spool.max_bytes)
        if not probe:
            self.alerts = AlertService(s, AlertStore(s.registry_path), self.metrics,
                                       lambda n: (self.query(n) or (None,))[0],
                                       self.complete_before)
        if not probe and s.initial_queries:
            self._initial_queries(Path(s.initial_queries))
        # a source per configured one, and an sFlow listener's counters feed after it: each
        # runs its own engine (the feed's stream is counters)
        fed: list[tuple[SourceConfig, Source]] = []
        for c in s.sources:
            try:
                src = make_source(c, s.batch_size, stats_callback(self.metrics, c), s.var_dir)
            except OSError as e:  # a misnamed interface, a port in use: which source says it
                raise OSError(f"source {c.name}: {e}") from e
            fed.append((c, src))
            if hasattr(src, "counters"):
                fed.append((c, src.counters))
        self.sources: list[Source] = [src for _, src in fed]
        self.engines = [Engine(self.spool, getattr(src, "stream", c.stream), self.metrics,
                               s.probe, s.spark.watermark_delay_s, self.meter, s.asc, s.lfta,
                               self.sampler, source=src.name,
                               spool_policy=c.spool_policy(s.spool.policy), stop=self._stop,
                               waiting=self.metrics.spool_wait.labels(src.name).inc,
                               checkpoint=self._checkpoint(src), commit_s=s.spool.commit_s,
                               residual=s.residual, om=s.om)
                        for c, src in fed]
        self.alignment = self._alignment()
        self.rebuild()
        freeze_startup_heap()
        no_huge_pages()
        self._with_spark = with_spark
        if with_spark:
            self._start_spark()
            self.alerts.start()  # reads what Spark answers
        if with_sources:
            for src, eng in zip(self.sources, self.engines, strict=True):
                t = threading.Thread(target=self._run_source, args=(src, eng),
                                     name=f"source-{src.name}", daemon=True)
                t.start()
                self._threads.append(t)
            t = threading.Thread(target=self._flusher, name="lfta-flusher", daemon=True)
            t.start()
            self._threads.append(t)
            if s.enrich.databases():
                self._enrich_reloader = enrich.Reloader(s.enrich.reload_s, self._enrich_gauges,
                                                        self._enrich_failed)
                self._enrich_reloader.start()
            if s.enrich.snmp is not None:
                self.snmp = SnmpPoller(s.enrich.snmp, self._devices_seen, self.metrics)
                self.snmp.start()
        self.started = True

    def _enrich(self, s: Settings) -> None:
        """The enrichment databases, loaded before any query is checked; their figures as
        gauges."""
        enrichment.configure(s.enrich, s.spool_dir)
        self._enrich_gauges(list(enrich.current().databases), reloaded=False)

    def _enrich_gauges(self, names: list[str], reloaded: bool = True) -> None:
        for name in names:
            db = enrich.current().databases.get(name)
            if db is not None:
                self.metrics.enrich_networks.labels(name).set(db.networks)
                self.metrics.enrich_bytes.labels(name).set(db.nbytes)
                if reloaded:
                    self.metrics.enrich_reloads.labels(name).inc()

    def _enrich_failed(self, name: str, error: Exception) -> None:
        self.metrics.enrich_errors.labels(name).inc()

    def _devices_seen(self) -> list[str]:
        """The exporters and sFlow agents the listeners have heard from."""
        return sorted({e["exporter"] for e in self.exporters()})

    def stop(self) -> None:
        """A clean stop within ``shutdown_timeout_s``: the sources stop (a durable one commits
        where it is), every engine's partials go to the spool and no window closes; Spark
        merges what the spool holds, its streaming queries stop between batches, and its JVM
        ends (killed at the deadline: never left behind). The deadline counts from
        ``stop_requested`` (the signal) when it is set."""
        s = self.settings
        if self.stop_requested is None:
            self.stop_requested = time.monotonic()
        start = self.stop_requested
        # the process exits after this (the API's server, the interpreter's teardown)
        deadline = start + s.shutdown_timeout_s - min(1.0, s.shutdown_timeout_s / 10)
        clean = True
        jvm_share = min(10.0, s.shutdown_timeout_s / 3)  # what the JVM's exit may take
        self._stop.set()
        if self._enrich_reloader is not None:
            self._enrich_reloader.stop()
        if self.snmp is not None:
            self.snmp.stop()
        for t in self._threads:  # each flushes its engine's partials when it ends
            t.join(timeout=max(0.0, deadline - jvm_share - time.monotonic()))
        left = [t.name for t in self._threads if t.is_alive()]
        if left:
            clean = False
            log.warning("stopping: %s did not end in time; their unflushed partials are lost",
                        ", ".join(left))
        if self.job is not None:
            if not self.job.drain(deadline - jvm_share):
                log.warning("stopping: Spark did not merge all of the spool in time; the "
                            "rest is merged when the daemon starts again")
            self.job.stop(deadline - jvm_share,
                          abandon_s=max(1.0, min(5.0, (deadline - time.monotonic()) / 2)))
            self.job = None
        if self._spark is None and self.spark is not None:
            from collector.spark.session import stop_jvm
            how = stop_jvm(self.spark, max(1.0, deadline - time.monotonic()))
            if how == "killed":
                clean = False
                log.warning("stopping: the Spark JVM did not exit in time and was killed")
            self.spark = None
        if self.alerts is not None:
            self.alerts.stop()
            self.alerts.store.close()
            self.alerts = None
        if self.registry is not None:
            self.registry.close()
        if self.started:
            log.info("stopped in %.1f s", time.monotonic() - start)
        self.started = False
        self.stopped_cleanly = clean
