"""Cluster mode (issue 13), started with README's commands: a Spark master and two workers, one
of them in a network namespace that reaches the driver over a veth pair (nothing can lean on
127.0.0.1); a control plane (``role: all``, no source) running the Spark job on that cluster;
two capture probes (``role: capture``) following their own growing captures into one spool and
running the queries the control plane publishes there. Every whole window's answers equal a
``local[*]`` replay of the two captures merged; both workers ran executors, the answer jobs'
tasks ran on both (Spark's event log) and wrote the results files; a query deleted at
the control plane gives its slot back once both probes run without it; a probe refuses to
register queries, and a daemon refuses to start under a probe name in use."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time

import httpx
import pyarrow.parquet as pq
import pytest

from collector.config import Settings
from collector.replay import replay
from planner.query import parse_single
from tests.conftest import ROOT, need
from tests.reference import rows_of
from tests.test_daemon import free_port, wait_for
from tests.test_hot_swap import PERIOD, Feeder, answers, whole_windows

pytestmark = pytest.mark.slow

QUERIES = {
    "all5s": "SELECT time/5 AS t, count(*) AS n, sum(wirelen) AS b FROM packets GROUP BY time/5",
    "udp_src": "SELECT time/5 AS t, src_ip, count(*) AS n FROM packets WHERE protocol = 17 "
               "GROUP BY time/5, src_ip",
    "tcp_low": "SELECT time/5 AS t, dst_port, count(*) AS n, max(wirelen) AS m FROM packets "
               "WHERE protocol = 6 AND dst_port < 1024 GROUP BY time/5, dst_port",
}
GONE = "SELECT time/5 AS t, count(*) AS n FROM packets WHERE dst_port = 53 GROUP BY time/5"


def readme_commands() -> list[str]:
    """The commands of README's cluster guide (its ``sh`` block)."""
    section = (ROOT / "README.md").read_text().split("## On a cluster", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


def stale_namespaces() -> None:
    """Remove the namespaces and veth pairs of earlier runs whose process is gone (a killed run
    leaves its address on a host link, and the kernel would route this run's replies there)."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for ns in names:
        m = re.fullmatch(r"fsc(\d+)", ns)
        if m and not os.path.exists(f"/proc/{m[1]}"):
            subprocess.run(["ip", "link", "del", f"{ns}a"], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def free_subnet() -> tuple[str, str]:
    """Two addresses of a /30 that no link of this host uses or routes."""
    taken = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True,
                           text=True).stdout
    for third in range(7, 256):
        if f"10.213.{third}." not in taken:
            return f"10.213.{third}.1", f"10.213.{third}.2"
    raise AssertionError("no free /30 in 10.213.0.0/16")


@pytest.fixture
def netns():
    """A network namespace joined to this host by a veth pair: (namespace, the address here,
    the address there)."""
    need(os.geteuid() == 0 and shutil.which("ip") is not None,
         "the cluster test needs root and iproute2 (ip netns, veth)")
    stale_namespaces()
    host, peer = free_subnet()
    ns, here, there = f"fsc{os.getpid()}", f"fsc{os.getpid()}a", f"fsc{os.getpid()}b"
    sh("ip", "netns", "add", ns)
    try:
        sh("ip", "link", "add", here, "type", "veth", "peer", "name", there)
        sh("ip", "link", "set", there, "netns", ns)
        sh("ip", "addr", "add", f"{host}/30", "dev", here)
        sh("ip", "link", "set", here, "up")
        for cmd in (["ip", "addr", "add", f"{peer}/30", "dev", there],
                    ["ip", "link", "set", there, "up"], ["ip", "link", "set", "lo", "up"]):
            sh("ip", "netns", "exec", ns, *cmd)
        yield ns, host, peer
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def answer_task_hosts(events) -> dict[int, str]:
    """From Spark's event log: every task of the answer jobs (their description) by task id,
    with the host of the executor that ran it."""
    stages, hosts = set(), {}
    for log in (p for p in events.rglob("*") if p.is_file() and not p.name.startswith(".")):
        for line in log.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:  # the last line of a log its JVM was still writing
                continue
            if e["Event"] == "SparkListenerJobStart" and (e.get("Properties") or {}).get(
                    "spark.job.description", "").startswith("flowsieve answers"):
                stages.update(e["Stage IDs"])
            elif e["Event"] == "SparkListenerTaskEnd" and e["Stage ID"] in stages:
                hosts[e["Task Info"]["Task ID"]] = e["Task Info"]["Host"]
    return hosts


def merge_pcaps(paths, out) -> None:
    """The records of several classic pcap files (one link type) in time order."""
    records = []
    header = None
    for path in paths:
        data = path.read_bytes()
        header = header or data[:24]
        pos = 24
        while pos + 16 <= len(data):
            sec, usec, incl, _ = struct.unpack_from("<IIII", data, pos)
            records.append((sec, usec, data[pos:pos + 16 + incl]))
            pos += 16 + incl
    records.sort(key=lambda r: (r[0], r[1]))
    out.write_bytes(header + b"".join(r[2] for r in records))


def test_two_probes_one_spool_one_spark_cluster(tmp_path, netns, spark):
    netns, HOST, PEER = netns  # noqa: N806 (the addresses read as constants below)
    need(shutil.which("java") is not None, "Java 17 is not installed")
    bindir = os.path.dirname(sys.executable)
    base_env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "PYTHONUNBUFFERED": "1",
                "PYSPARK_PYTHON": sys.executable}
    master_cmd, worker_cmd, run_cmd = readme_commands()
    master_port, master_ui = free_port(), free_port()
    procs: list[subprocess.Popen] = []
    logs = []

    def start(name: str, cmd: str, env: dict, ns: str | None = None) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "w")
        logs.append(log)
        argv = ["bash", "-c", cmd]
        if ns is not None:
            argv = ["ip", "netns", "exec", ns, *argv]
        p = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                             env={**base_env, **env}, start_new_session=True)
        procs.append(p)
        return p

    spool, checkpoints = tmp_path / "spool", tmp_path / "checkpoints"
    results, events = tmp_path / "results", tmp_path / "events"  # shared by the workers
    events.mkdir()
    control_port = free_port()
    (tmp_path / "control.yaml").write_text(f"""
role: all
var_dir: {tmp_path / 'control'}
api: {{host: 127.0.0.1, port: {control_port}}}
spool: {{path: {spool}}}
results: {{path: {results}}}
spark:
  master: spark://{HOST}:{master_port}
  driver_memory: 1g
  shuffle_partitions: 2
  trigger_s: 1
  watermark_delay_s: {2 * PERIOD}
  checkpoint_dir: {checkpoints}
  extra: {{spark.driver.host: {HOST}, spark.driver.bindAddress: {HOST},
          spark.executor.memory: 512m, spark.executor.cores: "1", spark.cores.max: "2",
          spark.eventLog.enabled: "true", spark.eventLog.dir: "file://{events}",
          spark.eventLog.compress: "false", spark.eventLog.rolling.enabled: "false"}}
initial_queries: null
sources: []
""")
    probes = {}
    for name in ("a", "b"):
        port = free_port()
        (tmp_path / f"{name}.yaml").write_text(f"""
role: capture
probe: edge-{name}
var_dir: {tmp_path / name}
api: {{host: 127.0.0.1, port: {port}}}
spool: {{path: {spool}}}
spark: {{trigger_s: 1}}
initial_queries: null
sources:
  - {{type: pcap, name: traffic, path: {tmp_path / f'{name}.pcap'}, follow: true}}
""")
        probes[name] = (port, Feeder(tmp_path / f"{name}.pcap", per_tick=20))
    clients = {n: httpx.Client(base_url=f"http://127.0.0.1:{p}", timeout=60)
               for n, (p, _) in probes.items()}
    control = httpx.Client(base_url=f"http://127.0.0.1:{control_port}", timeout=60)
    try:
        start("master", master_cmd, {"MASTER_HOST": HOST, "MASTER_PORT": str(master_port),
                                     "WEBUI_PORT": str(master_ui), "SPARK_LOCAL_IP": HOST})
        for name, host, ns in (("worker1", HOST, None), ("worker2", PEER, netns)):
            start(name, worker_cmd, {"MASTER_HOST": HOST, "MASTER_PORT": str(master_port),
                                     "WORKER_HOST": host, "WEBUI_PORT": str(free_port()),
                                     "WORK_DIR": str(tmp_path / name), "SPARK_LOCAL_IP": host},
                  ns)

        def workers() -> list[dict]:
            r = httpx.get(f"http://{HOST}:{master_ui}/json/", timeout=10)
            try:  # a master still starting may answer before its JSON page is up
                state = r.json() if r.status_code == 200 else {}
            except ValueError:
                state = {}
            return [w for w in state.get("workers", []) if w["state"] == "ALIVE"]
        wait_for(lambda: len(workers()) == 2, 120, "two workers registered at the master")
        assert {w["host"] for w in workers()} == {HOST, PEER}
        start("control", run_cmd, {"CONFIG": str(tmp_path / "control.yaml"),
                                   "SPARK_LOCAL_IP": HOST})
        for name in probes:
            start(f"probe-{name}", run_cmd, {"CONFIG": str(tmp_path / f"{name}.yaml")})
        for c in (control, *clients.values()):
            wait_for(lambda c=c: c.get("/healthz").status_code == 200, 240, "the APIs")
        for name, sql in {**QUERIES, "gone": GONE}.items():
            r = control.post("/queries", json={"name": name, "sql": sql})
            assert r.status_code == 201, r.text
        # a second daemon under a name in use would overwrite that probe's spool files
        (tmp_path / "dup.yaml").write_text((tmp_path / "a.yaml").read_text().replace(
            str(tmp_path / "a"), str(tmp_path / "dup")).replace(
            f"port: {probes['a'][0]}", f"port: {free_port()}"))
        wait_for(lambda: (spool / "_control" / "probes" / "edge-a.json").exists(), 60,
                 "probe a's status")
        dup = subprocess.run([sys.executable, "-m", "api.cli", "run", "--config",
                              str(tmp_path / "dup.yaml")], cwd=ROOT, capture_output=True,
                             text=True, timeout=120, env=base_env)
        assert dup.returncode == 1, dup.stderr
        assert dup.stderr.startswith("error: probe name 'edge-a' is in use") and \
            dup.stderr.count("\n") == 1, dup.stderr
        refused = clients["a"].post("/queries", json={"name": "x", "sql": GONE})
        assert refused.status_code == 409 and "capture probe" in refused.json()["detail"]
        version = control.get("/healthz").json()["plan_version"]
        for c in clients.values():  # each probe runs the published plan within a tick
            wait_for(lambda c=c: c.get("/healthz").json()["plan_version"] == version, 60,
                     "a probe to take the published plan")
            assert {q["name"]: q["slot"] for q in c.get("/queries").json()} == \
                {q["name"]: q["slot"] for q in control.get("/queries").json()}
        since = time.time()
        for _, feeder in probes.values():
            feeder.start()
        target = (int(since) // PERIOD + 4) * PERIOD  # three whole windows answered

        def complete() -> float:
            return answers(control, "all5s")[1] or 0.0
        wait_for(lambda: complete() >= target, 300, f"windows before {target} answered")
        assert all(w["coresused"] == 1 for w in workers())  # an executor on each worker
        got = {n: answers(control, n) for n in QUERIES}
        # a query deleted at the control plane: its slot comes back once both probes run a
        # plan without it and Spark has read what they wrote before
        slot = next(q["slot"] for q in control.get("/queries").json() if q["name"] == "gone")
        assert control.delete("/queries/gone").status_code == 204
        r = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            r = control.post("/queries", json={"name": f"again{int(time.monotonic())}",
                                               "sql": GONE})
            assert r.status_code == 201, r.text
            if r.json()["slot"] == slot:
                break
            control.delete(f"/queries/{r.json()['name']}")
            time.sleep(2)
        assert r is not None and r.json()["slot"] == slot, "the slot never came back"
        statuses = [json.loads(p.read_text())
                    for p in sorted((spool / "_control" / "probes").glob("*.json"))]
        assert {s["probe"] for s in statuses} >= {"edge-a", "edge-b"}
    except BaseException:  # the processes' last words, shown by pytest with the failure
        for log in reversed(logs):  # the daemons first, Spark's own logs without their INFO
            log.flush()
            lines = [x for x in open(log.name, errors="replace").read().splitlines()
                     if not x.startswith("\tat ") and not re.match(r"\d\d/\d\d/\d\d .* INFO ", x)]
            sys.stdout.write("\n".join([f"==> {log.name} <==", *lines[-25:], ""]))
        raise
    finally:
        for _, feeder in probes.values():
            feeder.stop.set()
        for c in (control, *clients.values()):
            c.close()
        for p in reversed(procs):  # the daemons before the workers, the master last
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(60)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for log in logs:
            log.close()

    # Spark's event log: the answer jobs' tasks ran on both workers, and each part file of the
    # results was written by one of those tasks (its footer names it)
    hosts = answer_task_hosts(events)
    assert set(hosts.values()) == {HOST, PEER}, hosts
    writers = set()
    for part in results.glob("query=*/part-*.parquet"):
        meta = pq.read_metadata(part).metadata
        writers.add(hosts[int(meta[b"flowsieve.task"])])
    assert writers == {HOST, PEER}, writers

    # the oracle: both captures merged, replayed alone in local[*]
    merge_pcaps([tmp_path / "a.pcap", tmp_path / "b.pcap"], tmp_path / "both.pcap")
    queries = [parse_single(sql, name) for name, sql in QUERIES.items()]
    res = replay(tmp_path / "both.pcap", queries, tmp_path / "replay", spark,
                 settings=Settings(initial_queries=None, planner={"measure_tuples": 0}))
    assert res.error is None
    truth = {q.name: rows_of(q, t) for q, t in res.answers}
    for name, (rows, before) in got.items():
        want = whole_windows(truth[name], since, before)
        assert whole_windows(rows, since, before) == want, name
        assert want  # not vacuous
