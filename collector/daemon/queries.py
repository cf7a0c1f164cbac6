"""The daemon's queries: registration, pause and deletion, the plan rebuilds they cause
(shared by concurrent changes, as a database's group commit), the slots of deleted queries given
back once nothing can refer to them, and the answers' whereabouts.

``QueryService`` is one side of ``Collector`` (service.py): it reads the registry, the engines,
the Spark job and the settings the collector holds, and the rebuild counters and slot marks it
keeps itself.
"""

from __future__ import annotations

import logging

import pyarrow as pa

from collector.daemon.alerts.rules import AlertRule, parse_directive
from collector.daemon.cluster import (
    publish_queries,
    statuses,
)
from collector.daemon.registry import UNLIMITED, planned
from collector.daemon.results import clear_results, read_results
from collector.daemon.retention import Limits, enforce, expire_quarantined
from collector.pipeline import enrichment, prefix_tables, user_predicates
from planner.ir import Query, QueryError
from planner.plan import Plan, build_plan
from planner.query import parse_single

log = logging.getLogger("flowsieve.collector")


class QueryService:
    """Queries registered, paused, deleted; the plan built from them."""

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
        for src, e in zip(self.sources, self.engines, strict=True):
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

    def retention_limits(self) -> dict[str, Limits]:
        """Every registered query's retention: its own limits over the configured ones."""
        if self.settings.role == "capture":  # a probe holds no answers
            return {}
        own = self.registry.retention()
        r = self.settings.results
        out = {}
        for q, _ in self.queries():
            age, size = own.get(q.name, (None, None))
            out[q.name] = Limits(
                r.max_age if age is None else (None if age == UNLIMITED else age),
                r.max_bytes if size is None else (None if size == UNLIMITED else int(size)))
        return out

    def set_retention(self, name: str, **limits: float | None) -> bool:
        """Set a query's own retention limits (``max_age_s``, ``max_bytes``: a number,
        UNLIMITED, or None for the configured default); enforced at the next check."""
        if not self.registry.set_retention(name, **limits):
            return False
        self._retention_due = 0.0
        return True

    def enforce_retention(self) -> None:
        """Every query's answers within its limits; the bytes each holds in the metrics;
        quarantined spool files aged out."""
        for name, limits in self.retention_limits().items():
            held = enforce(self.settings.results_dir, name, limits)
            self.metrics.results_bytes.labels(name).set(held.bytes)
            if held.removed_age:
                self.metrics.results_removed.labels(name, "age").inc(held.removed_age)
            if held.removed_bytes:
                self.metrics.results_removed.labels(name, "bytes").inc(held.removed_bytes)
        expire_quarantined(self.settings.spool_dir, self.settings.spool.quarantine_max_age)

    def register(self, name: str | None, text: str, alert: AlertRule | None = None) -> Query:
        """Register a query (and its alert rule: ``alert``, else its ``-- alert:``
        directive), checked whole before anything is stored."""
        parsed = parse_single(text, name)
        prefix_tables.check(parsed)  # the tables and user predicates it names are configured
        enrichment.check(parsed)  # and the enrichment databases of the fields it reads
        user_predicates.check(parsed)
        rule = self._rule(parsed, alert)
        q = self.registry.add(name, text)
        clear_results(self.settings.results_dir, q.name)
        if rule is not None:
            self.alerts.set_rule(q, rule)
        self.rebuild(change=self._changed())
        return q

    def _rule(self, q: Query, alert: AlertRule | None) -> AlertRule | None:
        if alert is None and q.alert is not None:
            alert = parse_directive(q.alert)
        if alert is None:
            return None
        if self.alerts is None:
            raise QueryError("alerts are set on the control plane (role: all)")
        return self.alerts.check(q, alert)

    def set_alert(self, name: str, alert: AlertRule | None) -> bool:
        """Set or remove a query's alert rule; False: no such query."""
        found = self.query(name)
        if found is None:
            return False
        if alert is not None:
            self._rule(found[0], alert)
        if self.alerts is not None:
            self.alerts.set_rule(found[0], alert)
        return True

    def alert_rule(self, name: str) -> AlertRule | None:
        return self.alerts.rule(name) if self.alerts is not None else None

    def delete(self, name: str) -> bool:
        found = self.query(name)
        if found is None:
            return False
        slots = self.registry.slots_of(name)  # a joined query holds one per WITH part
        if self.alerts is not None:
            self.alerts.forget(found[0])  # its firing alerts resolved
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
