"""The configured enrichment databases, compiled, and the enrichment of a batch.

A database is configured under a name that says what it gives (``enrich.asn``: AS numbers and
names, ``enrich.country``: countries and continents, ``enrich.city``: cities and regions, from
MMDB files; ``enrich.networks``: a file of the operator's own prefixes with a name, role and
site each) and, for an MMDB file whose records are laid out otherwise than MaxMind's, the record
path of each attribute. It is compiled once: its prefixes into ``lpm.PrefixIndex``, each
distinct record into one row of an array per attribute (row ``R``, the last, is none: record id
-1 takes it without a test). Values are integer codes (AS numbers; a country's two letters; a
text's hash, ``fields.code_of``), 0 for none. Enriching a batch is then one numba search per
(database, address field) and a gather per field; no Python per tuple.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import pyarrow as pa

from capture.enrich.batch import EnrichedBatch
from capture.enrich.interfaces import merged
from capture.enrich.lpm import PrefixIndex, build
from capture.enrich.mmdb import NO_DATA, MmdbError, MmdbFile, at_path
from capture.enrich.table import Table, file_stamp, read_map
from capture.fields import NULL_INT, code_of, enriched


def _asn(value) -> int:
    """An AS number from a record value: an integer, or text such as IPinfo's 'AS13335'."""
    if isinstance(value, str):
        text = value.strip().upper().removeprefix("AS")
        value = int(text) if text.isdigit() else None
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**32:
        return value
    return 0


def _letters(value) -> int:
    if isinstance(value, str):
        try:
            return code_of(value)
        except ValueError:
            pass
    return 0


def _text(value) -> int:
    return code_of(value.strip(), "text") if isinstance(value, str) and value.strip() else 0


def _region(value) -> int:
    """ISO 3166-2 subdivision codes as MaxMind gives them ('NH', 'ENG'; a full 'NL-NH' loses
    its country)."""
    if isinstance(value, str) and "-" in value:
        value = value.split("-", 1)[1]
    return _text(value)


@dataclass(frozen=True)
class Attribute:
    name: str
    paths: tuple[str, ...]  # record paths tried in order (MaxMind's first, then IPinfo's)
    convert: Callable  # record value -> code (0: none)
    text: bool = False  # a text code: its text goes into the published dictionary

    @property
    def dtype(self):
        return np.int64 if self.text else np.uint32


# what each MMDB database name gives, and where its records keep it by default
DATABASES: dict[str, tuple[Attribute, ...]] = {
    "asn": (Attribute("asn", ("autonomous_system_number", "asn"), _asn),
            Attribute("as_name", ("autonomous_system_organization", "as_name"), _text, True)),
    "country": (Attribute("country", ("country.iso_code", "country"), _letters),
                Attribute("continent", ("continent.code", "continent"), _letters)),
    "city": (Attribute("city", ("city.names.en", "city"), _text, True),
             Attribute("region", ("subdivisions.0.iso_code", "region_code"), _region, True)),
}
NETWORK_ATTRIBUTES = ("name", "role", "site")  # enrich.networks, a YAML file of prefixes


class Database(Table):
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
        attrs = {a.name: a for a in DATABASES[name]}
        unknown = set(paths or {}) - set(attrs)
        if unknown:
            raise MmdbError(f"enrich.{name}: no attribute {', '.join(sorted(unknown))} "
                            f"(known: {', '.join(attrs)})")
        f = MmdbFile(self.path)
        self.database_type, self.build_epoch = f.database_type, f.build_epoch
        h4, l4, r4 = f.leaves(v6=False)
        h6, l6, r6 = f.leaves(v6=True)
        offsets = np.unique(np.concatenate([r4[r4 >= 0], r6[r6 >= 0]]))
        self.records = len(offsets)
        self.paths = {a: (paths[a],) if paths and a in paths else attrs[a].paths for a in attrs}
        self.values = {a.name: np.zeros(self.records + 1, a.dtype) for a in attrs.values()}
        self.texts = {}
        split = {a: [tuple(p.split(".")) for p in self.paths[a]] for a in attrs}
        for i, offset in enumerate(offsets.tolist()):  # each record decoded, read, let go
            rec = f.record(offset)
            for a in attrs.values():
                for path in split[a.name]:
                    raw = at_path(rec, path)
                    v = a.convert(raw)
                    if v:
                        self.values[a.name][i] = v
                        if a.text:
                            self.texts[v] = raw.strip()
                        break

        def ids(rec: np.ndarray) -> np.ndarray:  # data offsets as record ids (-1 none)
            out = rec.copy()
            data = rec >= 0
            out[data] = np.searchsorted(offsets, rec[data])
            out[rec == NO_DATA] = -1
            return out

        self.index = build((l4 & np.uint64(0xFFFFFFFF), ids(r4)), (h6, l6, ids(r6)))
        self.networks = int((r4 >= 0).sum() + (r6 >= 0).sum())
        del f, h4, l4, r4, h6, l6, r6
        give_back()
        self.load_s = time.perf_counter() - started

    def describe(self) -> dict:
        return {**super().describe(), "type": self.database_type,
                "build_epoch": self.build_epoch,
                "paths": {a: list(p) for a, p in self.paths.items()}}


