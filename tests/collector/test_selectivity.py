"""Measured selectivities against dpkt, and their use by the planner and the API."""

from __future__ import annotations

from fastapi.testclient import TestClient

from api.app import create_app
from capture.pcap import open_capture
from collector.config import load_settings
from collector.service import Collector
from tests.conftest import capture
from tests.reference import packets


def test_measured_selectivity_in_prefilter_api(tmp_path):
    """After the engine has seen wikipedia.pcap, GET /prefilter reports each cheap predicate's
    selectivity as the fraction of packets dpkt finds satisfying it; a rebuild under a bit
    budget then chooses bits by expected invocations."""
    c = Collector(load_settings(var_dir=tmp_path / "var"))
    c.start(with_sources=False, with_spark=False)
    c.meter.min_seen = 1
    path = capture("wikipedia.pcap")
    for raw in open_capture(path):
        c.engines[0].process(raw, "test")
    ref = packets(path)
    want = {
        "protocol = 17": sum(p["protocol"] == 17 for p in ref) / len(ref),
        "dst_port = 53": sum(p["dst_port"] == 53 for p in ref) / len(ref),
        "dns_qr = 1": sum(p["dns_qr"] == 1 for p in ref) / len(ref),
    }
    with TestClient(create_app(c)) as client:
        doc = client.get("/prefilter").json()
        got = {p["text"]: p["selectivity"] for p in doc["predicates"]}
        for text, sel in want.items():
            assert abs(got[text] - sel) < 1e-12, text
        c.settings.planner.bit_budget = 2
        client.post("/prefilter/rebuild")
        doc = client.get("/prefilter").json()
        assert len(doc["bits"]) == 2 and doc["expected_invocations"] is not None
    c.stop()
