"""Crash points: a test stops the daemon at each of its durable steps, by name.

A crash point (``FLOWSIEVE_CRASH=<point>:<n>``) makes the process SIGKILL itself — the daemon,
its Spark JVM and the JVM's Python workers, as a power cut would — the ``n``-th time the
process tree reaches the named step (hits counted in ``FLOWSIEVE_CRASH_DIR`` when set, so the
JVM's Python workers count together with the daemon). ``<point>:<n>:jvm`` kills the JVM alone
(the daemon starts a new one). The Spark JVM's own steps (its offset and commit logs, its state
store) are reached when the file appears in a checkpoint (``watch_checkpoints``, inotify). A
test walks every point (tests/test_crash_points.py); nothing happens when the variable is unset.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import re
import signal
import struct
import threading
from pathlib import Path

log = logging.getLogger("flowsieve.crash")

# the daemon's durable steps (reached in this process or an answer task's Python worker)
POINTS = {
    "spool.write": "a spool file's bytes written, not yet renamed to its spool or held name",
    "spool.rename": "a spool file renamed into place (visible to Spark, or held)",
    "lfta.snapshot": "a durable source's LFTA snapshot written, its position not committed",
    "position.commit": "a durable source's position committed, its held files not published",
    "spool.publish": "the first of a commit's held files published, the others not",
    "results.write": "an answer part's rows written, not renamed into place",
    "results.rename": "an answer part renamed into place, Spark's batch not committed",
    "registry.update": "a query registered in the registry, the plan not rebuilt",
    "alerts.apply": "a window's alert changes and notifications in the outbox, none sent",
    "alerts.send": "notifications sent to a receiver, not yet marked delivered",
}
# the Spark JVM's, reached when its file appears in a streaming query's checkpoint
JVM_POINTS = {
    "spark.offsets": "a micro-batch's offset log being written (its temporary file)",
    "spark.sources": "the file source's log of the files a micro-batch takes, being written",
    "spark.commits": "a micro-batch's commit log being written (its temporary file)",
    "spark.state": "the state store's new version being written (its temporary file)",
}
_JVM_DIRS = {"spark.offsets": "offsets", "spark.sources": "sources", "spark.commits": "commits",
             "spark.state": "state"}

_UNREAD = ("", 0, False)
_spec: tuple[str, int, bool] | None = _UNREAD  # read from the environment on first use
_hits = 0
_lock = threading.Lock()


def _parse(value: str | None) -> tuple[str, int, bool] | None:
    if not value:
        return None
    m = re.fullmatch(r"([a-z._]+):(\d+)(:jvm)?", value.strip())
    if m is None or (m[1] not in POINTS and m[1] not in JVM_POINTS) or int(m[2]) < 1:
        raise ValueError(f"FLOWSIEVE_CRASH={value!r}: <point>:<n>[:jvm], n >= 1, a point of "
                         f"{', '.join(sorted({**POINTS, **JVM_POINTS}))}")
    return m[1], int(m[2]), bool(m[3])


def configure(value: str | None = None) -> tuple[str, int, bool] | None:
    """Read ``FLOWSIEVE_CRASH`` (or ``value``); the crash point armed, if any."""
    global _spec, _hits
    _spec = _parse(os.environ.get("FLOWSIEVE_CRASH") if value is None else value)
    _hits = 0
    return _spec


def reached(point: str) -> None:
    """The process is at a durable step: crash here if this is the armed point's n-th hit."""
    global _spec
    if _spec is _UNREAD:
        try:
            configure()
        except ValueError as e:  # the daemon said so at start; a worker keeps going
            log.error("%s", e)
            configure("")
    armed = _spec
    if armed is None or armed[0] != point:
        return
    if _count(point) == armed[1]:
        _spec = None  # once: a JVM killed alone is followed by a new one, never killed again
        crash(armed[2], point)


def _count(point: str) -> int:
    """This hit's number: in the process, or across the process tree (``FLOWSIEVE_CRASH_DIR``:
    one byte appended per hit under a lock, the file's size after it is the count)."""
    global _hits
    folder = os.environ.get("FLOWSIEVE_CRASH_DIR")
    if not folder:
        with _lock:
            _hits += 1
            return _hits
    fd = os.open(os.path.join(folder, f"{point}.hits"), os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b".")
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _ancestors() -> list[int]:
    out, pid = [], os.getpid()
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        out.append(pid)
    return out


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return out


