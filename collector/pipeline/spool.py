"""The spool: Parquet (default) or Arrow IPC files, one folder per stream and period, written
with an atomic rename. Parquet is read by Spark's own file source, Arrow IPC by flowsieve's Python
data source (collector/spark/source.py); bench/README.md says why Parquet is the default.

It is the contract between capture daemons and Spark. The schema is fixed per (stream, period),
so registering a query never restarts Spark (DESIGN, "Spool batch"). Several capture daemons
(probes) may write one spool on shared storage: each numbers its own files,
``<seq>.<probe>.parquet`` with a high-water mark ``_seq.<probe>`` per folder, so no two writers
ever need a lock or pick the same name.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from capture.disk import sync_dir, sync_file, write_bytes
from capture.fields import fields, measures
from collector.crashpoints import reached

log = logging.getLogger("flowsieve.spool")

SUFFIXES = {"parquet": ".parquet", "arrow": ".arrow"}
TS_US = pa.timestamp("us", tz="UTC")
PROBE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def aggregate_schema(stream: str) -> pa.Schema:
    """Partial-aggregate rows of a (stream, period) folder: the node's group key packed into one
    binary value (collector/keys.py; ``node`` names its layout), so the HFTA groups by
    ``(window_start, node, key)`` whatever the node."""
    cols = [pa.field("window_start", TS_US), pa.field("plan_version", pa.int32()),
            pa.field("node", pa.string()), pa.field("key", pa.binary()),
            pa.field("cnt", pa.int64())]
    for m in measures(stream):
        cols += [pa.field(f"{agg}_{m.name}", pa.int64()) for agg in ("sum", "min", "max")]
    # a node with a sketch key (~dst_ip): the row's HyperLogLog sketch (DataSketches, compact)
    cols += [pa.field("hll", pa.binary()), pa.field("probe", pa.string())]
    return pa.schema(cols)


def select_schema(stream: str) -> pa.Schema:
    """Matching tuples of a stream's selection folder."""
    cols = [pa.field(f.name, f.arrow_type) for f in fields(stream).values()]
    cols += [pa.field("qmask", pa.list_(pa.int64())), pa.field("plan_version", pa.int32())]
    return pa.schema(cols)


def schema_for(stream: str, folder: str) -> pa.Schema:
    return select_schema(stream) if folder == "select" else aggregate_schema(stream)


def spark_ddl(schema: pa.Schema) -> str:
    """The Spark DDL string of a spool schema."""
    def t(dt: pa.DataType) -> str:
        if pa.types.is_timestamp(dt):
            return "timestamp"
        if pa.types.is_list(dt):
            return f"array<{t(dt.value_type)}>"
        return {pa.int32(): "int", pa.int64(): "bigint", pa.binary(): "binary",
                pa.string(): "string"}[dt]
    return ", ".join(f"`{f.name}` {t(f.type)}" for f in schema)


# a Parquet spool file's footer key: its partial rows' counts per (node layout, query-bit
# pattern), JSON ``[[node, pattern as hex, rows], ...]``: ``replay`` learns which queries the
# spool's rows carry, and how many rows each has, from the footers, not from a Spark job
PATTERNS_KEY = b"flowsieve.patterns"


def with_patterns(stream: str, table: pa.Table) -> pa.Table:
    """A table of partial rows with their (node, pattern) counts in its schema's metadata."""
    import json

    from collector.keys import pattern_counts
    counts = pattern_counts(stream, table)
    text = json.dumps([[n, p.hex(), c] for (n, p), c in sorted(counts.items())])
    return table.replace_schema_metadata({**(table.schema.metadata or {}),
                                          PATTERNS_KEY: text.encode()})


def footer_patterns(paths) -> dict[tuple[str, bytes], int] | None:
    """The (node layout, query-bit pattern) counts of the partial rows in Parquet spool
    files, summed from their footers (``with_patterns``); None when a file has none (written
    by an older probe, or a selection's tuples) or cannot be read."""
    import json
    out: dict[tuple[str, bytes], int] = {}
    for path in paths:
        try:
            meta = pq.read_metadata(path).metadata or {}
        except (OSError, pa.ArrowException):
            return None
        if PATTERNS_KEY not in meta:
            return None
        for node, pat, n in json.loads(meta[PATTERNS_KEY]):
            key = (node, bytes.fromhex(pat))
            out[key] = out.get(key, 0) + n
    return out


