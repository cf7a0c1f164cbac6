"""Plan rebuilds as the control plane does them (issue 14): a registration or a deletion with
10, 100 and 1,000 queries registered. ``Collector.register`` / ``delete`` (registry, parse,
``build_plan``, hand-over to the engines) in a collector without sources or Spark; medians of 5.
Baseline in the same run: the ASC regions evaluated region by region (planner/reference.py's
``build_asc_qrb``, what ``build_asc`` did before its bitsets). Target: under 1 s at 1,000.

``python bench/bench_rebuild.py [--quick]``; figures in ``bench/results/rebuild.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import write_result  # noqa: E402
from collector.config import load_settings  # noqa: E402
from collector.daemon.service import Collector  # noqa: E402

SIZES = (10, 100, 1000)
REPEAT = 5


def query(i: int) -> str:
    """Gigascope-like: per-service sources, per-network port mixes, per-port counts, TTL
    classes; every query its own constants."""
    port, net = 1000 + i % 300, f"10.{i % 200}.{(i // 200) % 250}.0/24"
    return [
        f"SELECT time/60 AS t, src_ip, count(*) AS n FROM packets WHERE protocol = 6 AND "
        f"dst_port = {port} GROUP BY time/60, src_ip",
        f"SELECT time/60 AS t, dst_port, sum(wirelen) AS b FROM packets WHERE "
        f"in_prefix(src_ip, '{net}') GROUP BY time/60, dst_port",
        f"SELECT time/60 AS t, count(*) AS n FROM packets WHERE protocol = 17 AND "
        f"src_port = {port} GROUP BY time/60",
        f"SELECT time/10 AS t, dst_ip, count(*) AS n FROM packets WHERE ttl < {i % 64 + 1} "
        "GROUP BY time/10, dst_ip"][i % 4]


def measure(n: int, repeat: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        c = Collector(load_settings(var_dir=Path(d), initial_queries=None))
        c.start(with_sources=False, with_spark=False)
        for i in range(n - 1):
            c.registry.add(f"q{i}", query(i))
        c.rebuild()
        adds, deletes = [], []
        for k in range(repeat):
            t = time.perf_counter()
            c.register(f"extra{k}", query(n + k))
            adds.append(time.perf_counter() - t)
            t = time.perf_counter()
            c.delete(f"extra{k}")
            deletes.append(time.perf_counter() - t)
        c.stop()
    return {"register_s": statistics.median(adds), "delete_s": statistics.median(deletes)}


def regionwise_build_asc(attribute, stream, preds, uses):
    from capture.fields import IP, fields
    from planner.asc import ASC
    from planner.reference import build_asc_qrb
    kind = "ip" if fields(stream)[attribute].kind == IP else "int"
    constants = sorted({c for p in preds.values() for a in p.atoms for c in a.constants()})
    return ASC(attribute, stream, kind, constants, sorted(preds), sorted(uses),
               build_asc_qrb(attribute, stream, preds, uses))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 and 100 queries, 2 repeats")
    args = ap.parse_args()
    sizes, repeat = (SIZES[:2], 2) if args.quick else (SIZES, REPEAT)
    out: dict = {"sizes": {}}
    for n in sizes:
        new = measure(n, repeat)
        with mock.patch("planner.plan.build_asc", regionwise_build_asc):
            old = measure(n, repeat)
        out["sizes"][str(n)] = {"bitsets": new, "regionwise": old,
                                "speedup": old["register_s"] / new["register_s"]}
        print(f"{n:5} queries: register {new['register_s'] * 1e3:7.1f} ms, delete "
              f"{new['delete_s'] * 1e3:7.1f} ms (region by region: register "
              f"{old['register_s'] * 1e3:7.1f} ms, {out['sizes'][str(n)]['speedup']:.1f}x)",
              flush=True)
    if not args.quick:
        write_result("rebuild", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
