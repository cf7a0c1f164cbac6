"""Measured selectivities against dpkt, and their use by the planner and the API."""

from __future__ import annotations

import itertools
import math

from fastapi.testclient import TestClient

from api.app import create_app
from capture.pcap import open_capture
from collector.config import load_settings
from collector.daemon.service import Collector
from tests.helpers import capture
from tests.reference import packets

TCP = {"tcp_all": "protocol = 6", "tcp_web": "protocol = 6 AND dst_port = 80"}


def test_measured_selectivity_in_prefilter_api(tmp_path):
    """After the engine has seen wikipedia.pcap, GET /prefilter reports each cheap predicate's
    selectivity as the fraction of packets dpkt finds satisfying it; a rebuild under a bit
    budget then chooses the bits with the fewest expected invocations (paper 2.3), not the
    ones that cover the most ones of the matrix."""
    c = Collector(load_settings(var_dir=tmp_path / "var"))
    c.start(with_sources=False, with_spark=False)
    c.meter.min_seen = 1
    with TestClient(create_app(c)) as client:
        for name, where in TCP.items():
            r = client.post("/queries", json={
                "name": name, "sql": f"SELECT time/60 AS t, count(*) FROM packets WHERE {where}"
                                     " GROUP BY time/60"})
            assert r.status_code == 201, r.text
        path = capture("wikipedia.pcap")
        for raw in open_capture(path):
            c.engines[0].process(raw, "test")
        ref = packets(path)
        doc = client.get("/prefilter").json()
        sel = {}
        for p in doc["predicates"]:
            field, value = p["text"].split(" = ")
            sel[p["id"]] = sum(x[field] == int(value) for x in ref) / len(ref)
            assert abs(p["selectivity"] - sel[p["id"]]) < 1e-12, p["text"]
        c.settings.planner.bit_budget = 3
        client.post("/prefilter/rebuild")
        doc = client.get("/prefilter").json()
    c.stop()
    # expected invocations per tuple: per query, the product of the dpkt-measured selectivities
    # of the predicates its signature checks. Found here by brute force over every triple of
    # candidate bits (conjunctions inside some query), not by the planner.
    queries = [frozenset(q["predicates"]) for q in doc["queries"]]

    def invocations(bits) -> float:
        return sum(math.prod(sel[p] for p in set().union(*[b for b in bits if b <= q]))
                   for q in queries)

    def ones(bits) -> int:
        return sum(len(set().union(*[b for b in bits if b <= q])) for q in queries)

    candidates = {frozenset(c) for q in queries for k in range(1, len(q) + 1)
                  for c in itertools.combinations(sorted(q), k)}
    triples = list(itertools.combinations(candidates, 3))
    best = min(invocations(t) for t in triples)
    most_ones = max(ones(t) for t in triples)
    chosen = [frozenset(b["predicates"]) for b in doc["bits"]]
    assert len(chosen) == 3
    assert abs(invocations(chosen) - best) < 1e-12
    assert abs(doc["expected_invocations"] - best) < 1e-12
    # here the choice matters: covering the most ones would invoke more queries
    assert min(invocations(t) for t in triples if ones(t) == most_ones) > best + 1e-3
