"""Alerts end to end: `flowsieve run` follows a capture growing in real time into which SYN
floods are injected at known hosts, with a rule sending to a real Alertmanager and to a
webhook. Alertmanager shows exactly the attacked hosts as alerts with their labels; the daemon
is killed (SIGKILL) while they fire and started again: they stay firing (never fired twice),
the next attack joins them, and once the attacks end both are resolved in Alertmanager. Every
repeat the webhook sees carries the same idempotency key."""

from __future__ import annotations

import json
import signal
import subprocess
import threading

import dpkt
import httpx
import pytest

from tests.processes import (
    Feeder,
    Receiver,
    daemon_config,
    start_alertmanager,
    start_daemon,
    stop_daemon,
    wait_for,
)

pytestmark = pytest.mark.slow

SECRET = "webhook-secret-0123456789"
QUERIES = """
-- name: syn5s
-- alert: severity=critical for=2 summary="SYN flood on {dst_ip}: {syns} SYNs" label.team=noc
SELECT time/5 AS t, dst_ip, count(*) AS syns FROM packets
WHERE protocol = 6 AND (tcp_flags & 18) = 2
GROUP BY time/5, dst_ip HAVING count(*) > 50
"""
A, B = "203.0.113.7", "203.0.113.9"


def syn(dst: str, i: int) -> bytes:
    """A SYN to ``dst`` port 80 from one of 250 sources."""
    tcp = dpkt.tcp.TCP(sport=1024 + i, dport=80, flags=dpkt.tcp.TH_SYN, seq=i)
    ip = dpkt.ip.IP(src=bytes([198, 18, 0, i % 250 + 1]), dst=bytes(map(int, dst.split("."))),
                    p=dpkt.ip.IP_PROTO_TCP, data=tcp, ttl=64)
    ip.len = len(ip)
    return bytes(dpkt.ethernet.Ethernet(src=b"\x02" * 6, dst=b"\x04" * 6, data=ip,
                                        type=dpkt.ethernet.ETH_TYPE_IP))


def test_attacks_fire_in_alertmanager_survive_a_kill_and_resolve(tmp_path):
    hook, am_hook = Receiver(), Receiver()
    am, am_proc = start_alertmanager(tmp_path, am_hook.url, ["alertname", "dst_ip"])
    targets: set[str] = set()
    lock = threading.Lock()

    def attack() -> list[bytes]:  # 30 SYNs a tick (0.2 s) to each target: 750 a window
        with lock:
            return [syn(dst, i) for dst in sorted(targets) for i in range(30)]
    cfg, port = daemon_config(tmp_path, [
        f"{{type: pcap, name: wire, path: {tmp_path / 'wire.pcap'}, follow: true}}"], QUERIES)
    cfg.write_text(cfg.read_text() + f"""
alerts:
  check_s: 0.5
  receivers:
    am: {{type: alertmanager, url: "{am}", resend_s: 5}}
    hook: {{type: webhook, url: "{hook.url}", secret: {SECRET}, max_backoff_s: 1}}
""")
    feeder = Feeder(tmp_path / "wire.pcap", per_tick=20, inject=attack)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    log = open(tmp_path / "daemon.log", "a")

    def start() -> subprocess.Popen:
        proc = start_daemon(cfg, log)
        wait_for(lambda: client.get("/readyz").status_code == 200, 240, "the daemon ready")
        return proc

    def firing() -> list[dict]:
        return sorted((a for a in httpx.get(am + "/api/v2/alerts", timeout=5).json()
                       if a["status"]["state"] == "active"), key=lambda a: a["labels"]["dst_ip"])

    def hosts() -> list[str]:
        return [a["labels"]["dst_ip"] for a in firing()]
    proc = None
    try:
        feeder.start()
        proc = start()
        with lock:
            targets.add(A)
        wait_for(lambda: hosts() == [A], 120, "the attack on A in Alertmanager")
        got = firing()[0]
        assert got["labels"] == {"alertname": "syn5s", "severity": "critical", "team": "noc",
                                 "dst_ip": A}
        assert got["annotations"]["summary"].startswith(f"SYN flood on {A}: ")
        assert got["generatorURL"].endswith("/queries/syn5s/results")
        # killed while A fires; the capture keeps growing meanwhile
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc = start()
        with lock:
            targets.add(B)
        wait_for(lambda: hosts() == [A, B], 120, "the attack on B joining A")
        with lock:
            targets.clear()
        wait_for(lambda: hosts() == [], 120, "both resolved in Alertmanager")
        wait_for(lambda: {(a["labels"]["dst_ip"], a["status"]) for b, _ in am_hook.got
                          for a in json.loads(b)["alerts"]} >= {(A, "resolved"),
                                                                  (B, "resolved")},
                 60, "Alertmanager's resolved notifications")
        wait_for(lambda: sum(json.loads(b)["state"] == "resolved" for b, _ in hook.got) >= 2,
                 60, "the webhook's resolutions")
        alerts = client.get("/alerts", params={"state": "resolved"}).json()["alerts"]
        assert sorted(a["key"] for a in alerts) == [[A], [B]]
    finally:
        feeder.stop.set()
        client.close()
        if proc is not None:
            stop_daemon(proc)
        log.close()
        am_proc.terminate()
        am_proc.wait(10)
        hook.close()
        am_hook.close()
    # the webhook: A fired once (the kill did not fire it again) and resolved once, so did B;
    # whatever came twice came with the same idempotency key and the same body
    kinds: dict[tuple[str, str], set[str]] = {}
    for event in hook.events():
        kinds.setdefault((event["key"]["dst_ip"], event["state"]), set()).add(
            event["idempotency_key"])
    assert {k: len(v) for k, v in kinds.items()} == {(A, "firing"): 1, (A, "resolved"): 1,
                                                      (B, "firing"): 1, (B, "resolved"): 1}
