"""The collector: registry, planner, engine, capture sources and the Spark job, wired together.

The constructor does no I/O; ``start()`` opens everything and ``stop()`` closes it. Registering
or deleting a query rebuilds the plan (new version), which the engine takes between batches
while Spark keeps running.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import closing
from pathlib import Path

import pyarrow as pa

from capture.errors import DecodeError
from collector.config import Settings
from collector.daemon.cluster import (
    PublishedRegistry,
    owner,
    publish_queries,
    publish_status,
    statuses,
)
from collector.daemon.process import freeze_startup_heap, no_huge_pages
from collector.daemon.registry import Registry, planned
from collector.daemon.results import clear_results, read_results
from collector.daemon.sources import Alignment, PcapFileSource, Source, ahead, make_source
from collector.metrics import Metrics
from collector.pipeline import prefix_tables, user_predicates
from collector.pipeline.durability import Checkpoint
from collector.pipeline.engine import Engine
from collector.pipeline.sampling import TupleSampler
from collector.pipeline.selectivity import SelectivityMeter
from collector.pipeline.spool import Spool
from planner.ir import Query
from planner.plan import Plan, build_plan
from planner.query import parse_queries, parse_single

log = logging.getLogger("flowsieve.collector")


class Collector:
    """The daemon's services, for the CLI and the API."""

    def __init__(self, settings: Settings, spark=None):
        self.settings = settings
        self.metrics = Metrics()
        self.meter = SelectivityMeter()
        self.sampler = TupleSampler()
        self._spark = spark
        self.spark = None
        self.job = None
        self.registry: Registry | None = None
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
        self._flow_seen: dict[str, dict] = {}
        self.started = False

    # -- life cycle
    def start(self, with_sources: bool = True, with_spark: bool = True) -> None:
        s = self.settings
        prefix_tables.configure(s.tables)
        user_predicates.configure(s.predicates)
        for d in (s.var_dir, s.spool_dir, s.results_dir, s.checkpoint_dir):
            Path(d).mkdir(parents=True, exist_ok=True)
        probe = s.role == "capture"
        self.registry = PublishedRegistry(s.spool_dir) if probe else Registry(s.registry_path)
        with_spark = with_spark and not probe
        self.spool = Spool(s.spool_dir, s.spool.max_bytes, "drop", format=s.spool.format,
                           probe=s.probe)
        if not probe and not self.registry.entries() and s.initial_queries:
            for q in parse_queries(Path(s.initial_queries).read_text()):
                self.registry.add(q.name, q.text)
        self.sources: list[Source] = [
            make_source(c, s.batch_size, self._stats_callback(c), s.var_dir) for c in s.sources]
        self.engines = [Engine(self.spool, c.stream, self.metrics, s.probe,
                               s.spark.watermark_delay_s, self.meter, s.asc, s.lfta,
                               self.sampler, source=c.name,
                               spool_policy=c.spool_policy(s.spool.policy), stop=self._stop,
                               waiting=self.metrics.spool_wait.labels(c.name).inc,
                               checkpoint=self._checkpoint(src), commit_s=s.spool.commit_s,
                               residual=s.residual, om=s.om)
                        for c, src in zip(s.sources, self.sources, strict=True)]
        self.alignment = self._alignment()
        self.rebuild()
        freeze_startup_heap()
        no_huge_pages()
        self._with_spark = with_spark
        if with_spark:
            self._start_spark()
        if with_sources:
            for src, eng in zip(self.sources, self.engines, strict=True):
                t = threading.Thread(target=self._run_source, args=(src, eng),
                                     name=f"source-{src.name}", daemon=True)
                t.start()
                self._threads.append(t)
            t = threading.Thread(target=self._flusher, name="lfta-flusher", daemon=True)
            t.start()
            self._threads.append(t)
        self.started = True

    def _flusher(self) -> None:
        """The daemon's clock. Every ``spark.trigger_s``: flush every engine's due LFTA
        partials by the latest event time of all sources (so an idle source, such as a followed
        file or a quiet exporter, never holds a window the others closed); then, when a live
        source runs, flush what the current time closes in every engine before any engine
        writes the heartbeat that closes it in Spark."""
        live = [(src, e) for e, src in zip(self.engines, self.sources, strict=True)
                if src.restamp]
        delay = self.settings.spark.watermark_delay_s
        while not self._stop.wait(self.settings.spark.trigger_s):
            times = [e.max_time for e in self.engines if e.max_time is not None]
            latest = max(times) if times else None
            try:
                for e in self.engines:
                    e.flush_due(latest, time.monotonic_ns())
                # a heartbeat speaks for the present less the watermark delay (a tuple read a
                # little after it was stamped, by a ring's buffering, a followed file's poll or
                # an exporter's batching, still finds its window open), but never for a time
                # a running live source has not read up to: one busy with a plan or a backlog
                # has tuples of the windows it would close still to read
                edges = [self._read_up_to(src, e) for src, e in live
                         if self.source_state.get(src.name) == "running"]
                beat = bool(edges) and None not in edges
                closed = min(int(time.time()), *edges) - delay if beat else 0
                # it closes windows only once every engine has flushed them
                flushed = [e.flush_before(closed) for e in self.engines] if beat else []
                if beat and all(flushed):
                    for _, e in live:
                        e.heartbeat(closed)
            except Exception as err:  # reported like a source's failure, never silent
                self.source_errors.append(f"lfta flush: {err!r}")
                log.exception("LFTA flush or heartbeat failed")
            usage: dict[str, list[int]] = {}
            for e in self.engines:
                entries, nbytes = e.lfta_usage()
                acc = usage.setdefault(e.stream, [0, 0])
                acc[0] += entries
                acc[1] += nbytes
            for stream, (entries, nbytes) in usage.items():
                self.metrics.lfta_entries.labels(stream).set(entries)
                self.metrics.lfta_bytes.labels(stream).set(nbytes)
            if self._with_spark and (self.job is None or self._jvm_gone()):
                try:
                    self._restart_spark()
                except Exception:  # noqa: BLE001 - tried again on the next tick
                    log.exception("restarting Spark failed")
            if self.job is not None:
                try:
                    self.job.supervise(self.settings.spark.restart_backoff_s)
                    self.metrics.spool_quarantined.set(self.spool.quarantined())
                except Exception:  # the JVM itself is gone: /healthz says so
                    log.exception("supervising the Spark job failed")
            try:
                if self.settings.role == "capture" and self.registry.refresh():
                    self.rebuild()  # the control plane published another plan version
                for e in self.engines:
                    e.take_plan()  # an idle engine switches too (and flushes the old plan)
                self._publish_status()
                self.release_slots()
            except Exception:  # noqa: BLE001 - the registry or spool folder: retried next tick
                log.exception("following the plan or releasing deleted queries' slots failed")

    def _publish_status(self) -> None:
        """This daemon's plan version, high-water marks and event time, for the control plane
        of a shared spool (collector/daemon/cluster.py)."""
        running = [e.running_version() for e in self.engines]
        times = [e.max_time for e in self.engines if e.max_time is not None]
        version = None if None in running or not running else min(running)
        if not running:  # no source: nothing of this daemon's can hold a slot
            version = self.plan.version if self.plan is not None else None
        s = self.settings
        publish_status(s.spool_dir, s.probe, owner(s.var_dir), version, self.spool.high_water(),
                       max(times, default=None))

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:  # a durable source commits where it is before it ends
            t.join(timeout=60)
        if self.job is not None:
            self.job.stop()
        if self.registry is not None:
            self.registry.close()
        self.started = False

    def _alignment(self) -> Alignment | None:
        """The event-time alignment of the packet files read with their own times (when
        there are two or more); a warning when live sources run beside them, whose windows
        close before such a file's older tuples come (Spark drops them as late, counted in
        ``flowsieve_spark_late_rows_total``)."""
        own = [src.name for src in self.sources
               if isinstance(src, PcapFileSource) and not src.restamp]
        live = [c.name for c, src in zip(self.settings.sources, self.sources, strict=True)
                if c.stream == "packets" and src.restamp]
        if own and live:
            log.warning("sources %s read files with their own times beside live sources %s: "
                        "the live windows close before the files' older tuples come, and "
                        "Spark drops those as late (set restamp: true to replay the files at "
                        "the current time)", ", ".join(own), ", ".join(live))
        if len(own) < 2:
            return None
        alignment = Alignment(self.settings.spark.watermark_delay_s)
        for name in own:
            alignment.join(name)
        return alignment

    def _run_source(self, src, engine: Engine) -> None:
        self.source_state[src.name] = "running"
        align = self.alignment if self.alignment is not None and \
            isinstance(src, PcapFileSource) and not src.restamp else None
        try:
            durable = engine.checkpoint is not None
            with closing(self._batches(src, engine, durable, align is None)) as batches:
                for raw, (tuples, position) in batches:
                    if self._stop.is_set():  # what was read ahead is read again next time
                        break
                    if raw is None:  # waiting, with everything read processed
                        self._waited_at[src.name] = time.time()
                        if align is not None:
                            align.idle(src.name)
                    elif len(raw) and align is not None:  # in step with the other files
                        left = len(raw)
                        for piece in align.pieces(src.name, raw, self._stop,
                                                  self.metrics.align_wait.labels(src.name).inc):
                            left -= len(piece)
                            engine.process(piece, src.name,
                                           src.position(left) if durable else None)
                    elif len(raw):
                        engine.process(raw, src.name, position, tuples)
                    if hasattr(src, "decoder"):
                        self._flow_counters(src)
            if durable and self._stop.is_set():
                engine.commit(force=True)  # stopped, not at its end: resume here next time
                return
            self._finish(engine)
            self.source_state[src.name] = "finished"
        except DecodeError as e:
            self.metrics.decode_errors.labels(src.name, e.kind or "input").inc()
            self.source_errors.append(str(e))
            self.source_state[src.name] = f"failed: {e}"
            log.error("source %s: %s", src.name, e)
            self._finish(engine)
        except Exception as e:  # a source thread must report, not vanish
            self.source_errors.append(f"{src.name}: {e!r}")
            self.source_state[src.name] = f"failed: {e!r}"
            log.exception("source %s failed", src.name)
        finally:
            if align is not None:
                align.leave(src.name)

    def _batches(self, src, engine: Engine, durable: bool, read_ahead: bool):
        """``(raw, (tuples, position))`` of a source: where it is once the batch is read (a
        durable source's), and, read ahead, its tuples unpacked on a thread of their own
        while the engine prefilters and aggregates the batch before (``sources.ahead``). A
        followed file reads in step with its engine (the time it caught up at must mean every
        record was processed), a flow listener decodes as it receives, and files in step with
        others hand over pieces of their batches: those read only when the engine asks."""
        def prepare(raw):
            return (engine.prepare(raw) if raw is not None and len(raw) else None,
                    src.position() if durable else None)
        if read_ahead and not getattr(src, "follow", False) and not hasattr(src, "decoder"):
            yield from ahead(src.batches(self._stop), prepare)
            return
        for raw in src.batches(self._stop):
            yield raw, (None, src.position() if durable and raw is not None else None)

    def _finish(self, engine: Engine) -> None:
        """A source ended: its engine flushes its partials; the last engine of a stream to end
        also closes every window (beyond the latest time of them all). An engine that closed
        them while another still read would make Spark drop the other's partials as late."""
        with self._finish_lock:
            self._finished.add(id(engine))
            same = [e for e in self.engines if e.stream == engine.stream]
            last = all(id(e) in self._finished for e in same)
            times = [e.max_time for e in same if e.max_time is not None]
        engine.finish(max(times) if times else None, close=last)

    def _start_spark(self) -> None:
        """The Spark session (unless one was given) and the streaming queries of the plan."""
        from collector.spark.merge import SparkJob
        from collector.spark.session import build_session, class_archive_path
        s = self.settings
        self.spark = self._spark or build_session(
            s.spark.master, s.spark.driver_memory, s.spark.shuffle_partitions,
            s.spark.state_store == "rocksdb", s.spark.extra,
            class_archive=class_archive_path(s.var_dir) if s.spark.class_archive else None)
        self.job = SparkJob(self.spark, s.spool_dir, s.results_dir, s.checkpoint_dir,
                            self.slot_queries, s.spark.watermark_delay_s,
                            self.metrics, s.spark.trigger_s, s.spool.format)
        self.job.ensure(self.folders())

    def _jvm_gone(self) -> bool:
        """The JVM this process launched for Spark has died (killed, out of memory)."""
        from pyspark import SparkContext
        proc = getattr(SparkContext._gateway, "proc", None)
        return self._spark is None and proc is not None and proc.poll() is not None

    def _restart_spark(self) -> None:
        """A new JVM, session and streaming queries after the JVM died: each query resumes
        from its checkpoint (the spool files it had not committed are read again; a window's
        answer written again replaces itself). The capture side kept spooling meanwhile."""
        from pyspark import SparkContext
        from pyspark.sql import SparkSession
        if self.job is not None:
            log.error("the Spark JVM died (exit %s): starting a new one",
                      SparkContext._gateway.proc.returncode)
            self.metrics.spark_jvm_restarts.inc()
            self.job = None
        SparkContext._gateway = SparkContext._jvm = None
        SparkContext._active_spark_context = None
        SparkSession._instantiatedSession = SparkSession._activeSession = None
        self._start_spark()

    def _read_up_to(self, src, e: Engine) -> int | None:
        """The time (epoch s) up to which live source ``src`` has handed every tuple to its
        engine, which processed it: the latest time it was found waiting with nothing more
        to read (a tick, a followed file at its end), or its latest tuple's (a source that
        always has more); None before either. A tuple stamped before it and read after is
        late by more than the time a heartbeat leaves (the watermark delay)."""
        waited = [t for t in (self._waited_at.get(src.name),
                              getattr(src, "caught_up_at", lambda: None)()) if t is not None]
        times = [int(t) for t in waited] + ([e.max_time] if e.max_time is not None else [])
        return max(times) if times else None

    def _checkpoint(self, src) -> Checkpoint | None:
        """A loop-free file source resumes after what its last commit put in the spool, a
        flow listener counts what it lost since (collector/pipeline/durability.py); None for the
        others."""
        if not getattr(src, "durable", False):
            return None
        s = self.settings
        cp = Checkpoint(s.var_dir / "state" / f"{src.name}.json", self.spool,
                        f"{s.probe}-{src.name}")
        position = cp.recover()
        why = src.resume(position)
        if why:
            log.warning("source %s: %s", src.name, why)
        elif position and "records" in position:
            log.info("source %s resumes after record %d", src.name, position["records"])
        elif position:
            log.info("source %s resumes the sequence numbers of %d export streams: a gap at "
                     "their next export counts what the restart lost", src.name,
                     len(position.get("sequences", ())))
        return cp

    def not_ready(self) -> list[str]:
        """Why the daemon cannot serve its queries now (empty: ready): Spark not started or a
        streaming query down, a source that failed or never started (a file source that
        reached its end is fine)."""
        out = []
        if not self.started:
            out.append("the collector has not started")
        if self.job is None:
            out.append("Spark is not running")
        else:
            out += [f"Spark query {e}" for e in self.job.check()]
        for src in self.sources if self._threads else []:
            state = self.source_state.get(src.name, "not started")
            if state not in ("running", "finished"):
                out.append(f"source {src.name}: {state}")
        return out

    def _stats_callback(self, cfg):
        return self._listener_stats(cfg.name) if cfg.type == "netflow" else \
            self._kernel_stats(cfg.name)

    def _listener_stats(self, name: str):
        """A callback turning a flow listener's cumulative statistics into counters."""
        seen = [0, 0]
        self.metrics.kernel_drops.labels(name)
        self.metrics.flow_datagrams.labels(name)

        errors: dict[str, int] = {}

        def update(st) -> None:
            if st.datagrams > seen[0]:
                self.metrics.flow_datagrams.labels(name).inc(st.datagrams - seen[0])
            if st.kernel_drops > seen[1]:
                self.metrics.kernel_drops.labels(name).inc(st.kernel_drops - seen[1])
            seen[0], seen[1] = max(seen[0], st.datagrams), max(seen[1], st.kernel_drops)
            for reason, n in list(st.errors.items()):
                if n > errors.get(reason, 0):
                    self.metrics.receive_errors.labels(name, reason).inc(n - errors.get(reason, 0))
                    errors[reason] = n
        return update

    def _flow_counters(self, src) -> None:
        """Decoder counters (errors by reason, sequence loss) as metric increments."""
        seen = self._flow_seen.setdefault(src.name, {})
        dec = src.decoder
        for reason, n in list(dec.errors.items()):
            if n > seen.get(reason, 0):
                self.metrics.decode_errors.labels(src.name, reason).inc(n - seen.get(reason, 0))
                seen[reason] = n
        for st in dec.streams():
            k = ("lost", st["exporter"])
            lost = seen.get(k, 0)
            if st["sequence"]["lost"] > lost:
                self.metrics.flow_sequence_lost.labels(src.name, st["exporter"]).inc(
                    st["sequence"]["lost"] - lost)
                seen[k] = st["sequence"]["lost"]
        self.metrics.flow_pending.labels(src.name).set(dec.pending_sets)

    def exporters(self) -> list[dict]:
        """Per exporter: its export streams (templates, sampling, sequence loss, last seen)."""
        by: dict[str, dict] = {}
        for src in self.sources:
            if not hasattr(src, "exporters"):
                continue
            for st in src.exporters():
                e = by.setdefault(st["exporter"], {"exporter": st["exporter"], "source": src.name,
                                                   "last_seen": None, "streams": []})
                if st["last_seen_ns"]:
                    t = st["last_seen_ns"] / 1e9
                    e["last_seen"] = max(e["last_seen"] or 0, t)
                e["streams"].append(st)
        return sorted(by.values(), key=lambda e: e["exporter"])

    def _kernel_stats(self, name: str):
        """A callback turning a live source's cumulative kernel statistics into counters."""
        seen = [0, 0]
        self.metrics.kernel_packets.labels(name)  # exported as 0 from the start
        self.metrics.kernel_drops.labels(name)

        def update(k) -> None:
            if k.packets > seen[0]:
                self.metrics.kernel_packets.labels(name).inc(k.packets - seen[0])
            if k.drops > seen[1]:
                self.metrics.kernel_drops.labels(name).inc(k.drops - seen[1])
            seen[0], seen[1] = max(seen[0], k.packets), max(seen[1], k.drops)
        return update

    # -- queries
    def folders(self) -> list[tuple[str, str]]:
        plan = self.plan
        if plan is None:
            return []
        return [(s, f) for s in plan.streams() for f in plan.folders(s)]

    def _changed(self) -> int:
        """Count a registry change (made before this call); the count a plan must include."""
        with self._changes_lock:
            self._changes += 1
            return self._changes

    def rebuild(self, options: dict | None = None, change: int | None = None) -> Plan:
        """Compile the registered queries into a new plan version and hand it to the engines.
        ``options`` (``bit_budget``, ``use_selectivities``) replace the configuration's for this
        and every later rebuild until the next options or a restart. ``change``: the registry
        change (``_changed``) the caller needs in the plan; when a rebuild that began after it
        already built one, that plan is the caller's (concurrent registrations share a plan
        version, like a database's group commit: 100 at once cost one plan build, not 100)."""
        with self._rebuild_lock:
            if change is not None and options is None and self._built >= change \
                    and self.plan is not None:
                return self.plan
            with self.metrics.rebuild_seconds.time():
                return self._rebuild(options)

    def _rebuild(self, options: dict | None) -> Plan:
        with self._changes_lock:
            self._built = self._changes  # every change counted by now is in the registry
        if options is not None:
            self.plan_overrides = dict(options)
        overrides = dict(self.plan_overrides)
        measured = overrides.pop("use_selectivities", True)
        every = self.registry.entries()
        paused = self.registry.disabled()
        entries = [(q, s) for q, s in every if q.name not in paused]  # paused: no cost
        part_slots = self.registry.part_slots()
        slots = {q.name: s for q, s in planned(entries, part_slots)}  # WITH parts too
        plan = build_plan([q for q, _ in entries], slots,
                          self.registry.next_version(),
                          selectivity=self.meter.selectivities() if measured else None,
                          samples=self.sampler.samples(),
                          **{**self.settings.plan_options(), **overrides})
        # a paused query's partials in flight still answer. One assignment: Spark's batch
        # thread resolves slots meanwhile, and a map emptied and refilled in place showed
        # it a registered query as gone for a moment (its partials of a whole Spark batch
        # skipped, its windows missing: tests/test_hot_swap.py, one CI run in four)
        self._slot_queries = {s: q for q, s in planned(every, part_slots)}
        self.plan = plan
        if self.settings.role == "all":  # for capture probes sharing the spool
            publish_queries(self.settings.spool_dir, plan.version, every, paused,
                            part_slots)
        for e in self.engines:
            e.set_plan(plan)
        for src in getattr(self, "sources", []):
            if hasattr(src, "set_filter"):
                src.set_filter(plan.bpf)
        self.metrics.queries.set(len(entries))
        if self.job is not None:
            self.job.ensure(self.folders())
        return plan

    def query_of_slot(self, slot: int) -> Query | None:
        """The registered query (or WITH part) that holds ``slot``, paused ones too."""
        return self._slot_queries.get(slot)

    def slot_queries(self) -> dict[int, Query]:
        """Every registered query and WITH part by its slot, paused ones too (what Spark's
        next answer job answers)."""
        return dict(self._slot_queries)

    def plan_versions(self) -> list[dict]:
        """Tuples each recent plan version processed, by source, newest version first: every
        batch is processed under one version whole, so these add up to the tuples read."""
        out: dict[int, dict[str, int]] = {}
        for src, e in zip(self.settings.sources, self.engines, strict=True):
            for v, n in list(e.version_tuples.items()):
                out.setdefault(v, {})[src.name] = n
        return [{"version": v, "tuples": out[v]} for v in sorted(out, reverse=True)]

    def set_enabled(self, name: str, enabled: bool) -> bool:
        """Pause or resume a query without losing its slot or its answers so far."""
        if not self.registry.set_enabled(name, enabled):
            return False
        self.rebuild(change=self._changed())
        return True

    def enabled(self, name: str) -> bool:
        return name not in self.registry.disabled()

    def register(self, name: str | None, text: str) -> Query:
        parsed = parse_single(text, name)
        prefix_tables.check(parsed)  # the tables and user predicates it names are configured
        user_predicates.check(parsed)
        q = self.registry.add(name, text)
        clear_results(self.settings.results_dir, q.name)
        self.rebuild(change=self._changed())
        return q

    def delete(self, name: str) -> bool:
        found = self.query(name)
        if found is None:
            return False
        slots = self.registry.slots_of(name)  # a joined query holds one per WITH part
        if not self.registry.remove(name):
            return False
        plan = self.rebuild(change=self._changed())
        for slot in slots:
            self.registry.freed_by(slot, plan.version)
        self.metrics.forget_query(name)
        return True

    def release_slots(self) -> list[int]:
        """Release the slots of deleted queries that nothing can refer to any more (the
        daemon's clock calls this). A slot's partials were written under plans before the
        first plan without it: once every engine runs that plan (switching flushed the old
        plan's partials), the spool's files up to then are marked; the slot is free when Spark
        has read them all and has closed every window they could add to. Capture probes
        sharing the spool count as engines: each says in its status which plan it runs and
        how far its files go (collector/daemon/cluster.py)."""
        released = []
        freed = self.registry.freed()
        if not freed:
            return released  # nothing to release: no probe status read
        running = [v for v in (e.running_version() for e in self.engines) if v is not None]
        s = self.settings
        probes = [st for st in statuses(s.spool_dir, s.spool.probe_timeout_s)
                  if st["probe"] != s.probe]
        for slot, version in freed:
            if version is None or any(v < version for v in running) or any(
                    st["version"] is None or st["version"] < version for st in probes):
                continue
            mark = self._slot_marks.get(slot)
            if mark is None:  # every engine has switched: what can refer to it is written
                times = [e.max_time for e in self.engines if e.max_time is not None]
                times += [st["max_time"] for st in probes if st["max_time"] is not None]
                marks = {s.probe: self.spool.high_water()}
                marks.update({st["probe"]: st["high_water"] for st in probes})
                self._slot_marks[slot] = (marks, max(times, default=0))
                continue
            marks, event_time = mark
            if any(self.spool.holds_up_to(hw, probe) for probe, hw in marks.items()):
                continue  # Spark has not read every file that may hold its partials
            if self.job is not None and any(
                    self.job.complete_before.get(key, float("-inf")) <= event_time
                    for key in list(self.job.queries) if key[1] != "select"):
                continue  # a window their partials may add to is still open in Spark
            self.registry.release(slot)
            del self._slot_marks[slot]
            released.append(slot)
        return released

    def queries(self) -> list[tuple[Query, int]]:
        return self.registry.entries()

    def query(self, name: str) -> tuple[Query, int] | None:
        for q, slot in self.registry.entries():
            if q.name == name:
                return q, slot
        return None

    def complete_before(self, q: Query) -> float | None:
        """Every window of ``q`` starting before this time (epoch s) is answered for good (the
        watermark of the latest Spark batch done); None before one is done."""
        if self.job is None or q.period is None:
            return None
        return self.job.complete_before.get((q.stream, q.folder))

    def results(self, name: str, last_windows: int | None = None) -> pa.Table | None:
        found = self.query(name)
        if found is None:
            return None
        return read_results(self.settings.results_dir, found[0], last_windows)
