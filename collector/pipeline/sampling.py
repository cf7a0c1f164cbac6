"""A sample of the tuples that passed the prefilter, from which the planner sizes aggregate-tree
nodes (planner/sizes.py). Each tuple is taken with a probability adapted so that about ``rows``
samples span ``horizon_s`` seconds of event time (a period); the latest ``2 · rows`` are kept.
Only hashes of the key fields are stored, never the values."""

from __future__ import annotations

import hashlib
import threading

import numpy as np

from capture.fields import SKETCH
from collector.keys import KeyLayout
from planner.sizes import TupleSample, mix


def _stable_hash(value: str | None) -> int:
    """A string's 64-bit hash, the same in every process (Python's ``hash`` of a string
    changes with PYTHONHASHSEED, and with it the node sizes and the plan of a replay)."""
    if value is None:
        return 0
    return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "little")


def field_hashes(stream: str, tb, rows: np.ndarray, names) -> dict[str, np.ndarray]:
    """Per field, a uint64 hash of each of ``rows``' values (NULL hashes as itself)."""
    out = {}
    for name in names:
        layout = KeyLayout(stream, (name.lstrip(SKETCH),), 0)  # a sketch key: its field's
        words = layout.field_words_of(tb, rows)
        h = np.full(len(rows), 0x51ED270B27F5A3C1, np.uint64)
        for c in range(words.shape[1]):
            h = mix(h ^ words[:, c].view(np.uint64))
        if layout.string is not None:
            vals = layout.strings_of(tb, rows).to_pylist()
            h = mix(h ^ np.array([_stable_hash(v) for v in vals], np.uint64))
        out[name] = h
    return out


class TupleSampler:
    """``probability`` fixes the sampling rate (a measuring pass over a known number of
    tuples) instead of adapting it to the rate of event time."""

    def __init__(self, rows: int = 4096, horizon_s: float = 60.0, seed: int = 0,
                 probability: float | None = None):
        self.rows, self.horizon_s, self.probability = rows, horizon_s, probability
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self._parts: dict[str, list[TupleSample]] = {}
        self._names: dict[str, tuple] = {}  # stream -> (fields, slots) of the sample
        self._seen: dict[str, list[int]] = {}  # stream -> [tuples, first time, last time]

    def observe(self, stream: str, tb, Q: np.ndarray, names, slots,
                among: np.ndarray | None = None) -> None:
        """Sample a batch of tuples that passed the prefilter (``Q``: their query bits;
        ``names`` the fields to hash, ``slots`` the aggregate queries' slots of the plan).
        ``among``: the rows of ``tb`` and ``Q`` that passed (default: every row); the sample
        is drawn among them and only its rows are read (taking every passed row of a batch
        first read all its fields to keep a few percent of them)."""
        n = len(tb) if among is None else len(among)
        if not n:
            return
        names = (tuple(sorted(names)), frozenset(slots))
        t = tb.time if among is None else tb.time[among]
        with self._lock:
            seen = self._seen.setdefault(stream, [0, int(t.min()), int(t.max())])
            seen[0] += n
            seen[1], seen[2] = min(seen[1], int(t.min())), max(seen[2], int(t.max()))
            rate = seen[0] / max(1, seen[2] - seen[1] + 1)
            p = self.probability or min(1.0, self.rows / (rate * self.horizon_s))
            rows = np.flatnonzero(self._rng.random(n) < p)
        if not len(rows):
            return
        at = rows if among is None else among[rows]  # the sampled rows of the batch
        part = TupleSample(t[rows].astype(np.int64), field_hashes(stream, tb, at, names[0]),
                           Q[at].copy(), np.full(len(rows), 1.0 / p), names[1])
        with self._lock:
            if self._names.get(stream) != names or (
                    self._parts.get(stream) and self._parts[stream][0].Q.shape[1]
                    != Q.shape[1]):
                self._parts[stream] = []  # a new plan: other fields, other queries
                self._names[stream] = names
            parts = self._parts.setdefault(stream, [])
            parts.append(part)
            total = sum(len(x) for x in parts)
            while len(parts) > 1 and total - len(parts[0]) >= 2 * self.rows:
                total -= len(parts.pop(0))

    def sample(self, stream: str) -> TupleSample | None:
        with self._lock:
            parts = list(self._parts.get(stream, []))
        if not parts:
            return None
        return TupleSample(np.concatenate([p.time for p in parts]),
                           {k: np.concatenate([p.hashes[k] for p in parts])
                            for k in parts[0].hashes},
                           np.concatenate([p.Q for p in parts]),
                           np.concatenate([p.weight for p in parts]), parts[0].slots)

    def samples(self) -> dict[str, TupleSample]:
        return {s: x for s in list(self._parts) if (x := self.sample(s)) is not None}
