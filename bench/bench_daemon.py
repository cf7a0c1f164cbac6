"""The daemon's capture side on a file: ``flowsieve run`` with one pcap source read once with its
own times (``loop: false, restamp: false``), the backbone-shaped trace of ``bench_spark`` (6M
packets) and its 50 queries, Spark left out (the spool takes the partial rows). Packets per
second from ``start()`` until the source has finished (plan, numba's cached code, reading,
prefilter, LFTA, spool). Baseline in the same process: the source read in step with its engine
(each batch read and unpacked only when the engine asks, as before read-ahead), alternating
with the read-ahead runs after one warm-up run; medians of 3.

``python bench/bench_daemon.py [--quick]``; figures in ``bench/results/daemon.json``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_spark import _sql, trace  # noqa: E402
from bench.common import CACHE, write_result  # noqa: E402
from collector.config import SourceConfig, load_settings  # noqa: E402
from collector.daemon.service import Collector  # noqa: E402

PACKETS = 6_000_000
REPEAT = 3


def in_step(items, prepare, depth: int = 2):
    """``sources.ahead`` without the thread: each item prepared when the consumer asks."""
    for item in items:
        yield item, prepare(item)


def run(path: Path, queries: Path) -> float:
    """Seconds from the daemon's start until its one source has read the whole file."""
    var = Path(tempfile.mkdtemp(prefix="bench-daemon-", dir=CACHE))
    try:
        c = Collector(load_settings(var_dir=var, initial_queries=str(queries), sources=[
            SourceConfig(type="pcap", name="file", path=str(path), loop=False,
                         restamp=False)]))
        t = time.perf_counter()
        c.start(with_sources=True, with_spark=False)
        while c.source_state.get("file") != "finished":
            state = c.source_state.get("file", "")
            if state.startswith("failed"):
                raise RuntimeError(state)
            time.sleep(0.01)
        wall = time.perf_counter() - t
        c.stop()
        return wall
    finally:
        shutil.rmtree(var, ignore_errors=True)


def workload(quick: bool) -> tuple[Path, Path, int, int]:
    """The backbone trace (1M packets when ``quick``), its 50 queries in a file, its packets
    and the runs of each kind; one warm-up run done (the page cache, numba's cached code)."""
    n, repeat = (1_000_000, 1) if quick else (PACKETS, REPEAT)
    path, p = trace("backbone", n, CACHE)
    queries = Path(tempfile.mkdtemp(prefix="bench-daemon-q-", dir=CACHE)) / "queries.sql"
    queries.write_text(_sql("backbone", p))
    packets = len(p["proto"])
    del p
    run(path, queries)
    return path, queries, packets, repeat


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1M packets, one run each")
    args = ap.parse_args()
    path, queries, packets, repeat = workload(args.quick)
    ahead, step = [], []
    for _ in range(repeat):
        ahead.append(run(path, queries))
        with mock.patch("collector.daemon.service.ahead", in_step):
            step.append(run(path, queries))
        print(f"read ahead {ahead[-1]:.2f} s, in step {step[-1]:.2f} s", flush=True)
    a, s = statistics.median(ahead), statistics.median(step)
    out = {"packets": packets, "queries": 50, "trace": "backbone",
           "read_ahead": {"wall_s": ahead, "median_s": a, "pps": packets / a},
           "in_step": {"wall_s": step, "median_s": s, "pps": packets / s},
           "speedup": s / a}
    print(f"{packets:,} packets, 50 queries, no Spark: read ahead {packets / a / 1e6:.2f} Mpps, "
          f"in step {packets / s / 1e6:.2f} Mpps ({s / a:.2f}x)")
    shutil.rmtree(queries.parent, ignore_errors=True)
    if not args.quick:
        write_result("daemon", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
