"""Alerts from answer rows: rules (the queries file's directive, REST), the lifecycle over
closed windows (pending, firing, resolved once), a durable outbox delivered in order to a real
HTTP webhook that fails at first (retries, HMAC signature, each notification once), and a
restart that forgets nothing. Answers are written as Spark's answer task writes them."""

from __future__ import annotations

import hashlib
import hmac
import json
import time

import pyarrow as pa
import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest

from api.app import create_app
from collector.config import load_settings
from collector.daemon.alerts.rules import AlertRule, check_rule, key_columns, parse_directive
from collector.daemon.service import Collector
from collector.spark.answers import answer_schema
from collector.spark.write import PartWriter
from planner.ir import QueryError
from planner.query import parse_queries, parse_single
from tests.processes import Receiver, metric, start_alertmanager, wait_until

T0 = 1_700_000_040  # a minute boundary
SECRET = "webhook-secret-0123456789"
SQL = ("SELECT time/60 AS t, dst_ip, count(*) AS syns FROM packets WHERE protocol = 6 "
       "GROUP BY time/60, dst_ip HAVING count(*) > 100")


def write_window(root, query, w: int, rows: list[tuple[str, int]]) -> None:
    """Window ``w`` (minutes after T0) of the query's answer: (dst_ip, syns) rows."""
    start = (T0 + 60 * w) * 1_000_000
    n = len(rows)
    cols = {"t": pa.array([(T0 + 60 * w) // 60] * n, pa.int64()),
            "dst_ip": pa.array([r[0] for r in rows], pa.string()),
            "syns": pa.array([r[1] for r in rows], pa.int64()),
            "window_start": pa.array([start] * n, pa.timestamp("us", tz="UTC")),
            "window_end": pa.array([start + 60_000_000] * n, pa.timestamp("us", tz="UTC"))}
    schema = answer_schema(query)
    table = pa.Table.from_arrays([cols[f.name].cast(f.type) for f in schema], schema=schema)
    writer = PartWriter(root, query.name, f"part-run-{w:08d}.parquet", schema)
    writer.write(table)
    writer.close()


def collector(tmp_path, receiver_url: str, **alerts) -> Collector:
    c = Collector(load_settings(var_dir=tmp_path / "var", initial_queries=None, alerts={
        "receivers": {"hook": {"type": "webhook", "url": receiver_url, "secret": SECRET,
                               "timeout_s": 2, "max_backoff_s": 0.2}}, **alerts}))
    c.start(with_sources=False, with_spark=False)
    return c


def closed_until(c: Collector, w: int) -> None:
    """Spark's watermark: every window before minute ``w`` is answered for good."""
    c.alerts.complete_before = lambda q: T0 + 60 * w


def bodies(rec: Receiver) -> list[dict]:
    return [json.loads(b) for b, _ in rec.got]


def test_the_directive_and_the_rules_checks():
    qs = parse_queries(f"""-- name: syn
-- alert: severity=critical for=2 receivers=hook summary="{{syns}} to {{dst_ip}}" label.team=net
{SQL};
-- name: flood
WITH syn AS (SELECT time/60 AS t, dst_ip, count(*) AS n FROM packets GROUP BY time/60, dst_ip),
     ack AS (SELECT time/60 AS t, src_ip, count(*) AS n FROM packets GROUP BY time/60, src_ip)
SELECT syn.t AS t, syn.dst_ip AS host, syn.n - coalesce(ack.n, 0) AS half_open
FROM syn LEFT JOIN ack ON syn.t = ack.t AND syn.dst_ip = ack.src_ip""")
    rule = parse_directive(qs[0].alert)
    assert rule.severity == "critical" and rule.for_windows == 2
    assert rule.summary == "{syns} to {dst_ip}" and rule.labels == {"team": "net"}
    assert check_rule(rule, qs[0], {"hook"}).keys == ["dst_ip"]
    assert key_columns(qs[1]) == ["host"]  # a join's key column, not the bucket
    assert qs[1].alert is None
    for text, why in (("for=0", "for"), ("nope=1", "unknown key"), ("severity", "key=value"),
                      ('summary="{x"', "summary")):
        with pytest.raises(QueryError, match=why):
            check_rule(parse_directive(text), qs[0], {"hook"})
    for rule, why in ((AlertRule(keys=["t"]), "time bucket"),
                      (AlertRule(summary="{nope}"), "nope"),
                      (AlertRule(receivers=["pager"]), "pager"),
                      (AlertRule(labels={"severity": "x"}), "static label")):
        with pytest.raises(QueryError, match=why):
            check_rule(rule, qs[0], {"hook"})
    with pytest.raises(QueryError, match="no receiver"):
        check_rule(AlertRule(), qs[0], set())
    with pytest.raises(QueryError, match="aggregate"):
        check_rule(AlertRule(), parse_single("SELECT ts, src_ip FROM packets"), {"hook"})


def test_lifecycle_retries_signature_and_each_notification_once(tmp_path):
    """``for: 2`` over five closed windows: 10.0.0.1 in 0-3, 10.0.0.2 in 1 only, 10.0.0.3 in
    1-2 and 4 (a gap). Firing after two windows, resolved in the first window without it,
    a one-window key never fires; the webhook fails its first 3 calls."""
    rec = Receiver(fail=3)
    c = collector(tmp_path, rec.url)
    try:
        q = c.register("syn", SQL, AlertRule(severity="critical", for_windows=2))
        root = c.settings.results_dir
        present = {0: ["10.0.0.1"], 1: ["10.0.0.1", "10.0.0.2", "10.0.0.3"],
                   2: ["10.0.0.1", "10.0.0.3"], 3: ["10.0.0.1"], 4: ["10.0.0.3"]}
        for w, hosts in present.items():
            write_window(root, q, w, [(h, 500 + w) for h in hosts])
        closed_until(c, 5)
        c.alerts.evaluate()
        now = {(a["state"], *a["key"]) for a in c.alerts.alerts()}
        # .1 fired (window 1) and resolved (4); .3 fired (2), resolved (3), is back in 4:
        # pending again, one window of its two; .2 never fired
        assert now == {("pending", "10.0.0.3"), ("resolved", "10.0.0.1"),
                       ("resolved", "10.0.0.3")}
        c.alerts.start()
        # in order: .1 fires (window 1), .3 fires (2), .3 resolves (3), .1 resolves (4)
        wait_until(lambda: len(rec.got) >= 4, "four notifications")
        time.sleep(0.3)  # nothing more comes
        got = bodies(rec)
        assert [(b["key"]["dst_ip"], b["state"], b["window_start"]) for b in got] == [
            ("10.0.0.1", "firing", "2023-11-14T22:15:00Z"),
            ("10.0.0.3", "firing", "2023-11-14T22:16:00Z"),
            ("10.0.0.3", "resolved", "2023-11-14T22:17:00Z"),
            ("10.0.0.1", "resolved", "2023-11-14T22:18:00Z")]
        assert got[0]["starts_at"] == "2023-11-14T22:14:00Z"  # its run's first window
        assert got[3]["ends_at"] == "2023-11-14T22:18:00Z"  # the end of its last window
        assert got[0]["labels"] == {"alertname": "syn", "severity": "critical",
                                    "dst_ip": "10.0.0.1"}
        assert rec.calls == 4 + 3  # three refused, then each once
        for body, headers in rec.got:  # the signature, computed independently
            want = hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
            assert headers["X-Flowsieve-Signature"] == f"sha256={want}"
            assert headers["X-Flowsieve-Idempotency-Key"] == json.loads(body)["idempotency_key"]
        assert len({b["idempotency_key"] for b in got}) == 4
        text = generate_latest(c.metrics.registry).decode()
        assert metric(text, "flowsieve_alert_notifications_total",
                      'outcome="sent",receiver="hook"') == 4
        assert metric(text, "flowsieve_alert_notifications_total",
                      'outcome="failed",receiver="hook"') == 3
        assert metric(text, "flowsieve_alerts_firing", 'query="syn"') == 0
    finally:
        c.stop()
        rec.close()


def test_a_restart_keeps_firing_alerts_and_undelivered_notifications(tmp_path):
    """The receiver is down while a window fires an alert; after a restart (the database as
    a killed daemon left it) the alert still fires, its notification is delivered with the
    same idempotency key, and the next closed window without the key resolves it."""
    down = Receiver(fail=10**9)
    c = collector(tmp_path, down.url)
    q = c.register("syn", SQL, AlertRule())
    root = c.settings.results_dir
    write_window(root, q, 0, [("192.0.2.7", 900)])
    closed_until(c, 1)
    c.alerts.evaluate()
    c.alerts.start()
    wait_until(lambda: down.calls >= 2, "attempts on the receiver that is down")
    key = c.alerts.store.pending("hook", 10)[0].idem
    c.alerts.stop()  # as a kill leaves it: nothing was delivered
    c.alerts.store.close()
    c.alerts = None
    c.registry.close()
    down.close()
    up = Receiver()
    c2 = collector(tmp_path, up.url)
    try:
        assert [a["state"] for a in c2.alerts.alerts()] == ["firing"]
        c2.alerts.start()
        wait_until(lambda: len(up.got) == 1, "the firing notification")
        assert bodies(up)[0]["idempotency_key"] == key
        write_window(root, q, 1, [])  # the next window closes without it
        closed_until(c2, 2)
        c2.alerts.evaluate()
        wait_until(lambda: len(up.got) == 2, "the resolution")
        assert bodies(up)[1]["state"] == "resolved"
        assert [a["state"] for a in c2.alerts.alerts()] == ["resolved"]
    finally:
        c2.stop()
        up.close()


def test_alert_rules_over_rest(tmp_path):
    rec = Receiver()
    c = collector(tmp_path, rec.url)
    try:
        with TestClient(create_app(c)) as client:
            r = client.post("/queries", json={"name": "syn", "sql": SQL, "alert": {
                "severity": "critical", "for": 2, "summary": "{syns} SYNs to {dst_ip}"}})
            assert r.status_code == 201, r.text
            assert r.json()["alert"]["for"] == 2 and r.json()["alert"]["keys"] == ["dst_ip"]
            r = client.post("/queries", json={"name": "bad", "sql": SQL,
                                              "alert": {"keys": ["nope"]}})
            assert r.status_code == 422 and "nope" in r.json()["detail"]
            assert client.get("/queries/bad").status_code == 404  # nothing was registered
            # the directive in the SQL text itself
            r = client.post("/queries", json={"name": "by_text", "sql":
                                              "-- alert: severity=info\n" + SQL})
            assert r.status_code == 201 and r.json()["alert"]["severity"] == "info"
            r = client.patch("/queries/syn", json={"alert": {"severity": "warning"}})
            assert r.status_code == 200 and r.json()["alert"]["severity"] == "warning"
            assert client.patch("/queries/syn", json={"alert": None}).json()["alert"] is None
            r = client.patch("/queries/syn", json={"alert": {"summary": "{x}"}})
            assert r.status_code == 422
            r = client.get("/alerts")
            assert r.status_code == 200 and r.json() == {"alerts": [], "next_cursor": None}
    finally:
        c.stop()
        rec.close()


@pytest.fixture
def alertmanager(tmp_path):
    hook = Receiver()
    base, proc = start_alertmanager(tmp_path, hook.url, ["alertname", "dst_ip"])
    try:
        yield base, hook
    finally:
        proc.terminate()
        proc.wait(10)
        hook.close()


def test_alertmanager_receives_firing_then_resolved(tmp_path, alertmanager):
    """Through Alertmanager's v2 API: the attack keys as alerts with their labels and a
    generatorURL at the query's results while they fire; then, in the first closed window
    without them, resolved (its own webhook says so)."""
    import httpx
    base, hook = alertmanager
    c = Collector(load_settings(var_dir=tmp_path / "var", initial_queries=None, api={
        "port": 8181}, alerts={"receivers": {"am": {"type": "alertmanager", "url": base}}}))
    c.start(with_sources=False, with_spark=False)
    try:
        q = c.register("syn", SQL, AlertRule(severity="critical", labels={"team": "net"}))
        root = c.settings.results_dir
        write_window(root, q, 0, [("198.51.100.1", 900), ("198.51.100.2", 1200)])
        closed_until(c, 1)
        c.alerts.evaluate()
        c.alerts.start()

        def active() -> list[dict]:
            return [a for a in httpx.get(base + "/api/v2/alerts", timeout=5).json()
                    if a["status"]["state"] == "active"]
        wait_until(lambda: len(active()) == 2, "two alerts in Alertmanager")
        got = sorted(active(), key=lambda a: a["labels"]["dst_ip"])
        assert [a["labels"] for a in got] == [
            {"alertname": "syn", "severity": "critical", "team": "net", "dst_ip": ip}
            for ip in ("198.51.100.1", "198.51.100.2")]
        assert got[0]["startsAt"].startswith("2023-11-14T22:14:00")
        assert got[0]["generatorURL"] == "http://127.0.0.1:8181/queries/syn/results"
        assert json.loads(got[1]["annotations"]["row"])["syns"] == 1200
        write_window(root, q, 1, [("198.51.100.2", 1300)])  # .1's attack ended
        closed_until(c, 2)
        c.alerts.evaluate()
        wait_until(lambda: [a["labels"]["dst_ip"] for a in active()] == ["198.51.100.2"],
             "198.51.100.1 resolved in Alertmanager")
        wait_until(lambda: any(json.loads(b)["status"] == "resolved" for b, _ in hook.got),
             "Alertmanager's own resolved notification")
        resolved = [a for b, _ in hook.got for a in json.loads(b)["alerts"]
                    if a["status"] == "resolved"]
        assert {a["labels"]["dst_ip"] for a in resolved} == {"198.51.100.1"}
        assert resolved[0]["endsAt"].startswith("2023-11-14T22:15:00")
    finally:
        c.stop()


def test_a_receiver_that_never_answers_stalls_nothing(tmp_path):
    """A receiver accepts connections and never answers: evaluation goes on undisturbed (the
    windows keep being read), its outbox stays within max_pending and counts what it drops."""
    import socket
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(100)  # accepts (the kernel does), never reads, never answers
    c = Collector(load_settings(var_dir=tmp_path / "var", initial_queries=None, alerts={
        "receivers": {"slow": {"type": "webhook",
                               "url": f"http://127.0.0.1:{silent.getsockname()[1]}/",
                               "timeout_s": 0.5, "max_pending": 50, "max_backoff_s": 0.2}}}))
    c.start(with_sources=False, with_spark=False)
    try:
        q = c.register("syn", SQL, AlertRule())
        root = c.settings.results_dir
        c.alerts.start()
        for w in range(6):  # 40 new hosts a window: each window fires 40, resolves 40
            write_window(root, q, w, [(f"10.{w}.0.{i}", 500) for i in range(40)])
            closed_until(c, w + 1)
            t0 = time.monotonic()
            c.alerts.evaluate()
            assert time.monotonic() - t0 < 10  # never waits for the receiver
            assert c.alerts.store.outbox_size("slow") <= 50
        text = generate_latest(c.metrics.registry).decode()
        dropped = metric(text, "flowsieve_alert_notifications_total",
                         'outcome="dropped",receiver="slow"')
        # 6 x 40 firing + 5 x 40 resolved made; at most 50 kept (one may be in flight)
        assert dropped >= 440 - 50 - 1
        assert metric(text, "flowsieve_alerts_firing", 'query="syn"') == 40
    finally:
        c.stop()
        silent.close()


def test_the_readme_example_is_a_valid_rule():
    from tests.helpers import ROOT
    readme = (ROOT / "README.md").read_text()
    part = readme[readme.index("### Alerts"):]
    sql = part[part.index("```sql\n") + 7:]
    sql = sql[:sql.index("```")]
    (q,) = parse_queries(sql)
    rule = check_rule(parse_directive(q.alert), q, {"am", "ops"})
    assert (q.name, rule.severity, rule.keys, rule.receivers) == ("syn_flood", "critical",
                                                                 ["host"], ["am"])


def test_each_part_footer_is_read_once(tmp_path, monkeypatch):
    """A query keeps a part per answer job (months of them under retention): evaluation reads
    the footer of a part only when it is new or replaced."""
    import collector.daemon.alerts.service as service
    rec = Receiver()
    c = collector(tmp_path, rec.url)
    read: list[str] = []
    real = service.file_pieces
    monkeypatch.setattr(service, "file_pieces",
                        lambda path, q: read.append(path.name) or real(path, q))
    try:
        q = c.register("syn", SQL, AlertRule())
        root = c.settings.results_dir
        for w in range(3):
            write_window(root, q, w, [("192.0.2.1", 500)])
        closed_until(c, 3)
        c.alerts.evaluate()
        assert sorted(read) == [f"part-run-{w:08d}.parquet" for w in range(3)]
        read.clear()
        write_window(root, q, 3, [("192.0.2.1", 500)])
        closed_until(c, 4)
        c.alerts.evaluate()
        assert read == ["part-run-00000003.parquet"]
        assert [a["state"] for a in c.alerts.alerts()] == ["firing"]
    finally:
        c.stop()
        rec.close()
