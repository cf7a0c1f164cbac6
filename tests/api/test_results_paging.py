"""Results by time range, paged, in three formats: every row of every closed window comes back
exactly once across the pages, in the documented order, while new windows arrive between
pages. The answer files are written as Spark's sink writes them (collector.daemon.results)."""

from __future__ import annotations

import csv
import io
import json
from datetime import datetime

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.formats import write_answers
from collector.config import load_settings
from collector.daemon.service import Collector

SQL = ("SELECT time/60 AS t, protocol, count(*) AS n FROM packets "
       "GROUP BY time/60, protocol ORDER BY n DESC")
T0 = 1_700_000_040  # a minute boundary


def answers(windows: range) -> pa.Table:
    """Three protocols per window; counts chosen so ORDER BY n DESC is 17, 6, 1."""
    rows = [(w, p, n + w) for w in windows for p, n in ((6, 20), (17, 30), (1, 10))]
    return pa.table({
        "window_start": pa.array([(T0 + 60 * w) * 1_000_000 for w, _, _ in rows],
                                 pa.timestamp("us", tz="UTC")),
        "t": pa.array([(T0 + 60 * w) // 60 for w, _, _ in rows], pa.int64()),
        "protocol": pa.array([p for _, p, _ in rows], pa.int64()),
        "n": pa.array([n for _, _, n in rows], pa.int64())})


def write_results(root, name: str, table: pa.Table, job: str) -> None:
    """Answers as Spark's answer task writes them: a part per job, a row group per window
    (collector/spark/write.py)."""
    import pyarrow.compute as pc

    from collector.spark.write import PartWriter
    us = pc.cast(table.column("window_start"), pa.int64())
    table = table.append_column("window_end", pc.cast(pc.add(us, 60_000_000),
                                                      table.schema.field("window_start").type))
    w = PartWriter(root, name, f"part-{job}.parquet", table.schema)
    for start in sorted(pc.unique(us).to_pylist()):  # in the query's order: n DESC
        w.write(table.filter(pc.equal(us, start)).sort_by([("n", "descending")]))
    w.close()


@pytest.fixture
def client(tmp_path):
    c = Collector(load_settings(var_dir=tmp_path / "var", initial_queries=None))
    c.start(with_sources=False, with_spark=False)
    with TestClient(create_app(c)) as client:
        assert client.post("/queries", json={"name": "proto", "sql": SQL}).status_code == 201
        write_results(c.settings.results_dir, "proto", answers(range(5)), "1")
        yield c, client
    c.stop()


def walk(client, **params) -> list[list[dict]]:
    pages, cursor = [], None
    while True:
        r = client.get("/queries/proto/results", params={**params, **(
            {"cursor": cursor} if cursor else {})})
        assert r.status_code == 200, r.text
        pages.append(r.json()["rows"])
        cursor = r.json()["next_cursor"]
        if cursor is None:
            return pages


def test_pages_cover_every_row_once_newest_first(client):
    _, c = client
    pages = walk(c, limit=4)
    assert [len(p) for p in pages] == [4, 4, 4, 3]
    rows = [r for p in pages for r in p]
    # newest window first; within a window the query's ORDER BY n DESC (17, 6, 1)
    assert [(r["t"] - T0 // 60, r["protocol"]) for r in rows] == \
        [(w, p) for w in (4, 3, 2, 1, 0) for p in (17, 6, 1)]
    oldest = [r for p in walk(c, limit=2, order="oldest") for r in p]
    assert [(r["t"] - T0 // 60, r["protocol"]) for r in oldest] == \
        [(w, p) for w in range(5) for p in (17, 6, 1)]


def test_time_range_and_new_windows_between_pages(client):
    col, c = client
    r = c.get("/queries/proto/results", params={"from": T0 + 60, "to": T0 + 180})
    assert sorted({x["t"] - T0 // 60 for x in r.json()["rows"]}) == [1, 2]
    r = c.get("/queries/proto/results",
              params={"from": "2023-11-14T22:15:00Z", "limit": 100})  # ISO 8601: T0 + 60
    assert {x["t"] - T0 // 60 for x in r.json()["rows"]} == {1, 2, 3, 4}
    first = c.get("/queries/proto/results", params={"limit": 5}).json()
    # two newer windows close while the client pages: the rest of its walk is unchanged
    write_results(col.settings.results_dir, "proto", answers(range(5, 7)), "2")
    rest = walk(c, limit=5, cursor=first["next_cursor"])
    rows = first["rows"] + [x for p in rest for x in p]
    assert [(x["t"] - T0 // 60, x["protocol"]) for x in rows] == \
        [(w, p) for w in (4, 3, 2, 1, 0) for p in (17, 6, 1)]


def test_csv_parquet_and_bad_cursors(client):
    _, c = client
    r = c.get("/queries/proto/results", params={"format": "csv", "limit": 4})
    assert r.headers["content-type"].startswith("text/csv")
    got = list(csv.DictReader(io.StringIO(r.text)))
    assert list(got[0]) == ["t", "protocol", "n", "window_start", "window_end"]
    assert len(got) == 4
    assert got[0] == {"t": str(T0 // 60 + 4), "protocol": "17", "n": "34",
                      "window_start": "2023-11-14T22:18:00Z", "window_end": "2023-11-14T22:19:00Z"}
    assert r.headers["x-next-cursor"]
    r = c.get("/queries/proto/results", params={"format": "parquet"})
    assert r.headers["content-disposition"] == 'attachment; filename="proto.parquet"'
    t = pq.read_table(io.BytesIO(r.content))
    assert t.num_rows == 15 and {"t", "protocol", "n"} <= set(t.column_names)
    for bad in ("nonsense", "MTox", "!!!"):
        r = c.get("/queries/proto/results", params={"cursor": bad})
        assert r.status_code == 400, bad
    newest = c.get("/queries/proto/results", params={"limit": 1}).json()["next_cursor"]
    r = c.get("/queries/proto/results", params={"cursor": newest, "order": "oldest"})
    assert r.status_code == 400 and "other order" in r.text


def test_window_times_as_iso_epoch_or_only_the_bucket(client):
    """time=iso (default) prints windows as people read them, epoch as numbers, bucket leaves
    them out (the query's own time/60 column: the old form), in every format."""
    _, c = client
    start, end = T0 + 4 * 60, T0 + 5 * 60  # the newest window (T0: a minute boundary)
    newest = {"limit": 1}
    row = c.get("/queries/proto/results", params=newest).json()["rows"][0]
    assert (row["window_start"], row["window_end"]) == ("2023-11-14T22:18:00Z",
                                                        "2023-11-14T22:19:00Z")
    assert datetime.fromisoformat(row["window_start"]).timestamp() == start
    r = c.get("/queries/proto/results", params={**newest, "time": "epoch"}).json()
    assert (r["rows"][0]["window_start"], r["rows"][0]["window_end"]) == (start, end)
    r = c.get("/queries/proto/results", params={**newest, "time": "bucket"}).json()
    assert r["columns"] == ["t", "protocol", "n"] and list(r["rows"][0]) == r["columns"]
    assert r["rows"][0]["t"] == start // 60
    got = list(csv.DictReader(io.StringIO(c.get("/queries/proto/results", params={
        **newest, "format": "csv", "time": "epoch"}).text)))
    assert (got[0]["window_start"], got[0]["window_end"]) == (str(start), str(end))
    t = pq.read_table(io.BytesIO(c.get("/queries/proto/results", params={
        "format": "parquet", "time": "bucket"}).content))
    assert t.column_names == ["t", "protocol", "n"]
    t = pq.read_table(io.BytesIO(c.get("/queries/proto/results", params={
        "format": "parquet", "time": "epoch"}).content))
    assert t.schema.field("window_start").type == pa.int64()
    assert max(t.column("window_start").to_pylist()) == start
    assert c.get("/queries/proto/results", params={"time": "hours"}).status_code == 422


def test_replay_output_prints_times_as_asked(client):
    """``flowsieve replay --time``: the same modes in its table, CSV and JSON lines."""
    col, _ = client
    q = col.query("proto")[0]
    root = col.settings.results_dir

    def out(fmt: str, time: str) -> str:
        buf = io.BytesIO()
        write_answers(buf, fmt, root, [q], time)
        return buf.getvalue().decode()
    rows = list(csv.DictReader(io.StringIO(out("csv", "epoch"))))
    assert len(rows) == 15
    for r in rows:
        assert int(r["window_start"]) == int(r["t"]) * 60
        assert int(r["window_end"]) - int(r["window_start"]) == 60
    assert list(csv.DictReader(io.StringIO(out("csv", "bucket"))))[0].keys() == {
        "query", "t", "protocol", "n"}
    first = json.loads(out("json", "iso").splitlines()[0])
    assert datetime.fromisoformat(first["window_start"]).timestamp() == first["t"] * 60
    table = out("table", "bucket").splitlines()
    assert table[0] == "== proto (15 rows)" and table[1].split() == ["t", "protocol", "n"]
    assert out("table", "iso").splitlines()[1].split()[-2:] == ["window_start", "window_end"]


def test_pause_and_resume_keep_slot_and_answers(client, tmp_path):
    col, c = client
    assert c.post("/queries", json={"name": "other", "sql": SQL}).status_code == 201
    slot = c.get("/queries/proto").json()["slot"]
    version = c.get("/prefilter").json()["version"]
    r = c.patch("/queries/proto", json={"enabled": False})
    assert r.status_code == 200 and r.json()["enabled"] is False and r.json()["slot"] == slot
    plan = c.get("/prefilter").json()
    assert plan["version"] == version + 1
    assert [q["name"] for q in plan["queries"]] == ["other"]  # it costs nothing now
    assert len(c.get("/queries/proto/results").json()["rows"]) == 15  # answers kept
    assert c.post("/queries", json={"name": "third", "sql": SQL}).json()["slot"] != slot
    # the pause survives a restart (the registry holds it)
    again = Collector(load_settings(var_dir=col.settings.var_dir, initial_queries=None))
    again.start(with_sources=False, with_spark=False)
    assert [qp.query.name for qp in again.plan.queries] == ["other", "third"]
    again.stop()
    r = c.patch("/queries/proto", json={"enabled": True})
    assert r.json()["enabled"] is True and r.json()["slot"] == slot
    assert "proto" in [q["name"] for q in c.get("/prefilter").json()["queries"]]
    assert c.patch("/queries/nope", json={"enabled": False}).status_code == 404
    assert c.patch("/queries/proto", json={"enabled": "maybe"}).status_code == 422
