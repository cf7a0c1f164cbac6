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
    """The rows Spark read in a replay: every row spooled (the LFTA's partials)."""
    return sum(s.value for m in metrics.spool_rows.collect() for s in m.samples
               if s.name.endswith("_total"))


def answer_rows(query, table) -> list[dict]:
    """An answer table's rows as dicts of the query's output columns (for the check against
    the truth, after the clock)."""
    names = [o.name for o in query.outputs]
    return [{n: r.get(n) for n in names} for r in table.select(
        [n for n in names if n in table.column_names]).to_pylist()]


def write_result(name: str, data: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


def followed_daemon(var: Path, sql: str, **settings):
    """A daemon with Spark following ``var/live.pcap``, an empty pcap that a writer appends
    to (``follow``, ``restamp``), the queries of ``sql`` registered, ``settings`` (e.g.
    ``spark``, ``om``) over the defaults, started: (the daemon, the pcap's path)."""
    import struct

    from collector.config import SourceConfig, load_settings
    from collector.daemon.service import Collector
    queries = var / "queries.sql"
    queries.write_text(sql)
    path = var / "live.pcap"
    path.write_bytes(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 128, 1))
    c = Collector(load_settings(
        var_dir=var, initial_queries=str(queries), **settings,
        sources=[SourceConfig(type="pcap", name="live", path=str(path), follow=True,
                              restamp=True)]))
    c.start(with_sources=True, with_spark=True)
    return c, path


def written(p: dict, rows: list, stamps: list) -> dict:
    """The packets a live writer wrote: the generator's arrays ``p`` at ``rows`` (chunks of
    row numbers) with the time stamps it gave them."""
    import numpy as np
    taken = np.concatenate(rows)
    n = len(p["ts_us"])
    out = {k: v[taken] for k, v in p.items() if len(v) == n}
    out["ts_us"] = np.concatenate(stamps)
    return out
