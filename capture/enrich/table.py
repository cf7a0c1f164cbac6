"""What every compiled enrichment database offers the batch's enrichment (databases.py)."""

from __future__ import annotations

import os

import numpy as np
import yaml

from capture.enrich.lpm import PrefixIndex
from capture.enrich.mmdb import MmdbError
from capture.fields import NULL_INT


def read_map(path: str | os.PathLike, where: str, shape: str) -> dict:
    """A YAML file whose document is a map (MmdbError: why not, with ``where``)."""
    try:
        with open(path) as f:
            doc = yaml.safe_load(f) or {}
    except OSError as e:
        raise MmdbError(f"{where}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise MmdbError(f"{where}: not YAML: {e}") from None
    if not isinstance(doc, dict):
        raise MmdbError(f"{where}: {shape}")
    return doc


def file_stamp(path: str | os.PathLike) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size


class Table:
    """A compiled database: its index, values per attribute and record, and the texts of its
    text codes."""

    name: str
    path: str
    stamp: tuple[int, int]
    index: PrefixIndex
    values: dict[str, np.ndarray]
    texts: dict[int, str]
    records: int
    networks: int
    load_s: float

    @property
    def nbytes(self) -> int:
        return self.index.nbytes + sum(v.nbytes for v in self.values.values())

    def lookup(self, addrs: np.ndarray, ok: np.ndarray) -> np.ndarray:
        """Record ids of (n, 16) addresses (-1: none)."""
        return self.index.lookup(addrs, ok)

    def gather(self, attribute: str, ids: np.ndarray) -> np.ndarray:
        """An attribute's values (int64, NULL -1) of record ids (-1: none)."""
        out = self.values[attribute][ids].astype(np.int64)
        out[(ids < 0) | (out == 0)] = NULL_INT
        return out

    def attribute(self, attribute: str, addrs: np.ndarray, ok: np.ndarray) -> np.ndarray:
        """An attribute's values (int64, NULL -1) of (n, 16) addresses: the look-up and the
        gather in one pass."""
        return self.index.values(addrs, ok, self.values[attribute])

    def describe(self) -> dict:
        return {"database": self.name, "path": self.path, "records": self.records,
                "networks": self.networks, "intervals": self.index.intervals,
                "bytes": self.nbytes, "texts": len(self.texts),
                "load_s": round(self.load_s, 3)}