def give_back() -> None:
    """Return the heap a load's transient objects (the decoded records, the file's bytes) freed
    to the kernel (glibc keeps it otherwise; a daemon loads once and runs for months)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _segments(prefixes: list[tuple[int, int, int]], top: int) -> list[tuple[int, int]]:
    """(start, record id) of the intervals nested prefixes ``(start, end, id)`` cut
    ``[0, top)`` into, the most specific prefix's id in each (-1: none), neighbours of one id
    as one."""
    out: list[tuple[int, int]] = [(0, -1)]

    def emit(pos: int, rid: int) -> None:
        if pos >= top:
            return
        if out[-1][0] == pos:
            out[-1] = (pos, rid)
            if len(out) > 1 and out[-2][1] == rid:
                out.pop()
        elif out[-1][1] != rid:
            out.append((pos, rid))
    stack: list[tuple[int, int]] = []  # (end, id) of the prefixes open here, innermost last
    for start, end, rid in sorted(prefixes, key=lambda p: (p[0], p[0] - p[1])):
        while stack and stack[-1][0] <= start:
            e, _ = stack.pop()
            emit(e, stack[-1][1] if stack else -1)
        emit(start, rid)
        stack.append((end, rid))
    while stack:
        e, _ = stack.pop()
        emit(e, stack[-1][1] if stack else -1)
    return out


class Networks(Table):
    """The operator's own prefixes (``enrich.networks``): a YAML map of prefix to a name, or to
    ``{name, role, site}``; the most specific prefix of an address gives its values."""

    name = "networks"

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        started = time.perf_counter()
        where = f"enrich.networks: {self.path}"
        try:
            self.stamp = file_stamp(self.path)
        except OSError as e:
            raise MmdbError(f"{where}: {e.strerror or e}") from None
        doc = read_map(self.path, where, "a map of prefix to name or {name, role, site}")
        v4: list[tuple[int, int, int]] = []
        v6: list[tuple[int, int, int]] = []
        rows: list[dict] = []
        for key, value in doc.items():
            try:
                net = ipaddress.ip_network(str(key), strict=False)
            except ValueError as e:
                raise MmdbError(f"{where}: {key!r}: {e}") from None
            if isinstance(value, str):
                value = {"name": value}
            if not isinstance(value, dict) or set(value) - set(NETWORK_ATTRIBUTES):
                raise MmdbError(f"{where}: {key}: a name or a map of "
                                f"{', '.join(NETWORK_ATTRIBUTES)}")
            start = int(net.network_address)
            (v4 if net.version == 4 else v6).append((start, start + net.num_addresses,
                                                     len(rows)))
            rows.append({k: str(v) for k, v in value.items() if v is not None})
        self.records, self.networks = len(rows), len(rows)
        self.values, self.texts = {}, {}
        for a in NETWORK_ATTRIBUTES:
            col = np.zeros(len(rows) + 1, np.int64)
            for i, r in enumerate(rows):
                if r.get(a):
                    col[i] = code_of(r[a], "text")
                    self.texts[int(col[i])] = r[a]
            self.values[a] = col
        s4 = _segments(v4, 1 << 32)
        s6 = _segments(v6, 1 << 128)
        self.index = build(
            (np.array([s for s, _ in s4], np.uint64), np.array([r for _, r in s4], np.int64)),
            (np.array([s >> 64 for s, _ in s6], np.uint64),
             np.array([s & (2**64 - 1) for s, _ in s6], np.uint64),
             np.array([r for _, r in s6], np.int64)))
        self.load_s = time.perf_counter() - started


def load_table(name: str, path: str, paths: dict[str, str] | None = None,
               polled: dict | None = None) -> Table:
    """A configured database; ``interfaces``: what SNMP ``polled``, the file over it."""
    if name == "interfaces":
        return merged(polled or {}, path or None)
    return Networks(path) if name == "networks" else Database(name, path, paths)


PRECEDENCES = ("exporter", "exporter-public", "database")


def private_asn(a: np.ndarray) -> np.ndarray:
    """AS numbers for private use (RFC 6996) and AS_TRANS (RFC 6793): a router's, not the
    network's."""
    return (a == 23456) | ((a >= 64512) & (a <= 65534)) | ((a >= 4200000000) & (a <= 4294967294))


