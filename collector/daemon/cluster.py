"""What the control plane and the capture probes sharing one spool tell each other: small JSON
files in the spool's ``_control/`` folder, written atomically, read by anyone (no other channel
is needed between hosts; Spark's readers never list it).

- ``queries.json``, written by the control plane (``role: all``) at every rebuild: the plan
  version and every registered query with its slot and whether it is paused. A capture probe
  (``role: capture``) builds its own plan from it (its own samples and selectivities, the
  control plane's slots): the rows of every probe name their queries by the same slots, and the
  node of a row names its own keys, so one Spark job merges them all.
- ``probes/<probe>.json``, written by every daemon at every tick: the plan version its engines
  run, its spool high-water marks and its latest event time. The control plane releases a
  deleted query's slot only once every probe runs a plan without it and Spark has read the files
  each wrote before (``Collector.release_slots``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

from collector.pipeline.durability import write_json
from planner.ir import Query
from planner.query import parse_query

log = logging.getLogger("flowsieve.cluster")

CONTROL = "_control"


class ProbeOnly(RuntimeError):
    """A capture probe's queries are registered at the control plane."""


def queries_path(spool_root: Path) -> Path:
    return Path(spool_root) / CONTROL / "queries.json"


def publish_queries(spool_root: Path, version: int, entries: list[tuple[Query, int]],
                    paused: set[str], part_slots: dict[str, int] | None = None) -> None:
    parts = part_slots or {}
    write_json(queries_path(spool_root), {
        "version": version,
        "queries": [{"name": q.name, "sql": q.text, "slot": slot, "enabled": q.name not in paused,
                     "parts": {p.name: parts[p.name] for p in q.parts[1:] if q.join is not None}}
                    for q, slot in entries]}, durable=False)  # rewritten at every rebuild


def owner(var_dir: Path) -> str:
    """Who a probe is, beyond its name: its host and its state folder (a daemon restarted on
    the same folder is the same probe)."""
    return f"{socket.gethostname()}:{Path(var_dir).resolve()}"


def publish_status(spool_root: Path, probe: str, who: str, version: int | None,
                   high_water: dict[Path, int], max_time: int | None) -> None:
    root = Path(spool_root)
    write_json(root / CONTROL / "probes" / f"{probe}.json", {
        "probe": probe, "owner": who, "version": version, "max_time": max_time,
        "time": time.time(),
        "high_water": {str(p.relative_to(root)): seq for p, seq in high_water.items()}},
        durable=False)  # rewritten every tick


def probe_in_use(spool_root: Path, probe: str, who: str, fresh_s: float) -> str | None:
    """Another daemon's description if it wrote ``probe``'s status in the last ``fresh_s``
    (two daemons of one name would overwrite each other's spool files)."""
    try:
        st = json.loads((Path(spool_root) / CONTROL / "probes" / f"{probe}.json").read_text())
        age = time.time() - st["time"]
        other = st.get("owner")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if other and other != who and age <= fresh_s:
        return f"{other} ({age:.0f} s ago)"
    return None


def statuses(spool_root: Path, timeout_s: float) -> list[dict]:
    """The probes' statuses written in the last ``timeout_s`` (high-water marks as paths)."""
    root = Path(spool_root)
    out = []
    now = time.time()
    for path in sorted((root / CONTROL / "probes").glob("*.json")):
        try:
            st = json.loads(path.read_text())
            if now - st["time"] <= timeout_s:
                st["high_water"] = {root / k: v for k, v in st["high_water"].items()}
                out.append(st)
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("probe status %s unreadable: %s", path, e)
    return out


class PublishedRegistry:
    """A capture probe's registry: the control plane's ``queries.json``, read-only."""

    def __init__(self, spool_root: Path):
        self.path = queries_path(spool_root)
        self._seen: tuple[int, int] | None = None
        self._data: dict = {"version": 0, "queries": []}
        self._parsed: dict[tuple[str, str], Query] = {}
        self.refresh()

    def refresh(self) -> bool:
        """Read the file again if it changed; True when it holds another plan version."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        if self._seen == (st.st_mtime_ns, st.st_size):
            return False
        try:
            data = json.loads(self.path.read_text())
            queries = [(parse_query(e["sql"], e["name"]), int(e["slot"]), bool(e["enabled"]))
                       for e in data["queries"]]
            parts = {p: int(s) for e in data["queries"] for p, s in e.get("parts", {}).items()}
            version = int(data["version"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.error("%s unreadable (%s): the plan stays as it is", self.path, e)
            return False
        self._seen = (st.st_mtime_ns, st.st_size)
        changed = version != self._data["version"]
        self._data = {"version": version, "queries": queries, "parts": parts}
        return changed

    def entries(self) -> list[tuple[Query, int]]:
        return [(q, slot) for q, slot, _ in self._data["queries"]]

    def part_slots(self) -> dict[str, int]:
        return dict(self._data.get("parts", {}))

    def disabled(self) -> set[str]:
        return {q.name for q, _, enabled in self._data["queries"] if not enabled}

    def next_version(self) -> int:
        return self._data["version"]

    def freed(self) -> list:
        return []  # the control plane releases slots

    def _refuse(self, *args, **kwargs):
        raise ProbeOnly(f"this daemon is a capture probe (role: capture): queries are "
                        f"registered at the control plane that writes {self.path}")

    add = remove = set_enabled = freed_by = release = slots_of = _refuse

    def close(self) -> None:
        pass
