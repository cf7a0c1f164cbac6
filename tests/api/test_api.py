"""The control plane over a collector with no sources and no Spark (the daemon test covers
the whole pipeline)."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest

from api.app import create_app
from collector.config import load_settings
from collector.daemon.service import Collector
from tests.processes import metric


@pytest.fixture
def client(tmp_path):
    c = Collector(load_settings(var_dir=tmp_path / "var"))
    c.start(with_sources=False, with_spark=False)
    with TestClient(create_app(c)) as client:
        yield client
    c.stop()


def test_initial_queries_registered(client):
    r = client.get("/queries")
    assert r.status_code == 200
    assert [q["name"] for q in r.json()] == ["udp_bw", "dns_req", "dns_resp"]
    assert [q["slot"] for q in r.json()] == [0, 1, 2]


def test_register_rebuilds_plan(client):
    v0 = client.get("/prefilter").json()["version"]
    r = client.post("/queries", json={"name": "dns_big", "sql":
                    "SELECT time/10 AS t, count(*) AS n FROM packets "
                    "WHERE src_port = 53 AND wirelen > 512 GROUP BY time/10"})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["slot"] == 3 and body["period_s"] == 10 and body["columns"] == ["t", "n"]
    plan = client.get("/prefilter").json()
    assert plan["version"] == v0 + 1
    texts = {p["text"] for p in plan["predicates"]}
    assert {"src_port = 53", "wirelen > 512"} <= texts
    assert client.get("/queries/dns_big").json()["name"] == "dns_big"
    assert client.get("/queries/dns_big/results").json() == {
        "name": "dns_big", "columns": ["t", "n", "window_start", "window_end"], "rows": [],
        "next_cursor": None, "complete_before": None}


def test_errors(client):
    r = client.post("/queries", json={"name": "bad", "sql": "SELECT ts FROM packets\n"
                                                           "WHERE nope = 1"})
    assert r.status_code == 422
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["line"] == 2 and r.json()["column"] == 7 and r.json()["status"] == 422
    assert "nope" in r.json()["detail"] and r.json()["reason"]
    r = client.post("/queries", json={"name": "udp_bw", "sql": "SELECT ts FROM packets"})
    assert r.status_code == 409 and "exists" in r.json()["detail"]
    r = client.post("/queries", json={"name": "1bad", "sql": "SELECT ts FROM packets"})
    assert r.status_code == 422
    r = client.get("/queries/nope")
    assert r.status_code == 404 and r.json() == {"type": "about:blank", "title": "Not Found",
                                                 "status": 404, "detail": "query not found"}
    assert client.delete("/queries/nope").status_code == 404
    assert client.get("/queries/nope/results").status_code == 404


def test_delete_holds_slot(client):
    assert client.delete("/queries/dns_req").status_code == 204
    assert [q["name"] for q in client.get("/queries").json()] == ["udp_bw", "dns_resp"]
    r = client.post("/queries", json={"name": "again", "sql": "SELECT ts FROM packets"})
    assert r.json()["slot"] == 3, "slot 1 is held until no spool file can reference it"


def test_joined_query_registers_with_a_slot_per_part(client):
    """A WITH … JOIN query over REST: its parts are planned with their own slots (the first
    holds the query's), the query is listed once, and deleting it holds every part's slot."""
    sql = ("WITH s AS (SELECT time/60 AS t, dst_ip, count(*) AS n FROM packets "
           "WHERE (tcp_flags & 18) = 2 GROUP BY time/60, dst_ip), "
           "a AS (SELECT time/60 AS t, src_ip, count(*) AS n FROM packets "
           "WHERE (tcp_flags & 18) = 18 GROUP BY time/60, src_ip) "
           "SELECT s.t AS t, s.dst_ip AS host, s.n - coalesce(a.n, 0) AS open "
           "FROM s LEFT JOIN a ON s.t = a.t AND s.dst_ip = a.src_ip WHERE s.n > 100")
    r = client.post("/queries", json={"name": "syn_flood", "sql": sql})
    assert r.status_code == 201, r.text
    assert r.json()["slot"] == 3 and r.json()["columns"] == ["t", "host", "open"]
    assert [q["name"] for q in client.get("/queries").json()][-1] == "syn_flood"
    plan = client.get("/prefilter").json()
    slots = {q["name"]: q["slot"] for q in plan["queries"]}
    assert slots["syn_flood.s"] == 3 and slots["syn_flood.a"] == 4
    assert {"(tcp_flags & 18) = 2", "(tcp_flags & 18) = 18"} <= \
        {p["text"] for p in plan["predicates"]}
    assert client.delete("/queries/syn_flood").status_code == 204
    assert "syn_flood.s" not in {q["name"] for q in client.get("/prefilter").json()["queries"]}
    r = client.post("/queries", json={"name": "again", "sql": "SELECT ts FROM packets"})
    assert r.json()["slot"] == 5, "both parts' slots are held"
    r = client.post("/queries", json={"name": "bad", "sql": sql.replace("time/60 AS t, src",
                                                                         "time/10 AS t, src")
                                      .replace("time/60, src", "time/10, src")})
    assert r.status_code == 422 and "one period" in r.json()["reason"]


def test_metrics_and_health(client):
    r = client.get("/metrics")
    assert r.status_code == 200 and "text/plain" in r.headers["content-type"]
    assert "flowsieve_plan_version" in r.text and "flowsieve_queries 3.0" in r.text
    h = client.get("/healthz").json()
    assert h["status"] == "ok" and h["queries"] == 3


def test_process_build_and_spool_fill_metrics(tmp_path):
    """What a process is expected to export (memory, CPU, garbage collections), the build, and
    how full the spool is, against the files in it, read when scraped."""
    from importlib.metadata import version

    c = Collector(load_settings(var_dir=tmp_path / "var", spool={"max_bytes": 1 << 20}))
    c.start(with_sources=False, with_spark=False)
    try:
        with TestClient(create_app(c)) as client:
            text = client.get("/metrics").text
            values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                      for line in text.splitlines() if line and not line.startswith("#")}
            assert values["process_resident_memory_bytes"] > 0
            assert values['python_gc_objects_collected_total{generation="0"}'] >= 0
            assert values["flowsieve_spool_max_bytes"] == 1 << 20
            assert values["flowsieve_spool_bytes"] == 0
            assert any(k.startswith("flowsieve_build_info{") and
                       f'version="{version("flowsieve")}"' in k for k in values)
            folder = c.settings.spool_dir / "packets" / "60"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "1.test.parquet").write_bytes(b"x" * 5000)  # a spool file's name
            text = client.get("/metrics").text
            assert "flowsieve_spool_bytes 5000.0" in text.splitlines()
    finally:
        c.stop()


def test_api_requests_counted_by_route_template_and_status(tmp_path):
    """Requests by route template (never the path a client made up), method and status; one
    the guard refused before routing, as ``unrouted``."""
    c = Collector(load_settings(var_dir=tmp_path / "var", api={"token": "t" * 20}))
    c.start(with_sources=False, with_spark=False)
    admin = {"Authorization": "Bearer " + "t" * 20}
    try:
        with TestClient(create_app(c)) as client:
            for name in ("udp_bw", "dns_req", "no_such_query"):
                client.get(f"/queries/{name}")
            client.delete("/queries/udp_bw")  # no token: refused
            client.delete("/queries/udp_bw", headers=admin)
            text = client.get("/metrics").text
    finally:
        c.stop()
    count = "flowsieve_api_requests_total"
    assert metric(text, count, 'method="GET",route="/queries/{name}",status="200"') == 2
    assert metric(text, count, 'method="GET",route="/queries/{name}",status="404"') == 1
    assert metric(text, count, 'method="DELETE",route="/queries/{name}",status="204"') == 1
    assert metric(text, count, 'method="DELETE",route="unrouted",status="401"') == 1
    assert "no_such_query" not in text
    assert metric(text, "flowsieve_api_request_duration_seconds_count",
                  'method="GET",route="/queries/{name}"') == 3


def test_source_idle_seconds_fall_when_it_delivers(tmp_path):
    """``flowsieve_source_idle_seconds``: time since a flow listener last delivered, growing
    while no exporter sends, back near zero once one does."""
    import socket

    from collector.config import SourceConfig
    from tests.flowtools import HEX, read_hex
    from tests.processes import v5_now, wait_until
    src = SourceConfig(type="netflow", name="nf", listen=["127.0.0.1:0"])
    c = Collector(load_settings(var_dir=tmp_path / "var", sources=[src]))
    c.start(with_sources=True, with_spark=False)

    def idle() -> float:
        return metric(generate_latest(c.metrics.registry).decode(),
                      "flowsieve_source_idle_seconds", 'source="nf"')
    try:
        wait_until(lambda: c.sources[0].listener.bound, "the listener")
        wait_until(lambda: idle() > 0.6, "0.6 s of silence")
        quiet = idle()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(v5_now(read_hex(HEX / "PACKET_V5.hex")[0], 0, time.time()),
                     c.sources[0].listener.bound[0])
        wait_until(lambda: idle() < quiet, "the idle time to fall")  # else it only grows
    finally:
        c.stop()


def test_registry_survives_restart(tmp_path):
    """Queries, slots and the plan version persist in SQLite across a restart."""
    settings = load_settings(var_dir=tmp_path / "var")
    c = Collector(settings)
    c.start(with_sources=False, with_spark=False)
    c.register("extra", "SELECT ts FROM packets WHERE dst_port = 22")
    c.delete("dns_req")
    version = c.plan.version
    c.stop()
    c2 = Collector(settings)
    c2.start(with_sources=False, with_spark=False)
    assert [(q.name, s) for q, s in c2.queries()] == [("udp_bw", 0), ("dns_resp", 2),
                                                      ("extra", 3)]
    assert c2.plan.version == version + 1
    c2.stop()


def test_exporters_of_a_flow_listener(tmp_path):
    """GET /exporters: templates, sampling, sequence loss and last seen of what a netflow source
    received over UDP (no Spark); the decoder's counters reach /metrics."""
    import socket
    import time

    from collector.config import SourceConfig
    from tests.flowtools import HEX, read_hex
    src = SourceConfig(type="netflow", name="nf", listen=["127.0.0.1:0"],
                       sampling={"127.0.0.1": 10})
    c = Collector(load_settings(var_dir=tmp_path / "var", sources=[src]))
    c.start(with_sources=True, with_spark=False)
    try:
        deadline = time.monotonic() + 120  # bounds a hang; the loops end on their condition
        while not c.sources[0].listener.bound and time.monotonic() < deadline:
            time.sleep(0.05)
        dest = c.sources[0].listener.bound[0]
        tpl = read_hex(HEX / "PACKET_V9_TEMPLATE.hex")
        data = read_hex(HEX / "PACKETS_V9.hex")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for p in tpl + data[:1] + data[2:] + [b"\xff" * 21]:
                s.sendto(p, dest)
        with TestClient(create_app(c)) as client:
            bad = 'flowsieve_decode_errors_total{reason="unknown_version",source="nf"} 1.0'
            while time.monotonic() < deadline:  # the bad datagram, sent last, may lag the records
                ex = client.get("/exporters").json()
                if ex and ex[0]["streams"][0]["records"] == 32 \
                        and bad in client.get("/metrics").text:
                    break
                time.sleep(0.1)
            assert len(ex) == 1 and ex[0]["exporter"] == "127.0.0.1"
            st = ex[0]["streams"][0]
            assert st["version"] == 9 and st["templates"] == [1024, 2048]
            assert st["sampling_override"] == 10
            seqs = [int.from_bytes(p[12:16], "big") for p in tpl + data[:1] + data[2:]]
            lost = sum(b - a - 1 for a, b in zip(seqs, seqs[1:], strict=False) if b > a + 1)
            assert st["sequence"]["lost"] == lost >= 1
            assert ex[0]["last_seen"] > time.time() - 60
            text = client.get("/metrics").text
            assert bad in text
            assert 'flowsieve_flows_in_total{source="nf"} 32.0' in text
        # templates were saved under var/ for the next start
        assert (tmp_path / "var" / "flow-templates-nf.json").exists()
    finally:
        c.stop()


def test_bad_queries_get_reasons_not_internals(client):
    """Found by trying: each bad registration answers 422 with a reason a person can act on,
    a line and a column; never a 500, sqlglot's class names, or the request echoed back."""
    def reject(sql: str) -> dict:
        r = client.post("/queries", json={"name": "x", "sql": sql})
        assert r.status_code == 422, r.text
        return r.json()  # problem details: reason, line and column beside the message

    d = reject("SELEC * FROM packets")
    assert (d["line"], d["column"]) == (1, 1) and "starts with SELECT, not 'SELEC'" in d["reason"]
    d = reject("SELECT ts FROM packets WHERE protocol = ")
    assert "'=' lacks its right-hand side" in d["reason"] and "sqlglot" not in d["reason"]
    d = reject("SELECT ts FROM packets;\nSELECT ts FROM packets")
    assert (d["line"], d["column"]) == (2, 1) and "one statement per query" in d["reason"]
    conds = " AND ".join(["protocol = 6"] * 1000)
    d = reject(f"SELECT ts FROM packets WHERE {conds}")
    assert "1000 conditions" in d["reason"] and "at most 256" in d["reason"]
    assert d["column"] == len("SELECT ts FROM packets WHERE ") + 256 * 17 + 1
    # a body pydantic refuses: the reply says where and why, and does not echo it back
    r = client.post("/queries", json={"name": "x", "sql": "S" * 500_000})
    assert r.status_code == 422
    assert len(r.content) < 1000 and r.json()["errors"][0]["loc"] == ["body", "sql"]
    # past api.max_body_bytes (1 MiB) the body is not read at all
    r = client.post("/queries", json={"name": "x", "sql": "S" * 5_000_000})
    assert r.status_code == 413 and len(r.content) < 1000
    assert r.headers["content-type"] == "application/problem+json"


def test_prefilter_shows_the_residual_order(tmp_path):
    """GET /prefilter says in which order each engine runs its residual predicates, how often
    the order changed and how the value cache does."""
    from capture.pcap import open_capture
    from tests.helpers import capture
    c = Collector(load_settings(var_dir=tmp_path / "var", initial_queries=None))
    c.start(with_sources=False, with_spark=False)
    try:
        c.register("wiki", "SELECT ts FROM packets WHERE regexp(dns_qname, 'wiki') AND "
                           "regexp(dns_qname, 'org$')")
        for raw in open_capture(capture("wikipedia.pcap"), batch_size=256):
            c.engines[0].process(raw, "sample")
        with TestClient(create_app(c)) as client:
            runtime = client.get("/prefilter").json()["residual_runtime"]
            metrics = client.get("/metrics").text
    finally:
        c.stop()
    assert len(runtime) == 1 and runtime[0]["ordering"] == "a-greedy"
    assert sorted(runtime[0]["order"]) == ["regexp(dns_qname, 'org$')",
                                           "regexp(dns_qname, 'wiki')"]
    assert runtime[0]["cache_hits"] + runtime[0]["cache_misses"] > 0
    assert 'flowsieve_residual_cache_lookups_total{result="miss",stream="packets"}' in metrics


def test_prefilter_shows_om_charts_and_user_predicates_register(tmp_path):
    """An aggregate query's node has an OM chart in the plan and a running plan, estimates and
    counters in ``om_runtime`` and the metrics; a query calling a configured user predicate
    registers, one calling an unknown one is refused with its line and column."""
    from capture.pcap import open_capture
    from tests.helpers import capture
    c = Collector(load_settings(var_dir=tmp_path / "var", initial_queries=None, predicates={
        "is_private": "tests.collector.pipeline.user_predicates:is_private"}))
    c.start(with_sources=False, with_spark=False)
    try:
        c.register("private", "SELECT time/60 AS t, src_ip, count(*) AS n FROM packets WHERE "
                              "is_private(src_ip) GROUP BY time/60, src_ip")
        for raw in open_capture(capture("ok.pcap"), batch_size=64):
            c.engines[0].process(raw, "sample")
        with TestClient(create_app(c)) as client:
            doc = client.get("/prefilter").json()
            metrics = client.get("/metrics").text
            r = client.post("/queries", json={"name": "bad", "sql": "SELECT ts FROM packets\n"
                                              "WHERE protocol = 6 AND nope(src_ip)"})
    finally:
        c.stop()
    (tree,) = doc["aggregate_trees"]
    (chart,) = tree["charts"]
    # 60 s windows under a 1 s watermark: window-flushed tables only (planner/plan.py)
    assert chart["k"] == 10 and len(chart["grid"]) == 10 and chart["plans"] == [
        "table 4096/window", "table 65536/window", "table 1048576/window"]
    (node,) = doc["om_runtime"]
    assert node["plan"] in chart["plans"] and node["plan"] == "table 65536/window"
    assert {"selectivity", "lambda", "rounds", "fidelity", "moves", "switches"} <= set(node)
    labels = f'node="{node["node"]}",plan="{node["plan"]}",stream="packets"'
    assert f"flowsieve_om_plan{{{labels}}} 1.0" in metrics
    assert 'flowsieve_residual_position{predicate="is_private(src_ip)",stream="packets"} 0.0' \
        in metrics
    assert r.status_code == 422 and (r.json()["line"], r.json()["column"]) == (2, 24)
    assert "unknown function nope()" in r.json()["reason"]
