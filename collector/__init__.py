"""The capture daemon: engine, LFTA, spool, Spark HFTA, replay."""

from __future__ import annotations

import gc

_frozen = False


def freeze_startup_heap() -> None:
    """Move the objects the process holds now (its modules, classes, the Spark session's
    wrappers: some 150-200k) out of the garbage collector's view, once per process: they are
    never garbage, and every full collection walked them all (0.09-0.11 s, one of them in
    most of the telemetry bench's replays). Later calls do nothing, so the garbage of one
    replay is never frozen by the next."""
    global _frozen
    if not _frozen:
        _frozen = True
        gc.freeze()
