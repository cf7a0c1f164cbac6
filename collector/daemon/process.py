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


CAP_NET_ADMIN, CAP_NET_RAW = 12, 13  # linux/capability.h
CAPTURE_CAPS = {"CAP_NET_RAW": CAP_NET_RAW, "CAP_NET_ADMIN": CAP_NET_ADMIN}
_CAP_VERSION_3 = 0x20080522


def _capabilities():
    """capget/capset through libc: (header, data, libc) of this thread's sets."""
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(_CAP_VERSION_3, 0), (Data * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    return header, data, libc


def raise_capture_capabilities() -> list[str]:
    """Make the capture capabilities this process holds in its permitted set effective: the
    least privilege for a daemon that is not root. The image's and the systemd unit's
    interpreter carries CAP_NET_RAW (AF_PACKET sockets) and CAP_NET_ADMIN (receive buffers
    beyond net.core.rmem_max) as permitted-only file capabilities, so it starts even where
    they are not granted, and nothing it runs inherits them: the JVM and Spark's Python
    workers (a plain interpreter) start with none. Called once, before any thread starts
    (threads inherit the caller's effective set). The names made effective."""
    import ctypes
    import sys
    if not sys.platform.startswith("linux"):
        return []
    try:
        header, data, libc = _capabilities()
    except (OSError, AttributeError):
        return []
    raised = [name for name, bit in CAPTURE_CAPS.items()
              if data[0].permitted >> bit & 1 and not data[0].effective >> bit & 1]
    if not raised:
        return []
    for name in raised:
        data[0].effective |= 1 << CAPTURE_CAPS[name]
    if libc.capset(ctypes.byref(header), data) != 0:
        return []
    return raised


def effective_capabilities() -> set[str]:
    """The capture capabilities in effect for this thread."""
    try:
        _, data, _ = _capabilities()
    except (OSError, AttributeError):
        return set()
    return {name for name, bit in CAPTURE_CAPS.items() if data[0].effective >> bit & 1}
