"""The HFTA compiled to Spark's expressions (collector/spark/compile.py) against the Python
derivation (``derive.answer_locally``, itself checked against dpkt through replay's tests): the
same answers from the same merged partial rows of real captures, for every aggregate class, and
a physical plan with no Python node."""

from __future__ import annotations

import ipaddress
import random

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from pyspark.sql import functions as F

from capture.fields import IPV4_MAPPED, ip_text
from capture.pcap import open_capture
from collector.config import Settings
from collector.pipeline.engine import Engine
from collector.pipeline.spool import Spool, schema_for, spark_ddl
from collector.spark.compile import (
    RANK,
    SLOT,
    answer_frame,
    compiles,
    join_frame,
    plain,
    selection_frame,
    shared_frame,
    with_address_text,
)
from collector.spark.derive import Folder, answer_locally
from collector.spark.merge import merge_partials
from planner.plan import build_plan
from planner.query import parse_queries
from tests.helpers import capture
from tests.kernel_workloads import PACKET_QUERIES

pytestmark = pytest.mark.slow

# every aggregate class of the prepare workloads' queries (the enrichment ones need tables:
# not here), and more: a top-N of address pairs, IPv6 prefixes, names, a HAVING and a two-key
# ORDER BY, a LEFT JOIN without keys, a join with ORDER BY … LIMIT; plain aggregates that share
# output names (``n`` a count and a port, ``net`` two prefix lengths) and a two-part HAVING; a
# top 2 whose counts tie past its limit (``srcs``: the same rows unlimited), a LIMIT by an
# address's text
BASE = [q for q in parse_queries(PACKET_QUERIES)
        if not q.is_selection and q.name not in ("geo", "cities")]
MORE = """
-- name: top_pairs
SELECT time/10 AS t, src_ip, dst_ip, count(*) AS n, sum(wirelen) AS b FROM packets
GROUP BY time/10, src_ip, dst_ip ORDER BY b DESC LIMIT 3;
-- name: nets6
SELECT time/10 AS t, prefix(src_ip, 64) AS net, count(*) AS n FROM packets
GROUP BY time/10, prefix(src_ip, 64);
-- name: by_len
SELECT time/10 AS t, ip_len, count(DISTINCT src_ip) AS srcs, avg(ip_len) AS mean FROM packets
WHERE protocol = 6 GROUP BY time/10, ip_len;
-- name: busy_hosts
SELECT time/10 AS t, src_ip, count(*) AS n, sum(wirelen) AS b FROM packets
GROUP BY time/10, src_ip HAVING n > 2 AND b >= 100;
-- name: udp_pairs
SELECT time/10 AS t, src_ip, dst_ip, count(*) AS n, max(wirelen) AS m FROM packets
WHERE protocol = 17 GROUP BY time/10, src_ip, dst_ip;
-- name: port_as_n
SELECT time/10 AS t, dst_port AS n, count(*) AS c FROM packets GROUP BY time/10, dst_port;
-- name: nets48
SELECT time/10 AS t, prefix(src_ip, 48) AS net, count(*) AS n FROM packets
GROUP BY time/10, prefix(src_ip, 48);
-- name: names
SELECT time/10 AS t, dns_qname, count(*) AS n FROM packets WHERE dst_port = 53
GROUP BY time/10, dns_qname;
-- name: ports
SELECT time/10 AS t, protocol, dst_port, count(*) AS n, min(wirelen) AS lo FROM packets
GROUP BY time/10, protocol, dst_port HAVING count(*) > 1 ORDER BY n DESC, lo LIMIT 5;
-- name: srcs
SELECT time/10 AS t, src_ip, count(*) AS n FROM packets GROUP BY time/10, src_ip;
-- name: top_srcs
SELECT time/10 AS t, src_ip, count(*) AS n FROM packets GROUP BY time/10, src_ip
ORDER BY n DESC LIMIT 2;
-- name: first_srcs
SELECT time/10 AS t, src_ip, count(*) AS n FROM packets GROUP BY time/10, src_ip
ORDER BY src_ip LIMIT 2;
-- name: resets
WITH a AS (SELECT time/10 AS t, count(*) AS n FROM packets WHERE protocol = 6 GROUP BY time/10),
     r AS (SELECT time/10 AS t, count(*) AS n FROM packets WHERE tcp_flags & 4 != 0
           GROUP BY time/10)
SELECT a.t AS t, a.n AS tcp, coalesce(r.n, 0) AS rsts FROM a LEFT JOIN r ON a.t = r.t;
-- name: asym_top
WITH o AS (SELECT time/10 AS t, src_ip, sum(wirelen) AS bytes, count(*) AS n FROM packets
           WHERE protocol = 17 GROUP BY time/10, src_ip),
     i AS (SELECT time/10 AS t, dst_ip, count(*) AS n FROM packets WHERE protocol = 17
           GROUP BY time/10, dst_ip)
SELECT o.t AS t, o.src_ip AS host, o.bytes / o.n AS mean, o.n - i.n AS d
FROM o JOIN i ON i.dst_ip = o.src_ip AND o.t = i.t WHERE o.n >= 2
ORDER BY mean DESC LIMIT 4;
"""
QUERIES = BASE + parse_queries(MORE)
CAPTURES = ("var-services-std-ports.pcap", "icmp6.pcap", "ipv6-fragmented-dns.pcap",
            "wikipedia.pcap", "dns_udp.pcap")
