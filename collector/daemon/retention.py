"""How long answers are kept: by age and by bytes, per query (``results.max_age`` and
``results.max_bytes``, each query's own over REST), like nfexpire for nfdump's files.

A query's answers are its parts (collector/spark/write.py: one per answer job, a row group
per window it closed; a file, or several when Spark's engine spread a large answer).
Retention removes whole parts, oldest first: those written longer than the age limit ago,
then more until the query holds no more than its byte limit. A part being read while removed
is read to its end (POSIX keeps an open file); the API's next page finds the windows gone.
Quarantined spool files (``<folder>/bad/``) age out the same way.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from collector.daemon.results import part_files
from collector.spark.write import part_of, remove_older

log = logging.getLogger("flowsieve.retention")

@dataclass(frozen=True)
class Limits:
    """A query's retention: answers at most this old (s since written) and this many bytes;
    None: unbounded."""

    max_age_s: float | None = None
    max_bytes: int | None = None


@dataclass
class Held:
    """What a query holds after retention ran, and what it removed by reason."""

    bytes: int = 0
    files: int = 0
    removed_age: int = 0
    removed_bytes: int = 0


def _parts(root: str | os.PathLike, name: str) -> list[tuple[float, str, int, list[Path]]]:
    """A query's parts, oldest first: (last written, name, bytes, its files: one, or a
    spread answer's several, removed together)."""
    by_part: dict[str, list] = {}
    for path in part_files(root, name):
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        p = by_part.setdefault(part_of(path.name), [0.0, 0, []])
        p[0], p[1] = max(p[0], st.st_mtime), p[1] + st.st_size
        p[2].append(path)
    return sorted((mtime, part, size, sorted(paths))
                  for part, (mtime, size, paths) in by_part.items())


def held_bytes(root: str | os.PathLike, name: str) -> int:
    return sum(size for _, _, size, _ in _parts(root, name))


def enforce(root: str | os.PathLike, name: str, limits: Limits, now: float | None = None
            ) -> Held:
    """Remove query ``name``'s parts beyond its limits, oldest first."""
    now = time.time() if now is None else now
    parts = _parts(root, name)
    held = Held(bytes=sum(p[2] for p in parts), files=len(parts))
    keep = []
    for mtime, _, size, paths in parts:
        if limits.max_age_s is not None and now - mtime > limits.max_age_s:
            if _remove(paths):
                held.removed_age += 1
                held.bytes -= size
                held.files -= 1
                continue
        keep.append((size, paths))
    for size, paths in keep:  # oldest first, until within the byte limit
        if limits.max_bytes is None or held.bytes <= limits.max_bytes:
            break
        if _remove(paths):
            held.removed_bytes += 1
            held.bytes -= size
            held.files -= 1
    if held.removed_age or held.removed_bytes:
        log.info("retention: query %s: removed %d parts older than its age limit and %d "
                 "beyond its byte limit; it holds %d bytes in %d parts", name, held.removed_age,
                 held.removed_bytes, held.bytes, held.files)
    return held


def _remove(paths: list[Path]) -> bool:
    """Remove a part's files; whether any was there to remove."""
    removed = False
    for path in paths:
        try:
            path.unlink()
            removed = True
        except FileNotFoundError:  # replaced or removed meanwhile
            pass
        except OSError as e:
            log.warning("retention: cannot remove %s: %s", path, e)
    return removed


def expire_quarantined(spool_root: str | os.PathLike, max_age_s: float,
                       now: float | None = None) -> int:
    """Remove quarantined spool files (and their ``.reason``) set aside longer ago than
    ``max_age_s``; how many files were removed."""
    return remove_older(Path(spool_root).glob("*/*/bad/*"), max_age_s, now)
