"""Where the HFTA's work lands: answers written by the executors, and the checkpoints of its
streaming queries kept startable.

Each answer job writes, per query it answered, one Parquet file of the windows it closed:
``results/query=<name>/part-<job>.parquet`` (``<job>``: ``replay``, or the streaming query's
run and batch), a row group per window (its ``window_start`` statistics name it), rows in the
query's order. The task that computes a query's answers writes them, a window at a time,
under a hidden name, and renames the file into place when done: a part appears whole, and a
job run again (a batch Spark runs again after a crash) writes the same name and replaces its
part, never adds to it. Spark's engine answers a large query without ORDER BY or LIMIT in
several tasks, each its share of the keys: that part is then several files,
``part-<job>.parquet`` and ``part-<job>.<i>.parquet``, each in the query's order (readers
merge them: ``collector/daemon/results.py``), moved into place one by one (``promote``).
``results/query=<name>/`` reads as a table in Spark, pyarrow or DuckDB.

Why the task and not Spark's Parquet writer: a window's answer is a partition only that writer's
dynamic overwrite could replace, and on a local file system Hadoop sets every directory and file
it creates with a ``chmod`` process (no native library here): about 13 ms a (query, window)
partition (bench/README.md: 250 partitions, 4.3 s against 0.6 s for the same rows in one), and
it would take every answer row back from Python into the JVM first.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from capture.disk import sync_dir, sync_file
from collector.crashpoints import reached

QUERY = "query"  # the results' partition: results/query=<name>/


log = logging.getLogger("flowsieve.spark")


class PartWriter:
    """One query's part of an answer job's results, written a window (a row group) at a time
    by the task that computes them, renamed into place whole by ``close``."""

    def __init__(self, root: str | os.PathLike, query: str, name: str, schema: pa.Schema,
                 meta: dict[str, str] | None = None):
        d = Path(root) / f"{QUERY}={query}"
        d.mkdir(parents=True, exist_ok=True)
        self.final = d / name
        self.tmp = d / f".{name}.{uuid.uuid4().hex[:12]}.tmp"
        self.rows = 0
        self._writer = pq.ParquetWriter(self.tmp, schema.with_metadata(meta or {}))

    def write(self, table: pa.Table) -> None:
        self._writer.write_table(table)
        self.rows += table.num_rows

    def close(self) -> Path:
        """Rename the part into place, on disk with its name (Spark marks its batch done
        after the task returns)."""
        self._writer.close()
        sync_file(self.tmp)
        reached("results.write")
        os.replace(self.tmp, self.final)
        sync_dir(self.final.parent)
        reached("results.rename")
        return self.final

    def abort(self) -> None:
        try:
            self._writer.close()
        finally:
            self.tmp.unlink(missing_ok=True)


def stage_dir(root: str | os.PathLike, job: str) -> Path:
    """Where Spark's writer writes an answer job's parts before ``promote`` moves them in
    (``_``: hidden from readers of the results, Spark's included)."""
    return Path(root) / "_jobs" / job


def promote(root: str | os.PathLike, job: str, name: str) -> dict[str, list[Path]]:
    """Move what Spark's writer wrote for an answer job (``stage_dir``, a ``query=<name>``
    folder per query, a file per task that answered it) into the results as each query's
    part ``name`` (its first file; a spread answer's others ``spread_name(name, i)``): each
    file renamed over the part of an earlier run of the same job (a batch Spark runs again
    after a crash), on disk with its name before the next, then the earlier run's parts
    beyond this run's removed; then the staging folder goes. The parts by query."""
    stage = stage_dir(root, job)
    out: dict[str, list[Path]] = {}
    for qdir in sorted(stage.glob(f"{QUERY}=*")):
        files = sorted(f for f in qdir.iterdir() if f.name.endswith(".parquet")
                       and not f.name.startswith((".", "_")))
        if not files:
            continue
        dest_dir = Path(root) / qdir.name
        dest_dir.mkdir(parents=True, exist_ok=True)
        done = []
        for i, f in enumerate(files):
            dest = dest_dir / (name if i == 0 else spread_name(name, i))
            sync_file(f)
            reached("results.write")
            os.replace(f, dest)
            sync_dir(dest_dir)
            reached("results.rename")
            done.append(dest)
        drop_others(dest_dir, name, {p.name for p in done})
        out[qdir.name.partition("=")[2]] = done
    shutil.rmtree(stage, ignore_errors=True)
    return out


def drop_others(query_dir: Path, name: str, kept: set[str]) -> None:
    """The further files of part ``name`` that an earlier run of its job wrote (it spread the
    query wider) and this one did not: removed."""
    for old in query_dir.glob(f"{name.removesuffix('.parquet')}.*.parquet"):
        if old.name not in kept:
            old.unlink(missing_ok=True)


def file_rows(files) -> int:
    """The rows of Parquet files, from their footers."""
    return sum(pq.ParquetFile(f).metadata.num_rows for f in files)


def spread_name(name: str, i: int) -> str:
    """The ``i``-th (from 1) further file of part ``name`` (``part-<job>.parquet``) when
    several tasks answered its query: ``part-<job>.<i>.parquet``."""
    return f"{name.removesuffix('.parquet')}.{i}.parquet"


def part_of(file_name: str) -> str:
    """The part (answer job) a results file belongs to: ``part-<job>.parquet`` for itself
    and for its spread files."""
    return f"{file_name.split('.')[0]}.parquet"


STALE_S = 3600.0  # a hidden part file this old is a dead task's


def sweep_results(root: str | os.PathLike, older_than_s: float = STALE_S) -> int:
    """Remove the hidden files of answer tasks that died while writing (killed, out of memory)
    and are this old; the number removed."""
    # and the staging folders of Spark's writer whose batch never ran again
    return remove_older(Path(root).glob(f"{QUERY}=*/.part-*.tmp"), older_than_s) + \
        remove_older(Path(root).glob("_jobs/*"), older_than_s)


def remove_older(paths, older_than_s: float, now: float | None = None) -> int:
    """Remove those of ``paths`` (files, or folders with what they hold) last changed more
    than ``older_than_s`` ago; how many (one removed meanwhile by another is not counted)."""
    now = time.time() if now is None else now
    removed = 0
    for path in paths:
        try:
            if now - path.stat().st_mtime > older_than_s:
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink()
                removed += 1
        except FileNotFoundError:
            pass
    return removed


def clear_leftovers(checkpoint: Path) -> list[Path]:
    """Remove what an interrupted checkpoint write left in a streaming query's checkpoint, so
    that it starts again by itself: the temporary files of an offset or commit log entry that
    was never renamed into place (``.<batch>.<uuid>.tmp`` and their checksums). A checkpoint
    holding no logged batch at all is removed whole: its query never ran a batch, and Spark
    refuses to start batch 0 over anything left there. Returns what it removed."""
    removed: list[Path] = []
    if not checkpoint.is_dir():
        return removed
    logged = False
    for log_dir in ("offsets", "commits"):
        d = checkpoint / log_dir
        try:
            names = os.listdir(d)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for name in names:
            if name.startswith(".") and (name.endswith(".tmp") or name.endswith(".tmp.crc")):
                path = d / name
                path.unlink(missing_ok=True)
                removed.append(path)
            elif log_dir == "offsets" and name.isdigit():
                logged = True
    if not logged and any(checkpoint.iterdir()):
        log.warning("checkpoint %s holds no batch: removed, its query starts afresh", checkpoint)
        removed.append(checkpoint)
        shutil.rmtree(checkpoint, ignore_errors=True)
    elif removed:
        log.warning("checkpoint %s: removed %d leftovers of an interrupted write", checkpoint,
                    len(removed))
    return removed
