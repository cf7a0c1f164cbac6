"""Interface names, descriptions and speeds of flow exporters and sFlow agents, by (device
address, ifIndex): polled over SNMP (``collector/daemon/snmp.py``) and overridden by a static
file (``enrich.interfaces``: a YAML map of device address to ifIndex to ``{name, description,
speed}``, speed in bits per second).

A batch's look-up is vectorised numpy: each (device, ifIndex) pair hashed to one 64-bit key,
found by binary search in the table's sorted keys and checked against the pair itself.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from capture.enrich.mmdb import MmdbError
from capture.enrich.table import Table, file_stamp, read_map
from capture.fields import code_of, ip_bytes

K1, K2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F)
FIELDS = ("name", "description", "speed")


@dataclass(frozen=True)
class Interface:
    name: str | None = None
    description: str | None = None
    speed: int | None = None  # bits per second


def _keys(w0: np.ndarray, w1: np.ndarray, index: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        k = (w0 * K1) ^ ((w1 ^ (w1 >> np.uint64(29))) * K2) ^ (index.astype(np.uint64) * K1)
        return k ^ (k >> np.uint64(31))


class Interfaces(Table):
    """The interfaces of devices: ``entries`` {(device address text, ifIndex): Interface}."""

    name = "interfaces"

    def __init__(self, entries: dict[tuple[str, int], Interface], path: str = "",
                 stamp: tuple[int, int] = (0, 0)):
        started = time.perf_counter()
        self.path, self.stamp, self.entries = path, stamp, dict(entries)
        pairs = sorted(self.entries)
        n = len(pairs)
        dev = np.frombuffer(b"".join(ip_bytes(d) for d, _ in pairs), np.uint8).reshape(n, 16) \
            if n else np.zeros((0, 16), np.uint8)
        words = dev.view("<u8").reshape(n, 2)
        idx = np.array([i for _, i in pairs], np.int64)
        keys = _keys(words[:, 0], words[:, 1], idx)
        order = np.argsort(keys, kind="stable")
        self.keys, self.w0, self.w1 = keys[order], words[order, 0], words[order, 1]
        self.idx, self.rid = idx[order], order.astype(np.int64)
        self.values, self.texts = {}, {}
        for f in FIELDS:
            col = np.zeros(n + 1, np.int64)
            for i, p in enumerate(pairs):
                v = getattr(self.entries[p], f)
                if f == "speed":
                    col[i] = v if v and v > 0 else 0
                elif v:
                    col[i] = code_of(v, "text")
                    self.texts[int(col[i])] = v
            self.values[f] = col
        self.records = self.networks = n
        self.load_s = time.perf_counter() - started

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.keys, self.w0, self.w1, self.idx, self.rid,
                                      *self.values.values()))

    def lookup_pairs(self, devices: np.ndarray, ok: np.ndarray, index: np.ndarray
                     ) -> np.ndarray:
        """Record ids of (device, ifIndex) pairs (-1: unknown, no device or no index)."""
        n = len(index)
        if not len(self.keys) or not n:
            return np.full(n, -1, np.int64)
        words = np.ascontiguousarray(devices).view("<u8").reshape(-1, 2)
        index = np.asarray(index, np.int64)
        keys = _keys(words[:, 0], words[:, 1], index)
        at = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        found = ok & (index >= 0) & (self.keys[at] == keys) & (self.w0[at] == words[:, 0]) & \
            (self.w1[at] == words[:, 1]) & (self.idx[at] == index)
        return np.where(found, self.rid[at], -1)

    def describe(self) -> dict:
        return {"database": self.name, "path": self.path, "bytes": self.nbytes,
                "devices": len({d for d, _ in self.entries}), "interfaces": self.records,
                "texts": len(self.texts), "load_s": round(self.load_s, 3)}


def read_file(path: str | os.PathLike) -> dict[tuple[str, int], Interface]:
    """A static interfaces file: ``{device: {ifIndex: {name, description, speed}}}``."""
    where = f"enrich.interfaces: {path}"
    doc = read_map(path, where, "a map of device address to ifIndex to "
                   "{name, description, speed}")
    out: dict[tuple[str, int], Interface] = {}
    for device, ifaces in doc.items():
        try:
            ip_bytes(str(device))
        except ValueError as e:
            raise MmdbError(f"{where}: {device!r}: {e}") from None
        if not isinstance(ifaces, dict):
            raise MmdbError(f"{where}: {device}: a map of ifIndex to {{name, description, "
                            "speed}")
        for index, v in ifaces.items():
            if not isinstance(index, int) or index < 0:
                raise MmdbError(f"{where}: {device}: {index!r} is not an ifIndex")
            if isinstance(v, str):
                v = {"name": v}
            if not isinstance(v, dict) or set(v) - set(FIELDS):
                raise MmdbError(f"{where}: {device} {index}: a name or a map of "
                                f"{', '.join(FIELDS)}")
            speed = v.get("speed")
            if speed is not None and (not isinstance(speed, int) or speed < 0):
                raise MmdbError(f"{where}: {device} {index}: speed is bits per second")
            out[(str(device), index)] = Interface(
                v.get("name") and str(v["name"]), v.get("description") and
                str(v["description"]), speed)
    return out


def merged(polled: dict[tuple[str, int], Interface], path: str | None) -> Interfaces:
    """What SNMP found, each value the static file gives overriding it."""
    entries = dict(polled)
    stamp = (0, 0)
    if path:
        try:
            stamp = file_stamp(path)
        except OSError as e:
            raise MmdbError(f"enrich.interfaces: {path}: {e.strerror or e}") from None
        for key, over in read_file(path).items():
            base = entries.get(key, Interface())
            entries[key] = Interface(over.name or base.name,
                                     over.description or base.description,
                                     over.speed if over.speed is not None else base.speed)
    return Interfaces(entries, path or "", stamp)
