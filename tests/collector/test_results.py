"""The answer side on the driver, vectorised: addresses to text, partial rows merged to a
query's keys, LIMIT per window."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from hypothesis import given
from hypothesis import strategies as st

from capture.fields import ip_bytes, ip_text
from capture.pcap import open_capture
from capture.unpack import unpack
from collector.results import _ip_strings, merge_to_keys, order_rows
from planner.query import parse_single
from tests.conftest import capture


def test_address_text_equals_ip_text_on_real_captures():
    """IPv4-mapped, IPv6 and NULL addresses, whole columns and slices of them."""
    for name in ("ok.pcap", "icmp6.pcap", "q-in-q.pcap", "wikipedia.pcap"):
        for raw in open_capture(capture(name)):
            col = unpack(raw).arrow("src_ip")
            for arr in (col, col.slice(5, 40)):
                assert _ip_strings(arr).to_pylist() == [ip_text(v) for v in arr.to_pylist()]
    mixed = pa.array([ip_bytes("10.1.2.3"), None, ip_bytes("2001:db8::1"),
                      ip_bytes("64:ff9b::a01:203")], pa.binary())
    assert _ip_strings(mixed).to_pylist() == ["10.1.2.3", None, "2001:db8::1", "64:ff9b::a01:203"]


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
        assert _ip_strings(a).to_pylist() == [ip_text(v) for v in a.to_pylist()]


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
    from collector.results import join_answer
    left = parse_single(JOIN.format(how="LEFT"), "j")
    inner = parse_single(JOIN.format(how=""), "j")
    a = _part([1, 1, 2], ["10.0.0.1", "10.0.0.2", "10.0.0.1"], [5, 3, 1])
    a = a.rename_columns(["t", "dst_ip", "n", "window_start"])
    b = _part([1], ["10.0.0.1"], [3], m=pa.array([60.5]))
    b = b.rename_columns(["t", "src_ip", "n", "m", "window_start"])

    def rows(q, parts):
        t = join_answer(q, parts)
        return [(r["t"], r["host"], r["d"], r["m"]) for r in t.to_pylist()]

    assert rows(left, {"j.a": a, "j.b": b}) == [(1, "10.0.0.2", 3, None),
                                                 (1, "10.0.0.1", 2, 60.5)]
    assert rows(inner, {"j.a": a, "j.b": b}) == [(1, "10.0.0.1", 2, 60.5)]
    # the right part has no row in the batch: LEFT keeps every left row, inner none
    assert rows(left, {"j.a": a}) == [(1, "10.0.0.1", 5, None), (1, "10.0.0.2", 3, None)]
    assert rows(left, {"j.a": a, "j.b": b.slice(0, 0)}) == rows(left, {"j.a": a})
    assert rows(inner, {"j.a": a}) == []
    assert rows(left, {"j.b": b}) == [] and rows(inner, {}) == []
