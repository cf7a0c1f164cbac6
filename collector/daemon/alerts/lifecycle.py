"""An alert instance's lifecycle over closed windows, as pure functions of the instances so far
and a window's answer rows: pending while a key has appeared in fewer than ``for`` consecutive
windows, firing from then on while it keeps appearing, resolved (sent once) in the first closed
window without it."""

from __future__ import annotations

import json
import string

from collector.daemon.alerts.rules import AlertRule, bucket_columns
from collector.daemon.alerts.store import Instance, idempotency_key, iso
from planner.ir import Query


def instance_key(rule: AlertRule, row: dict) -> str:
    return json.dumps([row.get(k) for k in rule.keys or ()], separators=(",", ":"), default=str)


def labels_of(query: Query, rule: AlertRule, row: dict) -> dict[str, str]:
    """alertname (the query), severity, the key columns' values, the static labels."""
    out = {"alertname": query.name, "severity": rule.severity}
    out.update({k: str(row.get(k)) for k in rule.keys or ()})
    out.update(rule.labels)
    return out


def summary_of(query: Query, rule: AlertRule, row: dict, window_start: float,
               window_end: float) -> str:
    if rule.summary:
        values = {**row, "query": query.name, "window_start": iso(window_start),
                  "window_end": iso(window_end)}
        return string.Formatter().vformat(rule.summary, (), values)
    keys = set(rule.keys or ())
    skip = keys | bucket_columns(query)
    who = " ".join(f"{k}={row.get(k)}" for k in rule.keys or ())
    what = ", ".join(f"{k}={v}" for k, v in row.items() if k not in skip)
    return f"{query.name} {who}: {what}".replace("  ", " ").strip()


def event(query: Query, rule: AlertRule, inst: Instance, state: str, window_start: float,
          period: int, ends_at: float | None, generator_url: str) -> dict:
    """A notification, the same for every receiver (each formats it its own way)."""
    return {"query": query.name, "state": state,
            "key": dict(zip(rule.keys or (), json.loads(inst.key), strict=True)),
            "labels": inst.labels, "severity": rule.severity, "summary": inst.summary,
            "row": inst.row, "window_start": iso(window_start),
            "window_end": iso(window_start + period), "starts_at": iso(inst.starts_at),
            "ends_at": iso(ends_at),
            "idempotency_key": idempotency_key(query.name, inst.key, state, window_start),
            "generator_url": generator_url}


def apply_window(query: Query, rule: AlertRule, window_start: float, rows: list[dict],
                 instances: dict[str, Instance], receivers: list[str], generator_url: str):
    """What one closed window does to a query's instances: (changes, notifications,
    resolved history), for ``AlertStore.apply``; ``instances`` is updated in place."""
    period = query.period
    changes: list[tuple[str, object]] = []
    outgoing: list[tuple[str, str, dict]] = []
    resolved: list[tuple] = []
    present: dict[str, dict] = {}
    for row in rows:
        present.setdefault(instance_key(rule, row), row)
    for key, row in present.items():
        was = instances.get(key)
        run = was.run + 1 if was is not None and was.last_window == window_start - period else 1
        first = was.first_window if run > 1 else window_start
        firing = run >= rule.for_windows
        inst = Instance(query.name, key, "firing" if firing else "pending", run, first,
                        window_start, was.starts_at if was is not None and was.state ==
                        "firing" and run > 1 else (first if firing else None),
                        labels_of(query, rule, row), row,
                        summary_of(query, rule, row, window_start, window_start + period))
        if firing and (was is None or was.state != "firing" or run == 1):
            body = event(query, rule, inst, "firing", window_start, period, None,
                         generator_url)
            outgoing += [(r, body["idempotency_key"], body) for r in receivers]
        instances[key] = inst
        changes.append(("put", inst))
    for key in [k for k in instances if k not in present]:
        inst = instances.pop(key)
        changes.append(("del", key))
        if inst.state == "firing":
            ends = inst.last_window + period
            body = event(query, rule, inst, "resolved", window_start, period, ends,
                         generator_url)
            outgoing += [(r, body["idempotency_key"], body) for r in receivers]
            resolved.append((query.name, key, json.dumps(inst.labels), json.dumps(inst.row),
                             inst.summary, inst.starts_at, ends))
    return changes, outgoing, resolved