def file_seq(path: Path) -> int:
    return int(path.name.split(".", 1)[0])


def _is_spool_file(name: str) -> bool:
    """``<seq>.<probe>.parquet`` (or ``<seq>.parquet``, written before probes had names)."""
    parts = name.split(".")
    return parts[0].isdigit() and len(parts) in (2, 3) and f".{parts[-1]}" in SUFFIXES.values()


def _name_seq(name: str, probe: str | None = None) -> int | None:
    """The sequence number of any spool file name: ``<seq>.<probe>.parquet``,
    ``.<probe>.<seq>.tmp``, ``.<probe>-<source>.<seq>.held`` or ``.snap``; None for other
    names and, given ``probe``, for another probe's files (a name without a probe is
    anyone's)."""
    parts = name.split(".")
    if _is_spool_file(name):
        mine = len(parts) == 2 or probe in (None, parts[1])
        seq = int(parts[0])
    elif name.startswith(".") and parts[-1] in ("tmp", "held", "snap") and len(parts) >= 4 \
            and parts[-2].isdigit():
        tag = parts[1]
        mine = probe is None or tag == probe or (parts[-1] != "tmp" and
                                                 tag.startswith(f"{probe}-"))
        seq = int(parts[-2])
    else:
        return None
    return seq if mine else None


def list_files(folder: Path) -> list[Path]:
    """Complete spool files of a folder, by sequence number."""
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted((folder / n for n in names if _is_spool_file(n)), key=file_seq)


def read_spool_file(path: Path) -> pa.Table:
    """A spool file of either format, whole."""
    if path.suffix == SUFFIXES["parquet"]:
        return pq.read_table(path)
    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_file(source).read_all()


def as_spool_table(stream: str, folder: str, batch: pa.RecordBatch | pa.Table) -> pa.Table:
    """A batch as a table of the folder's spool schema (its columns, in order and type)."""
    schema = schema_for(stream, folder)
    table = batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])
    return table.select(schema.names).cast(schema)


SEQ_BLOCK = 1024  # sequence numbers reserved by one durable write of a folder's mark


class SpoolFull(RuntimeError):
    """The spool stayed over its size limit longer than a blocking writer may wait."""


class DiskFull(SpoolFull):
    """The spool's file system is full (or its quota reached): a ``drop`` writer's file was
    not written, or a blocking one was stopped while it waited."""


def disk_full(e: OSError) -> bool:
    return getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT)


DISK_RETRY_S = 1.0  # a blocked writer tries a full disk again this often


