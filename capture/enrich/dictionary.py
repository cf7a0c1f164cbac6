"""The texts of text codes (``fields.code_of``: a hash of the text), published beside the spool.

A probe that loads a database with text attributes (AS names, cities, the operator's network
names) writes their (code, text) pairs as a Parquet file into ``<spool>/_control/dictionary/``,
named by its content (the same database on several probes writes one file; a reload that changes
nothing writes nothing), before any tuple enriched by it is spooled. The LFTA and Spark group by
the codes, integers like any other key; Spark's answer tasks turn the codes of an answer's key
columns into their texts by reading the folder, which lies on the storage the spool's readers
share.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from capture import disk

SCHEMA = pa.schema([pa.field("code", pa.int64()), pa.field("text", pa.string())])


def folder_of(spool_root: str | os.PathLike) -> Path:
    return Path(spool_root) / "_control" / "dictionary"


def publish(folder: str | os.PathLike, name: str, texts: dict[int, str]) -> Path | None:
    """Write ``texts`` as ``<name>-<digest>.parquet`` (atomically; kept if there already)."""
    if not texts:
        return None
    codes = np.array(sorted(texts), np.int64)
    digest = hashlib.blake2b(codes.tobytes(), digest_size=10).hexdigest()
    folder = Path(folder)
    path = folder / f"{name}-{digest}.parquet"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    table = pa.table({"code": codes, "text": [texts[int(c)] for c in codes]}, schema=SCHEMA)
    tmp = folder / f".{path.name}.{os.getpid()}.tmp"
    pq.write_table(table, tmp)
    disk.replace(tmp, path)
    return path


class Dictionary:
    """The codes and texts of a dictionary folder: codes sorted, texts beside them."""

    def __init__(self, folder: Path, files: tuple[str, ...]):
        self.files = files
        tables = [pq.read_table(folder / f, schema=SCHEMA) for f in files]
        table = pa.concat_tables(tables) if tables else SCHEMA.empty_table()
        codes = table.column("code").to_numpy()
        order = np.argsort(codes, kind="stable")
        self.codes = codes[order]
        self.texts = table.column("text").take(pa.array(order))

    def lookup(self, codes: pa.Array | pa.ChunkedArray) -> pa.Array:
        """Texts of codes (NULL: a NULL code, or one no file has)."""
        if isinstance(codes, pa.ChunkedArray):
            codes = codes.combine_chunks()
        if not len(codes) or not len(self.codes):
            return pa.nulls(len(codes), pa.string())
        valid = codes.is_valid().to_numpy(zero_copy_only=False)
        v = pc.fill_null(codes, 0).to_numpy(zero_copy_only=False).astype(np.int64)
        at = np.minimum(np.searchsorted(self.codes, v), len(self.codes) - 1)
        found = valid & (self.codes[at] == v)
        return pc.if_else(pa.array(found), self.texts.take(pa.array(at)),
                          pa.scalar(None, pa.string()))


_lock = threading.Lock()
_cache: dict[str, Dictionary] = {}


def dictionary(folder: str | os.PathLike) -> Dictionary:
    """The folder's dictionary, read again when its files changed (per process: Spark's
    Python workers keep it between tasks)."""
    folder = Path(folder)
    try:
        files = tuple(sorted(n for n in os.listdir(folder) if n.endswith(".parquet")
                             and not n.startswith(".")))
    except FileNotFoundError:
        files = ()
    with _lock:
        d = _cache.get(str(folder))
        if d is None or d.files != files:
            d = _cache[str(folder)] = Dictionary(folder, files)
        return d
