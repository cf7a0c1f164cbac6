"""``flowsieve run`` as a user runs it: a subprocess, queries over HTTP, results, metrics."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from collector.config import data_file
from tests.conftest import ROOT

pytestmark = pytest.mark.slow

# DESIGN's Q1-Q3 with 5-second buckets instead of 60, so that windows close within the test.
Q123_5S = open(data_file("example.sql")).read().replace("time/60", "time/5")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(fn, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = fn()
            if last:
                return last
        except httpx.HTTPError as e:
            last = e
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last})")


def metric(text: str, name: str, labels: str = "") -> float:
    for line in text.splitlines():
        if line.startswith(name + (labels and "{" + labels + "}")) and not line.startswith("#"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture
def daemon(tmp_path):
    port = free_port()
    (tmp_path / "q.sql").write_text(Q123_5S)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"""
var_dir: {tmp_path / 'var'}
api: {{host: 127.0.0.1, port: {port}}}
spark: {{master: "local[2]", driver_memory: 1g, shuffle_partitions: 2, trigger_s: 1}}
initial_queries: {tmp_path / 'q.sql'}
""")
    log = open(tmp_path / "daemon.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "collector.cli", "run", "--config", str(cfg)],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(base + "/healthz", timeout=5).status_code == 200, 180,
                 "the API")
        yield base, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        if proc.returncode not in (0, -signal.SIGTERM):
            sys.stderr.write((tmp_path / "daemon.log").read_text()[-5000:])


def rows(base, name):
    r = httpx.get(f"{base}/queries/{name}/results", timeout=10)
    r.raise_for_status()
    return r.json()["rows"]


def test_register_query_over_http_while_running(daemon):
    base, proc = daemon
    # the example queries produce results on the looped sample capture
    wait_for(lambda: rows(base, "udp_bw"), 180, "udp_bw results")
    registered_at = time.time()
    r = httpx.post(base + "/queries", timeout=30, json={
        "name": "quic_up",
        "sql": "SELECT time/5 AS t, dst_port, count(*) AS pkts, sum(wirelen) AS bytes "
               "FROM packets WHERE protocol = 17 AND dst_port = 443 GROUP BY time/5, dst_port"})
    assert r.status_code == 201, r.text
    got = wait_for(lambda: rows(base, "quic_up"), 120, "quic_up results")
    assert all(row["dst_port"] == 443 and row["pkts"] >= 1 for row in got)
    assert all(row["t"] * 5 >= int(registered_at) - 5 for row in got)

    # Q1-Q3 kept producing results across the rebuild
    def after_rebuild():
        return [x for x in rows(base, "udp_bw") if x["t"] * 5 > registered_at]
    wait_for(after_rebuild, 60, "udp_bw windows after the rebuild")
    assert rows(base, "dns_req") and rows(base, "dns_resp")

    text = httpx.get(base + "/metrics", timeout=10).text
    matched = metric(text, "flowsieve_query_tuples_matched_total", 'query="quic_up"')
    assert matched >= sum(row["pkts"] for row in rows(base, "quic_up")) > 0
    assert metric(text, "flowsieve_packets_in_total", 'source="sample"') > 0
    assert metric(text, "flowsieve_packets_dropped_prefilter_total", 'stream="packets"') > 0
    assert httpx.get(base + "/prefilter", timeout=10).json()["version"] >= 2
    assert httpx.get(base + "/healthz", timeout=10).json()["status"] == "ok"
    assert proc.poll() is None
