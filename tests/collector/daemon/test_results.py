"""Reading answers back (collector/daemon/results.py): a window whose rows several tasks
wrote, each file its share of the keys in the query's order, reads as one window in that
order."""

from __future__ import annotations

import random
import zlib

import pyarrow as pa
import pyarrow.parquet as pq

from collector.daemon import results
from collector.daemon.results import page_windows, read_results
from planner.query import parse_queries

SQL = ("-- name: pairs\nSELECT time/60 AS t, src_ip, dst_port, count(*) AS n FROM packets "
       "GROUP BY time/60, src_ip, dst_port")
T0 = 1_700_000_040
US = 1_000_000


def _rows(window: int, keys: list[tuple[str, int]]) -> dict:
    ws = (T0 + 60 * window) * US
    return {"window_start": [ws] * len(keys), "window_end": [ws + 60 * US] * len(keys),
            "t": [(T0 + 60 * window) // 60] * len(keys), "src_ip": [k[0] for k in keys],
            "dst_port": [k[1] for k in keys], "n": [len(k[0]) + k[1] for k in keys]}


def _write(path, rows: dict, group_rows: int) -> None:
    ts = pa.timestamp("us", tz="UTC")
    table = pa.table({"window_start": pa.array(rows["window_start"], ts),
                      "window_end": pa.array(rows["window_end"], ts),
                      "t": pa.array(rows["t"], pa.int64()),
                      "src_ip": pa.array(rows["src_ip"], pa.string()),
                      "dst_port": pa.array(rows["dst_port"], pa.int32()),
                      "n": pa.array(rows["n"], pa.int64())})
    pq.write_table(table, path, row_group_size=group_rows)


def test_a_window_spread_over_files_reads_in_the_query_s_order(tmp_path, monkeypatch):
    """Three files of one answer job, each holding a hash share of two windows' keys (sorted
    by window, then src_ip, dst_port: the query's order), in row groups that hold both
    windows at their boundary: read back, every row once, each window's rows in key order
    (Python's sort of the same tuples), whatever the merge's buffer size."""
    (q,) = parse_queries(SQL)
    rng = random.Random(7)
    keys = {w: sorted({(f"10.0.{rng.randrange(4)}.{rng.randrange(256)}", rng.randrange(1, 99))
                       for _ in range(500)}) for w in (0, 1)}
    folder = tmp_path / "query=pairs"
    folder.mkdir()
    names = ["part-run-00000001.parquet", "part-run-00000001.1.parquet",
             "part-run-00000001.2.parquet"]
    for i, name in enumerate(names):
        share = {"window_start": [], "window_end": [], "t": [], "src_ip": [], "dst_port": [],
                 "n": []}
        for w in (0, 1):
            mine = [k for k in keys[w] if zlib.crc32(repr(k).encode()) % 3 == i]
            for col, vals in _rows(w, mine).items():
                share[col] += vals
        _write(folder / name, share, group_rows=37)
    want = [(w, k) for w in (0, 1) for k in keys[w]]
    for buffer in (5, 64, 1 << 16):
        monkeypatch.setattr(results, "MERGE_ROWS", buffer)
        got = read_results(tmp_path, q).to_pylist()
        assert [((r["t"] * 60 - T0) // 60, (r["src_ip"], r["dst_port"])) for r in got] == want
        assert all(r["n"] == len(r["src_ip"]) + r["dst_port"] for r in got)
    # a page of the newest window: its rows, in order
    page = page_windows(tmp_path, q, limit=10_000, last_windows=1)
    assert [(r["src_ip"], r["dst_port"]) for r in page.to_pylist()] == keys[1]
