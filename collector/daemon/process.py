"""Process-wide settings the daemon and ``replay`` make once at start-up."""


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


def no_huge_pages() -> None:
    """Stop numpy asking the kernel for 2 MiB pages (``madvise``) for its arrays of 4 MiB and
    more. Where transparent huge pages are given on request (``madvise``, the Debian and
    Ubuntu default), each such page is allocated and zeroed when first touched, and the
    engine's per-batch arrays, freed and made again, paid for it over again: on the
    telemetry bench a warm replay took 1.17 s (median of 8) with 4 KiB pages against 1.39 s,
    its first batches' unpacking 0.035-0.04 s against 0.035-0.2 s, in system time; a cold
    one was the same within noise. Process-wide, as the daemon and ``replay`` run."""
    import numpy as np

    try:
        np._core.multiarray._set_madvise_hugepage(False)
    except AttributeError:  # numpy < 2
        np.core.multiarray._set_madvise_hugepage(False)
