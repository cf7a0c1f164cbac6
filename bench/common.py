"""Helpers shared by the benchmarks: timing and result files."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
CACHE = Path(__file__).resolve().parent / ".cache"  # generated traces (not in git)


def median_time(fn, repeat: int) -> float:
    """Median wall time of ``repeat`` calls, in seconds."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def spark_rows(metrics) -> float:
    """The rows Spark read in a replay: those spooled less those left out before Spark."""
    def total(counter) -> float:
        return sum(s.value for m in counter.collect() for s in m.samples
                   if s.name.endswith("_total"))
    return total(metrics.spool_rows) - total(metrics.spool_pruned)


def write_result(name: str, data: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path