class Spool:
    """Writes ``probe``'s spool files under ``root/<stream>/<folder>/`` with sequence numbers
    that never repeat (a high-water mark survives restarts and Spark's deletion of committed
    files)."""

    def __init__(self, root: str | os.PathLike, max_bytes: int = 8 << 30, policy: str = "block",
                 block_timeout_s: float | None = None, format: str = "parquet",  # noqa: A002
                 probe: str = "flowsieve", fsync: bool = True):
        if policy not in ("block", "drop"):
            raise ValueError("spool policy is 'block' or 'drop'")
        if format not in SUFFIXES:
            raise ValueError(f"spool format is one of {', '.join(SUFFIXES)}")
        if not PROBE_NAME.fullmatch(probe):
            raise ValueError(f"probe name {probe!r}: 1 to 64 letters, digits, '_' or '-'")
        self.probe = probe
        self.format = format
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.policy = policy
        self.block_timeout_s = block_timeout_s
        self._lock = threading.Lock()
        self._seq: dict[Path, int] = {}
        self._reserved: dict[Path, int] = {}  # per folder: the mark on disk
        self.fsync = fsync
        self._walked = self.size()  # bytes found by the last walk of the folder
        self._written = 0  # bytes written since
        self.disk_full = 0  # writes that found the file system full
        self.full_since: float | None = None  # the disk is full since (None: it is not)

    def folder(self, stream: str, folder: str) -> Path:
        path = self.root / stream / folder
        if not path.is_dir():  # new, or removed by hand: its mark is written again
            path.mkdir(parents=True, exist_ok=True)
            with self._lock:
                self._reserved.pop(path, None)
        return path

    def _next_seq(self, folder: Path) -> int:
        """The next sequence number of ``folder``. The mark on disk is written ahead, a block
        of numbers at a time and fsynced (one durable write per ``SEQ_BLOCK`` files): a
        restart, even after a power cut, starts above every number it may have used (a number
        used again would name a file Spark has read before, which it skips)."""
        if folder not in self._seq:
            self._seq[folder] = self._stored_seq(folder)
        self._seq[folder] += 1
        seq = self._seq[folder]
        if seq > self._reserved.get(folder, -1):
            top = seq + SEQ_BLOCK - 1
            write_bytes(folder / f"_seq.{self.probe}", str(top).encode(), self.fsync)
            self._reserved[folder] = top
        return seq

    def _stored_seq(self, folder: Path) -> int:
        """This probe's latest sequence number in ``folder`` (its mark, or its files; a
        spool written before probes had names: the folder's ``_seq`` and unnamed files)."""
        marks = [-1]
        for name in (f"_seq.{self.probe}", "_seq"):
            try:
                marks.append(int((folder / name).read_text()))
            except (FileNotFoundError, ValueError):
                pass
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            names = []
        marks += [s for s in (_name_seq(n, self.probe) for n in names) if s is not None]
        return max(marks)

    def size(self) -> int:
        total = 0
        for dirpath, _, names in os.walk(self.root):
            for n in names:
                if _is_spool_file(n) or n.endswith(".held"):
                    try:
                        total += os.path.getsize(os.path.join(dirpath, n))
                    except FileNotFoundError:
                        pass
        return total

    def quarantined(self) -> int:
        """Spool files Spark's reader could not read, moved to ``<folder>/bad/``."""
        return sum(1 for p in self.root.glob("*/*/bad/*") if _is_spool_file(p.name))

    def has_room(self) -> bool:
        # the folder is walked only when what it may hold (its size when last walked, plus
        # what was written since) reaches the bound: Spark's deletions only make room
        if self._written + self._walked < self.max_bytes:
            return True
        self._walked, self._written = self.size(), 0
        return self._walked < self.max_bytes

    def wait_for_room(self, stop: threading.Event | None = None,
                      waiting: Callable[[float], None] | None = None) -> None:
        """Back-pressure before a batch: wait until the spool has room (``block``)."""
        self._room("block", stop, waiting)

    def _room(self, policy: str, stop: threading.Event | None,
              waiting: Callable[[float], None] | None) -> bool:
        """Whether a file may be written now. ``drop``: only if there is room. ``block``:
        wait for Spark to make room (back-pressure) for ``block_timeout_s`` (None: as long as
        it takes), then raise SpoolFull; once ``stop`` is set the file is written anyway
        (nothing accepted is lost at shutdown). ``waiting(seconds)`` hears, every 0.2 s of a
        wait, how long it has waited since it was last told."""
        if policy == "force" or self.has_room():
            return True
        if policy == "drop":
            return False
        t0 = told = time.monotonic()
        while not self.has_room():
            if stop is not None and stop.is_set():
                break
            if self.block_timeout_s is not None and \
                    time.monotonic() - t0 >= self.block_timeout_s:
                raise SpoolFull(f"spool {self.root} stayed over {self.max_bytes} bytes for "
                                f"{self.block_timeout_s:.0f} s: is the Spark job running?"
                                if self.block_timeout_s else
                                f"spool {self.root} reached spool.max_bytes "
                                f"({self.max_bytes} bytes) before the end of the input")
            (stop.wait if stop is not None else time.sleep)(0.2)
            now = time.monotonic()
            if waiting is not None:
                waiting(now - told)
            told = now
        return True

    def write(self, stream: str, folder: str, batch: pa.RecordBatch | pa.Table,
              policy: str | None = None, stop: threading.Event | None = None,
              waiting: Callable[[float], None] | None = None,
              hold: str | None = None, kind: str = "held") -> Path | Held | None:
        """Write one file atomically; None if dropped because the spool is full and the
        writer's ``policy`` (default: the spool's) is ``drop`` (a full file system: see
        ``on_disk``). With ``hold`` (the writer's
        tag) the file stays hidden, ``.<hold>.<seq>.held``, until ``publish``: a durable
        source makes it visible together with its read position (collector/pipeline/durability.py).
        ``kind="snap"``: a checkpoint's snapshot, published only by a restart; it does not count
        against ``max_bytes`` (Spark cannot make room by reading it)."""
        policy = policy or self.policy
        if not self._room(policy, stop, waiting):
            return None
        table = as_spool_table(stream, folder, batch)
        return self.on_disk(lambda: self._write(stream, folder, table, hold, kind), policy,
                            stop, waiting)

    def on_disk(self, write: Callable[[], object], policy: str,
                stop: threading.Event | None = None,
                waiting: Callable[[float], None] | None = None):
        """``write()``, which writes to the spool's file system. A full one (ENOSPC, EDQUOT):
        ``drop`` raises DiskFull at once; otherwise the write is tried again every second until
        it fits (the source waits: nothing it read is lost), or raises DiskFull once ``stop``
        is set."""
        while True:
            try:
                out = write()
            except OSError as e:
                if not disk_full(e):
                    raise
                with self._lock:
                    self.disk_full += 1
                    first, self.full_since = self.full_since is None, self.full_since or \
                        time.time()
                if first:
                    log.error("spool %s: the file system is full (%s); sources %s", self.root,
                              e.strerror or e, "drop their batches" if policy == "drop" else
                              "wait until there is room")
                if policy == "drop" or (stop is not None and stop.is_set()):
                    raise DiskFull(f"spool {self.root}: no space left on its file system") \
                        from e
                (stop.wait if stop is not None else time.sleep)(DISK_RETRY_S)
                if waiting is not None:
                    waiting(DISK_RETRY_S)
                continue
            if self.full_since is not None:
                log.warning("spool %s: there is room again", self.root)
                self.full_since = None
            return out

    def _write(self, stream: str, folder: str, table: pa.Table, hold: str | None, kind: str
               ) -> Path | Held:
        path_dir = self.folder(stream, folder)
        with self._lock:
            seq = self._next_seq(path_dir)
        final = path_dir / f"{seq:016d}.{self.probe}{SUFFIXES[self.format]}"
        tmp = path_dir / f".{self.probe}.{seq:016d}.tmp"  # hidden: no reader lists it
        try:
            self._write_file(tmp, table, stream, folder)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if kind == "held":
            size = tmp.stat().st_size
            with self._lock:  # writers on several threads (the daemon's engines, a source each)
                self._written += size
        if self.fsync:
            try:
                sync_file(tmp)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        reached("spool.write")
        if hold is not None:  # its name is synced by the commit that lists it
            held = path_dir / f".{hold}.{seq:016d}.{kind}"
            os.replace(tmp, held)
            reached("spool.rename")
            return Held(held, final)
        os.replace(tmp, final)
        if self.fsync:
            sync_dir(path_dir)
        reached("spool.rename")
        return final

    def _write_file(self, tmp: Path, table: pa.Table, stream: str, folder: str) -> None:
        if self.format == "parquet":
            if folder != "select":
                table = with_patterns(stream, table)
            pq.write_table(table, tmp, row_group_size=1 << 20, compression="lz4")
        else:
            with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
                writer.write_table(table, max_chunksize=65536)

    def high_water(self) -> dict[Path, int]:
        """Per folder, the sequence number of this probe's latest file written (or being
        written)."""
        out = {}
        for folder in (p for p in self.root.glob("*/*")
                       if p.is_dir() and not p.parent.name.startswith("_")):
            with self._lock:
                seq = self._seq.get(folder)
            out[folder] = self._stored_seq(folder) if seq is None else seq
        return out

    def holds_up_to(self, high_water: dict[Path, int], probe: str | None = None) -> bool:
        """Whether any of this probe's (or ``probe``'s) files numbered at or below a folder's
        ``high_water`` mark is still in it (visible, held, a snapshot or being written): Spark
        has not read all of them."""
        for folder, top in high_water.items():
            try:
                names = os.listdir(folder)
            except FileNotFoundError:
                continue
            for n in names:
                seq = _name_seq(n, probe or self.probe)
                if seq is not None and seq <= top:
                    return True
        return False

    def sweep(self) -> int:
        """Remove what this probe was writing when it last died (``.<probe>.<seq>.tmp``, a
        sequence mark's temporary file): called at start, before it writes. How many."""
        removed = 0
        for pattern in (f"*/*/.{self.probe}.*.tmp", f"*/*/._seq.{self.probe}.tmp"):
            for p in self.root.glob(pattern):
                p.unlink(missing_ok=True)
                removed += 1
        if removed:
            log.info("spool %s: %d files a crash left half-written removed", self.root, removed)
        return removed

    def held_files(self, hold: str) -> list[Path]:
        """Every hidden file a writer tagged ``hold`` left (published or not)."""
        return sorted([*self.root.glob(f"*/*/.{hold}.*.held"),
                       *self.root.glob(f"*/*/.{hold}.*.snap")])


