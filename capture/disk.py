"""Files written durably: fsynced before they are renamed into place, their directories
fsynced after.

SIGKILL keeps the page cache: a file renamed into place survives a killed process whether it
was fsynced or not. A power cut or a kernel panic does not keep it, and a rename whose target
was never written out can leave a name pointing at nothing. So every file flowsieve depends on
after a crash (a spool file, a source's committed position, an answer part, the NetFlow
templates, an enrichment dictionary) is written to a hidden name, fsynced, renamed, and its
directory fsynced before the step that relies on it (a position committed over it, a batch of
Spark's marked done). tests/collector/pipeline/test_fsync.py checks the order.
"""

from __future__ import annotations

import os
from pathlib import Path


def sync_dir(path: str | os.PathLike) -> None:
    """fsync a directory: the names created, renamed or removed in it are on disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_file(path: str | os.PathLike) -> None:
    """fsync a file written and closed by a library that does not (pyarrow's writers)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace(tmp: str | os.PathLike, final: str | os.PathLike, sync: bool = True) -> None:
    """Rename a written file into place: fsynced first (a crash never leaves the name
    pointing at unwritten bytes), its directory fsynced after (the name survives)."""
    if sync:
        sync_file(tmp)
    os.replace(tmp, final)
    if sync:
        sync_dir(Path(final).parent)


def write_bytes(path: str | os.PathLike, data: bytes, sync: bool = True) -> None:
    """Write a small file atomically (readers see the old one or the new one), on disk before
    it replaces the old one when ``sync``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync:
        sync_dir(path.parent)
