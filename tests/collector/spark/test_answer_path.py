"""The driver plans and commits; no answer row passes through it (issue 41). Every byte the
driver process receives on any socket — Py4J's answers, and the sockets PySpark's ``collect``,
``toArrow``, ``toPandas``, ``toLocalIterator`` and ``rdd.collect`` read rows from — is counted
while Spark answers a capture of many groups, in batch (``replay``) and streaming (the
daemon's ``foreachBatch``): it stays a small fixed amount, while collecting those answers counts
megabytes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import pyarrow.dataset as ds
import pytest

from api.replay import replay
from collector.config import Settings
from collector.daemon.results import read_results
from planner.query import parse_queries
from tests.helpers import BIG_WINDOW, ROOT, PeakRss, many_groups

pytestmark = pytest.mark.slow

GROUPS = 60_000
QUERIES = """
-- name: pairs
SELECT time/60 AS t, src_ip, dst_ip, src_port, count(*) AS n, sum(wirelen) AS b
FROM packets GROUP BY time/60, src_ip, dst_ip, src_port;
-- name: top
SELECT time/60 AS t, src_ip, count(*) AS n FROM packets GROUP BY time/60, src_ip
ORDER BY n DESC LIMIT 3;
-- name: picked
SELECT ts, src_ip, src_port FROM packets WHERE src_port < 1026
"""
# what the driver may receive while Spark answers: Py4J's small answers (plans, progress,
# a row per query of what each answer job wrote), whatever the answer's size: 14 KB in
# batch, 34 KB streaming, measured; collecting the answer is 4.7-6 MB
BOUND = 128 << 10


class Received:
    """Bytes this process receives on sockets (every recv and recv_into, which buffered socket
    files and Py4J read through) while it is entered."""

    def __init__(self):
        self.bytes = 0
        self._lock = threading.Lock()

    def __enter__(self):
        self._recv, self._recv_into = socket.socket.recv, socket.socket.recv_into
        meter = self

        def recv(sock, *args, **kwargs):
            data = meter._recv(sock, *args, **kwargs)
            meter._add(len(data))
            return data

        def recv_into(sock, *args, **kwargs):
            n = meter._recv_into(sock, *args, **kwargs)
            meter._add(n)
            return n
        socket.socket.recv, socket.socket.recv_into = recv, recv_into
        return self

    def _add(self, n: int) -> None:
        with self._lock:
            self.bytes += n

    def __exit__(self, *exc):
        socket.socket.recv, socket.socket.recv_into = self._recv, self._recv_into


def test_answers_never_pass_through_the_driver(spark, tmp_path):
    path = tmp_path / "groups.pcap"
    many_groups(path, GROUPS)
    queries = parse_queries(QUERIES)
    from collector.spark.merge import warm_up
    warm_up(spark)  # its job is as small as any other: it is counted below either way
    with Received() as batch:
        res = replay(path, queries, tmp_path / "replay", spark,
                     settings=Settings(initial_queries=None, planner={"measure_tuples": 0}))
    answers = {q.name: t for q, t in res.answers}
    assert answers["pairs"].num_rows == GROUPS  # one group per packet
    assert answers["top"].num_rows == 3
    assert answers["picked"].num_rows == sum(1 for i in range(GROUPS) if i % 7 < 2)
    assert batch.bytes < BOUND, f"the driver received {batch.bytes:,} bytes while answering"

    # the daemon's path: the streaming merge's foreachBatch answers the same spool
    from collector.spark.merge import SparkJob
    slots = {qp.slot: qp.query for qp in res.plan.queries}
    job = SparkJob(spark, tmp_path / "replay" / "spool", tmp_path / "streamed",
                   tmp_path / "ck", lambda: slots, 1)
    with Received() as streamed:
        job.run_available_now([(s, f) for s in res.plan.streams() for f in
                               res.plan.folders(s)])
    q = next(q for q in queries if q.name == "pairs")
    assert read_results(tmp_path / "streamed", q).num_rows == GROUPS
    assert streamed.bytes < BOUND, f"the driver received {streamed.bytes:,} bytes"

    # the meter sees rows the driver does collect, by any of PySpark's routes
    df = spark.read.parquet(str(tmp_path / "replay" / "results" / "query=pairs"))
    for route in (lambda: df.toArrow(), lambda: df.collect(), lambda: df.toPandas(),
                  lambda: list(df.toLocalIterator()), lambda: df.rdd.collect()):
        with Received() as r:
            route()
        assert r.bytes > 4 * BOUND, r.bytes
    on_disk = ds.dataset(str(tmp_path / "replay" / "results"), format="parquet").count_rows()
    assert on_disk >= GROUPS


@pytest.mark.parametrize("engine", ["python", "sql"])
def test_a_window_of_four_million_groups_with_a_small_driver(big_window, tmp_path, engine):
    """``replay`` of one window of 4 million groups with ``spark.driver_memory: 512m`` (the
    JVM that held every merged row died of it): every group answered once, in the query's
    order, and the Python driver's peak resident memory stays under 1 GiB (its answer is read
    back and printed a row group at a time). Either engine answers the query in several
    tasks (its part several files, merged as they are read)."""
    import pyarrow.compute as pc
    import pyarrow.csv as pacsv

    from collector.daemon.results import part_files
    (tmp_path / "q.sql").write_text(QUERIES.split("-- name: top")[0])
    out = tmp_path / "answers.csv"
    with open(out, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "api.cli", "replay", str(big_window), "--queries",
             str(tmp_path / "q.sql"), "--format", "csv", "--out", str(tmp_path / "work")],
            stdout=f, stderr=subprocess.PIPE, cwd=ROOT,
            env={**os.environ, "FLOWSIEVE_SPARK__DRIVER_MEMORY": "512m",
                 "FLOWSIEVE_SPARK__ANSWER_ENGINE": engine})
        rss = PeakRss(proc.pid)
        _, err = proc.communicate(timeout=900)
        peak = rss.stop()
    assert proc.returncode == 0, err.decode()[-2000:]
    assert 0 < peak < 1 << 30, f"the driver's peak RSS: {peak / 2**20:.0f} MiB"
    t = pacsv.read_csv(out, convert_options=pacsv.ConvertOptions(
        include_columns=["src_ip", "dst_ip", "src_port", "n"]))
    assert t.num_rows == BIG_WINDOW
    assert pc.all(pc.equal(t.column("n"), 1)).as_py()
    keys = t.group_by(["src_ip", "dst_ip", "src_port"]).aggregate([])
    assert keys.num_rows == BIG_WINDOW  # every group once
    key_columns = ["src_ip", "dst_ip", "src_port"]
    assert t.select(key_columns).equals(
        t.select(key_columns).sort_by([(c, "ascending") for c in key_columns]))
    parts = part_files(tmp_path / "work" / "results", "pairs")
    assert len(parts) > 1
