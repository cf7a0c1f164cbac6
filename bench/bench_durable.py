"""What putting it on disk costs (issue 48): ``bench_daemon``'s run — ``flowsieve run``'s capture
side on the backbone trace (6M packets) and its 50 queries, the pcap source read once (a durable
source: held spool files, a commit every ``spool.commit_s``), Spark left out — with every
durable file fsynced before its rename and every folder after (shipped), against the same run
with ``os.fsync`` a no-op (the page cache only, as before). The fsyncs of a run are counted.
The LFTA leaves the 50 queries few files to write; the second workload is the worst case, a
selection of every UDP packet (a spool file each batch). A warm-up run each, then medians of 3,
alternating.

``python bench/bench_durable.py [--quick]``; figures in ``bench/results/durable.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_daemon import run, workload  # noqa: E402
from bench.common import write_result  # noqa: E402


def compare(path: Path, queries: Path, packets: int, repeat: int, name: str) -> dict:
    real = os.fsync
    calls = [0]

    def counted(fd: int) -> None:
        calls[0] += 1
        real(fd)
    run(path, queries)  # warm-up
    synced, cached, fsyncs = [], [], []
    for _ in range(repeat):
        calls[0] = 0
        with mock.patch("os.fsync", counted):
            synced.append(run(path, queries))
        fsyncs.append(calls[0])
        with mock.patch("os.fsync", lambda fd: None):
            cached.append(run(path, queries))
        print(f"{name}: fsynced {synced[-1]:.2f} s ({fsyncs[-1]} fsyncs), page cache only "
              f"{cached[-1]:.2f} s", flush=True)
    s, c = statistics.median(synced), statistics.median(cached)
    print(f"{name}: {packets:,} packets, no Spark: fsynced {packets / s / 1e6:.2f} Mpps, page "
          f"cache only {packets / c / 1e6:.2f} Mpps ({s / c:.3f}x the time, "
          f"{statistics.median(fsyncs):.0f} fsyncs a run)", flush=True)
    return {"fsynced": {"wall_s": synced, "median_s": s, "pps": packets / s, "fsyncs": fsyncs},
            "page_cache_only": {"wall_s": cached, "median_s": c, "pps": packets / c},
            "time_ratio": s / c}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1M packets, one run each")
    args = ap.parse_args()
    path, queries, packets, repeat = workload(args.quick)
    select = queries.with_name("select.sql")
    select.write_text("-- name: udp\nSELECT ts, src_ip, dst_ip, dst_port, wirelen FROM packets "
                      "WHERE protocol = 17\n")
    out = {"packets": packets, "trace": "backbone"}
    for name, sql in (("queries50", queries), ("udp_selection", select)):
        out[name] = compare(path, sql, packets, repeat, name)
    shutil.rmtree(queries.parent, ignore_errors=True)
    if not args.quick:
        write_result("durable", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
