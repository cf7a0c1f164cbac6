"""Who may call the control plane: bearer tokens with read and admin scope on the routes that
need them, cross-origin requests refused, bodies and registrations bounded, and `flowsieve run`
refusing to expose an API without a token. Real HTTP requests through FastAPI's test client."""

from __future__ import annotations

import json
import re

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.security import scope_of
from collector.config import load_settings
from collector.daemon.service import Collector
from tests.processes import cli

ADMIN = "admin-token-0123456789abcdef"
READER = "read-token-0123456789abcdef"
SQL = "SELECT time/60 AS t, count(*) AS n FROM packets GROUP BY time/60"


def client_with(tmp_path, **api):
    c = Collector(load_settings(var_dir=tmp_path / "var", initial_queries=None, api=api))
    c.start(with_sources=False, with_spark=False)
    return c, TestClient(create_app(c))


def auth(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def test_tokens_guard_mutations_and_reads_by_scope(tmp_path):
    c, client = client_with(tmp_path, token=ADMIN, tokens=[{"token": READER, "scope": "read"}])
    with client:
        # reads are open unless api.protect_reads
        assert client.get("/queries").status_code == 200
        r = client.post("/queries", json={"name": "a", "sql": SQL})
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        assert r.headers["content-type"] == "application/problem+json"
        assert r.json()["status"] == 401 and ADMIN not in r.text
        assert client.post("/queries", json={"name": "a", "sql": SQL},
                           headers=auth("wrong-token-0123456789abcd")).status_code == 401
        assert client.post("/queries", json={"name": "a", "sql": SQL},
                           headers={"Authorization": ADMIN}).status_code == 401  # no scheme
        r = client.post("/queries", json={"name": "a", "sql": SQL}, headers=auth(READER))
        assert r.status_code == 403 and "only read" in r.json()["detail"]
        assert client.post("/queries", json={"name": "a", "sql": SQL},
                           headers=auth(ADMIN)).status_code == 201
        assert client.post("/prefilter/rebuild").status_code == 401
        assert client.post("/prefilter/rebuild", headers=auth(ADMIN)).status_code == 200
        assert client.delete("/queries/a", headers=auth(READER)).status_code == 403
        assert client.delete("/queries/a", headers=auth(ADMIN)).status_code == 204
    c.stop()


def test_protected_reads(tmp_path):
    c, client = client_with(tmp_path, token=ADMIN, protect_reads=True,
                            tokens=[{"token": READER, "scope": "read"}])
    with client:
        assert client.get("/queries").status_code == 401
        assert client.get("/metrics").status_code == 401
        assert client.get("/queries", headers=auth(READER)).status_code == 200
        assert client.get("/prefilter", headers=auth(ADMIN)).status_code == 200
        assert client.get("/healthz").status_code == 200  # liveness stays open
    c.stop()
    with pytest.raises(ValueError, match="protect_reads needs"):
        load_settings(var_dir=tmp_path / "v2", api={"protect_reads": True})


def test_docs_work_offline_and_know_the_token(tmp_path):
    """Swagger UI and ReDoc load every script and style sheet from the daemon itself (none
    from a CDN), even with reads protected; the schema declares the bearer scheme, so Swagger
    UI offers its Authorize button, and says the health checks need none."""

    c, client = client_with(tmp_path, token=ADMIN, protect_reads=True,
                            tokens=[{"token": READER, "scope": "read"}])
    with client:
        for page in ("/docs", "/redoc"):
            r = client.get(page)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
            assets = re.findall(r'(?:src|href)=["\']([^"\']+)["\']', r.text)
            urls = re.findall(r"https?://[^\s\"']+", r.text)
            assert assets and not urls, (page, assets, urls)  # nothing from another host
            for asset in assets:
                got = client.get(asset)
                assert got.status_code == 200 and len(got.content) > 1000, asset
        assert "swagger-ui-bundle.js" in client.get("/docs").text
        doc = client.get("/openapi.json").json()
        assert doc["components"]["securitySchemes"]["bearer"] == {
            "type": "http", "scheme": "bearer",
            "description": doc["components"]["securitySchemes"]["bearer"]["description"]}
        assert doc["paths"]["/healthz"]["get"]["security"] == []
        assert doc["paths"]["/queries"]["get"]["security"] == [{"bearer": []}]  # protected
        assert doc["paths"]["/queries"]["post"]["security"] == [{"bearer": []}]
        assert client.get("/queries").status_code == 401  # the data stays protected
    c.stop()
    # reads open: the document says a token is optional there, needed for mutations
    c, client = client_with(tmp_path / "open", token=ADMIN)
    with client:
        doc = client.get("/openapi.json").json()
        assert doc["paths"]["/queries"]["get"]["security"] == [{}, {"bearer": []}]
        assert doc["paths"]["/queries"]["post"]["security"] == [{"bearer": []}]
    c.stop()


def test_compose_prometheus_scrapes_with_the_read_token(tmp_path):
    """The compose file gives Prometheus and the daemon one secret, the daemon's read token,
    and the scrape configuration sends it: /metrics answers that request with reads
    protected. A token file that is missing or short is refused at start."""
    import yaml

    from tests.helpers import ROOT
    deploy = ROOT / "deploy"
    compose = yaml.safe_load((deploy / "docker-compose.yml").read_text())
    scrape = yaml.safe_load((deploy / "prometheus.yml").read_text())["scrape_configs"][0]
    assert scrape["metrics_path"] == "/metrics"
    auth_cfg = scrape["authorization"]
    assert auth_cfg["type"] == "Bearer"
    secret = auth_cfg["credentials_file"].removeprefix("/run/secrets/")
    assert secret in compose["services"]["prometheus"]["secrets"]
    assert secret in compose["services"]["flowsieve"]["secrets"]
    assert (compose["secrets"][secret]["file"]) == "./read-token"
    tokens = json.loads(compose["services"]["flowsieve"]["environment"]["FLOWSIEVE_API__TOKENS"])
    assert tokens == [{"token_file": auth_cfg["credentials_file"], "scope": "read"}]
    # the secret as both containers see it: the daemon reads it, Prometheus sends it
    token = "prometheus-read-token-0123456789"
    (tmp_path / "read-token").write_text(token + "\n")
    tokens[0]["token_file"] = str(tmp_path / "read-token")
    c, client = client_with(tmp_path, token=ADMIN, protect_reads=True, tokens=tokens)
    with client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers=auth(token)).status_code == 200
    c.stop()
    (tmp_path / "short").write_text("abc\n")
    for bad, why in ((tmp_path / "none", "No such file"), (tmp_path / "short", "16 or more")):
        with pytest.raises(ValueError, match=why):
            load_settings(var_dir=tmp_path / "v", api={"tokens": [{"token_file": str(bad)}]})
    with pytest.raises(ValueError, match="exactly one"):
        load_settings(var_dir=tmp_path / "v", api={"tokens": [{"scope": "read"}]})


