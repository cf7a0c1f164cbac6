"""A daemon run as for months, with Spark under traffic: its answers stay within their
retention limits while it runs; a clean stop (SIGTERM) exits in its time, leaves no process of
its own running, logs no Java stack trace and leaves nothing in the spool that Spark has not
merged; a JVM that cannot finish in time is killed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from collector.config import data_file
from tests.helpers import ROOT
from tests.processes import (
    daemon_config,
    descendants,
    metric,
    running,
    start_daemon,
    stop_daemon,
    wait_for,
)

pytestmark = pytest.mark.slow

Q_5S = open(data_file("example.sql")).read().replace("time/60", "time/5")
JAVA_FRAME = re.compile(r"^\s+at [\w$.<>/]+\(.*\)\s*$|Exception in thread|^Traceback ")


def merged_files(checkpoints: Path) -> set[str]:
    """The spool files Spark's file sources have taken into a batch (their logs)."""
    out = set()
    for log in checkpoints.glob("*/*/sources/0/*"):
        if log.name.startswith("."):  # Hadoop's .crc checksums: binary, may begin with "{"
            continue
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                out.add(Path(json.loads(line)["path"].removeprefix("file:")).name)
    return out


def oldest_window(base: str, name: str) -> str | None:
    rows = httpx.get(f"{base}/queries/{name}/results", params={"order": "oldest", "limit": 1},
                     timeout=10).json()["rows"]
    return rows[0]["window_start"] if rows else None


def test_retention_while_running_then_a_clean_stop_under_traffic(tmp_path):
    cfg, port = daemon_config(tmp_path, ["{type: pcap, name: sample, loop: true, "
                                         "restamp: true}"], Q_5S)
    cfg.write_text(cfg.read_text() + "shutdown_timeout_s: 40\n"
                   "results: {max_age: 12s, check_s: 1}\n")
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "daemon.log"
    with open(log_path, "w") as log:
        proc = start_daemon(cfg, log)
        try:
            # Spark answers windows, and packets keep coming (the capture loops)
            first = wait_for(lambda: oldest_window(base, "udp_bw"), 240, "udp_bw results")
            # by bytes: dns_req keeps at most 4 kB (a part of a window or two is 1-3 kB; a part
            # of more windows, on a slow machine, may alone be over the limit and go too)
            r = httpx.patch(f"{base}/queries/dns_req", json={"max_bytes": 4096,
                                                             "max_age": "unlimited"})
            assert r.status_code == 200 and r.json()["retention"]["max_bytes"] == 4096

            def removed(query: str, reason: str) -> float:
                return metric(httpx.get(f"{base}/metrics", timeout=10).text,
                              "flowsieve_results_removed_files_total",
                              f'query="{query}",reason="{reason}"')
            wait_for(lambda: removed("dns_req", "bytes"), 120, "dns_req over its 4 kB")
            held = metric(httpx.get(f"{base}/metrics", timeout=10).text,
                          "flowsieve_results_bytes", 'query="dns_req"')
            assert held <= 4096
            assert removed("dns_req", "age") == 0  # its own limit: no age
            # by age: udp_bw's first window goes once its part is 12 s old
            wait_for(lambda: removed("udp_bw", "age"), 120, "udp_bw's parts older than 12 s")
            wait_for(lambda: (oldest_window(base, "udp_bw") or first) > first, 60,
                     "udp_bw's oldest window removed")
            # the driver JVM's figures, from its management beans: its heap is the configured
            # driver_memory (1g: -Xmx1g)
            text = httpx.get(f"{base}/metrics", timeout=10).text
            heap = {k: metric(text, "flowsieve_jvm_memory_bytes", f'area="heap",kind="{k}"')
                    for k in ("used", "committed", "max")}
            assert 0 < heap["used"] <= heap["committed"] <= heap["max"] <= 1 << 30, heap
            assert heap["max"] > 1 << 29, heap
            assert "flowsieve_jvm_gc_collections_total{gc=" in text
            assert metric(text, "flowsieve_jvm_threads") > 10
            assert 'flowsieve_source_idle_seconds{source="sample"}' in text
            tree = descendants(proc.pid)
            assert any("java" in c for c in tree.values()), tree  # the JVM is a child
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=40 + 60)
        finally:
            stop_daemon(proc)
    text = log_path.read_text(errors="replace")
    assert code == 0, text[-3000:]  # a SIGTERM is the daemon's normal stop
    # nothing of the daemon's runs on: the JVM and Spark's Python workers have ended with it
    deadline = time.monotonic() + 10  # a worker reads its end of a closed socket
    while time.monotonic() < deadline and any(running(p) for p in tree):
        time.sleep(0.2)
    assert not {p: c for p, c in tree.items() if running(p)}
    # no Java stack trace, no Python traceback: a stop is no failure
    bad = [ln for ln in text.splitlines() if JAVA_FRAME.search(ln)]
    assert not bad, "\n".join(bad[:20])
    assert "stopped in" in text
    assert "did not" not in text  # neither the sources, Spark nor the JVM needed the deadline
    # drained: every spool file left was merged by Spark (the checkpoints say so)
    spool = [p.name for p in (tmp_path / "var" / "spool").glob("*/*/*.parquet")]
    assert spool == [] or set(spool) <= merged_files(tmp_path / "var" / "checkpoints")


def test_a_jvm_that_cannot_exit_in_time_is_killed(tmp_path):
    """A JVM still running at the deadline is killed (a daemon never leaves one behind), and
    none writes a class-data archive on its way out."""
    script = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from pyspark import SparkContext
from collector.spark.session import build_session, class_archive_path, stop_jvm
archive = class_archive_path({str(tmp_path)!r})
spark = build_session("local[1]", "512m", 1, False, class_archive=archive)
spark.range(10).count()
pid = SparkContext._gateway.proc.pid
print(pid, stop_jvm(spark, 0.0), flush=True)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"})
    assert out.returncode == 0, out.stderr[-3000:]
    pid, how = out.stdout.split()
    assert how == "killed"
    assert not running(int(pid))
    assert list(tmp_path.glob("*.jsa*")) == []
