"""A full spool, by source kind (issue 13): a capture file waits for room and loses nothing; a
flow listener drops, counts by reason and keeps running. The collector runs its real source
threads; the test plays Spark, consuming (reading and deleting) spool files when it chooses."""

from __future__ import annotations

import socket
import time

import pyarrow.parquet as pq
import pytest

from collector.config import SourceConfig, load_settings
from collector.daemon.service import Collector
from collector.pipeline.spool import list_files
from tests.helpers import capture
from tests.processes import metric
from tests.reference import packets

pytestmark = pytest.mark.slow  # the collector's real source threads, waiting on a real clock

DEADLINE_S = 120  # bounds a hang; every loop ends on its condition


def consume(root) -> list:
    """Read and delete every complete spool file (what Spark's file source does)."""
    tables = []
    for folder in sorted(p for p in root.glob("*/*") if p.is_dir()):
        for f in list_files(folder):
            tables.append((folder.name, pq.read_table(f)))
            f.unlink()
    return tables


def text(c: Collector) -> str:
    from prometheus_client import generate_latest
    return generate_latest(c.metrics.registry).decode()


def test_a_capture_file_waits_for_room_and_loses_nothing(tmp_path):
    path = capture("ok.pcap")
    want = len(packets(path))
    queries = tmp_path / "q.sql"
    queries.write_text("SELECT time/5 AS t, count(*) AS n FROM packets GROUP BY time/5;\n"
                       "SELECT ts, src_ip FROM packets WHERE protocol = 17")
    # one byte: after the first file every write waits for the consumer
    src = SourceConfig(type="pcap", name="file", path=str(path), loop=False, restamp=False)
    c = Collector(load_settings(var_dir=tmp_path / "var", initial_queries=str(queries),
                                sources=[src], batch_size=64, spool={"max_bytes": 1},
                                spark={"trigger_s": 0.2}))
    assert c.settings.sources[0].spool_policy(c.settings.spool.policy) == "block"
    c.start(with_sources=True, with_spark=False)
    got = []
    try:
        deadline = time.monotonic() + DEADLINE_S
        # the source fills the spool and waits for the consumer
        while metric(text(c), "flowsieve_spool_wait_seconds_total", 'source="file"') == 0 \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric(text(c), "flowsieve_spool_wait_seconds_total", 'source="file"') > 0
        assert c.source_state["file"] == "running"
        while time.monotonic() < deadline:
            finished = c.source_state["file"] == "finished"
            got += consume(c.settings.spool_dir)
            if finished and not any(list_files(p) for p in c.settings.spool_dir.glob("*/*")):
                break
            time.sleep(0.3)  # a slow consumer: the source waits between files
    finally:
        c.stop()
    got += consume(c.settings.spool_dir)
    assert c.source_state["file"] == "finished"
    counted = sum(t.column("cnt").to_numpy().sum() for f, t in got if f == "5")
    assert counted == want  # every packet in a partial aggregate, once
    udp = sum(t.num_rows for f, t in got if f == "select")
    truth = sum(1 for p in packets(path) if p["protocol"] == 17)  # dpkt
    assert udp == truth
    assert metric(text(c), "flowsieve_spool_rows_dropped_total") == 0


def test_a_flow_listener_drops_counts_and_keeps_running(tmp_path):
    from tests.flowtools import HEX, read_hex
    from tests.processes import v5_now
    queries = tmp_path / "q.sql"
    queries.write_text("SELECT time/5 AS t, count(*) AS n FROM flows GROUP BY time/5")
    src = SourceConfig(type="netflow", name="nf", listen=["127.0.0.1:0"])
    c = Collector(load_settings(var_dir=tmp_path / "var", initial_queries=str(queries),
                                sources=[src], spool={"max_bytes": 1},
                                spark={"trigger_s": 0.2}, lfta={"max_age_s": 0.5}))
    assert c.settings.sources[0].spool_policy(c.settings.spool.policy) == "drop"
    c.start(with_sources=True, with_spark=False)
    template = read_hex(HEX / "PACKET_V5.hex")[0]
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not c.sources[0].listener.bound and time.monotonic() < deadline:
            time.sleep(0.05)
        dest = c.sources[0].listener.bound[0]
        seq = 0

        def send(n: int) -> None:
            nonlocal seq
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                for _ in range(n):
                    s.sendto(v5_now(template, seq, time.time()), dest)
                    seq += 3
                    time.sleep(0.05)

        def dropped() -> float:
            return metric(text(c), "flowsieve_spool_rows_dropped_total",
                          'reason="spool_full",source="nf",stream="flows"')
        send(40)  # ~2 s: the first flush fills the spool, later ones are dropped
        while dropped() == 0 and time.monotonic() < deadline:
            send(5)
        assert dropped() > 0
        assert c.source_state["nf"] == "running"
        assert metric(text(c), "flowsieve_spool_wait_seconds_total", 'source="nf"') == 0
        # room again: the listener never stopped, its rows reach the spool again
        consume(c.settings.spool_dir)
        before = dropped()
        rows = []
        while not rows and time.monotonic() < deadline:
            send(5)
            rows = [t for _, t in consume(c.settings.spool_dir) if t.column("cnt").to_numpy().sum()]
        assert rows and c.source_state["nf"] == "running"
        assert dropped() >= before
    finally:
        c.stop()