# ExistingRDD: a DataFrame made of a Python list (createDataFrame) is a Python RDD, read by
# Python workers (the rows here come from Parquet files)
PYTHON_NODES = ("MapInArrow", "ArrowEvalPython", "BatchEvalPython", "FlatMapGroupsIn",
                "PythonUDF", "MapInPandas", "ExistingRDD")


def spooled(queries, root):
    """The captures through one LFTA engine each under ``queries``' plan, into a spool at
    ``root``; the plan."""
    plan = build_plan(queries, **Settings(initial_queries=None).plan_options())
    spool = Spool(root)
    for name in CAPTURES:
        engine = Engine(spool, "packets", watermark_delay_s=1)
        engine.set_plan(plan)
        for raw in open_capture(capture(name), batch_size=256):
            engine.process(raw)
        engine.finish()
    return plan


@pytest.fixture(scope="module")
def merged(spark, tmp_path_factory):
    """The captures' partial rows spooled by the LFTA and merged by Spark (in batch), per
    folder: the DataFrame, the same rows in Arrow, the folder's queries by slot and its node
    labels."""
    tmp = tmp_path_factory.mktemp("compile")
    plan = spooled(QUERIES, tmp / "spool")
    out = []
    for name in plan.folders("packets"):
        folder = Folder("packets", name, tuple(sorted(
            ((qp.slot, qp.query) for qp in plan.queries if qp.query.folder == name),
            key=lambda sq: sq[0])))
        df = spark.read.schema(spark_ddl(schema_for("packets", name))).parquet(
            str(tmp / "spool" / "packets" / name))
        rows = merge_partials(df, "packets", None).where(F.col("node") != "").cache()
        labels = sorted(r["node"] for r in rows.select("node").distinct().collect())
        out.append((rows, rows.toArrow(), folder, labels))
    return out


def _rows(table: pa.Table) -> list[tuple]:
    """An answer's rows as sortable tuples (floats rounded: Spark and Arrow divide alike,
    but a sum may come in another order)."""
    out = []
    for r in table.to_pylist():
        out.append(tuple((k, round(v, 9) if isinstance(v, float) else v)
                         for k, v in r.items()))
    return sorted(out, key=repr)


def compiled(rows, folder: Folder, labels: list[str]) -> dict:
    """Each answer of the folder (a joined query's, not its parts') as Spark computes it."""
    slots = {q.name: s for s, q in folder.slots}
    out = {}
    for q in folder.answers:
        assert compiles(q), q.name
        out[q.name] = join_frame(rows, q, slots, labels) if q.join is not None else \
            answer_frame(rows, q, slots[q.name], labels)
    return out


def test_every_aggregate_class_equals_the_python_derivation(merged):
    names = set()
    for rows, table, folder, labels in merged:
        want = answer_locally(table, folder)
        for name, frame in compiled(rows, folder, labels).items():
            ranked = frame.toArrow()
            got = ranked.drop_columns([RANK]) if RANK in ranked.column_names else ranked
            expected = want.get(name)
            assert expected is not None and expected.num_rows, f"{name}: no rows to compare"
            assert [(f.name, f.type) for f in got.schema] == \
                [(f.name, f.type) for f in expected.schema], name
            assert _rows(got) == _rows(expected), name
            if RANK in ranked.column_names:  # a window's rows in the query's order
                in_order = ranked.sort_by([("window_start", "ascending"), (RANK, "ascending")])
                assert in_order.drop_columns([RANK]).to_pylist() == expected.sort_by(
                    "window_start").to_pylist(), name
            names.add(name)
    assert names == {q.name for q in QUERIES}


