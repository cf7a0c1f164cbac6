"""The configured enrichment databases, compiled, and the enrichment of a batch.

A database is configured under a name that says what it gives (``enrich.asn``: AS numbers,
``enrich.country``: countries): an MMDB file and, where its records are laid out otherwise than
MaxMind's, the record path of each attribute. It is compiled once (``Database``): the trie into
``lpm.PrefixIndex``, each distinct record into one row of an array per attribute (row ``R``, the
last, is NULL: record id -1 takes it without a test). Enriching a batch is then one numba search
per (database, address field) and a numpy gather per field; no Python per tuple.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np

from capture.enrich.batch import EnrichedBatch
from capture.enrich.lpm import PrefixIndex, build
from capture.enrich.mmdb import NO_DATA, MmdbError, MmdbFile, at_path
from capture.fields import NULL_INT, code_of, enriched


def _asn(value) -> int:
    """An AS number from a record value: an integer, or text such as IPinfo's 'AS13335'."""
    if isinstance(value, str):
        text = value.strip().upper().removeprefix("AS")
        value = int(text) if text.isdigit() else None
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**32:
        return value
    return NULL_INT


def _country(value) -> int:
    if isinstance(value, str):
        try:
            return code_of(value)
        except ValueError:
            pass
    return NULL_INT


@dataclass(frozen=True)
class Attribute:
    name: str
    paths: tuple[str, ...]  # record paths tried in order (MaxMind's first, then IPinfo's)
    convert: object  # record value -> int code (NULL_INT: none)


# what each database name gives, and where its records keep it by default
DATABASES: dict[str, tuple[Attribute, ...]] = {
    "asn": (Attribute("asn", ("autonomous_system_number", "asn"), _asn),),
    "country": (Attribute("country", ("country.iso_code", "country"), _country),),
}


def file_stamp(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size


class Database:
    """One configured MMDB file, compiled (raises MmdbError with the file and reason)."""

    def __init__(self, name: str, path: str | os.PathLike, paths: dict[str, str] | None = None):
        if name not in DATABASES:
            raise MmdbError(f"enrich.{name}: unknown database (known: {', '.join(DATABASES)})")
        self.name, self.path = name, str(path)
        started = time.perf_counter()
        try:
            self.stamp = file_stamp(self.path)
        except OSError as e:
            raise MmdbError(f"enrich.{name}: {self.path}: {e.strerror or e}") from None
        f = MmdbFile(self.path)
        self.database_type, self.build_epoch = f.database_type, f.build_epoch
        h4, l4, r4 = f.leaves(v6=False)
        h6, l6, r6 = f.leaves(v6=True)
        offsets = np.unique(np.concatenate([r4[r4 >= 0], r6[r6 >= 0]]))
        self.records = len(offsets)
        decoded = [f.record(int(o)) for o in offsets]
        attrs = {a.name: a for a in DATABASES[name]}
        unknown = set(paths or {}) - set(attrs)
        if unknown:
            raise MmdbError(f"enrich.{name}: no attribute {', '.join(sorted(unknown))} "
                            f"(known: {', '.join(attrs)})")
        self.paths = {a: (paths[a],) if paths and a in paths else attrs[a].paths for a in attrs}
        # each attribute's value per record id as uint32, 0 for none (no AS is 0: RFC 7607;
        # codes are never 0): half the cache lines of int64, read once per look-up
        self.values: dict[str, np.ndarray] = {}
        for a in attrs.values():
            col = np.zeros(self.records + 1, np.uint32)
            split = [tuple(p.split(".")) for p in self.paths[a.name]]
            for i, rec in enumerate(decoded):
                for path in split:
                    v = a.convert(at_path(rec, path))
                    if 0 < v < 2**32:
                        col[i] = v
                        break
            self.values[a.name] = col

        def ids(rec: np.ndarray) -> np.ndarray:  # data offsets as record ids (-1 none)
            out = rec.copy()
            data = rec >= 0
            out[data] = np.searchsorted(offsets, rec[data])
            out[rec == NO_DATA] = -1
            return out

        self.index: PrefixIndex = build((l4 & np.uint64(0xFFFFFFFF), ids(r4)), (h6, l6, ids(r6)))
        self.networks = int((r4 >= 0).sum() + (r6 >= 0).sum())
        self.load_s = time.perf_counter() - started
        del f

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
        return {"database": self.name, "path": self.path, "type": self.database_type,
                "build_epoch": self.build_epoch, "records": self.records,
                "networks": self.networks, "intervals": self.index.intervals,
                "bytes": self.nbytes, "load_s": round(self.load_s, 3),
                "paths": {a: list(p) for a, p in self.paths.items()}}


PRECEDENCES = ("exporter", "exporter-public", "database")


def private_asn(a: np.ndarray) -> np.ndarray:
    """AS numbers for private use (RFC 6996) and AS_TRANS (RFC 6793): a router's, not the
    network's."""
    return (a == 23456) | ((a >= 64512) & (a <= 65534)) | ((a >= 4200000000) & (a <= 4294967294))


@dataclass
class Enrichment:
    """The databases a process enriches with (by name), and the AS precedence."""

    databases: dict[str, Database] = field(default_factory=dict)
    asn_precedence: str = "exporter"

    def apply(self, tb, names) -> EnrichedBatch:
        """``tb`` with the enrichment fields ``names`` computed (NULL where no database gives
        one)."""
        table = enriched(tb.stream)
        names = list(names)
        # a (database, address) that several fields read is searched once for record ids;
        # one field alone gets its value from the search directly
        uses: dict[tuple[str, str], int] = {}
        for name in names:
            e = table[name]
            uses[(e.database, e.address)] = uses.get((e.database, e.address), 0) + 1
        ids: dict[tuple[str, str], np.ndarray] = {}
        cols: dict[str, np.ndarray] = {}
        n = len(tb)
        for name in names:
            e = table[name]
            db = self.databases.get(e.database)
            key = (e.database, e.address)
            if db is None:
                col = np.full(n, NULL_INT, np.int64)
            elif uses[key] == 1:
                col = db.attribute(e.attribute, tb.column(e.address), tb.ip_valid(e.address))
            else:
                if key not in ids:
                    ids[key] = db.lookup(tb.column(e.address), tb.ip_valid(e.address))
                col = db.gather(e.attribute, ids[key])
            if e.exported:
                col = self._precede(np.asarray(tb.column(e.exported), np.int64), col)
            cols[name] = col
        return EnrichedBatch(tb, cols)

    def _precede(self, exported: np.ndarray, found: np.ndarray) -> np.ndarray:
        """An AS from what the exporter sent and what the database says (0 and NULL:
        unknown)."""
        sent = exported > 0
        if self.asn_precedence == "database":
            return np.where(found >= 0, found, np.where(sent, exported, NULL_INT))
        if self.asn_precedence == "exporter-public":
            sent &= ~private_asn(exported)
        return np.where(sent, exported, found)


def load(databases: dict[str, tuple[str, dict[str, str]]], asn_precedence: str = "exporter"
         ) -> Enrichment:
    """The enrichment of ``{name: (path, record paths)}``."""
    if asn_precedence not in PRECEDENCES:
        raise ValueError(f"enrich.asn_precedence: {asn_precedence!r} is not one of "
                         f"{', '.join(PRECEDENCES)}")
    return Enrichment({name: Database(name, path, paths)
                       for name, (path, paths) in databases.items()}, asn_precedence)
