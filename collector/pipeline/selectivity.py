"""Measured predicate selectivities: every cheap base predicate of the plan, evaluated alone on
a random sample of each batch (the paper's COUNT(*) per predicate, section 3.3, done inline).

Counts are halved once a predicate has seen ``window`` tuples, so the estimate follows the
traffic. The planner uses them for the bit budget (section 2.3) and ``GET /prefilter`` shows them.
"""

from __future__ import annotations

import threading

import numpy as np

from capture.batch import Batch
from collector.pipeline.residual import eval_predicate
from planner.plan import Plan


class SelectivityMeter:
    def __init__(self, sample_rows: int = 512, window: int = 1_000_000, min_seen: int = 1000,
                 seed: int = 0):
        self.sample_rows = sample_rows
        self.window = window
        self.min_seen = min_seen
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self._hits: dict[str, float] = {}
        self._seen: dict[str, float] = {}

    def observe(self, plan: Plan, tb: Batch) -> None:
        """Evaluate each cheap predicate of this stream on a sample of the batch."""
        n = len(tb)
        if not n:
            return
        rows = (np.arange(n) if n <= self.sample_rows
                else np.sort(self._rng.choice(n, self.sample_rows, replace=False)))
        for info in plan.predicates:
            p = info.predicate
            if not info.cheap or p.stream != tb.stream:
                continue
            hits = int(eval_predicate(p, tb, rows).sum())
            with self._lock:
                key = p.text
                self._hits[key] = self._hits.get(key, 0.0) + hits
                self._seen[key] = self._seen.get(key, 0.0) + len(rows)
                if self._seen[key] >= self.window:
                    self._hits[key] /= 2
                    self._seen[key] /= 2

    def selectivities(self) -> dict[str, float]:
        """Predicate text -> fraction of sampled tuples that satisfied it (enough samples only)."""
        with self._lock:
            return {k: self._hits[k] / s for k, s in self._seen.items() if s >= self.min_seen}
