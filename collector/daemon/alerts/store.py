"""Alert state in the registry's database: the rules, each query's evaluated windows, the
instances pending or firing, recently resolved ones, and the outbox of notifications.

A closed window is applied in one transaction: the instances it changes, the notifications
those changes send (one per receiver, in the outbox) and the window marked evaluated commit
together. A daemon killed at any moment restarts with every firing alert still firing and
every notification not yet delivered still in the outbox (delivered at least once, each with
an idempotency key of its instance, state and window, so a receiver can drop a repeat).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from collector.daemon.alerts.rules import AlertRule

SCHEMA = """
CREATE TABLE IF NOT EXISTS alert_rules (query TEXT PRIMARY KEY, rule TEXT NOT NULL,
    created REAL NOT NULL, evaluated_before REAL);
CREATE TABLE IF NOT EXISTS alert_instances (query TEXT NOT NULL, key TEXT NOT NULL,
    state TEXT NOT NULL, run INTEGER NOT NULL, first_window REAL NOT NULL,
    last_window REAL NOT NULL, starts_at REAL, labels TEXT NOT NULL, row TEXT NOT NULL,
    summary TEXT NOT NULL, PRIMARY KEY (query, key));
CREATE TABLE IF NOT EXISTS alert_resolved (id INTEGER PRIMARY KEY AUTOINCREMENT,
    query TEXT NOT NULL, key TEXT NOT NULL, labels TEXT NOT NULL, row TEXT NOT NULL,
    summary TEXT NOT NULL, starts_at REAL NOT NULL, ends_at REAL NOT NULL,
    resolved_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS alert_outbox (id INTEGER PRIMARY KEY AUTOINCREMENT,
    receiver TEXT NOT NULL, idem TEXT NOT NULL, body TEXT NOT NULL, created REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS alert_outbox_receiver ON alert_outbox (receiver, id);
"""


def iso(t: float | None) -> str | None:
    """Epoch seconds as ISO 8601 UTC (whole seconds unless it has a fraction)."""
    if t is None:
        return None
    d = datetime.fromtimestamp(t, UTC)
    return d.isoformat(timespec="seconds" if t == int(t) else "microseconds").replace(
        "+00:00", "Z")


def idempotency_key(query: str, key: str, state: str, window: float) -> str:
    """One notification's identity: its instance, state and the window that made it."""
    return hashlib.sha256(f"{query}\0{key}\0{state}\0{window:.0f}".encode()).hexdigest()[:32]


@dataclass
class Instance:
    query: str
    key: str  # the key columns' values, as JSON
    state: str  # pending or firing
    run: int  # consecutive windows it appeared in
    first_window: float  # the run's first window start
    last_window: float
    starts_at: float | None  # when it fired: its run's first window start
    labels: dict
    row: dict
    summary: str


@dataclass
class Outgoing:
    id: int
    receiver: str
    idem: str
    body: dict
    created: float
    attempts: int


class AlertStore:
    """The alert tables, beside the registry's in its SQLite file (a connection of their
    own: the registry's lock is never held while alerts are written)."""

    def __init__(self, path: str | Path):
        self._db = sqlite3.connect(str(path), check_same_thread=False, timeout=30)
        self._db.execute("PRAGMA synchronous = FULL")  # the outbox survives a power cut
        self._db.executescript(SCHEMA)
        self._db.commit()
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- rules
    def set_rule(self, query: str, rule: AlertRule | None) -> None:
        """A query's rule (None: none). A new or changed rule evaluates answers written from
        now on; its instances so far are kept when it only changed."""
        with self._lock, self._db:
            if rule is None:
                self._forget(query)
                return
            self._db.execute(
                "INSERT INTO alert_rules (query, rule, created) VALUES (?, ?, ?) "
                "ON CONFLICT (query) DO UPDATE SET rule = excluded.rule",
                (query, rule.model_dump_json(by_alias=True), time.time()))

    def forget(self, query: str) -> None:
        """A deleted query: its rule, instances and pending notifications go."""
        with self._lock, self._db:
            self._forget(query)

    def _forget(self, query: str) -> None:
        self._db.execute("DELETE FROM alert_rules WHERE query = ?", (query,))
        self._db.execute("DELETE FROM alert_instances WHERE query = ?", (query,))

    def rules(self) -> dict[str, tuple[AlertRule, float, float | None]]:
        """query -> (rule, created, evaluated_before)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT query, rule, created, evaluated_before FROM alert_rules").fetchall()
        return {q: (AlertRule.model_validate_json(r), c, e) for q, r, c, e in rows}

    # -- instances
    def instances(self, query: str | None = None) -> list[Instance]:
        sql = ("SELECT query, key, state, run, first_window, last_window, starts_at, labels, "
               "row, summary FROM alert_instances")
        args: tuple = ()
        if query is not None:
            sql += " WHERE query = ?"
            args = (query,)
        with self._lock:
            rows = self._db.execute(sql + " ORDER BY query, key", args).fetchall()
        return [Instance(q, k, s, r, f, lw, st, json.loads(lb), json.loads(rw), sm)
                for q, k, s, r, f, lw, st, lb, rw, sm in rows]

    def resolved(self, since: float) -> list[dict]:
        """Instances resolved since ``since`` (wall clock), newest first."""
        with self._lock:
            self._db.execute("DELETE FROM alert_resolved WHERE resolved_at < ?", (since,))
            rows = self._db.execute(
                "SELECT query, key, labels, row, summary, starts_at, ends_at FROM "
                "alert_resolved ORDER BY id DESC").fetchall()
        return [{"query": q, "key": json.loads(k), "labels": json.loads(lb),
                 "row": json.loads(rw), "summary": sm, "state": "resolved",
                 "starts_at": iso(st), "ends_at": iso(en)}
                for q, k, lb, rw, sm, st, en in rows]

    def apply(self, query: str, evaluated_before: float, changes: list[tuple[str, object]],
              outgoing: list[tuple[str, str, dict]], resolved: list[tuple]) -> None:
        """One evaluation's effects, atomically: instance upserts (``("put", Instance)``) and
        deletions (``("del", key)``), notifications (receiver, idempotency key, body),
        resolved history rows, and the query's windows evaluated up to ``evaluated_before``."""
        now = time.time()
        with self._lock, self._db:
            for op, v in changes:
                if op == "put":
                    i: Instance = v  # type: ignore[assignment]
                    self._db.execute(
                        "INSERT OR REPLACE INTO alert_instances VALUES (?, ?, ?, ?, ?, ?, ?, ?, "
                        "?, ?)", (i.query, i.key, i.state, i.run, i.first_window,
                                  i.last_window, i.starts_at, json.dumps(i.labels),
                                  json.dumps(i.row), i.summary))
                else:
                    self._db.execute("DELETE FROM alert_instances WHERE query = ? AND key = ?",
                                     (query, v))
            self._db.executemany(
                "INSERT INTO alert_outbox (receiver, idem, body, created) VALUES (?, ?, ?, ?)",
                [(r, idem, json.dumps(body), now) for r, idem, body in outgoing])
            self._db.executemany(
                "INSERT INTO alert_resolved (query, key, labels, row, summary, starts_at, "
                "ends_at, resolved_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [(*r, now) for r in resolved])
            self._db.execute("UPDATE alert_rules SET evaluated_before = ? WHERE query = ?",
                             (evaluated_before, query))

    # -- the outbox
    def pending(self, receiver: str, limit: int) -> list[Outgoing]:
        """A receiver's oldest notifications, in the order they were made."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id, receiver, idem, body, created, attempts FROM alert_outbox WHERE "
                "receiver = ? ORDER BY id LIMIT ?", (receiver, limit)).fetchall()
        return [Outgoing(i, r, k, json.loads(b), c, a) for i, r, k, b, c, a in rows]

    def delivered(self, ids: list[int]) -> None:
        with self._lock, self._db:
            self._db.executemany("DELETE FROM alert_outbox WHERE id = ?", [(i,) for i in ids])

    def failed(self, ids: list[int]) -> None:
        with self._lock, self._db:
            self._db.executemany("UPDATE alert_outbox SET attempts = attempts + 1 WHERE id = ?",
                                 [(i,) for i in ids])

    def bound(self, receiver: str, max_pending: int) -> int:
        """Drop a receiver's oldest notifications beyond ``max_pending``; how many."""
        with self._lock, self._db:
            cur = self._db.execute(
                "DELETE FROM alert_outbox WHERE receiver = ? AND id NOT IN (SELECT id FROM "
                "alert_outbox WHERE receiver = ? ORDER BY id DESC LIMIT ?)",
                (receiver, receiver, max_pending))
            return cur.rowcount

    def drop_receivers_except(self, receivers: set[str]) -> int:
        """Remove the notifications of receivers not in ``receivers``; how many."""
        with self._lock, self._db:
            names = [r[0] for r in self._db.execute(
                "SELECT DISTINCT receiver FROM alert_outbox")]
            gone = 0
            for name in set(names) - receivers:
                gone += self._db.execute("DELETE FROM alert_outbox WHERE receiver = ?",
                                         (name,)).rowcount
            return gone

    def outbox_size(self, receiver: str) -> int:
        with self._lock:
            return self._db.execute("SELECT count(*) FROM alert_outbox WHERE receiver = ?",
                                    (receiver,)).fetchone()[0]
