"""Retention of answers: per query, by age and by bytes, the configured limits overridden over
REST; the answer files are the ones Spark's answer task writes (collector/spark/write.py)."""

from __future__ import annotations

import os
import time

import pyarrow as pa
import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest

from api.app import create_app
from collector.config import load_settings, parse_duration
from collector.daemon.results import part_files
from collector.daemon.retention import Limits, enforce, expire_quarantined
from collector.daemon.service import Collector
from collector.spark.write import PartWriter
from tests.processes import metric

SQL = "SELECT time/60 AS t, protocol, count(*) AS n FROM packets GROUP BY time/60, protocol"
T0 = 1_700_000_040
HOUR = 3600


def write_part(root, name: str, job: int, age_s: float, rows: int = 200) -> int:
    """A part of one window as the answer task writes it, written ``age_s`` ago; its size."""
    ws = (T0 + 60 * job) * 1_000_000
    table = pa.table({
        "window_start": pa.array([ws] * rows, pa.timestamp("us", tz="UTC")),
        "window_end": pa.array([ws + 60_000_000] * rows, pa.timestamp("us", tz="UTC")),
        "t": pa.array([(T0 + 60 * job) // 60] * rows, pa.int64()),
        "protocol": pa.array(range(rows), pa.int64()),
        "n": pa.array([job] * rows, pa.int64())})
    w = PartWriter(root, name, f"part-{job:04d}.parquet", table.schema)
    w.write(table)
    path = w.close()
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path.stat().st_size


def jobs(root, name: str) -> list[int]:
    return sorted(int(p.stem.split("-")[1]) for p in part_files(root, name))


def test_durations_read_as_people_write_them():
    assert parse_duration("90s") == 90 and parse_duration("12h") == 12 * HOUR
    assert parse_duration("30d") == 30 * 86400 and parse_duration("2w") == 14 * 86400
    assert parse_duration(3600) == 3600 and parse_duration("1.5h") == 5400
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("soon")


def test_age_then_bytes_remove_the_oldest_parts(tmp_path):
    sizes = {j: write_part(tmp_path, "q", j, age_s=(10 - j) * HOUR) for j in range(10)}
    # older than 5.5 h: jobs 0-4 (10 h .. 6 h ago)
    held = enforce(tmp_path, "q", Limits(max_age_s=5.5 * HOUR))
    assert jobs(tmp_path, "q") == [5, 6, 7, 8, 9]
    assert (held.removed_age, held.removed_bytes, held.files) == (5, 0, 5)
    assert held.bytes == sum(sizes[j] for j in range(5, 10))
    # at most three parts' bytes: the two oldest left go
    limit = sum(sizes[j] for j in (7, 8, 9))
    held = enforce(tmp_path, "q", Limits(max_bytes=limit))
    assert jobs(tmp_path, "q") == [7, 8, 9] and held.bytes == limit
    assert held.removed_bytes == 2
    # within its limits: nothing more goes
    assert enforce(tmp_path, "q", Limits(max_age_s=HOUR * 24, max_bytes=limit)).files == 3
    assert jobs(tmp_path, "q") == [7, 8, 9]


def test_a_spread_part_s_files_go_together(tmp_path):
    """A part Spark's engine spread over several tasks (``part-<job>.parquet`` and
    ``part-<job>.<i>.parquet``) is one part: the byte limit removes all its files or none,
    and counts it once."""
    from collector.spark.write import spread_name
    sizes = {j: write_part(tmp_path, "q", j, age_s=(10 - j) * HOUR) for j in range(3)}
    for i in (1, 2):  # job 0's answer in three files
        extra = tmp_path / "query=q" / spread_name("part-0000.parquet", i)
        extra.write_bytes((tmp_path / "query=q" / "part-0000.parquet").read_bytes())
        os.utime(extra, (time.time() - 10 * HOUR,) * 2)
        sizes[0] += extra.stat().st_size
    held = enforce(tmp_path, "q", Limits(max_bytes=sizes[1] + sizes[2]))
    assert sorted(p.name for p in part_files(tmp_path, "q")) == ["part-0001.parquet",
                                                                 "part-0002.parquet"]
    assert (held.removed_bytes, held.files, held.bytes) == (1, 2, sizes[1] + sizes[2])


def test_quarantined_spool_files_age_out(tmp_path):
    bad = tmp_path / "packets" / "60" / "bad"
    bad.mkdir(parents=True)
    old, new = bad / "0000000000000001.p.parquet", bad / "0000000000000002.p.parquet"
    for p in (old, new, bad / (old.name + ".reason")):
        p.write_bytes(b"x")
    t = time.time() - 8 * 86400
    for p in (old, bad / (old.name + ".reason")):
        os.utime(p, (t, t))
    assert expire_quarantined(tmp_path, 7 * 86400) == 2
    assert [p.name for p in bad.iterdir()] == [new.name]


@pytest.fixture
def daemon(tmp_path):
    c = Collector(load_settings(var_dir=tmp_path / "var", initial_queries=None,
                                results={"max_age": "6h", "check_s": 3600}))
    c.start(with_sources=False, with_spark=False)
    with TestClient(create_app(c)) as client:
        for name in ("a", "b"):
            assert client.post("/queries", json={"name": name, "sql": SQL}).status_code == 201
            for j in range(10):
                write_part(c.settings.results_dir, name, j, age_s=(10 - j) * HOUR)
        yield c, client
    c.stop()


def test_a_query_sets_its_own_limits_over_rest(daemon):
    c, client = daemon
    root = c.settings.results_dir
    r = client.patch("/queries/b", json={"max_age": "2d", "max_bytes": "unlimited"})
    assert r.status_code == 200, r.text
    assert r.json()["retention"]["max_age_s"] == 2 * 86400
    assert r.json()["retention"]["max_bytes"] is None
    before = client.get("/queries/a").json()["retention"]
    assert before["max_age_s"] == 6 * HOUR and before["max_bytes"] is None
    assert before["bytes"] == sum(p.stat().st_size for p in part_files(root, "a"))
    c.enforce_retention()
    assert jobs(root, "a") == [5, 6, 7, 8, 9]  # the configured 6 h: 10 h .. 7 h ago went
    assert jobs(root, "b") == list(range(10))  # its own 2 days: all kept
    size = client.get("/queries/b").json()["retention"]["bytes"]
    r = client.patch("/queries/b", json={"max_bytes": size // 2})  # the age stays as it was
    assert r.json()["retention"] == {"max_age_s": 2 * 86400, "max_bytes": size // 2,
                                     "bytes": size}
    c.enforce_retention()
    assert jobs(root, "b") == [5, 6, 7, 8, 9]  # equal sizes: the older half went
    text = generate_latest(c.metrics.registry).decode()
    assert metric(text, "flowsieve_results_removed_files_total",
                  'query="a",reason="age"') == 5
    assert metric(text, "flowsieve_results_removed_files_total",
                  'query="b",reason="bytes"') == 5
    assert metric(text, "flowsieve_results_bytes", 'query="b"') == sum(
        p.stat().st_size for p in part_files(root, "b"))
    # back to the configured limits
    r = client.patch("/queries/b", json={"max_age": None, "max_bytes": None})
    assert r.json()["retention"]["max_age_s"] == 6 * HOUR
    assert r.json()["retention"]["max_bytes"] is None
    assert client.patch("/queries/b", json={"max_age": "soon"}).status_code == 422
    assert client.patch("/queries/b", json={"max_bytes": 0}).status_code == 422
    assert client.patch("/queries/nope", json={"max_age": "1d"}).status_code == 404
    # pausing leaves the limits alone
    r = client.patch("/queries/b", json={"enabled": False})
    assert r.json()["enabled"] is False and r.json()["retention"]["max_age_s"] == 6 * HOUR


def test_a_deleted_query_forgets_its_limits(daemon):
    c, client = daemon
    client.patch("/queries/a", json={"max_age": "1h"})
    c.enforce_retention()
    text = generate_latest(c.metrics.registry).decode()
    assert metric(text, "flowsieve_results_removed_files_total", 'query="a",reason="age"') > 0
    assert client.delete("/queries/a").status_code == 204
    text = generate_latest(c.metrics.registry).decode()  # its series go with it
    assert 'query="a"' not in text
    assert client.post("/queries", json={"name": "a", "sql": SQL}).status_code == 201
    assert client.get("/queries/a").json()["retention"]["max_age_s"] == 6 * HOUR


def test_logs_of_failed_replays_go_after_a_day(tmp_path):
    from api.cli import forget_jvm_logs
    old, new = (tmp_path / f"flowsieve-replay-{pid}-spark.log" for pid in (11, 12))
    other = tmp_path / "other.log"
    for p in (old, new, other):
        p.write_text("java.lang.OutOfMemoryError\n")
    t = time.time() - 2 * 86400
    for p in (old, other):
        os.utime(p, (t, t))
    assert forget_jvm_logs(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([new.name, other.name])