def test_cross_origin_mutations_are_refused(tmp_path):
    """The request of the report: a body-less cross-origin POST from any web page."""
    c, client = client_with(tmp_path, cors_origins=["https://grafana.example"])
    with client:
        r = client.post("/prefilter/rebuild", headers={"Origin": "https://evil.example"})
        assert r.status_code == 403 and "cross-origin" in r.json()["detail"]
        # a configured origin passes (and gets CORS headers); no Origin: not a browser
        r = client.post("/prefilter/rebuild", headers={"Origin": "https://grafana.example"})
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://grafana.example"
        assert client.post("/prefilter/rebuild").status_code == 200
        # the API's own pages (its /docs) are the same origin
        assert client.post("/prefilter/rebuild",
                           headers={"Origin": "http://testserver"}).status_code == 200
        # reads carry no CORS header for an origin not configured
        r = client.get("/queries", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in r.headers
    c.stop()


def test_registrations_are_bounded(tmp_path):
    c, client = client_with(tmp_path, max_queries=2, max_body_bytes=4096)
    with client:
        for name in ("a", "b"):
            assert client.post("/queries", json={"name": name, "sql": SQL}).status_code == 201
        r = client.post("/queries", json={"name": "c", "sql": SQL})
        assert r.status_code == 429 and "api.max_queries" in r.json()["detail"]
        assert client.post("/queries", json={"name": "c", "sql": SQL + " " * 5000}
                           ).status_code == 413
    c.stop()


def test_token_from_the_environment_is_never_shown(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWSIEVE_API__TOKEN", ADMIN)
    settings = load_settings(var_dir=tmp_path / "var")
    assert settings.api.scopes() == [(ADMIN.encode(), "admin")]
    assert ADMIN not in repr(settings) and ADMIN not in str(settings.model_dump())
    with pytest.raises(ValueError, match="at least 16"):
        load_settings(var_dir=tmp_path / "var", api={"token": "short"})


def test_scope_of_compares_every_token():
    tokens = [(READER.encode(), "read"), (ADMIN.encode(), "admin")]
    assert scope_of(tokens, f"Bearer {ADMIN}") == "admin"
    assert scope_of(tokens, f"bearer {READER}") == "read"
    assert scope_of(tokens, f"Bearer {ADMIN}x") is None
    assert scope_of(tokens, None) is None and scope_of([], f"Bearer {ADMIN}") is None


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3"])
def test_run_refuses_an_exposed_api_without_a_token(tmp_path, host):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"api: {{host: '{host}'}}\nvar_dir: {tmp_path / 'var'}\n")
    r = cli("run", "--config", str(cfg), timeout=120)
    assert r.returncode != 0
    lines = r.stdout.strip().splitlines() + r.stderr.strip().splitlines()
    assert lines == [f"error: api.host is {host}, not a loopback address, and no token is "
                     "set: set api.token (or FLOWSIEVE_API__TOKEN) or bind 127.0.0.1"]


def test_readyz_says_why_not(tmp_path):
    """Readiness is not liveness: without Spark the daemon is alive (/healthz) but not ready."""
    c, client = client_with(tmp_path, token=ADMIN, protect_reads=True)
    with client:
        assert client.get("/healthz").status_code == 200
        r = client.get("/readyz")  # open, like /healthz
        assert r.status_code == 503 and r.headers["content-type"] == "application/problem+json"
        assert "Spark is not running" in r.json()["detail"]
    c.stop()


def test_rebuild_options(tmp_path):
    """A bit budget for the next plans, from the API; a body-less rebuild keeps working."""
    c, client = client_with(tmp_path)
    sql = ";".join(f"SELECT ts FROM packets WHERE {w}" for w in (  # one constant per field:
        "dst_port = 22", "src_port = 25", "ttl = 64", "protocol = 17", "icmp_type = 8"))  # bits
    for i, q in enumerate(sql.split(";")):
        assert client.post("/queries", json={"name": f"q{i}", "sql": q}).status_code == 201
    wide = client.post("/prefilter/rebuild").json()
    assert wide["bits"] > 2 and wide["options"] == {}
    r = client.post("/prefilter/rebuild", json={"bit_budget": 2, "use_selectivities": False})
    narrow = r.json()
    assert narrow["bits"] == 2 == narrow["bit_budget"] and narrow["version"] > wide["version"]
    assert client.get("/prefilter").json()["bit_budget"] == 2
    # the options stay for later rebuilds (a registration) until new ones
    assert client.post("/queries", json={"name": "q9", "sql": SQL}).status_code == 201
    assert client.get("/prefilter").json()["bit_budget"] == 2
    assert client.post("/prefilter/rebuild", json={}).json()["bit_budget"] == \
        c.settings.planner.bit_budget
    assert client.post("/prefilter/rebuild", json={"bit_budget": -1}).status_code == 422
    c.stop()


def test_a_deleted_querys_series_disappear(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families
    c, client = client_with(tmp_path)
    with client:
        assert client.post("/queries", json={"name": "gone", "sql": SQL}).status_code == 201
        for m in (c.metrics.query_matched, c.metrics.query_avoided, c.metrics.query_windows,
                  c.metrics.result_rows):
            m.labels("gone").inc()
        c.metrics.query_lag.labels("gone").observe(3)

        def series() -> set:
            return {s.labels.get("query") for f in text_string_to_metric_families(
                client.get("/metrics").text) for s in f.samples}
        assert "gone" in series()
        assert client.delete("/queries/gone").status_code == 204
        assert "gone" not in series()
        text = client.get("/metrics").text
        assert "flowsieve_rebuild_duration_seconds_count 3.0" in text  # start, add, delete
    c.stop()
