"""The query language: parsing, normalisation, names, errors with line and column."""

from __future__ import annotations

import pytest

from planner.ir import QueryError
from planner.query import parse_queries, parse_single
from tests.helpers import Q123


def test_design_queries():
    qs = parse_queries(Q123)
    assert [q.name for q in qs] == ["udp_bw", "dns_req", "dns_resp"]
    assert all(q.period == 60 and q.keys == ("src_ip", "dst_ip") for q in qs)
    assert [p.text for p in qs[1].predicates] == ["protocol = 17", "dst_port = 53", "dns_qr = 0"]
    assert [o.name for o in qs[0].outputs] == ["t", "src_ip", "dst_ip", "bytes", "pkts"]


def test_names_default_in_order_and_semicolons_in_strings():
    qs = parse_queries("SELECT ts FROM packets WHERE dns_qname = 'a;b';\n"
                       "SELECT ts FROM packets")
    assert [q.name for q in qs] == ["q1", "q2"]
    assert qs[0].predicates[0].text == "dns_qname = 'a;b'"


@pytest.mark.parametrize("a,b", [
    ("53 = dst_port", "dst_port = 53"),
    ("80 < dst_port", "dst_port > 80"),
    ("NOT (protocol = 6)", "protocol != 6"),
    ("NOT protocol >= 6", "protocol < 6"),
    ("dst_port IN (53)", "dst_port = 53"),
    ("dst_port IN (443, 80, 80)", "dst_port IN (80, 443)"),
    ("(src_port = 2 OR 1 = src_port)", "(src_port = 1 OR src_port = 2)"),
    ("dst_port BETWEEN 10 AND 1", "dst_port BETWEEN 1 AND 10"),
    ("src_ip = '10.0.0.1'", "in_prefix(src_ip, '10.0.0.1/32')"),
    ("in_prefix(src_ip, '10.1.2.3/8')", "in_prefix(src_ip, '10.0.0.0/8')"),
    ("tcp_flags & 4 != 0", "(tcp_flags & 4) = 4"),
    ("18 = (18 & tcp_flags)", "(tcp_flags & 18) = 18"),
    ("NOT (tcp_flags & 18) = 2", "(tcp_flags & 18) != 2"),
    ("(tcp_flags & 1) != 1", "(tcp_flags & 1) = 0"),
])
def test_normalised_predicates_are_one(a, b):
    """Equal predicates written differently are one base predicate (shared in the prefilter)."""
    qa = parse_single(f"SELECT ts FROM packets WHERE {a}")
    qb = parse_single(f"SELECT ts FROM packets WHERE {b}")
    assert qa.predicates == qb.predicates


@pytest.mark.parametrize("sql,line,col,reason", [
    ("SELECT time/60, foo FROM packets GROUP BY time/60", 1, 17, "unknown field 'foo'"),
    ("SELECT ts\nFROM packets\nWHERE  dst_port = 'x'", 3, 19, "whole number"),
    ("SELECT time/60, sum(ttl) FROM packets GROUP BY time/60", 1, 21, "measures are"),
    ("SELECT ts FROM packets WHERE src_ip < '1.2.3.4'", 1, 30, "not <"),
    ("SELECT ts FROM nowhere", 1, 16, "unknown stream"),
    ("SELECT time/60, src_ip, count(*) FROM packets GROUP BY time/60", 1, 17,
     "must appear in GROUP BY"),
    ("SELECT ts FROM packets WHERE regexp(dns_qname, '(')", 1, 48, "bad regular expression"),
    ("SELECT ts FROM packets WHERE (tcp_flags & 18) = 1", 1, 31, "never holds"),
    ("SELECT ts FROM packets WHERE tcp_flags & 18 > 2", 1, 30, "with = or !="),
    ("SELECT ts FROM packets WHERE (src_ip & 18) = 2", 1, 31, "integer field"),
    ("SELECT ts FROM packets\nWHERE (tcp_flags & -2) = 0", 2, 21, "positive whole number"),
    ("SELECT time/60, avg(ip_len) FROM packets WHERE dst_port = 53 OR vlan = 3 "
     "GROUP BY time/60", 1, 17, "IP packets only"),
    ("SELECT time/60, count(DISTINCT wirelen) FROM packets GROUP BY time/60", 1, 32,
     "can be grouped by"),
    ("SELECT time/60, prefix(src_ip, 0) FROM packets GROUP BY time/60, prefix(src_ip, 0)", 1,
     81, "prefix length"),
    ("SELECT time/60, prefix(src_ip, 24) FROM packets GROUP BY time/60, prefix(src_ip, 16)",
     1, 17, "must appear in GROUP BY"),
    ("SELECT ts FROM packets WHERE contains(ttl, 'x')", 1, 39, "not ttl"),
    ("SELECT ts FROM packets WHERE contains(payload, '')", 1, 48, "non-empty quoted string"),
    ("SELECT time/60, src_ip, approx_count_distinct(dst_ip) AS a, approx_count_distinct("
     "dst_port) AS b FROM packets GROUP BY time/60, src_ip", 1, 8, "one field per query"),
    ("SELECT time/60, payload, count(*) FROM packets GROUP BY time/60, payload", 1, 66,
     "cannot be grouped by"),
    ("SELECT time/60, dns_qname, approx_count_distinct(dns_an_name) AS a FROM packets "
     "GROUP BY time/60, dns_qname", 1, 8, "at most one text field"),
])
def test_errors_name_line_and_column(sql, line, col, reason):
    with pytest.raises(QueryError) as e:
        parse_queries(sql)
    assert (e.value.line, e.value.col) == (line, col)
    assert reason in e.value.reason


