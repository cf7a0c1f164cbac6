"""Alerts beside the pipeline: a thread reads each rule's newly closed windows from the answers
Spark committed (never rows in flight) and applies them to the instances (lifecycle.py), and a
thread per receiver delivers its outbox in order, retrying with exponential back-off and
jitter. Neither waits on capture or Spark, nor they on it: a receiver that never answers
holds only its own thread, and its outbox is bounded."""

from __future__ import annotations

import json
import logging
import math
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

from collector.config import Settings
from collector.crashpoints import reached
from collector.daemon.alerts.lifecycle import apply_window, event
from collector.daemon.alerts.receivers import Receiver, make_receiver
from collector.daemon.alerts.rules import AlertRule, check_rule
from collector.daemon.alerts.store import AlertStore, Instance, iso
from collector.daemon.results import file_pieces, part_files, read_pieces
from collector.metrics import Metrics
from planner.ir import Query

log = logging.getLogger("flowsieve.alerts")


class AlertService:
    """Rules, evaluation and delivery for one daemon."""

    def __init__(self, settings: Settings, store: AlertStore, metrics: Metrics,
                 query: Callable[[str], Query | None],
                 complete_before: Callable[[Query], float | None]):
        self.settings = settings
        self.store = store
        self.metrics = metrics
        self.query = query
        self.complete_before = complete_before
        cfg = settings.alerts
        self.receivers: dict[str, Receiver] = {n: make_receiver(n, c)
                                               for n, c in cfg.receivers.items()}
        api = settings.api
        host = f"[{api.host}]" if ":" in api.host else api.host
        self.public_url = (cfg.public_url or f"http://{host}:{api.port}").rstrip("/")
        self._stop = threading.Event()
        self._wake = {n: threading.Event() for n in self.receivers}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()  # one evaluation at a time (the clock, a rule change)
        self._footers: dict[str, dict] = {}  # query -> part file -> ((mtime, size), pieces)

    # -- rules
    def check(self, query: Query, rule: AlertRule) -> AlertRule:
        return check_rule(rule, query, set(self.receivers))

    def set_rule(self, query: Query, rule: AlertRule | None) -> None:
        """Set (checked) or remove a query's rule; removing resolves what it has firing."""
        with self._lock:
            if rule is None:
                self._resolve_all(query)
                self.store.set_rule(query.name, None)
            else:
                self.store.set_rule(query.name, self.check(query, rule))
        self._update_gauges()

    def rule(self, name: str) -> AlertRule | None:
        found = self.store.rules().get(name)
        return found[0] if found else None

    def forget(self, query: Query) -> None:
        """A deleted query: its firing alerts are resolved, its rule goes."""
        with self._lock:
            self._resolve_all(query)
            self.store.forget(query.name)
        self._update_gauges()

    def _resolve_all(self, query: Query) -> None:
        found = self.store.rules().get(query.name)
        if found is None:
            return
        rule, _, evaluated = found
        instances = {i.key: i for i in self.store.instances(query.name)}
        if not instances:
            return
        window = evaluated if evaluated is not None else time.time()
        self._apply(query, rule, window, [], instances, evaluated)

    # -- evaluation
    def start(self) -> None:
        gone = self.store.drop_receivers_except(set(self.receivers))
        if gone:
            log.warning("alerts: dropped %d notifications of receivers no longer configured",
                        gone)
        for name, (rule, _, _) in self.store.rules().items():
            missing = set(rule.receivers) - set(self.receivers)
            if missing:
                log.warning("alerts: the rule of query %s names receivers no longer "
                            "configured: %s", name, ", ".join(sorted(missing)))
        for name, rec in self.receivers.items():
            t = threading.Thread(target=self._deliver, args=(rec,), name=f"alerts-{name}",
                                 daemon=True)
            t.start()
            self._threads.append(t)
        t = threading.Thread(target=self._run, name="alerts-evaluate", daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        for e in self._wake.values():
            e.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        for r in self.receivers.values():
            r.close()

    def _run(self) -> None:
        while not self._stop.wait(self.settings.alerts.check_s):
            try:
                self.evaluate()
            except Exception:  # noqa: BLE001 - the results folder or the database: next tick
                log.exception("evaluating alerts failed")

    def evaluate(self) -> None:
        """Apply every rule's newly closed windows, oldest first."""
        with self._lock:
            for name, (rule, created, evaluated) in self.store.rules().items():
                q = self.query(name)
                if q is None or q.period is None:
                    continue
                cb = self.complete_before(q)
                if cb is None:
                    continue
                self._evaluate(q, rule, created, evaluated, cb)
        self._update_gauges()

    def _evaluate(self, q: Query, rule: AlertRule, created: float, evaluated: float | None,
                  cb: float) -> None:
        period = q.period
        done_before = math.ceil(cb / period) * period  # windows starting before cb are closed
        found = [p for p in self._pieces(q) if p.start / 1e6 < cb]
        if evaluated is None:
            # a new rule reads the answers written since it was set
            found = [p for p in found if _mtime(p.path) >= created - 1]
            if not found:
                return
            evaluated = min(p.start for p in found) / 1e6
        windows: dict[float, list] = {}
        for p in found:
            if p.start / 1e6 >= evaluated:
                windows.setdefault(p.start / 1e6, []).append(p)
        instances = {i.key: i for i in self.store.instances(q.name)}
        at = evaluated
        for start in sorted(windows):
            if start > at and instances:  # a closed window without rows in between
                self._apply(q, rule, at, [], instances, at + period)
            self._apply(q, rule, start, self._rows(q, windows[start]), instances,
                        start + period)
            at = start + period
        if done_before > at:
            if instances:
                self._apply(q, rule, at, [], instances, done_before)
            else:
                self.store.apply(q.name, done_before, [], [], [])

    def _pieces(self, q: Query) -> list:
        """The query's row groups, a footer read only for a part file that is new or was
        replaced since the last look (a query keeps a part per answer job: months of them
        under retention, every check_s)."""
        seen = self._footers.setdefault(q.name, {})
        now: dict = {}
        out = []
        for path in part_files(self.settings.results_dir, q.name):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            stamp = (st.st_mtime_ns, st.st_size)
            cached = seen.get(path)
            found = cached[1] if cached is not None and cached[0] == stamp else \
                file_pieces(path, q)
            now[path] = (stamp, found)
            out += found
        self._footers[q.name] = now
        return out

    def _rows(self, q: Query, chosen) -> list[dict]:
        rows = []
        names = [o.name for o in q.outputs]
        for t in read_pieces(q, chosen):
            rows += t.select(names).to_pylist()
        return rows

    def _apply(self, q: Query, rule: AlertRule, window: float, rows: list[dict],
               instances: dict[str, Instance], evaluated_before: float) -> None:
        # a receiver a rule names that is no longer configured is skipped (start says so)
        receivers = [r for r in rule.receivers or list(self.receivers) if r in self.receivers]
        url = f"{self.public_url}/queries/{q.name}/results"
        changes, outgoing, resolved = apply_window(q, rule, window, rows, instances,
                                                   receivers, url)
        self.store.apply(q.name, evaluated_before, changes, outgoing, resolved)
        if outgoing:
            reached("alerts.apply")
        for r in {r for r, _, _ in outgoing}:
            dropped = self.store.bound(r, self.receivers[r].config.max_pending)
            if dropped:
                self.metrics.alert_notifications.labels(r, "dropped").inc(dropped)
                log.warning("alerts: receiver %s is behind: dropped its %d oldest "
                            "notifications (max_pending)", r, dropped)
            self._wake[r].set()

    def _update_gauges(self) -> None:
        counts: dict[str, int] = dict.fromkeys(self.store.rules(), 0)
        for i in self.store.instances():
            if i.state == "firing":
                counts[i.query] = counts.get(i.query, 0) + 1
        for name, n in counts.items():
            self.metrics.alerts_firing.labels(name).set(n)
        for name in self.receivers:
            self.metrics.alert_outbox.labels(name).set(self.store.outbox_size(name))

    # -- delivery
    def _deliver(self, rec: Receiver) -> None:
        """A receiver's outbox in order: the oldest notifications first, a request carrying
        ``rec.batch`` of them, retried (the whole receiver backs off) until delivered; those
        delivered leave the outbox together, a hundred requests at a time at most (one
        commit). Alertmanager is sent the firing alerts again every ``resend_s``."""
        cfg = rec.config
        failures = 0
        resend_at = time.monotonic() + cfg.resend_s
        wake = self._wake[rec.name]
        while not self._stop.is_set():
            items = self.store.pending(rec.name, rec.batch * 100)
            if not items:
                if rec.batch > 1 and time.monotonic() >= resend_at:
                    resend_at = time.monotonic() + cfg.resend_s
                    self._resend(rec)
                wake.wait(min(1.0, max(0.05, resend_at - time.monotonic())))
                wake.clear()
                continue
            done: list = []
            error = None
            for i in range(0, len(items), rec.batch):
                chunk = items[i:i + rec.batch]
                t0 = time.time()
                try:
                    rec.send([o.body for o in chunk])
                except Exception as e:  # noqa: BLE001 - any failure: counted, retried
                    error, failed = e, chunk
                    break
                done += chunk
                reached("alerts.send")  # sent, not marked: sent again, the same key
                for o in chunk:
                    self.metrics.alert_delivery.labels(rec.name).observe(max(0.0, t0 - o.created))
                if self._stop.is_set():
                    break
            if done:
                failures = 0
                self.store.delivered([o.id for o in done])
                self.metrics.alert_notifications.labels(rec.name, "sent").inc(len(done))
            self.metrics.alert_outbox.labels(rec.name).set(self.store.outbox_size(rec.name))
            if error is not None:
                failures += 1
                self.store.failed([o.id for o in failed])
                self.metrics.alert_notifications.labels(rec.name, "failed").inc(len(failed))
                delay = min(cfg.max_backoff_s, 0.5 * 2 ** min(failures, 20))
                delay *= random.uniform(0.5, 1.5)
                log.warning("alerts: delivery to %s failed (%s); again in %.1f s", rec.name,
                            error, delay)
                self._stop.wait(delay)

    def _resend(self, rec: Receiver) -> None:
        """The firing alerts of the rules that send to ``rec``, again (Alertmanager resolves
        an alert it has not heard of by its endsAt)."""
        rules = self.store.rules()
        events = []
        for inst in self.store.instances():
            found = rules.get(inst.query)
            q = self.query(inst.query)
            if inst.state != "firing" or found is None or q is None:
                continue
            rule = found[0]
            if rule.receivers and rec.name not in rule.receivers:
                continue
            events.append(event(q, rule, inst, "firing", inst.last_window, q.period, None,
                                f"{self.public_url}/queries/{q.name}/results"))
        for i in range(0, len(events), rec.batch):
            try:
                rec.send(events[i:i + rec.batch])
            except Exception as e:  # noqa: BLE001 - the next resend tries again
                log.warning("alerts: resending to %s failed: %s", rec.name, e)
                return

    # -- the API's view
    def alerts(self) -> list[dict]:
        """Firing and pending instances, then those resolved within ``keep_resolved_s``."""
        out = [{"query": i.query, "key": json.loads(i.key), "labels": i.labels, "row": i.row,
                "summary": i.summary, "state": i.state, "starts_at": iso(i.starts_at),
                "ends_at": None, "last_window": iso(i.last_window)}
               for i in self.store.instances()]
        out.sort(key=lambda a: (a["state"] != "firing", a["starts_at"] or ""), reverse=False)
        return out + self.store.resolved(time.time() - self.settings.alerts.keep_resolved_s)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0

