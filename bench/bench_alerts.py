"""Alerts (issue 44). (1) 10,000 alert instances in one closed window, delivered: seconds from
the window's evaluation until the last notification is acknowledged, to a webhook (a signed
POST each) and to a real Alertmanager (its v2 API, batches of 500). Baseline in the same run:
the bare posting a script would do of the same notifications (http.client on one kept
connection, no state, no outbox). (2) The capture side's throughput (``bench_daemon``'s run:
the backbone trace, its 50 queries, Spark left out) without alerts, with a window of 10,000
instances applied beside it every second (each fires 10,000 and resolves 10,000: far beyond a
real rule's pace, a window a minute), and with such windows back to back (the worst case).
Medians of 5, alternating.

``python bench/bench_alerts.py [--quick]``; figures in ``bench/results/alerts.json``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pyarrow as pa  # noqa: E402

from bench.common import CACHE, write_result  # noqa: E402
from collector.config import load_settings  # noqa: E402
from collector.daemon.alerts.receivers import sign, to_alertmanager  # noqa: E402
from collector.daemon.alerts.rules import AlertRule  # noqa: E402
from collector.daemon.service import Collector  # noqa: E402
from collector.spark.answers import answer_schema  # noqa: E402
from collector.spark.write import PartWriter  # noqa: E402

INSTANCES = 10_000
T0 = 1_700_000_040
SQL = ("SELECT time/60 AS t, dst_ip, count(*) AS syns FROM packets WHERE protocol = 6 "
       "GROUP BY time/60, dst_ip HAVING count(*) > 100")
SECRET = "bench-secret-0123456789"


class Counting:
    """A webhook receiver that counts the notifications (Alertmanager's are counted by it)."""

    def __init__(self):
        self.n = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keeps the connection, as a real receiver does

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                outer.n += 1
                self.send_response(204)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def write_window(root, query, w: int, hosts: int, offset: int = 0) -> None:
    start = (T0 + 60 * w) * 1_000_000
    ips = [f"10.{(i + offset) >> 16 & 255}.{(i + offset) >> 8 & 255}.{(i + offset) & 255}"
           for i in range(hosts)]
    cols = {"t": pa.array([(T0 + 60 * w) // 60] * hosts, pa.int64()),
            "dst_ip": pa.array(ips, pa.string()),
            "syns": pa.array([500] * hosts, pa.int64()),
            "window_start": pa.array([start] * hosts, pa.timestamp("us", tz="UTC")),
            "window_end": pa.array([start + 60_000_000] * hosts, pa.timestamp("us", tz="UTC"))}
    schema = answer_schema(query)
    w_ = PartWriter(root, query.name, f"part-run-{w:08d}.parquet", schema)
    w_.write(pa.Table.from_arrays([cols[f.name].cast(f.type) for f in schema], schema=schema))
    w_.close()


def delivery(receiver: dict, done) -> tuple[float, list[dict]]:
    """Seconds from evaluating a window of INSTANCES new keys until ``done()``; the events."""
    var = Path(tempfile.mkdtemp(prefix="bench-alerts-", dir=CACHE))
    try:
        c = Collector(load_settings(var_dir=var, initial_queries=None,
                                    alerts={"receivers": {"r": receiver}}))
        c.start(with_sources=False, with_spark=False)
        q = c.register("syn", SQL, AlertRule())
        write_window(c.settings.results_dir, q, 0, INSTANCES)
        c.alerts.complete_before = lambda q: T0 + 60
        t = time.perf_counter()
        c.alerts.evaluate()
        t_snap = time.perf_counter()  # the baseline's notifications, off the clock
        events = [o.body for o in c.alerts.store.pending("r", INSTANCES)]
        snap = time.perf_counter() - t_snap
        c.alerts.start()  # the delivery threads
        while not done() or c.alerts.store.outbox_size("r"):
            time.sleep(0.005)
        wall = time.perf_counter() - t - snap
        c.stop()
        return wall, events
    finally:
        shutil.rmtree(var, ignore_errors=True)


def bare_webhook(port: int, events: list[dict]) -> float:
    """The same notifications posted by a script: one kept connection, one POST each."""
    bodies = [json.dumps(e, separators=(",", ":")).encode() for e in events]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    t = time.perf_counter()
    for b in bodies:
        conn.request("POST", "/hook", b, {"Content-Type": "application/json",
                                          "X-Flowsieve-Signature": "sha256=" + sign(SECRET, b)})
        conn.getresponse().read()
    wall = time.perf_counter() - t
    conn.close()
    return wall


def bare_alertmanager(port: int, events: list[dict]) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    t = time.perf_counter()
    now = time.time()
    for i in range(0, len(events), 500):
        body = json.dumps([to_alertmanager(e, now, 60) for e in events[i:i + 500]]).encode()
        conn.request("POST", "/api/v2/alerts", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        assert r.status == 200, r.status
    wall = time.perf_counter() - t
    conn.close()
    return wall


def alertmanager(folder: Path):
    exe = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    if exe is None:
        return None, None
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = folder / "am.yml"
    cfg.write_text("route: {receiver: none}\nreceivers: [{name: none}]\n")
    proc = subprocess.Popen([exe, f"--config.file={cfg}", f"--storage.path={folder / 'am'}",
                             f"--web.listen-address=127.0.0.1:{port}",
                             "--cluster.listen-address="], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            c.request("GET", "/-/ready")
            if c.getresponse().status == 200:
                return port, proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    return None, None


def am_count(port: int) -> int:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/api/v2/alerts")
    return len(json.loads(c.getresponse().read()))


def capture_side(quick: bool) -> dict:
    """bench_daemon's capture-side run with the evaluator busy beside it, and without."""
    from bench.bench_daemon import PACKETS, run
    from bench.bench_spark import _sql, trace
    n = 1_000_000 if quick else PACKETS
    path, p = trace("backbone", n, CACHE)
    queries = Path(tempfile.mkdtemp(prefix="bench-alerts-q-", dir=CACHE)) / "queries.sql"
    queries.write_text(_sql("backbone", p))
    packets = len(p["proto"])
    del p
    busy_var = Path(tempfile.mkdtemp(prefix="bench-alerts-busy-", dir=CACHE))
    c = Collector(load_settings(var_dir=busy_var, initial_queries=None, alerts={
        "receivers": {"r": {"type": "webhook", "url": "http://127.0.0.1:9/",
                            "max_pending": 100}}}))
    c.start(with_sources=False, with_spark=False)
    q = c.register("syn", SQL, AlertRule())
    stop = threading.Event()
    applied = [0]
    state = {"w": 0}

    def evaluate(pause: float):
        while not stop.is_set():  # each window: 10,000 new keys fire, the last 10,000 resolve
            w = state["w"]
            write_window(c.settings.results_dir, q, w, INSTANCES, offset=(w % 2) * INSTANCES)
            c.alerts.complete_before = lambda q, w=w: T0 + 60 * (w + 1)
            c.alerts.evaluate()
            applied[0] += 1
            state["w"] += 1
            stop.wait(pause)

    def beside(pause: float) -> float:
        stop.clear()
        t = threading.Thread(target=evaluate, args=(pause,), daemon=True)
        t.start()
        try:
            return run(path, queries)
        finally:
            stop.set()
            t.join()
    run(path, queries)  # warm-up
    off, paced, busy = [], [], []
    for _ in range(1 if quick else 5):
        off.append(run(path, queries))
        paced.append(beside(1.0))
        busy.append(beside(0.0))
        print(f"capture: alerts off {off[-1]:.2f} s, a 10,000-alert window a second beside "
              f"it {paced[-1]:.2f} s, windows back to back {busy[-1]:.2f} s", flush=True)
    c.stop()
    shutil.rmtree(busy_var, ignore_errors=True)
    m = {k: statistics.median(v) for k, v in (("off", off), ("paced", paced), ("busy", busy))}
    return {"packets": packets, **{f"{k}_s": v for k, v in m.items()},
            **{f"{k}_mpps": packets / v / 1e6 for k, v in m.items()},
            "windows_applied": applied[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one run each, 1M packets")
    args = ap.parse_args()
    repeat = 1 if args.quick else 5
    CACHE.mkdir(exist_ok=True)
    out: dict = {"instances": INSTANCES}
    hook = Counting()
    ours, bare = [], []
    for _ in range(repeat):
        start = hook.n
        wall, events = delivery({"type": "webhook", "url": f"http://127.0.0.1:{hook.port}/hook",
                                 "secret": SECRET}, lambda s=start: hook.n - s >= INSTANCES)
        ours.append(wall)
        bare.append(bare_webhook(hook.port, events))
        print(f"webhook: flowsieve {ours[-1]:.2f} s, bare posting {bare[-1]:.2f} s", flush=True)
    out["webhook"] = {"flowsieve_s": statistics.median(ours), "bare_s": statistics.median(bare),
                      "ratio": statistics.median(ours) / statistics.median(bare)}
    folder = Path(tempfile.mkdtemp(prefix="bench-alerts-am-", dir=CACHE))
    port, proc = alertmanager(folder)
    if port is not None:
        ours, bare = [], []
        try:
            for _ in range(repeat):
                wall, events = delivery({"type": "alertmanager", "url":
                                         f"http://127.0.0.1:{port}"},
                                        lambda: True)
                ours.append(wall)
                bare.append(bare_alertmanager(port, events))
                print(f"alertmanager: flowsieve {ours[-1]:.2f} s, bare {bare[-1]:.2f} s",
                      flush=True)
            out["alertmanager"] = {"flowsieve_s": statistics.median(ours),
                                   "bare_s": statistics.median(bare),
                                   "ratio": statistics.median(ours) / statistics.median(bare),
                                   "alerts_held": am_count(port)}
        finally:
            proc.terminate()
            proc.wait(10)
            shutil.rmtree(folder, ignore_errors=True)
    out["capture"] = capture_side(args.quick)
    path = write_result("alerts", out)
    print(json.dumps(out, indent=1))
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
