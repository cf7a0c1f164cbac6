"""Nothing lost, nothing twice (issue 13): `flowsieve run` follows a capture that grows in real
time and listens to a NetFlow v5 exporter that resends nothing; at three seeded random points the
daemon (its Spark JVM with it) or its Spark JVM alone is killed with SIGKILL — the daemon is
started again, or starts a new JVM itself. At the end every window's answers over the capture
equal a replay of the whole capture, every packet counted once; over the flows, no window holds
more records than were sent in it, the records answered plus those the restarts counted lost
(by the sequence gap each finds) equal the records sent, and the windows after the last restart
are answered exactly."""

from __future__ import annotations

import os
import random
import signal
import socket
import struct
import subprocess
import threading
import time
from collections import Counter

import httpx
import pytest

from api.replay import replay
from planner.query import parse_queries
from tests.flowtools import HEX, read_hex
from tests.processes import (
    PERIOD,
    Feeder,
    answers,
    daemon_config,
    metric,
    no_server_errors,
    start_daemon,
    stop_daemon,
    v5_now,
    wait_for,
    whole_windows,
)
from tests.reference import rows_of

pytestmark = pytest.mark.slow

QUERIES = """
-- name: all5s
SELECT time/5 AS t, count(*) AS n, sum(wirelen) AS b FROM packets GROUP BY time/5;
-- name: udp_src
SELECT time/5 AS t, src_ip, count(*) AS n, max(wirelen) AS m FROM packets
WHERE protocol = 17 GROUP BY time/5, src_ip;
-- name: flows5s
SELECT time/5 AS t, count(*) AS n, sum(packets) AS p FROM flows GROUP BY time/5
"""


class Exporter(threading.Thread):
    """NetFlow v5 exports of a real datagram's records stamped with the wall clock, every
    0.1 s, numbered by flow sequence; nothing is ever sent again."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.template = read_hex(HEX / "PACKET_V5.hex")[0]
        self.records = struct.unpack_from(">H", self.template, 2)[0]
        self.port = port
        self.sent: Counter = Counter()  # window -> records
        self.stop = threading.Event()

    def run(self) -> None:
        seq = 0
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            while not self.stop.is_set():
                now = time.time()
                try:
                    s.sendto(v5_now(self.template, seq, now), ("127.0.0.1", self.port))
                except OSError:
                    pass  # the collector is down: the datagram is lost, as on a network
                self.sent[int(now) // PERIOD] += self.records
                seq += self.records
                self.stop.wait(0.1)


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
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        flow_port = s.getsockname()[1]
    cfg, port = daemon_config(tmp_path, [
        f"{{type: pcap, name: traffic, path: {tmp_path / 'traffic.pcap'}, follow: true}}",
        f"{{type: netflow, name: nf, listen: ['127.0.0.1:{flow_port}']}}"], QUERIES)
    feeder = Feeder(tmp_path / "traffic.pcap", per_tick=20)
    exporter = Exporter(flow_port)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    rnd = random.Random(13)
    log = open(tmp_path / "daemon.log", "a")

    def start() -> subprocess.Popen:
        proc = start_daemon(cfg, log)
        wait_for(lambda: client.get("/readyz").status_code == 200, 240, "the daemon ready")
        return proc

    def flows(name: str) -> float:
        return metric(client.get("/metrics").text, name, 'source="nf"')

    def lost() -> float:  # what this process counted lost (its counter starts at zero)
        return metric(client.get("/metrics").text, "flowsieve_flow_sequence_lost_total")

    proc = None
    restarts = jvm_restarts = 0
    counted_lost = 0.0  # records the killed processes counted lost
    # each durable step is aimed at by tests/test_crash_points.py: here random moments
    victims = ["daemon"] * 2 + ["spark"]
    rnd.shuffle(victims)
    try:
        feeder.start()
        proc = start()
        exporter.start()
        restarted = time.time()
        for victim in victims:
            # this process has heard the exporter (a restarted one counted its gap by then)
            wait_for(lambda: flows("flowsieve_flows_in_total") > 0, 60, "flows")
            time.sleep(rnd.uniform(0.5, 5.0))  # a random point of its life
            jvms = [p for p in children(proc.pid) if comm(p) == "java"]
            assert len(jvms) == 1
            if victim == "daemon":  # its JVM exits once the daemon's pipe closes
                counted_lost += lost()
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            else:  # the Spark job alone: the daemon starts a new JVM
                os.kill(jvms[0], signal.SIGKILL)
            wait_for(lambda jvms=jvms: not any(alive(p) for p in jvms), 120, "the JVM gone")
            if victim == "daemon":
                proc, jvm_restarts = start(), 0  # a new process counts from zero
                restarted = time.time()
            else:
                restarts += 1
                jvm_restarts += 1
                wait_for(lambda n=jvm_restarts: metric(
                    client.get("/metrics").text, "flowsieve_spark_jvm_restarts_total") == n,
                    120, "a new JVM")
                wait_for(lambda: client.get("/readyz").status_code == 200, 240, "Spark again")
        # two whole windows after the last restart, then the sources stop
        exact_from = (int(restarted) // PERIOD + 1) * PERIOD
        wait_for(lambda: flows("flowsieve_flows_in_total") > 0, 60, "flows")
        time.sleep(max(5.0, exact_from + 2 * PERIOD + 0.5 - time.time()))
        exporter.stop.set()
        feeder.stop.set()
        feeder.join(10)
        exporter.join(10)
        end = time.time()
        last = (int(end) // PERIOD + 1) * PERIOD  # every window with data starts before this
        for name in ("all5s", "flows5s"):
            wait_for(lambda name=name: (answers(client, name)[1] or 0) >= last, 240,
                     "every window answered")
        got = {name: answers(client, name)[0] for name in ("all5s", "udp_src", "flows5s")}
        counted_lost += lost()
    finally:
        exporter.stop.set()
        feeder.stop.set()
        client.close()
        if proc is not None:
            stop_daemon(proc)
        log.close()
    assert restarts == 1
    no_server_errors(tmp_path / "daemon.log")
    # the flows: nothing twice, nothing lost uncounted, exact where no kill reached
    sent = exporter.sent
    answered = {r["t"]: r["n"] for r in got["flows5s"]}
    assert all(n <= sent[t] for t, n in answered.items()), (answered, sent)
    assert counted_lost > 0  # the kills did lose records (in memory, and sent while down)
    assert sum(answered.values()) + counted_lost == sum(sent.values())
    after = [t for t in sent if exact_from <= t * PERIOD and t * PERIOD + PERIOD <= end]
    assert after and all(answered.get(t) == sent[t] for t in after), (after, answered, sent)
    packets = [q for q in parse_queries(QUERIES) if q.stream == "packets"]
    res = replay(tmp_path / "traffic.pcap", packets, tmp_path / "replay", spark)
    assert res.error is None
    want = {q.name: rows_of(q, t) for q, t in res.answers}
    for name in ("all5s", "udp_src"):
        w = whole_windows(want[name], 0, last)
        assert w and whole_windows(got[name], 0, last) == w, name
    # every packet written is counted once
    assert sum(r["n"] for r in got["all5s"]) == feeder.written
