"""Named prefix tables for ``in_table(src_ip, 'customers')``: CIDR lists (one prefix per line,
``#`` comments) named in the configuration (``tables: {customers: /etc/flowsieve/customers.txt}``),
loaded once per process and again when a file changes. Membership is a residual predicate
(collector/pipeline/residual.py): IPv4 addresses are matched with one sorted-array search per prefix
length present, IPv6 ones per length against a set.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import threading
from pathlib import Path

import numpy as np

from planner.ir import Query, QueryError

log = logging.getLogger("flowsieve.tables")
V4_HI = np.uint64(0xFFFF)  # the high word of an IPv4-mapped address
_lock = threading.Lock()
_tables: dict[str, PrefixTable] = {}
_paths: dict[str, Path] = {}
_missing: set[str] = set()  # names a query uses that the configuration lost (said once)


class PrefixTable:
    """The prefixes of one file, by family and length."""

    def __init__(self, name: str, path: str | os.PathLike):
        self.name, self.path = name, Path(path)
        try:
            text = self.path.read_text()
            st = self.path.stat()
        except OSError as e:
            raise ValueError(f"prefix table {name!r}: {self.path}: {e.strerror or e}") from None
        self.stamp = (st.st_mtime_ns, st.st_size)
        v4: dict[int, set[int]] = {}
        v6: dict[int, set[tuple[int, int]]] = {}
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            try:
                net = ipaddress.ip_network(line, strict=False)
            except ValueError as e:
                raise ValueError(f"prefix table {name!r}: {self.path} line {n}: {e}") from None
            if net.version == 4:
                v4.setdefault(net.prefixlen, set()).add(int(net.network_address))
            else:
                value = int(net.network_address)
                v6.setdefault(net.prefixlen, set()).add((value >> 64, value & (2**64 - 1)))
        self.v4 = {length: np.array(sorted(nets), np.uint64) for length, nets in v4.items()}
        ones = 2**64 - 1  # each IPv6 length as (mask of the high word, of the low word, nets)
        self.v6 = [(ones ^ ((1 << max(0, 64 - length)) - 1),
                    0 if length <= 64 else ones ^ ((1 << (128 - length)) - 1), nets)
                   for length, nets in v6.items()]
        self.size = sum(len(x) for x in v4.values()) + sum(len(x) for x in v6.values())

    def contains(self, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
        """Whether each address (two 64-bit words, IPv4-mapped for IPv4) is in a prefix."""
        out = np.zeros(len(hi), bool)
        is4 = ((hi == 0) & ((lo >> np.uint64(32)) == V4_HI))
        if self.v4 and is4.any():
            a = lo[is4] & np.uint64(0xFFFFFFFF)
            hit = np.zeros(len(a), bool)
            for length, nets in self.v4.items():
                shift = np.uint64(32 - length)
                key = (a >> shift) << shift
                i = np.searchsorted(nets, key)
                hit |= (i < len(nets)) & (nets[np.minimum(i, len(nets) - 1)] == key)
            out[is4] = hit
        six = np.flatnonzero(~is4)
        if self.v6 and len(six):
            for k in six:
                h, low = int(hi[k]), int(lo[k])
                out[k] = any((h & mh, low & ml) in nets for mh, ml, nets in self.v6)
        return out


def configure(tables: dict[str, str | os.PathLike]) -> None:
    """The tables of the configuration (name -> file); each loaded now, errors raised."""
    with _lock:
        _paths.clear()
        _paths.update({n: Path(p) for n, p in tables.items()})
        for name in list(_tables):
            if name not in _paths:
                del _tables[name]
    for name in list(_paths):
        get(name)


def get(name: str) -> PrefixTable:
    """The table of that name, loaded again if its file changed."""
    with _lock:
        path = _paths.get(name)
        if path is None:
            known = ", ".join(sorted(_paths)) or "none"
            raise ValueError(f"no prefix table {name!r} is configured (tables: {known})")
        t = _tables.get(name)
        try:
            st = path.stat()
            fresh = t is not None and t.stamp == (st.st_mtime_ns, st.st_size)
        except OSError:
            fresh = t is not None  # gone since: keep what was loaded
        if not fresh:
            t = _tables[name] = PrefixTable(name, path)
        return t


def lookup(name: str, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """Membership in table ``name``; a table the configuration no longer has (a query
    registered before it was removed) holds nothing, said once in the log."""
    try:
        t = get(name)
    except ValueError as e:
        if name not in _missing:
            _missing.add(name)
            log.error("%s: in_table(…, %r) holds for no address", e, name)
        return np.zeros(len(hi), bool)
    _missing.discard(name)
    return t.contains(hi, lo)


def check(q: Query) -> None:
    """Every table ``q`` names is configured; else a QueryError at the name in its text."""
    for p in (p for part in q.parts for p in part.predicates):  # a join: its parts'
        for a in p.atoms:
            if a.op == "table" and a.values[0] not in _paths:
                line, col = _position(q.text, a.values[0])
                known = ", ".join(sorted(_paths)) or "none"
                raise QueryError(f"no prefix table {a.values[0]!r} is configured (tables: "
                                 f"{known})", line, col, q.name)


def _position(text: str, name: str) -> tuple[int, int]:
    m = re.search(r"['\"]" + re.escape(name) + r"['\"]", text)
    if m is None:
        return 0, 0
    before = text[:m.start()]
    return before.count("\n") + 1, m.start() - (before.rfind("\n") + 1) + 1
