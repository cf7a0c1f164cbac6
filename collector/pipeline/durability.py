"""Exactly-once capture of a file source: its read position is committed together with the
spool files that hold what it read, so a daemon killed at any point resumes where the spool
left off — nothing lost, nothing counted twice.

A durable engine writes its spool files *held* (hidden from Spark, ``Spool.write(hold=…)``).
Every ``commit_s`` it commits, at a batch boundary:

1. a snapshot of its LFTA tables (the partial aggregates still in memory), written held too;
2. the state file, replaced atomically: the position (records read from the file, its
   identity), the held files to publish, the snapshot's files;
3. the held files are published (renamed to their spool names: Spark sees them), and the
   previous commit's snapshot files are deleted.

A restart (``recover``) publishes what the state lists — a crash between 2 and 3 rolls
forward — and also publishes the snapshot: the partials that were in memory at the commit
become spool rows, and reading resumes right after the tuples they hold. Every other held file
of this writer was written after the last commit: it is deleted, and its tuples are read again.
Spark merges partial rows associatively, so a window's partials may arrive in any number of
files; the results sink writes each window once (collector/spark/merge.py)."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

from capture.disk import sync_dir, write_bytes
from collector.crashpoints import reached
from collector.pipeline.spool import Held, Spool

log = logging.getLogger("flowsieve.durability")


class Checkpoint:
    """The committed state of one durable source: ``<var_dir>/state/<source>.json``."""

    def __init__(self, path: str | os.PathLike, spool: Spool, tag: str):
        self.path = Path(path)
        self.spool = spool
        self.tag = tag  # the held files' tag: this writer's, never another daemon's
        self._snapshot: list[Held] = []

    def load(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise ValueError(f"state file {self.path} is unreadable ({e}); move it away to "
                             "start the source from the beginning") from e

    def recover(self) -> dict | None:
        """Finish the last commit and publish its snapshot; delete what came after it.
        Returns the committed position (None: start from the beginning)."""
        state = self.load()
        keep: set[Path] = set()
        if state is not None:
            for v in state.get("publish", []) + state.get("snapshot", []):
                held = Held.from_json(v)
                held.publish()
                keep.add(held.path)
        dropped = [p for p in self.spool.held_files(self.tag) if p not in keep]
        for p in dropped:
            p.unlink(missing_ok=True)
        if dropped:
            log.info("%s: %d spool files written after the last commit deleted (their tuples "
                     "are read again)", self.tag, len(dropped))
        if state is None:
            return None
        # the snapshot is now spool input: the next commit must not list it again
        self._write({"position": state["position"], "publish": [], "snapshot": []})
        return state["position"]

    def commit(self, position: dict, publish: list[Held], snapshot: list[Held],
               stop: threading.Event | None = None) -> None:
        """Commit ``position`` with the held files written since the last commit and the
        LFTA's snapshot; a full disk waits for room (until ``stop``: then DiskFull, and the
        last commit stands)."""
        # the held files' names on disk before the state that lists them (their bytes were
        # fsynced as they were written)
        for folder in sorted({h.path.parent for h in publish + snapshot}):
            sync_dir(folder)
        reached("lfta.snapshot")
        state = {"position": position, "publish": [h.to_json() for h in publish],
                 "snapshot": [h.to_json() for h in snapshot]}
        self.spool.on_disk(lambda: self._write(state), "block", stop)
        reached("position.commit")
        for i, h in enumerate(publish):
            h.publish()
            if i == 0:
                reached("spool.publish")
        for h in self._snapshot:  # the previous commit's: superseded by this one
            h.path.unlink(missing_ok=True)
        self._snapshot = list(snapshot)

    def _write(self, state: dict) -> None:
        write_json(self.path, state)


def write_json(path: Path, obj, durable: bool = True) -> None:
    """Write a JSON file atomically (readers see the old file or the new one) and, when
    ``durable``, on disk with its name before it replaces the old one (a crash keeps one of
    them)."""
    write_bytes(path, json.dumps(obj).encode(), durable)
