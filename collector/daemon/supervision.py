"""The daemon's supervision: a thread per source feeding its engine, the clock that flushes the
LFTAs, closes windows with heartbeats and follows the plan, and the Spark job started, watched
and started again when its JVM dies.

``Supervision`` is one side of ``Collector`` (service.py): it runs the sources and engines the
collector made, and reports in ``source_state``, ``source_errors`` and the metrics.
"""

from __future__ import annotations

import logging
import time
from contextlib import closing

from capture.errors import DecodeError
from collector.daemon.cluster import (
    owner,
    publish_status,
)
from collector.daemon.sources import Alignment, PcapFileSource, ahead
from collector.pipeline.durability import Checkpoint
from collector.pipeline.engine import Engine

log = logging.getLogger("flowsieve.collector")


class Supervision:
    """Sources, engines and Spark kept running."""

    def _flusher(self) -> None:
        """The daemon's clock. Every ``spark.trigger_s``: flush every engine's due LFTA
        partials by the latest event time of all sources (so an idle source, such as a followed
        file or a quiet exporter, never holds a window the others closed); then, when a live
        source runs, flush what the current time closes in every engine before any engine
        writes the heartbeat that closes it in Spark."""
        live = [(src, e) for e, src in zip(self.engines, self.sources, strict=True)
                if self._live(src)]
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
            if self.settings.role != "capture" and time.monotonic() >= self._retention_due:
                self._retention_due = time.monotonic() + self.settings.results.check_s
                try:
                    self.enforce_retention()
                except Exception:  # noqa: BLE001 - the results folder: retried next time
                    log.exception("enforcing the results' retention failed")
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

    def _alignment(self) -> Alignment | None:
        """The event-time alignment of the packet files read with their own times (when
        there are two or more); a warning when live sources run beside them, whose windows
        close before such a file's older tuples come (Spark drops them as late, counted in
        ``flowsieve_spark_late_rows_total``)."""
        own = [src.name for src in self.sources
               if isinstance(src, PcapFileSource) and not src.restamp]
        live = [e.source for e, src in zip(self.engines, self.sources, strict=True)
                if e.stream == "packets" and src.restamp]
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
        delivered = [time.time()]  # when it last delivered a tuple (its start before)
        self.metrics.source_idle.labels(src.name).set_function(
            lambda: time.time() - delivered[0])
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
                    elif len(raw):
                        delivered[0] = time.time()
                        if align is not None:  # in step with the other files
                            left = len(raw)
                            for piece in align.pieces(src.name, raw, self._stop,
                                                      self.metrics.align_wait.labels(
                                                          src.name).inc):
                                left -= len(piece)
                                engine.process(piece, src.name,
                                               src.position(left) if durable else None)
                        else:
                            engine.process(raw, src.name, position, tuples)
                    if hasattr(src, "decoder"):
                        self.flow_counters.update(src)
            if self._stop.is_set():  # stopped, not at its end: no window closes
                if durable:
                    engine.commit(force=True)  # resume here next time
                else:
                    engine.finish(close=False)  # the partials to the spool, for Spark
                self.source_state[src.name] = "stopped"
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
        from collector.config import cache_dir
        from collector.spark.jvm_metrics import JvmCollector
        from collector.spark.merge import SparkJob
        from collector.spark.session import build_session, class_archive_path
        s = self.settings
        if not self._jvm_metrics:
            self.metrics.registry.register(JvmCollector())
            self._jvm_metrics = True
        self.spark = self._spark or build_session(
            s.spark.master, s.spark.driver_memory, s.spark.shuffle_partitions,
            s.spark.state_store == "rocksdb", s.spark.extra,
            class_archive=class_archive_path(s.spark.class_archive_dir or cache_dir())
            if s.spark.class_archive else None)
        self.job = SparkJob(self.spark, s.spool_dir, s.results_dir, s.checkpoint_dir,
                            self.slot_queries, s.spark.watermark_delay_s,
                            self.metrics, s.spark.trigger_s, s.spool.format,
                            s.spark.answer_engine, s.spark.answer_task_rows, self._layouts)
        self.job.ensure(self.folders())

    def _layouts(self, stream: str, folder: str) -> list[str]:
        """The node layouts the plan's probes write to a folder (Spark's engine warms up
        its answers for them)."""
        from collector.pipeline.compiled_plan import node_layouts
        plan = self.plan
        return [] if plan is None else node_layouts(plan, stream, folder)

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
            from collector.spark.session import death_reason
            code = SparkContext._gateway.proc.returncode
            self.jvm_died = f"the Spark JVM died: {death_reason(code)}"
            log.error("%s; starting a new one", self.jvm_died)
            self.metrics.spark_jvm_restarts.inc()
            self.job = None
        SparkContext._gateway = SparkContext._jvm = None
        SparkContext._active_spark_context = None
        SparkSession._instantiatedSession = SparkSession._activeSession = None
        self._start_spark()

    def _live(self, src) -> bool:
        """Whether ``src`` speaks for the present (its quiet times close windows): a re-stamped
        or live source, and a followed file whatever ``restamp`` says (it is written as the
        traffic comes: ``tcpdump -w``), unless a file read once with its own times runs beside
        it (the present would close that file's older windows before its tuples come)."""
        if src.restamp:
            return True
        return bool(getattr(src, "follow", False)) and not any(
            isinstance(o, PcapFileSource) and not o.restamp and not o.follow
            for o in self.sources)

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
            died = getattr(self, "jvm_died", None)
            out.append(f"Spark is not running ({died}; a new JVM is starting)" if died else
                       "Spark is not running")
        else:
            out += self.job.check()
        for src in self.sources if self._threads else []:
            state = self.source_state.get(src.name, "not started")
            if state not in ("running", "finished"):
                out.append(f"source {src.name}: {state}")
        spool = getattr(self, "spool", None)
        full = spool.full_since if spool is not None else None
        if full is not None:
            out.append(f"spool: its file system is full (for {time.time() - full:.0f} s); "
                       "sources wait or drop by their spool policy")
        return out

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

