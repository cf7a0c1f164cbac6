"""The answer side on the driver, vectorised: addresses to text, partial rows merged to a
query's keys, LIMIT per window."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capture.fields import ip_bytes, ip_text
from capture.pcap import open_capture
from capture.unpack import unpack
from collector.spark.answers import group_rows, ip_strings, merge_to_keys, order_rows
from planner.query import parse_single
from tests.helpers import capture


def test_address_text_equals_ip_text_on_real_captures():
    """IPv4-mapped, IPv6 and NULL addresses, whole columns and slices of them."""
    for name in ("ok.pcap", "icmp6.pcap", "q-in-q.pcap", "wikipedia.pcap"):
        for raw in open_capture(capture(name)):
            col = unpack(raw).arrow("src_ip")
            for arr in (col, col.slice(5, 40)):
                assert ip_strings(arr).to_pylist() == [ip_text(v) for v in arr.to_pylist()]
    mixed = pa.array([ip_bytes("10.1.2.3"), None, ip_bytes("2001:db8::1"),
                      ip_bytes("64:ff9b::a01:203")], pa.binary())
    assert ip_strings(mixed).to_pylist() == ["10.1.2.3", None, "2001:db8::1", "64:ff9b::a01:203"]


GROUP = st.sampled_from([0, 0, 0, 1, 0xFFFF]) | st.integers(0, 0xFFFF)
ADDRESS = (st.lists(GROUP, min_size=8, max_size=8).map(
    lambda g: b"".join(x.to_bytes(2, "big") for x in g))
           | st.binary(min_size=4, max_size=4).map(lambda v4: bytes(10) + b"\xff\xff" + v4)
           | st.none())


@given(st.lists(ADDRESS, max_size=60), st.integers(0, 10))
def test_address_text_equals_ip_text_on_drawn_addresses(values, cut):
    """Zero runs of every length and place (RFC 5952's longest, first of equal ones),
    IPv4-mapped and NULL addresses, repeated ones, in slices too."""
    arr = pa.array(values + values[:cut], pa.binary())
    for a in (arr, arr.slice(min(cut, len(arr)))):
        assert ip_strings(a).to_pylist() == [ip_text(v) for v in a.to_pylist()]


def test_rows_of_a_finer_node_merge_to_the_query_keys():
    """Worked by hand: three partial rows of (src, dst) for one src in one window become one
    row: counts and sums add, min of mins, max of maxes; another window stays apart."""
    q = parse_single("SELECT time/60 AS t, src_ip, count(*) AS n, sum(wirelen) AS b, "
                     "min(wirelen) AS lo, max(wirelen) AS hi FROM packets "
                     "GROUP BY time/60, src_ip")
    a, b = ip_bytes("10.0.0.1"), ip_bytes("10.0.0.2")
    ts = pa.array([0, 0, 0, 60_000_000], pa.timestamp("us", tz="UTC"))
    ones = pa.array([1, 1, 1, 1])
    rows = pa.table({"window_start": ts, "src_ip": [a, a, b, a],
                     "dst_ip": [ip_bytes("1.1.1.1"), ip_bytes("2.2.2.2"), None, None],
                     "cnt": [1, 2, 3, 4], "sum_wirelen": [10, 20, 30, 40],
                     "min_wirelen": [10, 5, 30, 40], "max_wirelen": [10, 15, 30, 40],
                     "sum_caplen": ones, "min_caplen": ones, "max_caplen": ones})
    got = merge_to_keys(q, rows).sort_by([("window_start", "ascending"),
                                          ("src_ip", "ascending")]).to_pydict()
    assert got["src_ip"] == [a, b, a]
    assert got["cnt"] == [3, 3, 4]
    assert got["sum_wirelen"] == [30, 30, 40]
    assert got["min_wirelen"] == [5, 30, 40] and got["max_wirelen"] == [15, 30, 40]


def test_limit_per_window():
    q = parse_single("SELECT time/60 AS t, dst_port, count(*) AS n FROM packets "
                     "GROUP BY time/60, dst_port ORDER BY n DESC LIMIT 2")
    ws = np.repeat([0, 60, 120], [3, 1, 4]) * 1_000_000
    table = pa.table({"window_start": pa.array(ws, pa.timestamp("us", tz="UTC")),
                      "dst_port": list(range(8)), "n": [5, 7, 6, 1, 2, 9, 4, 8]})
    out = order_rows(q, table).to_pydict()
    assert out["dst_port"] == [1, 2, 3, 5, 7]


JOIN = """WITH a AS (SELECT time/60 AS t, dst_ip, count(*) AS n FROM packets
                     GROUP BY time/60, dst_ip),
b AS (SELECT time/60 AS t, src_ip, count(*) AS n, avg(wirelen) AS m FROM packets
      GROUP BY time/60, src_ip)
SELECT a.t AS t, a.dst_ip AS host, a.n - coalesce(b.n, 0) AS d, b.m AS m
FROM a {how} JOIN b ON a.t = b.t AND a.dst_ip = b.src_ip WHERE a.n >= 2 ORDER BY d DESC"""


def _part(ts, hosts, n, **more) -> pa.Table:
    """A part's answer as ``finalize`` gives it (window starts in µs, bucket in minutes)."""
    ws = pa.array([t * 60_000_000 for t in ts], pa.timestamp("us", tz="UTC"))
    return pa.table({"t": pa.array(ts, pa.int64()), "host": pa.array(hosts), "n": pa.array(n),
                     **more, "window_start": ws})


def test_join_windows_where_one_side_is_empty():
    """Per window, a LEFT JOIN keeps the left rows with NULLs where the right part has no row
    (or no row at all in the batch); an inner join drops them; no left rows, no answer."""
    from collector.spark.answers import join_answer
    left = parse_single(JOIN.format(how="LEFT"), "j")
    inner = parse_single(JOIN.format(how=""), "j")
    a = _part([1, 1, 2], ["10.0.0.1", "10.0.0.2", "10.0.0.1"], [5, 3, 1])
    a = a.rename_columns(["t", "dst_ip", "n", "window_start"])
    b = _part([1], ["10.0.0.1"], [3], m=pa.array([60.5]))
    b = b.rename_columns(["t", "src_ip", "n", "m", "window_start"])

    def rows(q, parts):  # in the query's order, as results are read back
        t = order_rows(q, join_answer(q, parts))
        return [(r["t"], r["host"], r["d"], r["m"]) for r in t.to_pylist()]

    assert rows(left, {"j.a": a, "j.b": b}) == [(1, "10.0.0.2", 3, None),
                                                 (1, "10.0.0.1", 2, 60.5)]
    assert rows(inner, {"j.a": a, "j.b": b}) == [(1, "10.0.0.1", 2, 60.5)]
    # the right part has no row in the batch: LEFT keeps every left row, inner none
    assert rows(left, {"j.a": a}) == [(1, "10.0.0.1", 5, None), (1, "10.0.0.2", 3, None)]
    assert rows(left, {"j.a": a, "j.b": b.slice(0, 0)}) == rows(left, {"j.a": a})
    assert rows(inner, {"j.a": a}) == []
    assert rows(left, {"j.b": b}) == [] and rows(inner, {}) == []


@pytest.mark.parametrize(("how", "where", "want"), [
    ("LEFT", "a.n >= 2 AND b.m > 60", [(1, "10.0.0.1", 2, 60.5)]),
    ("", "a.n >= 2 AND b.m > 60", [(1, "10.0.0.1", 2, 60.5)]),
    ("LEFT", "a.n >= 2 AND b.m > 61", []),
    # a condition on the right part of a LEFT JOIN holds after the join: the left row whose
    # partner fails it is dropped, not joined to NULL
    ("LEFT", "a.n >= 2 AND coalesce(b.m, 0) < 60", [(1, "10.0.0.2", 3, None)]),
    ("", "a.n >= 2 AND coalesce(b.m, 0) < 60", []),
    ("LEFT", "(a.n >= 2 AND a.n < 5) AND a.n - coalesce(b.n, 0) > 0", [(1, "10.0.0.2", 3, None)]),
    ("LEFT", "a.n >= 5 OR b.m > 60", [(1, "10.0.0.1", 2, 60.5)]),
])
def test_a_join_s_where_holds_whichever_side_its_conditions_read(how, where, want):
    """Hand-worked: the WHERE's conditions on one part filter it before the join (the right
    part's only in an inner join); the answer is the WHERE over the joined rows."""
    from collector.spark.answers import join_answer
    q = parse_single(JOIN.format(how=how).replace("WHERE a.n >= 2", f"WHERE {where}"), "j")
    a = _part([1, 1, 2], ["10.0.0.1", "10.0.0.2", "10.0.0.1"], [5, 3, 1])
    a = a.rename_columns(["t", "dst_ip", "n", "window_start"])
    b = _part([1], ["10.0.0.1"], [3], m=pa.array([60.5]))
    b = b.rename_columns(["t", "src_ip", "n", "m", "window_start"])
    got = order_rows(q, join_answer(q, {"j.a": a, "j.b": b}))
    assert [(r["t"], r["host"], r["d"], r["m"]) for r in got.to_pylist()] == want


def _draw_rows(draw, n: int) -> list[dict]:
    pool = [ip_bytes("10.0.0.1"), ip_bytes("::"), ip_bytes("2001:db8::1"), None]
    names = ["a.example", "b.example", "", None]
    small = st.integers(-5, 1 << 40) | st.none()
    return [{"window_start": draw(st.sampled_from([0, 60_000_000])),
             "src_ip": draw(st.sampled_from(pool)), "dst_ip": draw(st.sampled_from(pool)),
             "dst_port": draw(st.sampled_from([22, 0, None])),
             "dns_qname": draw(st.sampled_from(names)),
             "cnt": draw(st.integers(0, 1 << 40)), "sum_wirelen": draw(small),
             "min_wirelen": draw(small), "max_wirelen": draw(small)} for _ in range(n)]


@settings(max_examples=120, deadline=None, derandomize=True, database=None)
@given(st.data(), st.integers(0, 40), st.sampled_from(["src_ip, dst_port", "dns_qname", ""]))
def test_merged_rows_equal_a_dictionary_s_groups(data, n, keys):
    """``merge_to_keys`` (hash groups in numba) against a dictionary: NULL keys a group of
    their own, addresses and strings as keys, NULL measures skipped (a group of NULLs only is
    NULL), distinct values counted without NULL; ``group_rows`` puts each row in its group."""
    rows = _draw_rows(data.draw, n)
    by = ", ".join(["time/60", *filter(None, [keys])])
    q = parse_single(f"SELECT time/60 AS t{', ' + keys if keys else ''}, count(*) AS n, "
                     "count(DISTINCT dst_ip) AS d, sum(wirelen) AS b, min(wirelen) AS lo, "
                     f"max(wirelen) AS hi FROM packets GROUP BY {by}")
    types = {"window_start": pa.timestamp("us", tz="UTC"), "src_ip": pa.binary(),
             "dst_ip": pa.binary(), "dst_port": pa.int64(), "dns_qname": pa.string()}
    table = pa.table({**{c: pa.array([r[c] for r in rows], types.get(c, pa.int64()))
                         for c in _draw_rows(lambda s: None, 1)[0]},
                      })
    got = merge_to_keys(q, table)
    if n:
        merged, gid = group_rows(q, table)
        assert merged.equals(got)
        got = got.append_column("_row", pa.array(
            [np.flatnonzero(gid == g).tolist() for g in range(merged.num_rows)]))
        got = got.set_column(0, "window_start", got.column("window_start").cast(pa.int64()))
    got = got.to_pylist()
    key_names = ["window_start", *q.keys]
    want: dict[tuple, dict] = {}
    for i, r in enumerate(rows):
        g = want.setdefault(tuple(r[k] for k in key_names), {
            "cnt": 0, "sum_wirelen": None, "min_wirelen": None, "max_wirelen": None,
            "d": set(), "rows": []})
        g["cnt"] += r["cnt"]
        for c, f in (("sum_wirelen", sum), ("min_wirelen", min), ("max_wirelen", max)):
            if r[c] is not None:
                g[c] = r[c] if g[c] is None else f([g[c], r[c]])
        if r["dst_ip"] is not None:
            g["d"].add(r["dst_ip"])
        g["rows"].append(i)
    assert len(got) == len(want)
    for row in got:
        w = want[tuple(row[c] for c in key_names)]
        assert row["cnt"] == w["cnt"]
        assert [row[c] for c in ("sum_wirelen", "min_wirelen", "max_wirelen")] == \
            [w[c] for c in ("sum_wirelen", "min_wirelen", "max_wirelen")]
        assert row["distinct_dst_ip"] == len(w["d"])
        assert row["_row"] == w["rows"]
