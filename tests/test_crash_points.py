"""Crash anywhere, come back by itself (issue 48): the daemon is stopped at each of its durable
steps by name (collector/crashpoints.py: ``FLOWSIEVE_CRASH=<point>:<n>``), at the first time it
reaches it and at a later one — a spool file written, renamed, a source's position committed,
its held files published, its LFTA snapshot; an answer part written, renamed; a query
registered; the Spark JVM's offset, file-source, commit and state-store logs (seen in the
checkpoint with inotify). Each time the daemon, its JVM and their workers die together with
SIGKILL (``:jvm``: the JVM alone, and the daemon starts a new one while readiness says 503,
never 500). After each crash every window answered so far, read from the results folder, equals
dpkt's count of the capture, and no window is answered twice; a new daemon (with the next point
armed) starts by itself — no person clears anything — and at the end every window of the
whole capture is answered exactly, every packet counted once.

``make test`` walks a sample (``SAMPLE``); ``make crash-matrix`` (``.ci/run`` calls it too)
walks the whole matrix (``FLOWSIEVE_CRASH_MATRIX=all``)."""

from __future__ import annotations

import os
import struct
import subprocess
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest

from collector.crashpoints import JVM_POINTS, POINTS
from tests.processes import (
    PERIOD,
    Feeder,
    answers,
    daemon_config,
    metric,
    start_daemon,
    stop_daemon,
    wait_for,
)
from tests.reference import fields_of

pytestmark = pytest.mark.slow

QUERIES = """
-- name: all5s
SELECT time/5 AS t, count(*) AS n, sum(caplen) AS b FROM packets GROUP BY time/5;
-- name: udp_src
SELECT time/5 AS t, src_ip, count(*) AS n, max(caplen) AS m FROM packets
WHERE protocol = 17 GROUP BY time/5, src_ip
"""
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


# make test: the JVM alone at its first offset log (the first-batch hole), the whole daemon
# as a position is committed, and as an answer part is renamed in a later batch
SAMPLE = [["spark.offsets:1:jvm", "position.commit:2", "results.rename:3"]]
CHAINS = matrix() if os.environ.get("FLOWSIEVE_CRASH_MATRIX") == "all" else SAMPLE


def test_matrix_covers_every_point():
    walked = {s.split(":")[0] for chain in matrix() for s in chain}
    assert walked == set(POINTS_ALL)
    assert sum(len(c) for c in matrix()) == 2 * len(POINTS_ALL) + len(JVM_POINTS)


def pcap_records(path: Path) -> list[tuple[float, bytes]]:
    """The whole records of a pcap being written (a record cut short at the end is left)."""
    data = path.read_bytes()
    out, at = [], 24
    while at + 16 <= len(data):
        sec, usec, caplen, _ = struct.unpack_from("<IIII", data, at)
        if at + 16 + caplen > len(data):
            break
        out.append((sec + usec / 1e6, data[at + 16: at + 16 + caplen]))
        at += 16 + caplen
    return out


def truth(path: Path) -> dict[str, dict]:
    """dpkt's answers of the queries, per window (``t``), over the capture as it is now."""
    all5s: dict = defaultdict(lambda: [0, 0])
    udp: dict = defaultdict(lambda: [0, 0])
    for ts, buf in pcap_records(path):
        f = fields_of(ts, buf, 1)
        t = f["time"] // PERIOD
        all5s[t][0] += 1
        all5s[t][1] += f["caplen"]
        if f["protocol"] == 17 and f["src_ip"] is not None:
            u = udp[(t, f["src_ip"])]
            u[0] += 1
            u[1] = max(u[1], f["caplen"])
    by_t: dict = defaultdict(set)
    for (t, ip), (n, m) in udp.items():
        by_t[t].add((ip, n, m))
    return {"all5s": {t: {(n, b)} for t, (n, b) in all5s.items()}, "udp_src": dict(by_t)}


def answered(results: Path) -> dict[str, dict]:
    """Every window each query answered, read from its part files (each window once: a
    window in two parts is an answer doubled)."""
    out = {}
    for name, cols in (("all5s", ("n", "b")), ("udp_src", ("src_ip", "n", "m"))):
        windows: dict = {}
        where: dict = {}
        for part in sorted((results / f"query={name}").glob("part-*.parquet")):
            rows = pq.read_table(part).to_pylist()
            got: dict = defaultdict(set)
            for r in rows:
                got[r["t"]].add(tuple(r[c] for c in cols))
            for t, v in got.items():
                assert t not in windows, f"{name}: window {t} answered twice ({where[t]}, " \
                                         f"{part.name})"
                windows[t], where[t] = v, part.name
        out[name] = windows
    return out


def check(results: Path, capture: Path) -> int:
    """Every window answered so far equals the truth; how many windows all5s answered."""
    want, got = truth(capture), answered(results)
    for name in got:
        for t, rows in got[name].items():
            assert rows == want[name].get(t, set()), (name, t, rows, want[name].get(t))
    return len(got["all5s"])


def run_chain(tmp_path: Path, chain: list[str]) -> None:
    cfg, port = daemon_config(tmp_path, [
        f"{{type: pcap, name: traffic, path: {tmp_path / 'traffic.pcap'}, follow: true, "
        "restamp: false}"], QUERIES)
    # the JVM-alone crashes: the daemon starts a new JVM at once
    cfg.write_text(cfg.read_text().replace("class_archive: false", "class_archive: false, "
                                           "restart_backoff_s: 1"))
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
                stop_daemon(proc)
            else:
                try:
                    proc.wait(timeout=240)  # only a hang fails here
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"{step} was never reached") from None
                assert proc.returncode == -9, (step, proc.returncode)
            assert (hits / f"{point}.hits").stat().st_size == n, step  # died at that hit
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
        feeder.stop.set()
        feeder.join(10)
        last = (int(time.time()) // PERIOD + 1) * PERIOD
        wait_for(lambda: (answers(client, "all5s")[1] or 0) >= last, 240,
                 "every window answered")
        stop_daemon(proc)
    finally:
        feeder.stop.set()
        client.close()
        if proc is not None:
            stop_daemon(proc)
        log.close()
    windows = check(results, tmp_path / "traffic.pcap")
    got = answered(results)["all5s"]
    want = truth(tmp_path / "traffic.pcap")["all5s"]
    # every window from the first to the last one written: nothing lost
    assert windows and sorted(got) == sorted(want), (sorted(got), sorted(want))
    assert sum(n for rows in got.values() for n, _ in rows) == feeder.written


def jvm_alone(client: httpx.Client, proc: subprocess.Popen) -> None:
    """The JVM died alone: from then until Spark runs again readiness says no (503, with
    why), never fails (500), and liveness stays 200."""
    ready, live = [], []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the daemon died with its JVM"
        try:
            ready.append(client.get("/readyz").status_code)
            live.append(client.get("/healthz").status_code)
            if ready[-1] == 200 and metric(client.get("/metrics").text,
                                           "flowsieve_spark_jvm_restarts_total") == 1:
                break
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.05)
    assert ready and ready[-1] == 200, "Spark again"
    assert set(ready) <= {200, 503} and set(live) == {200}, Counter(ready)


@pytest.mark.parametrize("chain", CHAINS, ids=[",".join(c) for c in CHAINS])
def test_crash_at_each_durable_step(tmp_path, chain):
    run_chain(tmp_path, chain)