def test_syntax_error_position():
    with pytest.raises(QueryError) as e:
        parse_queries("SELECT ts\nFROM packets WHERE")
    assert e.value.line == 2 and e.value.col >= 1
    with pytest.raises(QueryError) as e:
        parse_queries("SELECT FROM WHERE x = 3")
    assert (e.value.line, e.value.col) == (1, 13)


def test_error_lines_count_in_the_file():
    text = Q123 + "-- name: bad\nSELECT time/60 FROM packets\nWHERE nope = 1 GROUP BY time/60;"
    with pytest.raises(QueryError) as e:
        parse_queries(text)
    assert e.value.line == 12 and e.value.query == "bad"


def test_duplicate_and_bad_names():
    with pytest.raises(QueryError, match="duplicate"):
        parse_queries("-- name: a\nSELECT ts FROM packets;\n-- name: a\nSELECT ts FROM packets")
    with pytest.raises(QueryError, match="invalid query name"):
        parse_queries("-- name: 9x\nSELECT ts FROM packets")


def test_having_order_limit():
    q = parse_single("SELECT time/10 AS t, dst_port, count(*) AS n, avg(wirelen) AS mean "
                     "FROM packets GROUP BY time/10, dst_port HAVING count(*) >= 2 "
                     "ORDER BY n DESC LIMIT 3")
    assert q.period == 10 and q.keys == ("dst_port",)
    assert [(c.column, c.op, c.value) for c in q.having] == [("n", ">=", 2)]
    assert q.order == (("n", True),) and q.limit == 3


def test_regexp_is_expensive_and_ports_cheap():
    q = parse_single("SELECT ts FROM packets WHERE dst_port = 53 AND regexp(dns_qname, 'x')")
    assert q.predicates[0].cost < 10 < q.predicates[1].cost


PARTS = """WITH a AS (SELECT time/60 AS t, dst_ip, count(*) AS n FROM packets
                     WHERE (tcp_flags & 18) = 2 GROUP BY time/60, dst_ip),
     b AS (SELECT time/{p} AS t, src_ip, count(*) AS n FROM packets GROUP BY time/{p}, src_ip)
"""


@pytest.mark.parametrize("tail,period,line,col,reason", [
    ("SELECT a.n FROM a JOIN b ON a.t = b.t", 10, 3, 77, "one period"),
    ("SELECT a.n FROM a JOIN b ON a.t = b.t AND a.n = b.n", 60, 4, 43, "not a group key of a"),
    ("SELECT a.n FROM a JOIN b ON a.dst_ip = b.src_ip", 60, 4, 29, "ON needs a.<bucket>"),
    ("SELECT n FROM a JOIN b ON a.t = b.t", 60, 4, 8, "qualify a column"),
    ("SELECT a.x FROM a JOIN b ON a.t = b.t", 60, 4, 8, "has no column 'x'"),
    ("SELECT a.n FROM a RIGHT JOIN b ON a.t = b.t", 60, 4, 30, "JOIN or LEFT JOIN"),
    ("SELECT a.n FROM a JOIN c ON a.t = c.t", 60, 4, 24, "no part of the WITH"),
    ("SELECT upper(a.n) FROM a JOIN b ON a.t = b.t", 60, 4, 8, "not 'UPPER(a.n)'"),
    ("SELECT a.n FROM a JOIN b ON a.t = b.t WHERE a.n + 1", 60, 4, 45, "compares"),
])
def test_join_errors_name_line_and_column(tail, period, line, col, reason):
    with pytest.raises(QueryError) as e:
        parse_single(PARTS.format(p=period) + tail, "j")
    assert reason in e.value.reason
    assert (e.value.line, e.value.col) == (line, col)


def test_join_parts_are_planned_queries():
    """Each part is an ordinary aggregate query (own predicates, keys, slot); the join itself
    has none; a part's parse errors point into the whole text."""
    from planner.plan import build_plan
    q = parse_single(PARTS.format(p=60) + "SELECT a.t, a.n - coalesce(b.n, 0) AS d FROM a LEFT "
                     "JOIN b ON a.t = b.t AND a.dst_ip = b.src_ip", "half_open")
    assert [p.name for p in q.parts] == ["half_open.a", "half_open.b"]
    assert q.parts[0].predicates[0].text == "(tcp_flags & 18) = 2"
    assert q.join.how == "left" and q.join.on == (("dst_ip", "src_ip"),)
    assert [o.name for o in q.outputs] == ["t", "d"] and q.period == 60
    plan = build_plan([q])
    assert [qp.query.name for qp in plan.queries] == ["half_open.a", "half_open.b"]
    assert all(qp.query.parent is q for qp in plan.queries)
    with pytest.raises(QueryError) as e:
        parse_single(PARTS.format(p=60).replace("dst_ip, count", "dst_ipx, count") +
                     "SELECT a.n FROM a JOIN b ON a.t = b.t", "j")
    assert (e.value.line, e.value.col) == (1, 33) and "unknown field 'dst_ipx'" in e.value.reason
