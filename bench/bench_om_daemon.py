"""OM on and off in the daemon (issue 47): a live stream whose arrival rate and selectivity
drift, the same in both runs, through the whole daemon with Spark answering.

A writer thread appends the backbone trace's packets to a pcap file the daemon follows
(``follow: true``, ``restamp: true``: heartbeats close quiet windows), each stamped with the
wall-clock time it is written, at a rate that follows ``SCHEDULE`` (5,000 to 300,000 packets/s,
with bursts) and a share of UDP that drifts between 5 % and 60 % (the selectivity of the UDP
query's node). Three queries of 5 s windows keep three LFTA nodes: UDP sources, TCP
destination ports, and address pairs (many groups). One run with OM (the shipped defaults: its
charts pick pass-through, a table of 4,096 / 65,536 / 1,048,576 groups flushed at the window's
end or every quarter of it), one with ``om.enabled: false`` (every node a 65,536-slot table):

- memory held: the LFTA's groups and bytes, sampled every 0.25 s (mean and peak);
- rows into Spark: the partial rows spooled;
- answers: every window of every query equal to numpy's truth over the packets written, and
  how long after the stream's end the last window was answered for good;
- OM's plans: the switches and fidelity of each node.

``python bench/bench_om_daemon.py [--seconds S]``; figures in ``bench/results/om_daemon.json``.
About 8 minutes.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    CACHE,
    answer_rows,
    followed_daemon,
    spark_rows,
    write_result,
    written,
)
from bench.spark_queries import canonical, truth  # noqa: E402
from bench.traces import records, trace  # noqa: E402
from collector.config import OmConfig, SparkConfig  # noqa: E402
from planner.query import parse_queries  # noqa: E402

PERIOD = 5
QUERIES = f"""-- name: udp_sources
SELECT time/{PERIOD} AS t, src_ip, count(*) AS n, sum(wirelen) AS bytes FROM packets
WHERE protocol = 17 GROUP BY time/{PERIOD}, src_ip;
-- name: tcp_ports
SELECT time/{PERIOD} AS t, dst_port, count(*) AS n FROM packets
WHERE protocol = 6 GROUP BY time/{PERIOD}, dst_port;
-- name: pairs
SELECT time/{PERIOD} AS t, src_ip, dst_ip, count(*) AS n FROM packets
GROUP BY time/{PERIOD}, src_ip, dst_ip;
"""
# (seconds from the start, packets/s, share of UDP): linear between the points; bursts on top
SCHEDULE = [(0, 5_000, 0.6), (20, 5_000, 0.6), (40, 60_000, 0.3), (60, 250_000, 0.05),
            (80, 300_000, 0.1), (100, 40_000, 0.5), (120, 8_000, 0.6), (140, 150_000, 0.2),
            (160, 20_000, 0.4), (180, 5_000, 0.6)]
BURSTS = [(70, 4, 2.0), (145, 3, 2.0)]  # (start s, length s, rate factor)
TICK = 0.05


def at(t: float) -> tuple[float, float]:
    """(packets/s, UDP share) ``t`` seconds into the schedule."""
    for (t0, r0, u0), (t1, r1, u1) in zip(SCHEDULE, SCHEDULE[1:], strict=False):
        if t0 <= t < t1:
            f = (t - t0) / (t1 - t0)
            rate, udp = r0 + f * (r1 - r0), u0 + f * (u1 - u0)
            break
    else:
        rate, udp = SCHEDULE[-1][1], SCHEDULE[-1][2]
    for b0, length, factor in BURSTS:
        if b0 <= t < b0 + length:
            rate *= factor
    return rate, udp


class Writer(threading.Thread):
    """Appends the trace's packets to ``path`` at the schedule's rate, stamped with the time
    they are written; keeps the rows and stamps written (the truth's input)."""

    def __init__(self, path: Path, p: dict, seconds: float, seed: int = 47):
        super().__init__(name="writer", daemon=True)
        self.path, self.p, self.seconds = path, p, seconds
        udp = p["proto"] == 17
        self.udp, self.other = np.flatnonzero(udp), np.flatnonzero(~udp)
        self.rng = np.random.default_rng(seed)
        self.rows: list[np.ndarray] = []
        self.stamps: list[np.ndarray] = []
        self.behind_s = 0.0  # the most the writer fell behind its schedule
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - reported by the bench
            self.error = e

    def _run(self) -> None:
        cu = co = 0
        owed = 0.0
        with open(self.path, "ab") as fh:
            start = time.time()
            k = 0
            while (t := k * TICK) < self.seconds:
                rate, share = at(t)
                owed += rate * TICK
                n = int(owed)
                owed -= n
                nu = int(self.rng.binomial(n, share))
                u = self.udp[(cu + np.arange(nu)) % len(self.udp)]
                o = self.other[(co + np.arange(n - nu)) % len(self.other)]
                cu, co = cu + nu, co + n - nu
                rows = np.concatenate([u, o])
                self.rng.shuffle(rows)
                wake = start + t
                pause = wake - time.time()
                if pause > 0:
                    time.sleep(pause)
                else:
                    self.behind_s = max(self.behind_s, -pause)
                base = int(max(wake, time.time() - TICK) * 1e6)
                stamps = base + np.sort(self.rng.integers(0, int(TICK * 1e6), len(rows)))
                if len(rows):
                    fh.write(records(self.p, rows, stamps, 128))
                    fh.flush()
                self.rows.append(rows)
                self.stamps.append(stamps)
                k += 1

    def written(self) -> dict:
        """The packets written, as the generator's arrays with their new stamps."""
        return written(self.p, self.rows, self.stamps)


def run(om: bool, p: dict, seconds: float) -> dict:
    """One daemon, OM on or off, on the schedule; its memory, rows and answers."""
    var = Path(tempfile.mkdtemp(prefix="bench-om-", dir=CACHE))
    try:
        c, path = followed_daemon(var, QUERIES, spark=SparkConfig(watermark_delay_s=2 * PERIOD),
                                  om=OmConfig(enabled=om))
        writer = Writer(path, p, seconds)
        held, nbytes = [], []
        writer.start()
        while writer.is_alive():
            g, b = c.engines[0].lfta_usage()
            held.append(g)
            nbytes.append(b)
            time.sleep(0.25)
        if writer.error is not None:
            raise writer.error
        wrote = writer.written()
        last = int(wrote["ts_us"].max() // 1_000_000) // PERIOD * PERIOD + PERIOD
        qs = {q.name: q for q in parse_queries(QUERIES)}
        ended = time.time()
        deadline = ended + 300
        while time.time() < deadline:  # every window answered for good
            done = [c.complete_before(q) for q in qs.values()]
            if all(d is not None and d >= last for d in done):
                break
            time.sleep(1)
        else:
            raise RuntimeError(f"windows not answered by the deadline: {done} < {last}")
        drain = time.time() - ended
        om_state = c.engines[0].om_state()
        rows = spark_rows(c.metrics)
        answers = {}
        for name, q in qs.items():
            got = canonical(q, answer_rows(q, c.results(name)))
            want = canonical(q, truth(q, wrote))
            answers[name] = {"windows": len({r[0] for r in want}), "rows": len(want),
                             "equal_truth": got == want}
        c.stop()
        return {"om": om, "packets": int(len(wrote["ts_us"])),
                "writer_behind_s": writer.behind_s,
                "lfta_groups_mean": float(np.mean(held)), "lfta_groups_peak": int(max(held)),
                "lfta_bytes_mean": float(np.mean(nbytes)), "lfta_bytes_peak": int(max(nbytes)),
                "spool_rows": rows, "answers": answers, "answered_after_s": drain,
                "nodes": [{k: s.get(k) for k in ("node", "plan", "fidelity", "switches",
                                                  "moves", "rounds", "chart_rebuilds")}
                          for s in om_state]}
    finally:
        shutil.rmtree(var, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=SCHEDULE[-1][0])
    args = ap.parse_args()
    _, p = trace("backbone", 6_000_000, CACHE)
    out = {"period_s": PERIOD, "schedule": SCHEDULE, "bursts": BURSTS, "runs": []}
    for om in (True, False):
        r = run(om, p, args.seconds)
        out["runs"].append(r)
        print(f"om {'on ' if om else 'off'}: {r['packets']:,} packets; LFTA groups mean "
              f"{r['lfta_groups_mean']:,.0f} peak {r['lfta_groups_peak']:,}, bytes mean "
              f"{r['lfta_bytes_mean'] / 2**20:.1f} MiB peak {r['lfta_bytes_peak'] / 2**20:.1f} "
              f"MiB; {r['spool_rows']:,.0f} rows into Spark; last window answered "
              f"{r['answered_after_s']:.1f} s after the stream ended; answers equal the truth: "
              + ", ".join(f"{n} {a['equal_truth']}" for n, a in r["answers"].items()),
              flush=True)
        for n in r["nodes"]:
            print(f"    {n}", flush=True)
    on, off = out["runs"]
    out["summary"] = {
        "memory_mean_on_over_off": on["lfta_bytes_mean"] / max(1.0, off["lfta_bytes_mean"]),
        "memory_peak_on_over_off": on["lfta_bytes_peak"] / max(1.0, off["lfta_bytes_peak"]),
        "spark_rows_on_over_off": on["spool_rows"] / max(1.0, off["spool_rows"]),
        "answers_equal_truth": all(a["equal_truth"] for r in out["runs"]
                                   for a in r["answers"].values()),
        "writer_behind_s": max(r["writer_behind_s"] for r in out["runs"]),
    }
    if not math.isfinite(out["summary"]["memory_mean_on_over_off"]):
        out["summary"]["memory_mean_on_over_off"] = None
    write_result("om_daemon", out)
    print(f"== OM on / off: mean LFTA memory {out['summary']['memory_mean_on_over_off']:.2f}x, "
          f"peak {out['summary']['memory_peak_on_over_off']:.2f}x, rows into Spark "
          f"{out['summary']['spark_rows_on_over_off']:.2f}x; answers equal the truth: "
          f"{out['summary']['answers_equal_truth']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