def test_the_plain_queries_answered_together_equal_the_python_derivation(merged):
    """A folder's plain aggregates (no distinct count, sketch or join) in one pass and one
    aggregation (``shared_frame``): each slot's rows, in its own columns, equal Python's, a
    window's rows of an ORDER BY … LIMIT query in its order (ranked in one window function
    for every such query); a name two queries have with two types is ``<name>__<type>`` for
    the second."""
    names, tied_past_the_limit = set(), False
    for rows, table, folder, labels in merged:
        slots = {q.name: s for s, q in folder.slots}
        together = [(slots[q.name], q) for q in folder.answers if plain(q)]
        if not together:
            continue
        want = answer_locally(table, folder)
        seen: dict[str, str] = {}
        frame, columns = shared_frame(rows, together, labels, None, seen)
        plan = frame._jdf.queryExecution().executedPlan().toString()
        assert not [n for n in PYTHON_NODES if n in plan], plan
        got = frame.toArrow()
        for s, q in together:
            rows_of_slot = got.filter(pc.equal(got[SLOT], s))
            mine = pa.table({name: rows_of_slot[columns[s].get(name, name)]
                             for name in want[q.name].column_names})
            expected = want[q.name]
            assert expected.num_rows, f"{q.name}: no rows to compare"
            assert mine.schema == expected.schema, q.name
            assert _rows(mine) == _rows(expected), q.name
            if q.order or q.limit is not None:  # a window's rows in the query's order
                assert rows_of_slot[RANK].null_count == 0, q.name
                at = pc.sort_indices(rows_of_slot, [("window_start", "ascending"),
                                                    (RANK, "ascending")])
                assert mine.take(at).to_pylist() == expected.sort_by(
                    "window_start").to_pylist(), q.name
            else:
                assert rows_of_slot[RANK].null_count == rows_of_slot.num_rows, q.name
            names.add(q.name)
        if "srcs" in want:  # the cut before the texts keeps every row tied at the limit
            by_window: dict = {}
            for r in want["srcs"].to_pylist():
                by_window.setdefault(r["window_start"], []).append(r["n"])
            tied_past_the_limit |= any(len(n) > 2 and sorted(n)[-2] == sorted(n)[-3]
                                       for n in by_window.values())
        if {"port_as_n", "busy_hosts"} <= {q.name for _, q in together}:
            assert "n__int" in frame.columns, frame.columns
    assert {"busy_hosts", "udp_pairs", "port_as_n", "nets6", "nets48", "names", "top_pairs",
            "ports", "top_srcs", "first_srcs"} <= names, names
    assert tied_past_the_limit, "no window whose third count ties its second: the cut untested"


def test_the_answer_plan_holds_no_python_node(merged):
    for rows, _, folder, labels in merged:
        for name, frame in compiled(rows, folder, labels).items():
            plan = frame._jdf.queryExecution().executedPlan().toString()
            assert not [n for n in PYTHON_NODES if n in plan], (name, plan)


SELECTIONS = [q for q in parse_queries(PACKET_QUERIES) if q.is_selection] + parse_queries("""
-- name: v6_sel
SELECT ts, src_ip, dst_ip, ip_len, dns_qname FROM packets WHERE ip_version = 6;
""")


def test_selections_equal_the_python_derivation(spark, tmp_path):
    """Each selection's tuples (addresses of both families as text, a payload as hex, names,
    the tuple's time) from the select folder's spool, as the Python derivation gives them, by
    a plan with no Python node."""
    plan = spooled(SELECTIONS, tmp_path / "spool")
    folder = Folder("packets", "select", tuple(sorted(
        (qp.slot, qp.query) for qp in plan.queries if qp.query.folder == "select")))
    tuples = spark.read.schema(spark_ddl(schema_for("packets", "select"))).parquet(
        str(tmp_path / "spool" / "packets" / "select"))
    want = answer_locally(tuples.toArrow(), folder)
    for slot, q in folder.slots:
        assert compiles(q), q.name
        frame = selection_frame(tuples, q, slot)
        plan_text = frame._jdf.queryExecution().executedPlan().toString()
        assert not [n for n in PYTHON_NODES if n in plan_text], plan_text
        got, expected = frame.toArrow(), want.get(q.name)
        assert expected is not None and expected.num_rows, f"{q.name}: no rows to compare"
        assert got.schema == expected.schema, q.name
        assert _rows(got) == _rows(expected), q.name


def _drawn_addresses(n: int) -> list[bytes]:
    """IPv4-mapped addresses and IPv6 ones with zero runs of every length and place (ties of
    equal runs included), drawn with a fixed seed."""
    rng = random.Random(5952)
    out = [IPV4_MAPPED + bytes(4), IPV4_MAPPED + b"\xff" * 4, bytes(16), bytes(15) + b"\x01",
           b"\x20\x01\x0d\xb8" + bytes(12), ipaddress.IPv6Address("1:0:0:2:0:0:3:4").packed,
           ipaddress.IPv6Address("1:0:2:0:3:0:4:0").packed,
           ipaddress.IPv6Address("::ffff:0:1.2.3.4").packed]
    while len(out) < n:
        if rng.random() < 0.3:
            out.append(IPV4_MAPPED + bytes(rng.randrange(256) for _ in range(4)))
            continue
        groups = [0 if rng.random() < 0.5 else rng.choice((1, 0xF, 0xFF0, 0xFFFF,
                                                              rng.randrange(65536)))
                  for _ in range(8)]
        out.append(b"".join(g.to_bytes(2, "big") for g in groups))
    return out


def test_address_text_equals_python_s_ipaddress(spark):
    addresses = _drawn_addresses(3000)
    halves = [(int.from_bytes(a[:8], "big", signed=True), int.from_bytes(a[8:], "big",
                                                                       signed=True))
              for a in addresses]
    # from Arrow: no Python worker (a worker of the shared session once crashed under CI load)
    df = spark.createDataFrame(pa.table({"i": list(range(len(halves))),
                                         "hi": [h for h, _ in halves],
                                         "lo": [w for _, w in halves]}))
    got = {r["i"]: r["t"] for r in with_address_text(df, "t", "hi", "lo")
           .select("i", "t").toArrow().to_pylist()}
    for i, a in enumerate(addresses):
        assert got[i] == ip_text(a), (a.hex(), got[i], ip_text(a))
