"""Crash anywhere, come back by itself (issue 48): the daemon is stopped at each of its durable
steps by name (collector/crashpoints.py: ``FLOWSIEVE_CRASH=<point>:<n>``), at the first time it
reaches it and at a later one — a spool file written, renamed, a source's position committed,
its held files published, its LFTA snapshot; an answer part written, renamed; a query
registered; a window's alerts committed to the outbox, notifications sent and not yet marked;
the Spark JVM's offset, file-source, commit and state-store logs (seen in the checkpoint with
inotify). Each time the daemon, its JVM and their workers die together with
SIGKILL (``:jvm``: the JVM alone, and the daemon starts a new one while readiness says 503,
never 500). After each crash every window answered so far, read from the results folder, equals
dpkt's count of the capture, and no window is answered twice; a new daemon (with the next point
armed) starts by itself — no person clears anything — and at the end every window of the
whole capture is answered exactly, every packet counted once, and the webhook has heard every
alert the daemon holds (fired, resolved), a notification sent again only with its own
idempotency key and body.

The chains are the long lane's (``make test-long``, which ``.ci/run`` calls after ``make test``;
``make crash-matrix`` alone): the whole matrix (``FLOWSIEVE_CRASH_MATRIX=all``); a plain pytest
of this file walks a sample (``SAMPLE``)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from collector.crashpoints import JVM_POINTS, POINTS
from tests.processes import (
    PERIOD,
    Feeder,
    Receiver,
    daemon_config,
    metric,
    no_server_errors,
    start_daemon,
    stop_and_drain,
    stop_daemon,
    wait_for,
)
from tests.windows import QUERIES, check, check_whole

pytestmark = pytest.mark.slow

REGISTERED = {  # registered over REST by the registry's later crash (the second one dies)
    "tcp5s": "SELECT time/5 AS t, count(*) AS n FROM packets WHERE protocol = 6 GROUP BY time/5",
    "big5s": "SELECT time/5 AS t, count(*) AS n FROM packets WHERE caplen > 100 "
             "GROUP BY time/5",
}

# a later hit of each point: a batch or commit after the first few (the state store writes a
# file per operator and partition: four a batch here)
LATER = {"spool.write": 12, "spool.rename": 12, "spark.state": 9, "registry.update": 2}
POINTS_ALL = [*POINTS, *JVM_POINTS]


def matrix() -> list[list[str]]:
    """Every point at its first hit and a later one (and the JVM's alone at its first), in
    four chains; a chain starts from an empty var folder."""
    steps = [f"{p}:{n}" for p in POINTS_ALL for n in (1, LATER.get(p, 3))]
    steps += [f"{p}:1:jvm" for p in JVM_POINTS]
    # the registry's first hit is the initial queries' load: only a fresh var folder has it
    first = [s for s in steps if s == "registry.update:1"]
    rest = [s for s in steps if s != "registry.update:1"]
    chains = [rest[i::4] for i in range(4)]
    chains[0] = first + chains[0]
    return chains


# a plain pytest of this file: the JVM alone at its first offset log (the first-batch hole),
# the whole daemon as a position is committed, as an answer part is renamed in a later batch,
# and as alerts were sent but not yet marked delivered
SAMPLE = [["spark.offsets:1:jvm", "position.commit:2", "results.rename:3", "alerts.send:2"]]
_CHOSEN = os.environ.get("FLOWSIEVE_CRASH_MATRIX", "")  # "all", or one chain: "p:n,p:n"
CHAINS = matrix() if _CHOSEN == "all" else [_CHOSEN.split(",")] if _CHOSEN else SAMPLE


def test_matrix_covers_every_point():
    walked = {s.split(":")[0] for chain in matrix() for s in chain}
    assert walked == set(POINTS_ALL)
    assert sum(len(c) for c in matrix()) == 2 * len(POINTS_ALL) + len(JVM_POINTS)


def run_chain(tmp_path: Path, chain: list[str]) -> None:
    # udp_src alerts for every UDP source, to a webhook (alerts.apply, alerts.send)
    queries = QUERIES.replace("-- name: udp_src\n", "-- name: udp_src\n"
                              "-- alert: for=1 summary=\"UDP from {src_ip}\"\n")
    cfg, port = daemon_config(tmp_path, [
        f"{{type: pcap, name: traffic, path: {tmp_path / 'traffic.pcap'}, follow: true, "
        "restamp: false}"], queries)
    # the JVM-alone crashes: the daemon starts a new JVM at once
    cfg.write_text(cfg.read_text().replace("trigger_s: 1,", "trigger_s: 1, "
                                           "restart_backoff_s: 1,"))
    hook = Receiver()
    cfg.write_text(cfg.read_text() + f"""
alerts:
  check_s: 0.5
  receivers:
    hook: {{type: webhook, url: "{hook.url}", secret: webhook-secret-0123456789,
           max_backoff_s: 1}}
""")
    results = tmp_path / "var" / "results"
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    log = open(tmp_path / "daemon.log", "a")  # noqa: SIM115 - closed in finally
    feeder = Feeder(tmp_path / "traffic.pcap", per_tick=20)
    proc = None
    try:
        feeder.start()
        for k, step in enumerate(chain):
            point, n = step.split(":")[0], int(step.split(":")[1])
            hits = tmp_path / f"hits-{k}"
            hits.mkdir()
            log.write(f"\n==== test: armed {step}\n")
            log.flush()
            proc = start_daemon(cfg, log, env={"FLOWSIEVE_CRASH": step,
                                               "FLOWSIEVE_CRASH_DIR": str(hits)})
            if point == "registry.update" and n > 1:
                wait_for(lambda: client.get("/readyz").status_code == 200, 240, "ready")
                for name, text in list(REGISTERED.items())[:n]:
                    try:
                        client.post("/queries", json={"name": name, "sql": text})
                    except httpx.HTTPError:
                        pass  # the daemon died answering: the point was after the commit
            if step.endswith(":jvm"):
                jvm_alone(client, proc)
                kill_tree(proc)  # on to the next point (a crash at no step in particular)
            else:
                try:
                    proc.wait(timeout=240)  # only a hang fails here
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"{step} was never reached") from None
                assert proc.returncode == -9, (step, proc.returncode)
            # died at that hit: the n-th hit crashes; answer tasks running at once (a
            # folder's queries on tasks of their own) may each hit the point before the kill
            # lands, so a count past n is another task's hit, never an earlier crash
            assert (hits / f"{point}.hits").stat().st_size >= n, step
            check(results, tmp_path / "traffic.pcap")
        # a daemon with nothing armed: two whole windows after it is ready, then the end
        proc = start_daemon(cfg, log)
        wait_for(lambda: client.get("/readyz").status_code == 200, 240, "ready")
        if any(s.startswith("registry.update") for s in chain):
            names = {q["name"] for q in client.get("/queries").json()}
            assert {"all5s", "udp_src"} <= names  # the initial load resumed
            if any(s == "registry.update:2" for s in chain):
                assert set(REGISTERED) <= names  # both committed before the crash
        time.sleep(2 * PERIOD + 1)
        stop_and_drain(feeder, client, "all5s")
        wait_for(lambda: metric(client.get("/metrics").text, "flowsieve_alert_outbox",
                                'receiver="hook"') == 0 and hook.got, 120,
                 "every alert delivered")
        held = client.get("/alerts", params={"state": "all", "limit": 1000}).json()["alerts"]
        stop_daemon(proc)
    finally:
        feeder.stop.set()
        client.close()
        if proc is not None:
            stop_daemon(proc)
        log.close()
        hook.close()
    check_whole(results, tmp_path / "traffic.pcap", feeder.written)
    no_server_errors(tmp_path / "daemon.log")  # through every crash and restart
    # alerts: every one the daemon holds was heard in its state; a repeat is the same
    heard = {(e["key"]["src_ip"], e["state"]) for e in hook.events()}
    firing = [a for a in held if a["state"] in ("firing", "resolved")]
    assert firing and all((a["key"][0], a["state"]) in heard for a in firing), (firing, heard)
    # nothing half-written is left in the spool (a crash's temporary files are swept)
    assert not list((tmp_path / "var" / "spool").rglob("*.tmp"))


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the daemon and its JVM together (no JVM may write the checkpoints on after
    it)."""
    jvms = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid), "java"],
                                           capture_output=True, text=True).stdout.split()]
    for pid in jvms:
        os.kill(pid, signal.SIGKILL)
    proc.kill()
    proc.wait()


def jvm_alone(client: httpx.Client, proc: subprocess.Popen) -> None:
    """The JVM died alone: from then until Spark runs again readiness says no (503, with
    why: killed), never fails (500), and liveness stays 200."""
    ready, live, said = [], [], set()
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the daemon died with its JVM"
        try:
            r = client.get("/readyz")
            ready.append(r.status_code)
            said.add("it was killed (SIGKILL" in r.text)
            live.append(client.get("/healthz").status_code)
            if ready[-1] == 200 and metric(client.get("/metrics").text,
                                           "flowsieve_spark_jvm_restarts_total") == 1:
                break
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.05)
    assert ready and ready[-1] == 200, "Spark again"
    assert set(ready) <= {200, 503} and set(live) == {200}, Counter(ready)
    assert True in said  # while a new JVM starts, readiness says how the last one died


@pytest.mark.long
@pytest.mark.parametrize("chain", CHAINS, ids=[",".join(c) for c in CHAINS])
def test_crash_at_each_durable_step(tmp_path, chain):
    run_chain(tmp_path, chain)
