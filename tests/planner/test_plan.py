"""The plan: one bit per distinct cheap base predicate, signatures, residuals, JSON."""

from __future__ import annotations

import json

from planner.plan import build_plan
from planner.query import parse_queries
from tests.helpers import Q123


def test_paper_figure_1():
    """Golab et al., section 1: the five distinct predicates of Q1-Q3 fit in three bits,
    protocol=UDP, (dest_port=53 AND qr=0) and (src_port=53 AND qr=1)."""
    plan = build_plan(parse_queries(Q123))
    texts = [p.predicate.text for p in plan.predicates]
    assert texts == ["protocol = 17", "dst_port = 53", "dns_qr = 0", "src_port = 53",
                     "dns_qr = 1"]
    assert plan.bits == [(0,), (1, 2), (3, 4)]
    sigs = {qp.query.name: [plan.bits[b] for b in qp.signature] for qp in plan.queries}
    assert sigs == {"udp_bw": [(0,)], "dns_req": [(0,), (1, 2)], "dns_resp": [(0,), (3, 4)]}
    assert all(not qp.residual for qp in plan.queries)


def test_expensive_predicates_are_residual():
    plan = build_plan(parse_queries(
        "SELECT ts FROM packets WHERE dst_port = 53 AND regexp(dns_qname, 'goo')"))
    qp = plan.queries[0]
    assert [plan.predicates[p].predicate.text for p in qp.residual] == ["regexp(dns_qname, 'goo')"]
    assert len(qp.signature) == 1


def test_budget_keeps_most_shared_predicates():
    plan = build_plan(parse_queries(Q123), bit_budget=1)
    assert plan.bits == [(0,)]
    assert plan.by_name("dns_req").residual == [1, 2]


def test_json_contract():
    doc = json.loads(json.dumps(build_plan(parse_queries(Q123), version=7).to_json()))
    assert doc["version"] == 7
    assert {"id", "text", "cost", "cheap", "selectivity"} <= set(doc["predicates"][0])
    assert {"id", "predicates"} <= set(doc["bits"][0])
    assert {"name", "slot", "signature", "ascs", "residual"} <= set(doc["queries"][0])
    assert doc["ascs"] == []


def test_every_tree_node_fits_one_key_row():
    """Queries keyed on, counting or sketching different text fields (DNS names): whatever
    the random search and however cheap sharing is, every maintained node packs into one spool
    key and one LFTA table key (collector/keys.py holds one string field: a node uniting
    dns_an_name with a sketch of dns_qname once failed in CI)."""
    from collector.keys import KeyLayout
    queries = parse_queries("""
-- name: names
SELECT time/10 AS t, approx_count_distinct(dns_qname) AS names FROM packets GROUP BY time/10;
-- name: ttls
SELECT time/10 AS t, dns_an_name, dns_an_addr, count(DISTINCT dns_an_ttl) AS ttls FROM packets
WHERE dns_qr = 1 GROUP BY time/10, dns_an_name, dns_an_addr;
-- name: asked
SELECT time/10 AS t, dns_qname, count(*) AS n FROM packets GROUP BY time/10, dns_qname;
-- name: per_src
SELECT time/10 AS t, src_ip, count(DISTINCT dns_an_addr) AS n FROM packets GROUP BY time/10, src_ip;
""")
    for seed in range(12):
        for cost in (0.01, 1.0, 200.0):
            plan = build_plan(queries, tree_seed=seed, hfta_row_cost=cost)
            for tree in plan.trees:
                for keys, _ in tree.maintained():
                    spool = KeyLayout("packets", keys, 1)
                    KeyLayout("packets", spool.table_keys(), 1)
