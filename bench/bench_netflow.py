"""NetFlow/IPFIX collector benchmark (issue 5), three parts, each with a baseline in the run:

1. Decode: flowsieve's numba decoder against the pure-Python ``netflow`` package (PyPI) on the
   same v9 and IPFIX datagrams (softflowd-like template, 30 records each), one core.
2. Loopback load: a sender process paces v9 / IPFIX exports at rising rates, ``--seconds`` each
   (30 by default), into listener -> decoder -> engine -> spool (Spark not running). A rate has
   zero loss when the kernel dropped nothing (SO_RXQ_OVFL, /proc/net/udp) and every record
   sent was decoded and spooled.
3. End to end with Spark: the daemon's collector (listener, engine, Spark job) at a fixed rate;
   the rate is records / time until Spark has committed every spool file.

Writes bench/results/netflow.json and prints a summary.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import median_time, write_result  # noqa: E402
from flowgen import PER_DATAGRAM, datagrams, send_paced  # noqa: E402

from capture.listen import FlowListener  # noqa: E402
from capture.netflow import Datagrams, Decoder  # noqa: E402

QUERY = ("-- name: top_src\nSELECT time/60 AS t, src_ip, sum(bytes) AS bytes, "
         "sum(est_packets) AS pkts FROM flows WHERE protocol = 6 OR protocol = 17 "
         "GROUP BY time/60, src_ip;\n")


def _batches(payloads: list[bytes], per: int = 1024) -> list[Datagrams]:
    return [Datagrams.from_payloads(payloads[i:i + per], "192.0.2.1", 0)
            for i in range(0, len(payloads), per)]


def bench_decode(n_records: int, repeat: int) -> dict:
    import netflow
    out = {}
    for version in (9, 10):
        payloads = datagrams(version, n_records)
        batches = _batches(payloads)
        d = Decoder()
        for b in batches:  # compile and learn the template
            d.decode(b)

        def run(d=d, batches=batches):
            dec = Decoder(d.store)
            return sum(len(dec.decode(b)) for b in batches)
        assert run() == n_records
        t = median_time(run, repeat)
        sub = payloads[:max(1, len(payloads) // 10)]

        def baseline(sub=sub):
            templates = {"netflow": {}, "ipfix": {}}
            return sum(len(netflow.parse_packet(p, templates).flows) for p in sub)
        n_base = baseline()
        assert n_base == len(sub) * PER_DATAGRAM
        tb = median_time(baseline, max(3, repeat // 2))
        ours, theirs = n_records / t, n_base / tb
        out["v9" if version == 9 else "ipfix"] = {
            "records": n_records, "flowsieve_flows_per_s": round(ours),
            "netflow_pkg_flows_per_s": round(theirs), "ratio": round(ours / theirs, 1)}
    return out


def _sender(payloads, dest, rate, seconds, q):
    q.put(send_paced(payloads, dest, rate, seconds))


def _engine(spool_dir: Path):
    from collector.pipeline.engine import Engine
    from collector.pipeline.spool import Spool
    from planner.plan import build_plan
    from planner.query import parse_queries
    engine = Engine(Spool(spool_dir, policy="drop"), "flows", probe="bench")
    engine.set_plan(build_plan(parse_queries(QUERY)))
    return engine


def load_run(version: int, rate: float, seconds: float, workdir: Path) -> dict:
    """One rate: sender process -> listener -> decoder -> engine -> spool."""
    payloads = datagrams(version, 30_000 * PER_DATAGRAM // 30, seed=version)
    lst = FlowListener(["127.0.0.1:0"], rcvbuf=32 << 20)
    lst.open()
    dec = Decoder()
    engine = _engine(workdir / f"spool-{version}-{int(rate)}")
    stop = threading.Event()
    got = [0]
    busy = [0.0]

    def receive():
        for dg in lst.batches(stop, poll_s=0.1, linger_s=0.02):
            if dg is None:
                continue
            t = time.perf_counter()
            fb = dec.decode(dg)
            engine.process(fb, "bench")
            busy[0] += time.perf_counter() - t
            got[0] += len(fb)

    t = threading.Thread(target=receive)
    t.start()
    q = mp.get_context("fork").Queue()
    p = mp.get_context("fork").Process(target=_sender, args=(payloads, lst.bound[0], rate,
                                                              seconds, q))
    p.start()
    sent = q.get()
    p.join()
    deadline = time.monotonic() + 30
    while got[0] < sent["records"] and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)
    stop.set()
    t.join()
    drops = lst.update_drops()
    lst.close()
    lost_seq = sum(s["sequence"]["lost"] for s in dec.streams())
    return {"rate": rate, "sent_records": sent["records"],
            "achieved_send_rate": round(sent["records"] / sent["seconds"]),
            "decoded_records": got[0], "kernel_drops": drops, "sequence_lost": lost_seq,
            "decode_errors": dict(dec.errors), "receiver_busy_fraction":
                round(busy[0] / sent["seconds"], 3),
            "zero_loss": drops == 0 and got[0] == sent["records"] and not dec.errors}


def bench_load(rates: list[float], seconds: float) -> dict:
    out = {}
    with tempfile.TemporaryDirectory(prefix="flowsieve-bench-") as tmp:
        for version in (9, 10):
            runs = []
            for rate in rates:
                r = load_run(version, rate, seconds, Path(tmp))
                runs.append(r)
                print(f"  v{version} {rate:>9,.0f}/s: sent {r['sent_records']:,} at "
                      f"{r['achieved_send_rate']:,}/s, decoded {r['decoded_records']:,}, "
                      f"kernel drops {r['kernel_drops']}, busy {r['receiver_busy_fraction']}",
                      flush=True)
                if not r["zero_loss"]:
                    break
            ok = [r["rate"] for r in runs if r["zero_loss"]]
            out["v9" if version == 9 else "ipfix"] = {
                "runs": runs, "highest_zero_loss_rate": max(ok) if ok else 0}
    return out


def bench_spark(rate: float, seconds: float) -> dict:
    """The daemon's collector with Spark: listener -> engine -> spool -> Spark job."""
    from collector.config import SourceConfig, load_settings
    from collector.daemon.service import Collector
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    with tempfile.TemporaryDirectory(prefix="flowsieve-bench-spark-") as tmp:
        qfile = Path(tmp) / "q.sql"
        qfile.write_text(QUERY)
        settings = load_settings(var_dir=Path(tmp) / "var", initial_queries=str(qfile),
                                 sources=[SourceConfig(type="netflow", name="nf",
                                                       listen=["127.0.0.1:0"])])
        settings.spark.master = "local[2]"
        settings.spark.trigger_s = 1.0
        c = Collector(settings)
        c.start(with_sources=False)
        src = c.sources[0]
        src.open()
        dest = src.listener.bound[0]
        c_thread = threading.Thread(target=c._run_source, args=(src, c.engines[0]))
        c_thread.start()
        clock = threading.Thread(target=c._flusher)  # LFTA flushes and heartbeats
        clock.start()
        payloads = datagrams(10, 30_000 * PER_DATAGRAM // 30, seed=3)
        q = mp.get_context("fork").Queue()
        t0 = time.perf_counter()
        p = mp.get_context("fork").Process(target=_sender, args=(payloads, dest, rate, seconds,
                                                                  q))
        p.start()
        sent = q.get()
        p.join()
        spool = settings.spool_dir / "flows"
        deadline = time.monotonic() + 900
        while c.engines[0].tuples_in < sent["records"] and time.monotonic() < deadline:
            time.sleep(0.2)
        # every data file written so far must be merged and committed by Spark (heartbeat
        # punctuation files keep coming and are not waited for)
        pending = set(spool.rglob("*.arrow"))
        while pending and time.monotonic() < deadline:
            pending = {f for f in pending if f.exists()}
            time.sleep(0.2)
        elapsed = time.perf_counter() - t0
        decoded = c.engines[0].tuples_in
        drops = src.listener.update_drops()
        c.stop()
        c_thread.join(timeout=30)
        clock.join(timeout=30)
        return {"rate": rate, "sent_records": sent["records"], "decoded_records": decoded,
                "kernel_drops": drops, "send_seconds": round(sent["seconds"], 1),
                "seconds_until_spark_done": round(elapsed, 1),
                "spark_lag_after_last_datagram_s": round(elapsed - sent["seconds"], 1),
                "end_to_end_flows_per_s": round(decoded / elapsed)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small sizes, 3 s per rate; no file")
    ap.add_argument("--seconds", type=float, default=30.0)
    args = ap.parse_args()
    quick = args.quick
    seconds = 3.0 if quick else args.seconds
    res = {"machine": f"{os.cpu_count()} cores", "note": "medians; one core for decode"}
    print("decode (numba vs netflow package)...", flush=True)
    res["decode"] = bench_decode(60_000 if quick else 600_000, 3 if quick else 5)
    for k, v in res["decode"].items():
        print(f"  {k}: {v['flowsieve_flows_per_s']:,} flows/s vs {v['netflow_pkg_flows_per_s']:,}"
              f" = {v['ratio']}x", flush=True)
    rates = [100_000, 200_000, 300_000, 400_000, 600_000, 800_000, 1_000_000]
    print(f"loopback load, {seconds:.0f} s per rate...", flush=True)
    res["load"] = bench_load(rates[:3] if quick else rates, seconds)
    res["load"]["seconds_per_rate"] = seconds
    best = min(v["highest_zero_loss_rate"] for k, v in res["load"].items()
               if isinstance(v, dict))
    e2e_rate = min(best, 300_000) or 100_000
    print(f"end to end with Spark at {e2e_rate:,}/s...", flush=True)
    res["spark"] = bench_spark(e2e_rate, seconds)
    print(f"  {res['spark']}", flush=True)
    if not quick:
        print("wrote", write_result("netflow", res))



if __name__ == "__main__":
    main()
