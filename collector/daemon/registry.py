"""The query registry (SQLite): names, texts, slots and the plan version survive restarts.

A deleted query's slot is held until the collector has seen that no spool file and no Spark
state can still refer to it (``release``), so partials written under the old query are never
attributed to a new one (DESIGN, "slots").
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

from collector.crashpoints import reached
from planner.ir import Query
from planner.query import parse_query, parse_single

SCHEMA = """
CREATE TABLE IF NOT EXISTS queries (
    name TEXT PRIMARY KEY, text TEXT NOT NULL, slot INTEGER NOT NULL UNIQUE,
    created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS freed_slots (slot INTEGER PRIMARY KEY, freed_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS part_slots (query TEXT NOT NULL, part TEXT PRIMARY KEY,
    slot INTEGER NOT NULL UNIQUE);
CREATE TABLE IF NOT EXISTS retention (name TEXT PRIMARY KEY, max_age_s REAL, max_bytes INTEGER);
"""
UNLIMITED = -1  # a query's retention limit: none (NULL: the configured default)


def planned(entries: list[tuple[Query, int]], part_slots: dict[str, int]
            ) -> list[tuple[Query, int]]:
    """The queries the planner plans, with their slots: a joined query's WITH parts, the
    first holding the query's own slot, the others theirs in ``part_slots``."""
    out = []
    for q, slot in entries:
        for i, p in enumerate(q.parts):
            out.append((p, slot if i == 0 or q.join is None else part_slots[p.name]))
    return out


class QueryExists(ValueError):
    """A query of that name is registered already."""


class Registry:
    """Registered queries and their slots, in SQLite."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._parsed: dict[tuple[str, str], Query] = {}  # (name, text) -> parsed query
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False)
        # a commit is on disk, journal and directory included, before it returns (SQLite's
        # usual default, said here so that no build's default can change it)
        self._db.execute("PRAGMA synchronous = FULL")
        self._db.executescript(SCHEMA)
        columns = {r[1] for r in self._db.execute("PRAGMA table_info(queries)")}
        if "enabled" not in columns:  # a registry written before queries could be paused
            self._db.execute("ALTER TABLE queries ADD COLUMN enabled INTEGER NOT NULL DEFAULT 1")
        freed = {r[1] for r in self._db.execute("PRAGMA table_info(freed_slots)")}
        if "plan_version" not in freed:  # the plan that no longer holds the slot
            self._db.execute("ALTER TABLE freed_slots ADD COLUMN plan_version INTEGER")
        self._db.commit()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _free_slot(self) -> int:
        used = {r[0] for r in self._db.execute("SELECT slot FROM queries UNION "
                                               "SELECT slot FROM part_slots")}
        held = {r[0] for r in self._db.execute("SELECT slot FROM freed_slots")}
        slot = 0
        while slot in used or slot in held:
            slot += 1
        return slot

    def freed(self) -> list[tuple[int, int | None]]:
        """Slots of deleted queries not released yet, with the first plan version without
        them (None: not known yet)."""
        with self._lock:
            return list(self._db.execute("SELECT slot, plan_version FROM freed_slots "
                                         "ORDER BY slot"))

    def freed_by(self, slot: int, plan_version: int) -> None:
        """Plan ``plan_version`` is the first without the deleted query of ``slot``."""
        with self._lock:
            self._db.execute("UPDATE freed_slots SET plan_version = ? WHERE slot = ? AND "
                             "plan_version IS NULL", (plan_version, slot))
            self._db.commit()

    def release(self, slot: int) -> None:
        """Nothing refers to ``slot`` any more: a new query may take it."""
        with self._lock:
            self._db.execute("DELETE FROM freed_slots WHERE slot = ?", (slot,))
            self._db.commit()

    def add(self, name: str | None, text: str) -> Query:
        """Parse and register one query; raises QueryError or QueryExists."""
        q = parse_single(text, name)
        with self._lock:
            if self._db.execute("SELECT 1 FROM queries WHERE name = ?", (q.name,)).fetchone():
                raise QueryExists(f"query {q.name!r} exists; delete it first")
            slot = self._free_slot()
            self._db.execute("INSERT INTO queries (name, text, slot, created_at) "
                             "VALUES (?, ?, ?, ?)", (q.name, q.text, slot, time.time()))
            for p in q.parts[1:] if q.join is not None else ():  # a slot per WITH part
                self._db.execute("INSERT INTO part_slots (query, part, slot) VALUES (?, ?, ?)",
                                 (q.name, p.name, self._free_slot()))
            self._db.commit()
        reached("registry.update")
        return q

    def slots_of(self, name: str) -> list[int]:
        """Every slot a query holds (a joined query: one per WITH part)."""
        with self._lock:
            return [r[0] for r in self._db.execute(
                "SELECT slot FROM queries WHERE name = ? UNION SELECT slot FROM part_slots "
                "WHERE query = ? ORDER BY 1", (name, name))]

    def part_slots(self) -> dict[str, int]:
        """The slots of joined queries' WITH parts after the first, by part name."""
        with self._lock:
            return dict(self._db.execute("SELECT part, slot FROM part_slots"))

    def remove(self, name: str) -> bool:
        with self._lock:
            row = self._db.execute("SELECT slot FROM queries WHERE name = ?", (name,)).fetchone()
            if row is None:
                return False
            slots = [row[0], *(r[0] for r in self._db.execute(
                "SELECT slot FROM part_slots WHERE query = ?", (name,)))]
            self._db.execute("DELETE FROM queries WHERE name = ?", (name,))
            self._db.execute("DELETE FROM part_slots WHERE query = ?", (name,))
            self._db.execute("DELETE FROM retention WHERE name = ?", (name,))
            for slot in slots:
                self._db.execute("INSERT OR REPLACE INTO freed_slots (slot, freed_at, "
                                 "plan_version) VALUES (?, ?, NULL)", (slot, time.time()))
            self._db.commit()
            return True

    def set_enabled(self, name: str, enabled: bool) -> bool:
        """Pause or resume a query; it keeps its slot (and so its answers). False: unknown."""
        with self._lock:
            cur = self._db.execute("UPDATE queries SET enabled = ? WHERE name = ?",
                                   (int(enabled), name))
            self._db.commit()
            return cur.rowcount == 1

    def set_retention(self, name: str, **limits: float | None) -> bool:
        """A query's own retention limits (``max_age_s``, ``max_bytes``): a number, UNLIMITED,
        or None for the configured default; the ones not given stay. False: unknown query."""
        with self._lock:
            if self._db.execute("SELECT 1 FROM queries WHERE name = ?", (name,)).fetchone() \
                    is None:
                return False
            self._db.execute("INSERT OR IGNORE INTO retention (name) VALUES (?)", (name,))
            for column, value in limits.items():
                assert column in ("max_age_s", "max_bytes"), column
                self._db.execute(f"UPDATE retention SET {column} = ? WHERE name = ?",
                                 (value, name))
            self._db.commit()
            return True

    def retention(self) -> dict[str, tuple[float | None, int | None]]:
        """Queries' own retention limits: name -> (max_age_s, max_bytes), each a number,
        UNLIMITED or None (the configured default)."""
        with self._lock:
            return {r[0]: (r[1], r[2]) for r in self._db.execute(
                "SELECT name, max_age_s, max_bytes FROM retention")}

    def disabled(self) -> set[str]:
        """Names of the paused queries."""
        with self._lock:
            return {r[0] for r in self._db.execute("SELECT name FROM queries WHERE enabled = 0")}

    def entries(self) -> list[tuple[Query, int]]:
        """Every registered query with its slot, in slot order."""
        with self._lock:
            rows = self._db.execute("SELECT name, text, slot FROM queries ORDER BY slot").fetchall()
        out = []
        for name, text, slot in rows:
            q = self._parsed.get((name, text))
            if q is None:  # parsing is most of a rebuild's time at 1,000 queries
                q = self._parsed[name, text] = parse_query(text, name)
            out.append((q, slot))
        if len(self._parsed) > 2 * len(rows) + 64:  # forget deleted ones
            live = {(name, text) for name, text, _ in rows}
            self._parsed = {k: v for k, v in self._parsed.items() if k in live}
        return out

    def meta(self, key: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
            return row[0] if row else None

    def set_meta(self, key: str, value: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))
            self._db.commit()

    def next_version(self) -> int:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key = 'plan_version'").fetchone()
            v = int(row[0]) + 1 if row else 1
            self._db.execute("INSERT OR REPLACE INTO meta VALUES ('plan_version', ?)", (str(v),))
            self._db.commit()
            return v
