"""The engine's counters, one wrapper per stage: everything that moves gets a counter, done once
per stage here and not interleaved with the stages' work (the engine calls a stage inside its
meter, or hands the meter what a stage returned).

The stages keep cumulative statistics of their own (the ASC runtime's evaluations, the residual's
evaluations and reorders, the value cache's hits, an LFTA table's rows in and out, an OM
scheduler's rounds); a meter turns what changed while the stage ran into increments of the
Prometheus families in ``collector/metrics.py``, labelled by stream (and source, node, query).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np

from collector.metrics import Metrics
from collector.pipeline import user_predicates
from collector.pipeline.lfta import NodeTable, PartialTable


class EngineMeters:
    """The counters of one engine (a stream read from one source)."""

    def __init__(self, metrics: Metrics, stream: str, source: str):
        self.m, self.stream, self.source = metrics, stream, source
        self._order: list[str] = []  # the residual order the gauge shows
        # per query, its avoided and matched counters (a labels() look-up per query and batch
        # cost the 50-query replay 4 % of its engine time)
        self._queries: dict[str, tuple] = {}

    # -- input
    def packets_in(self, source: str, n: int, nbytes: int) -> None:
        self.m.packets_in.labels(source).inc(n)
        self.m.bytes_in.labels(source).inc(nbytes)

    def flows_in(self, source: str, n: int) -> None:
        self.m.flows_in.labels(source).inc(n)

    def dropped(self, n: int) -> None:
        """Tuples no query kept (the prefilter's and the residual's drops, or no plan)."""
        self.m.prefilter_dropped.labels(self.stream).inc(n)

    # -- enrichment
    @contextmanager
    def enrich(self):
        """Around the enrichment of a batch: its time (tuples are counted by ``enriched``)."""
        started = time.perf_counter()
        yield
        self.m.enrich_seconds.labels(self.stream).inc(time.perf_counter() - started)

    def enriched(self, n: int) -> None:
        self.m.enrich_tuples.labels(self.stream).inc(n)

    # -- prefilter and residual
    @contextmanager
    def asc(self, runtime):
        """Around the prefilter: the ASC evaluations and rearrangements it made."""
        evals, moves = runtime.evaluations, runtime.rearrangements
        yield
        if runtime.evaluations != evals:
            self.m.asc_evaluations.labels(self.stream).inc(runtime.evaluations - evals)
        if runtime.rearrangements != moves:
            self.m.asc_rearrangements.labels(self.stream).inc(runtime.rearrangements - moves)

    @contextmanager
    def residual(self, residual, cache):
        """Around the residual stage: evaluations, A-Greedy's reorders, the value cache's hits
        and misses, user predicates' errors, and the order it runs as a gauge."""
        adaptive = residual.adaptive
        before = (residual.evaluated, adaptive.reorders if adaptive else 0, cache.hits,
                  cache.misses, residual.filter_s(), residual.profile_s())
        yield
        m, st = self.m, self.stream
        m.residual_evals.labels(st).inc(residual.evaluated - before[0])
        if adaptive and adaptive.reorders != before[1]:
            m.residual_reorders.labels(st).inc(adaptive.reorders - before[1])
        if cache.hits != before[2]:
            m.residual_cache.labels(st, "hit").inc(cache.hits - before[2])
        if cache.misses != before[3]:
            m.residual_cache.labels(st, "miss").inc(cache.misses - before[3])
        filter_s, profile_s = residual.filter_s(), residual.profile_s()
        m.residual_seconds.labels(st, "filter").inc(max(0.0, filter_s - before[4]))
        m.residual_seconds.labels(st, "profile").inc(max(0.0, profile_s - before[5]))
        if adaptive:
            m.residual_profile.labels(st).set(residual.p / residual.every)
            m.residual_saved.labels(st, "order").set(residual.saved_s - profile_s)
        if cache.size:
            m.residual_saved.labels(st, "cache").set(cache.saved_s - cache.spent_s)
            for text, on in cache.state().items():
                m.residual_cache_on.labels(st, text).set(int(on))
        texts = [residual.plan.predicates[pid].predicate.text for pid in residual.order()]
        if texts != self._order:
            self._show_order(texts)
        for name, n in user_predicates.take_errors().items():
            m.residual_errors.labels(name).inc(n)

    def _show_order(self, texts: list[str]) -> None:
        """The residual predicates' positions as a gauge (those of an older order removed)."""
        g = self.m.residual_position
        for text in set(self._order) - set(texts):
            try:
                g.remove(self.stream, text)
            except KeyError:
                pass
        for pos, text in enumerate(texts):
            g.labels(self.stream, text).set(pos)
        self._order = texts

    def queries(self, names: dict[int, str], n: int, invoked: np.ndarray,
                matched: np.ndarray) -> None:
        """Per query: the tuples its bit signature spared it (``n - invoked``) and those it
        matched after the residual."""
        for slot, name in names.items():
            pair = self._queries.get(name)
            if pair is None:
                pair = self._queries[name] = (self.m.query_avoided.labels(name),
                                              self.m.query_matched.labels(name))
            if n > invoked[slot]:
                pair[0].inc(n - int(invoked[slot]))
            if matched[slot]:
                pair[1].inc(int(matched[slot]))

    # -- LFTA and OM
    def lfta(self, table: PartialTable) -> None:
        """A table's rows in and out, evictions and flushes by reason since last reported."""
        st, seen = table.stats, table.reported
        m = self.m
        m.lfta_rows_in.labels(self.stream).inc(st.rows_in - seen.rows_in)
        m.lfta_rows_out.labels(self.stream).inc(st.rows_out - seen.rows_out)
        if st.evicted > seen.evicted:
            m.lfta_evicted.labels(self.stream).inc(st.evicted - seen.evicted)
        for reason, n in st.flushes.items():
            if n > seen.flushes[reason]:
                m.lfta_flushes.labels(self.stream, reason).inc(n - seen.flushes[reason])
        table.reported = st.copy()

    def plan(self, version: int, tables: list[NodeTable]) -> None:
        """A plan taken: its version, and the plan each charted node starts on."""
        self.m.plan_version.set(version)
        self._queries.clear()  # a deleted query's counters were removed with it
        for t in tables:
            if t.scheduler is not None:
                self.m.om_plan.labels(self.stream, t.name, t.scheduler.chart.plans[
                    t.scheduler.plan].name).set(1)

    def om_round(self, table: NodeTable, latest: int, tuples: int, now_ns: int) -> None:
        """Around a charted node's end of batch: a round ended is counted (hits, moves,
        switches, fidelity) and a switch moves the plan gauge."""
        s = table.scheduler
        before = (s.rounds, s.hits, s.moves, s.switches, s.plan)
        switched = table.end_of_batch(latest, tuples, now_ns)
        if s.rounds == before[0]:
            return
        m, labels = self.m, (self.stream, table.name)
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

    # -- spool
    def spooled(self, folder: str, rows: int, written: bool, reason: str = "spool_full"
                ) -> None:
        """A batch for the spool: a file and its rows, or rows dropped (a full spool, a full
        disk)."""
        if written:
            self.m.spool_files.labels(self.stream, folder).inc()
            self.m.spool_rows.labels(self.stream, folder).inc(rows)
        else:
            self.m.spool_dropped.labels(self.stream, self.source, reason).inc(rows)
