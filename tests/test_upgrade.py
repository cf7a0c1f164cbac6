"""Upgrading without losing a window, across the answer engines (issue 57, item 6): a daemon
answering with the Python engine follows a capture that grows in real time; it is stopped with
SIGTERM while windows are open, the capture still growing, and started again on the same
``var_dir`` with Spark's engine (``spark.answer_engine: sql``), its streaming state and spool as
the first one left them. Every window's answers equal a replay of the whole capture (nothing
lost, nothing twice), every packet is counted once, and both engines wrote answer parts."""

from __future__ import annotations

import time

import httpx
import pyarrow.parquet as pq
import pytest

from api.replay import replay
from planner.query import parse_queries
from tests.processes import (
    PERIOD,
    Feeder,
    answers,
    daemon_config,
    no_server_errors,
    start_daemon,
    stop_and_drain,
    stop_daemon,
    wait_for,
    whole_windows,
)
from tests.reference import rows_of

pytestmark = pytest.mark.slow

# a plain count, addresses as text, and a top 2 (Spark's engine cuts its rows before the texts)
QUERIES = """
-- name: all5s
SELECT time/5 AS t, count(*) AS n, sum(wirelen) AS b FROM packets GROUP BY time/5;
-- name: srcs
SELECT time/5 AS t, src_ip, count(*) AS n, max(wirelen) AS m FROM packets GROUP BY time/5, src_ip;
-- name: top_dst
SELECT time/5 AS t, dst_ip, count(*) AS n FROM packets GROUP BY time/5, dst_ip
ORDER BY n DESC LIMIT 2;
"""
NAMES = ("all5s", "srcs", "top_dst")


def writers(results) -> set[str]:
    """Who wrote the answer parts under ``results``: "spark" (Spark's Parquet writer) or
    "arrow" (the Python engine's)."""
    out = set()
    for part in results.glob("query=*/part-*.parquet"):
        meta = pq.read_metadata(part).metadata or {}
        out.add("spark" if b"org.apache.spark.version" in meta else "arrow")
    return out


def test_an_engine_switch_across_a_restart_keeps_every_window(tmp_path, spark):
    cfg, port = daemon_config(tmp_path, [
        f"{{type: pcap, name: traffic, path: {tmp_path / 'traffic.pcap'}, follow: true}}"],
        QUERIES)
    feeder = Feeder(tmp_path / "traffic.pcap", per_tick=20)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    log = open(tmp_path / "daemon.log", "a")

    def start(engine: str):
        proc = start_daemon(cfg, log, env={"FLOWSIEVE_SPARK__ANSWER_ENGINE": engine})
        wait_for(lambda: client.get("/readyz").status_code == 200, 240, "the daemon ready")
        return proc

    proc = None
    try:
        feeder.start()
        proc = start("python")
        wait_for(lambda: answers(client, "all5s")[0], 120, "a window answered (Python)")
        # stopped part way through a window: its partial rows are in the spool or in
        # Spark's state, not answered
        time.sleep(PERIOD / 2)
        stop_daemon(proc)
        assert proc.returncode == 0, (tmp_path / "daemon.log").read_text()[-3000:]
        time.sleep(2)  # the capture grows while no daemon reads it
        restarted = time.time()
        proc = start("sql")
        wait_for(lambda: (answers(client, "all5s")[1] or 0) >= restarted + PERIOD, 240,
                 "a window answered after the restart (Spark's engine)")
        last = stop_and_drain(feeder, client, "all5s")
        got = {name: answers(client, name)[0] for name in NAMES}
    finally:
        feeder.stop.set()
        client.close()
        if proc is not None:
            stop_daemon(proc)
        log.close()
    no_server_errors(tmp_path / "daemon.log")
    assert writers(tmp_path / "var" / "results") == {"spark", "arrow"}
    res = replay(tmp_path / "traffic.pcap", parse_queries(QUERIES), tmp_path / "replay", spark)
    assert res.error is None
    want = {q.name: rows_of(q, t) for q, t in res.answers}
    for name in NAMES:
        w = whole_windows(want[name], 0, last)
        assert w and whole_windows(got[name], 0, last) == w, name
    assert sum(r["n"] for r in got["all5s"]) == feeder.written
