"""The control plane's view of enrichment: GET /enrichment shows the loaded databases, a query
over an enrichment field registers when its database is configured and is refused (422, where
it names the field) when not."""

from __future__ import annotations

from fastapi.testclient import TestClient

from api.app import create_app
from capture import enrich
from collector.config import load_settings
from collector.daemon.service import Collector
from tests.enrichtools import DATA
from tests.processes import metric


def test_enrichment_route_and_registration(tmp_path):
    asn = DATA / "GeoLite2-ASN-Test.mmdb"
    c = Collector(load_settings(var_dir=tmp_path / "var", initial_queries=None,
                                enrich={"asn": str(asn), "asn_precedence": "database"}))
    c.start(with_sources=False, with_spark=False)
    try:
        with TestClient(create_app(c)) as client:
            body = client.get("/enrichment").json()
            assert body["asn_precedence"] == "database"
            [db] = body["databases"]
            assert db["database"] == "asn" and db["path"] == str(asn)
            assert db["type"] == "GeoLite2-ASN" and db["networks"] > 100
            r = client.post("/queries", json={"name": "by_as", "sql":
                            "SELECT time/60 AS t, src_asn, count(*) AS n FROM flows "
                            "WHERE dst_asn IN (15169, 1221) GROUP BY time/60, src_asn"})
            assert r.status_code == 201, r.text
            r = client.post("/queries", json={"name": "nl", "sql":
                            "SELECT time/60 AS t, count(*) AS n FROM packets\n"
                            "WHERE dst_country = 'NL' GROUP BY time/60"})
            assert r.status_code == 422
            d = r.json()
            assert "set enrich.country" in d["reason"] and (d["line"], d["column"]) == (2, 7)
            text = client.get("/metrics").text
            assert metric(text, "flowsieve_enrich_networks", 'database="asn"') == \
                db["networks"]
    finally:
        c.stop()
        enrich.configure({})