@dataclass
class Enrichment:
    """The databases a process enriches with (by name), and the AS precedence."""

    databases: dict[str, Table] = field(default_factory=dict)
    asn_precedence: str = "exporter"

    @cached_property
    def texts(self) -> dict[int, str]:
        """Every text code of the databases and its text."""
        out: dict[int, str] = {}
        for db in self.databases.values():
            out.update(db.texts)
        return out

    def text_array(self, codes: np.ndarray) -> pa.Array:
        """Text codes (-1 NULL) as their texts."""
        uniq, inv = np.unique(codes, return_inverse=True)
        texts = pa.array([self.texts.get(int(c)) for c in uniq], pa.string())
        return texts.take(pa.array(inv.reshape(-1)))

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
        found = self._pairs(tb, table, names, uses)  # src_ and dst_ of one attribute at once
        for name in names:
            e = table[name]
            db = self.databases.get(e.database)
            key = (e.database, e.address)
            if name in found:
                col = found[name]
            elif db is None:
                col = np.full(n, NULL_INT, np.int64)
            elif e.index:  # an interface: (device, ifIndex)
                col = db.gather(e.attribute, db.lookup_pairs(
                    tb.column(e.address), tb.ip_valid(e.address), tb.column(e.index)))
            elif uses[key] == 1:
                col = db.attribute(e.attribute, tb.column(e.address), tb.ip_valid(e.address))
            else:
                if key not in ids:
                    ids[key] = db.lookup(tb.column(e.address), tb.ip_valid(e.address))
                col = db.gather(e.attribute, ids[key])
            if e.exported:
                col = self._precede(np.asarray(tb.column(e.exported), np.int64), col)
            cols[name] = col
        return EnrichedBatch(tb, cols, self)

    def _pairs(self, tb, table, names: list[str], uses: dict) -> dict[str, np.ndarray]:
        """The fields that are one attribute of one prefix database by two addresses each read
        alone (src_asn and dst_asn), looked up two at a time."""
        by: dict[tuple[str, str], list[str]] = {}
        for name in names:
            e = table[name]
            db = self.databases.get(e.database)
            if db is not None and not e.index and uses[(e.database, e.address)] == 1 and \
                    isinstance(db.index, PrefixIndex):
                by.setdefault((e.database, e.attribute), []).append(name)
        out = {}
        for (database, attribute), pair in by.items():
            if len(pair) != 2:
                continue
            a, b = (table[x].address for x in pair)
            db = self.databases[database]
            out[pair[0]], out[pair[1]] = db.index.values_pair(
                tb.column(a), tb.ip_valid(a), tb.column(b), tb.ip_valid(b),
                db.values[attribute])
        return out

    def _precede(self, exported: np.ndarray, found: np.ndarray) -> np.ndarray:
        """An AS from what the exporter sent and what the database says (0 and NULL:
        unknown)."""
        sent = exported > 0
        if self.asn_precedence == "database":
            return np.where(found >= 0, found, np.where(sent, exported, NULL_INT))
        if self.asn_precedence == "exporter-public":
            sent &= ~private_asn(exported)
        return np.where(sent, exported, found)


def load(databases: dict[str, tuple[str, dict[str, str]]], asn_precedence: str = "exporter",
         polled: dict | None = None) -> Enrichment:
    """The enrichment of ``{name: (path, record paths)}``."""
    if asn_precedence not in PRECEDENCES:
        raise ValueError(f"enrich.asn_precedence: {asn_precedence!r} is not one of "
                         f"{', '.join(PRECEDENCES)}")
    return Enrichment({name: load_table(name, path, paths, polled)
                       for name, (path, paths) in databases.items()}, asn_precedence)