def crash(jvm_only: bool = False, point: str = "") -> None:
    """SIGKILL the process tree at once: the Spark JVM (this process's child, or the ancestor
    of an answer task's worker) and, unless ``jvm_only``, the daemon; then this process, unless
    it is the daemon and only the JVM dies."""
    up = _ancestors()
    jvm = next((p for p in up if _comm(p) == "java"), None)
    if jvm is not None:  # an answer task's worker: the daemon is the JVM's parent
        above = up[up.index(jvm) + 1:]
        victims = [jvm] + ([] if jvm_only or not above else [above[0]])
    else:
        victims = [p for p in _children(os.getpid()) if _comm(p) == "java"]
    log.warning("crash point %s reached: SIGKILL %s%s", point, victims,
                "" if jvm_only and jvm is None else " and this process")
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    if not (jvm_only and jvm is None):
        os.kill(os.getpid(), signal.SIGKILL)


# ---- the JVM's steps, seen in its checkpoints

IN_CREATE, IN_MOVED_TO, IN_ISDIR = 0x100, 0x80, 0x40000000
_EVENT = struct.Struct("iIII")


class _Inotify:
    def __init__(self):
        self.libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self.fd = self.libc.inotify_init()
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init")
        self.paths: dict[int, Path] = {}

    def add(self, path: Path) -> None:
        wd = self.libc.inotify_add_watch(self.fd, str(path).encode(), IN_CREATE | IN_MOVED_TO)
        if wd < 0:
            err = ctypes.get_errno()
            if err != errno.ENOENT:
                raise OSError(err, f"inotify_add_watch {path}")
            return
        self.paths[wd] = path

    def events(self):
        while True:
            buf = os.read(self.fd, 65536)
            at = 0
            while at < len(buf):
                wd, mask, _, size = _EVENT.unpack_from(buf, at)
                name = buf[at + 16: at + 16 + size].rstrip(b"\0").decode()
                at += 16 + size
                if wd in self.paths:
                    yield self.paths[wd], name, mask


def _jvm_step(point: str, rel: Path, name: str) -> bool:
    """Whether a file ``name`` created in ``rel`` (relative to a query's checkpoint) is the
    start of the JVM step ``point``: the temporary file of a log entry or state version."""
    parts = rel.parts
    return bool(parts) and parts[0] == _JVM_DIRS[point] and name.endswith(".tmp") \
        and "_metadata" not in parts and (point != "spark.state" or len(parts) >= 3)


def watch_checkpoints(root: str | os.PathLike) -> threading.Thread | None:
    """When the armed crash point is the JVM's: watch every streaming query's checkpoint
    under ``root`` (folders as they appear) and crash when the point's file appears for the
    n-th time."""
    if _spec is _UNREAD:
        configure()
    if _spec is None or _spec[0] not in JVM_POINTS:
        return None
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    ino = _Inotify()

    def add_tree(path: Path) -> list[tuple[Path, str]]:
        """Watch ``path`` and the folders in it; the files already there (in a folder that
        appeared since the watch started, created before its own watch: seen now)."""
        found = []
        ino.add(path)
        try:
            entries = sorted(os.scandir(path), key=lambda e: e.name)
        except OSError:
            return found
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                found += add_tree(Path(e.path))
            else:
                found.append((path, e.name))
        return found

    counted: set[Path] = set()  # a file both found by a folder's scan and heard counts once

    def seen(folder: Path, name: str) -> None:
        rel = folder.relative_to(root)
        if folder / name in counted:
            return
        counted.add(folder / name)
        armed = _spec  # None once a JVM killed alone has been
        if armed is not None and len(rel.parts) >= 2 and \
                _jvm_step(armed[0], Path(*rel.parts[2:]), name):
            reached(armed[0])

    def run() -> None:
        for folder, name, mask in ino.events():
            if mask & IN_ISDIR:
                for f, n in add_tree(folder / name):
                    seen(f, n)
            elif mask & IN_CREATE:
                seen(folder, name)

    add_tree(root)  # what is there already was written before this process: no step of it
    t = threading.Thread(target=run, name="crash-watch", daemon=True)
    t.start()
    return t