@dataclass(frozen=True)
class Held:
    """A spool file written but hidden from Spark until its writer publishes it."""

    path: Path
    final: Path

    def publish(self) -> None:
        """Make it visible. Idempotent: a file published before (and maybe read and deleted
        by Spark since) is left alone."""
        try:
            os.replace(self.path, self.final)
        except FileNotFoundError:
            pass

    def to_json(self) -> list[str]:
        return [str(self.path), str(self.final)]

    @classmethod
    def from_json(cls, v: list[str]) -> Held:
        return cls(Path(v[0]), Path(v[1]))


def qmask_array(words: np.ndarray) -> pa.Array:
    """Query-bit words, (rows, words) uint64 or int64, as the spool's ``qmask`` column."""
    n, w = words.shape
    offsets = pa.array(np.arange(0, n * w + 1, w, dtype=np.int32))
    return pa.ListArray.from_arrays(
        offsets, pa.array(np.ascontiguousarray(words).view(np.int64).reshape(-1)))


def qmask_words(qmask: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The ``qmask`` column back to (rows, words) uint64; shorter lists (an older plan with
    fewer slots) are padded with zero words."""
    if isinstance(qmask, pa.ChunkedArray):
        qmask = qmask.combine_chunks()
    n = len(qmask)
    lens = pc.list_value_length(qmask).to_numpy(zero_copy_only=False).astype(np.int64)
    width = int(lens.max()) if n else 1
    flat = pc.list_flatten(qmask).to_numpy(zero_copy_only=False).view(np.uint64)
    if (lens == width).all():
        return flat.reshape(n, width)
    out = np.zeros((n, width), np.uint64)
    row = np.repeat(np.arange(n), lens)
    col = np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)
    out[row, col] = flat
    return out


def null_columns(schema: pa.Schema, n: int, present: dict[str, pa.Array]) -> list[pa.Array]:
    """Arrays for every schema column: given ones, NULL for the rest."""
    return [present[f.name] if f.name in present else pa.nulls(n, f.type) for f in schema]


def punctuation(stream: str, window_start_s: int, plan_version: int, probe: str
                ) -> pa.RecordBatch:
    """One row of no node (``node`` empty, count 0) whose window_start advances Spark's
    watermark."""
    schema = aggregate_schema(stream)
    present = {
        "window_start": pa.array([window_start_s * 1_000_000], TS_US),
        "plan_version": pa.array([plan_version], pa.int32()),
        "node": pa.array([""], pa.string()),
        "key": pa.array([b""], pa.binary()),
        "cnt": pa.array([0], pa.int64()),
        "probe": pa.array([probe], pa.string()),
    }
    return pa.RecordBatch.from_arrays(null_columns(schema, 1, present), schema=schema)
