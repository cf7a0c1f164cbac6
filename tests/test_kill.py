"""Nothing lost, nothing twice (issue 13): `flowsieve run` follows a capture that grows in real
time; at five seeded random points the daemon (its Spark JVM with it) or its Spark JVM alone is
killed with SIGKILL — the daemon is started again, or starts a new JVM itself; at the end every
window's answers equal a replay of the whole capture, every packet counted once."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time

import httpx
import pytest

from collector.replay import replay
from collector.results import rows_of
from planner.query import parse_queries
from tests.test_daemon import daemon_config, metric, start_daemon, stop_daemon, wait_for
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


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""


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
    cfg, port = daemon_config(tmp_path, [
        f"{{type: pcap, name: traffic, path: {tmp_path / 'traffic.pcap'}, follow: true}}"],
        QUERIES)
    feeder = Feeder(tmp_path / "traffic.pcap", per_tick=20)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    rnd = random.Random(13)
    log = open(tmp_path / "daemon.log", "a")

    def start() -> subprocess.Popen:
        proc = start_daemon(cfg, log)
        wait_for(lambda: client.get("/readyz").status_code == 200, 240, "the daemon ready")
        return proc

    proc = None
    restarts = jvm_restarts = 0
    victims = ["daemon"] * 3 + ["spark"] * 2
    rnd.shuffle(victims)
    try:
        feeder.start()
        proc = start()
        for victim in victims:
            time.sleep(rnd.uniform(0.5, 5.0))  # a random point of its life
            jvms = [p for p in children(proc.pid) if comm(p) == "java"]
            assert len(jvms) == 1
            if victim == "daemon":  # its JVM exits once the daemon's pipe closes
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            else:  # the Spark job alone: the daemon starts a new JVM
                os.kill(jvms[0], signal.SIGKILL)
            wait_for(lambda jvms=jvms: not any(alive(p) for p in jvms), 120, "the JVM gone")
            if victim == "daemon":
                proc, jvm_restarts = start(), 0  # a new process counts from zero
            else:
                restarts += 1
                jvm_restarts += 1
                wait_for(lambda n=jvm_restarts: metric(
                    client.get("/metrics").text, "flowsieve_spark_jvm_restarts_total") == n,
                    120, "a new JVM")
                wait_for(lambda: client.get("/readyz").status_code == 200, 240, "Spark again")
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
        if proc is not None:
            stop_daemon(proc)
        log.close()
    assert restarts == 2
    res = replay(tmp_path / "traffic.pcap", parse_queries(QUERIES), tmp_path / "replay", spark)
    assert res.error is None
    want = {q.name: rows_of(q, t) for q, t in res.answers}
    for name in ("all5s", "udp_src"):
        w = whole_windows(want[name], 0, last)
        assert w and whole_windows(got[name], 0, last) == w, name
    # every packet written is counted once
    assert sum(r["n"] for r in got["all5s"]) == feeder.written
