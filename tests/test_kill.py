"""Nothing lost, nothing twice (issue 13): `flowsieve run` follows a capture that grows in real
time and is killed with SIGKILL (its Spark JVM with it) at five seeded random points, restarted
each time; at the end every window's answers equal a replay of the whole capture."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import httpx
import pytest

from collector.replay import replay
from collector.results import rows_of
from planner.query import parse_queries
from tests.conftest import ROOT
from tests.test_daemon import free_port, wait_for
from tests.test_hot_swap import PERIOD, Feeder, answers, whole_windows

pytestmark = pytest.mark.slow

QUERIES = """
-- name: all5s
SELECT time/5 AS t, count(*) AS n, sum(wirelen) AS b FROM packets GROUP BY time/5;
-- name: udp_src
SELECT time/5 AS t, src_ip, count(*) AS n, max(wirelen) AS m FROM packets
WHERE protocol = 17 GROUP BY time/5, src_ip
"""


def children(pid: int) -> list[int]:
    r = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (killed, not yet reaped) is gone for our purpose
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_killed_daemon_answers_every_window_once(tmp_path, spark):
    port = free_port()
    (tmp_path / "q.sql").write_text(QUERIES)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"""
var_dir: {tmp_path / 'var'}
api: {{host: 127.0.0.1, port: {port}}}
spark: {{master: "local[2]", driver_memory: 1g, shuffle_partitions: 2, trigger_s: 1}}
initial_queries: {tmp_path / 'q.sql'}
sources:
  - {{type: pcap, name: traffic, path: {tmp_path / 'traffic.pcap'}, follow: true}}
""")
    feeder = Feeder(tmp_path / "traffic.pcap", per_tick=20)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    rnd = random.Random(13)
    log = open(tmp_path / "daemon.log", "a")

    def start() -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "api.cli", "run", "--config", str(cfg)],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wait_for(lambda: client.get("/readyz").status_code == 200, 240, "the daemon ready")
        return proc

    proc = None
    kills = 0
    try:
        feeder.start()
        while kills < 5:
            proc = start()
            time.sleep(rnd.uniform(1.0, 9.0))  # a random point of its life
            jvms = children(proc.pid)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
            # the JVM exits when its parent's pipe closes; the next daemon needs its locks
            wait_for(lambda jvms=jvms: not any(alive(p) for p in jvms), 120, "the JVM gone")
        proc = start()
        time.sleep(5)
        feeder.stop.set()
        feeder.join(10)
        end = time.time()
        last = (int(end) // PERIOD + 1) * PERIOD  # every window with data starts before this
        wait_for(lambda: (answers(client, "all5s")[1] or 0) >= last, 240,
                 "every window answered")
        got = {name: answers(client, name)[0] for name in ("all5s", "udp_src")}
    finally:
        feeder.stop.set()
        client.close()
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
    assert kills == 5
    res = replay(tmp_path / "traffic.pcap", parse_queries(QUERIES), tmp_path / "replay", spark)
    assert res.error is None
    want = {q.name: rows_of(q, t) for q, t in res.answers}
    for name in ("all5s", "udp_src"):
        w = whole_windows(want[name], 0, last)
        assert w and whole_windows(got[name], 0, last) == w, name
    # every packet written is counted once
    assert sum(r["n"] for r in got["all5s"]) == feeder.written
