"""``flowsieve run`` as a user runs it: a subprocess, queries over HTTP, results, metrics."""

from __future__ import annotations

import struct
import sys
import time
from pathlib import Path

import dpkt
import httpx
import pytest
from scapy.utils import RawPcapReader

from collector.config import data_file
from tests.helpers import capture
from tests.processes import daemon_config, metric, start_daemon, stop_daemon, wait_for
from tests.reference import fields_of

pytestmark = pytest.mark.slow

# DESIGN's Q1-Q3 with 5-second buckets instead of 60, so that windows close within the test.
Q123_5S = open(data_file("example.sql")).read().replace("time/60", "time/5")














@pytest.fixture
def daemon(tmp_path):
    cfg, port = daemon_config(tmp_path, [
        "{type: pcap, name: sample, loop: true, restamp: true}",
        f"{{type: pcap, name: appended, path: {tmp_path / 'appended.pcap'}, follow: true}}"],
        Q123_5S)
    with open(tmp_path / "appended.pcap", "wb") as f:  # the header now, packets later
        dpkt.pcap.Writer(f, snaplen=262144)
    log = open(tmp_path / "daemon.log", "w")
    proc = start_daemon(cfg, log)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(base + "/healthz", timeout=5).status_code == 200, 180,
                 "the API")
        yield base, proc
    finally:
        stop_daemon(proc)
        log.close()
        if proc.returncode != 0:
            sys.stderr.write((tmp_path / "daemon.log").read_text()[-5000:])


def daemon_dir(proc) -> Path:
    return Path(proc.args[proc.args.index("--config") + 1]).parent


def append_now(path: Path, source: Path) -> dict[tuple[int, int], tuple[int, int]]:
    """Append ``source``'s packets to a pcap, 1 ms apart from now; return the expected
    (time/5, dst_port) -> (packets, bytes) of UDP to ports 137 and 5355 (dpkt, scapy)."""
    t0 = time.time()
    with open(source, "rb") as fh:
        frames = [buf for _, buf in dpkt.pcap.Reader(fh)]
    wirelens = [meta.wirelen for _, meta in RawPcapReader(str(source))]
    stamps = [t0 + i / 1000 for i in range(len(frames))]
    with open(path, "ab") as f:
        for ts, buf, wl in zip(stamps, frames, wirelens, strict=True):
            sec = int(ts)
            f.write(struct.pack("<IIII", sec, int((ts - sec) * 1e6), len(buf), wl) + buf)
    want: dict[tuple[int, int], list[int]] = {}
    for ts, buf, wl in zip(stamps, frames, wirelens, strict=True):
        p = fields_of(ts, buf, dpkt.pcap.DLT_EN10MB)
        if p["protocol"] == 17 and p["dst_port"] in (137, 5355):
            acc = want.setdefault((int(ts) // 5, p["dst_port"]), [0, 0])
            acc[0] += 1
            acc[1] += wl
    return {k: tuple(v) for k, v in want.items()}


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
        "name": "netbios",
        "sql": "SELECT time/5 AS t, dst_port, count(*) AS pkts, sum(wirelen) AS bytes "
               "FROM packets WHERE protocol = 17 AND dst_port IN (137, 5355) "
               "GROUP BY time/5, dst_port"})
    assert r.status_code == 201, r.text
    # wikipedia.pcap's packets, stamped now, appended to the followed file; the looped sample
    # has none of these packets, so the answer is what dpkt and scapy count in the appended ones
    want = append_now(daemon_dir(proc) / "appended.pcap", capture("wikipedia.pcap"))
    assert want

    def complete():
        got = rows(base, "netbios")
        return got if sum(row["pkts"] for row in got) >= sum(v[0] for v in want.values()) \
            else None
    got = wait_for(complete, 120, "netbios results")
    assert {(row["t"], row["dst_port"]): (row["pkts"], row["bytes"]) for row in got} == want
    assert all(row["t"] * 5 >= int(registered_at) - 5 for row in got)

    # Q1-Q3 kept producing results across the rebuild
    def after_rebuild():
        return [x for x in rows(base, "udp_bw") if x["t"] * 5 > registered_at]
    wait_for(after_rebuild, 60, "udp_bw windows after the rebuild")
    assert rows(base, "dns_req") and rows(base, "dns_resp")

    text = httpx.get(base + "/metrics", timeout=10).text
    matched = metric(text, "flowsieve_query_tuples_matched_total", 'query="netbios"')
    assert matched == sum(v[0] for v in want.values())
    assert metric(text, "flowsieve_packets_in_total", 'source="sample"') > 0
    assert metric(text, "flowsieve_packets_dropped_prefilter_total", 'stream="packets"') > 0
    assert httpx.get(base + "/prefilter", timeout=10).json()["version"] >= 2
    assert httpx.get(base + "/healthz", timeout=10).json()["status"] == "ok"
    # per-query dashboard metrics: windows answered and their lag, Spark's own batch reports
    assert metric(text, "flowsieve_query_windows_closed_total", 'query="netbios"') > 0
    assert metric(text, "flowsieve_query_output_lag_seconds_count", 'query="netbios"') == \
        metric(text, "flowsieve_query_windows_closed_total", 'query="netbios"')
    assert metric(text, "flowsieve_query_invocations_avoided_total", 'query="netbios"') > 0
    assert sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("flowsieve_spark_input_rows_total{")) > 0
    assert metric(text, "flowsieve_rebuild_duration_seconds_count") >= 2
    ready = httpx.get(base + "/readyz", timeout=10)  # Spark and the followed file source run
    assert ready.status_code == 200, ready.text
    assert ready.json()["sources"] and set(ready.json()["sources"].values()) <= {"running",
                                                                                  "finished"}
    assert proc.poll() is None
