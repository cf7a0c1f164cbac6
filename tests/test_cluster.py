"""Cluster mode (issue 13), started with README's commands: a Spark master and two workers, one
of them in a network namespace that reaches the driver over a veth pair (nothing can lean on
127.0.0.1); a control plane (``role: all``, no source) running the Spark job on that cluster;
two capture probes (``role: capture``) following their own growing captures into one spool and
running the queries the control plane publishes there. Every whole window's answers equal a
``local[*]`` replay of the two captures merged; both workers ran executors, the answer jobs'
tasks ran on both (Spark's event log) and wrote the results files; a query deleted at
the control plane gives its slot back once both probes run without it; a probe refuses to
register queries, and a daemon refuses to start under a probe name in use. With Spark's engine
answering (``spark.answer_engine: sql``) the executors need no flowsieve, numba, pandas,
pyarrow or pyspark: a daemon answers through executors whose Python has none of them."""

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

from api.replay import replay
from collector.config import Settings
from planner.query import parse_single
from tests.helpers import ROOT, need
from tests.netns import namespace
from tests.processes import (
    PERIOD,
    TEST_JVM,
    Feeder,
    answers,
    free_port,
    metric,
    wait_for,
    whole_windows,
)
from tests.reference import rows_of

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


@pytest.fixture(scope="module")
def netns():
    """A network namespace joined to this host by a veth pair: (namespace, the address here,
    the address there)."""
    with namespace("fsc", "the cluster test") as ns:
        yield ns


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


class Cluster:
    """README's standalone cluster: a master and two workers, one of them in the network
    namespace, started by ``up`` and stopped by ``close`` (once per module: the tests' daemons
    share it). A test's processes (``start``) run in their own sessions, their output in
    ``<name>.log`` of the test's folder ``here``, and are stopped by ``stop_daemons``."""

    def __init__(self, tmp_path, netns):
        self.tmp, (self.netns, self.host, self.peer) = tmp_path, netns
        self.here = tmp_path
        bindir = os.path.dirname(sys.executable)
        self.env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}",
                    "PYTHONUNBUFFERED": "1", "PYSPARK_PYTHON": sys.executable}
        self.master_cmd, self.worker_cmd, self.run_cmd = readme_commands()
        self.master_port, self.master_ui = free_port(), free_port()
        self.procs: list[subprocess.Popen] = []  # the master and the workers
        self.daemons: list[subprocess.Popen] = []  # the test's
        self.logs: list = []  # the test's
        self.cluster_logs: list = []

    def start(self, name: str, cmd: str, env: dict, ns: str | None = None) -> subprocess.Popen:
        log = open(self.here / f"{name}.log", "w")
        self.logs.append(log)
        argv = ["bash", "-c", cmd]
        if ns is not None:
            argv = ["ip", "netns", "exec", ns, *argv]
        p = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                             env={**self.env, **env}, start_new_session=True)
        self.daemons.append(p)
        return p

    def up(self) -> None:
        """The master and two workers, registered."""
        host = self.host
        self.env["SPARK_DAEMON_JAVA_OPTS"] = TEST_JVM  # the master's and workers' JVMs
        self.start("master", self.master_cmd, {
            "MASTER_HOST": host, "MASTER_PORT": str(self.master_port),
            "WEBUI_PORT": str(self.master_ui), "SPARK_LOCAL_IP": host})
        for name, where, ns in (("worker1", host, None), ("worker2", self.peer, self.netns)):
            self.start(name, self.worker_cmd, {
                "MASTER_HOST": host, "MASTER_PORT": str(self.master_port),
                "WORKER_HOST": where, "WEBUI_PORT": str(free_port()),
                "WORK_DIR": str(self.tmp / name), "SPARK_LOCAL_IP": where}, ns)
        self.procs, self.daemons = self.daemons, []
        self.cluster_logs, self.logs = self.logs, []
        wait_for(lambda: len(self.workers()) == 2, 120, "two workers registered at the master")
        assert {w["host"] for w in self.workers()} == {host, self.peer}

    def workers(self) -> list[dict]:
        r = httpx.get(f"http://{self.host}:{self.master_ui}/json/", timeout=10)
        try:  # a master still starting may answer before its JSON page is up
            state = r.json() if r.status_code == 200 else {}
        except ValueError:
            state = {}
        return [w for w in state.get("workers", []) if w["state"] == "ALIVE"]

    def control_yaml(self, port: int, results, checkpoints, events, spool=None,
                     driver_memory: str = "1g", engine: str = "python",
                     jvm: str = TEST_JVM) -> str:
        """A control plane's configuration up to its queries and sources: this cluster, an
        executor on each worker, Spark's event log in ``events``, the answers computed by
        ``engine`` (spark.answer_engine), the driver's and executors' JVM options ``jvm``
        (none: HotSpot's defaults)."""
        h = self.host
        jvm_lines = (f",\n          spark.driver.extraJavaOptions: \"{jvm}\", "
                     f"spark.executor.extraJavaOptions: \"{jvm}\"") if jvm else ""
        spool_line = f"spool: {{path: {spool}}}\n" if spool is not None else ""
        return f"""
role: all
var_dir: {self.here / 'control'}
api: {{host: 127.0.0.1, port: {port}}}
{spool_line}results: {{path: {results}}}
spark:
  master: spark://{h}:{self.master_port}
  driver_memory: {driver_memory}
  answer_engine: {engine}
  shuffle_partitions: 2
  trigger_s: 1
  watermark_delay_s: {2 * PERIOD}
  checkpoint_dir: {checkpoints}
  extra: {{spark.driver.host: {h}, spark.driver.bindAddress: {h},
          spark.executor.memory: 512m, spark.executor.cores: "1", spark.cores.max: "2",
          spark.eventLog.enabled: "true", spark.eventLog.dir: "file://{events}",
          spark.eventLog.compress: "false", spark.eventLog.rolling.enabled: "false"{jvm_lines}}}
"""

    def last_words(self) -> None:
        """The processes' last lines, shown by pytest with a failure (the daemons first,
        Spark's own logs without their INFO)."""
        for log in [*reversed(self.logs), *reversed(self.cluster_logs)]:
            log.flush()
            lines = [x for x in open(log.name, errors="replace").read().splitlines()
                     if not x.startswith("\tat ") and not re.match(r"\d\d/\d\d/\d\d .* INFO ", x)]
            sys.stdout.write("\n".join([f"==> {log.name} <==", *lines[-25:], ""]))

    def stop_daemons(self) -> None:
        """The test's processes, in reverse order; then the workers hold no application (an
        application ends once its driver is gone: the next test's gets every core)."""
        _stop(self.daemons)
        for log in self.logs:
            log.close()
        self.daemons, self.logs = [], []
        wait_for(lambda: all(w["coresused"] == 0 for w in self.workers()), 120,
                 "the workers free")

    def close(self) -> None:
        _stop(self.procs + self.daemons)  # the daemons before the workers, the master last
        for log in self.logs + self.cluster_logs:
            log.close()


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(60)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory, netns):
    need(shutil.which("java") is not None, "Java 17 is not installed")
    c = Cluster(tmp_path_factory.mktemp("cluster"), netns)
    try:
        c.up()
        yield c
    finally:
        c.close()


@pytest.fixture
def cluster(spark_cluster, tmp_path, request):
    """The module's cluster for one test: its processes' logs in the test's folder, their last
    words printed when it fails, and they are stopped after it."""
    c = spark_cluster
    c.here = tmp_path
    try:
        yield c
    finally:
        rep = getattr(request.node, "rep_call", None)
        if rep is not None and rep.failed:
            c.last_words()
        c.stop_daemons()
        c.here = c.tmp


def test_two_probes_one_spool_one_spark_cluster(tmp_path, cluster, spark):
    HOST, PEER = cluster.host, cluster.peer  # noqa: N806 (they read as constants below)
    base_env, start, workers = cluster.env, cluster.start, cluster.workers
    run_cmd = cluster.run_cmd
    spool, checkpoints = tmp_path / "spool", tmp_path / "checkpoints"
    results, events = tmp_path / "results", tmp_path / "events"  # shared by the workers
    events.mkdir()
    control_port = free_port()
    (tmp_path / "control.yaml").write_text(cluster.control_yaml(
        control_port, results, checkpoints, events, spool) + """initial_queries: null
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
    finally:
        for _, feeder in probes.values():
            feeder.stop.set()
        for c in (control, *clients.values()):
            c.close()
        cluster.stop_daemons()  # Spark's event log complete once its application ends

    # Spark's event log: the answer jobs' tasks ran on both workers, and each part file of the
    # results was written by one of those tasks (its footer names it)
    hosts = answer_task_hosts(events)
    assert set(hosts.values()) == {HOST, PEER}, hosts
    tasks = [int(pq.read_metadata(p).metadata[b"flowsieve.task"])
             for p in results.glob("query=*/part-*.parquet")]
    # every part by a task of the workers (which of them wrote which is the scheduler's
    # choice, the machine's load among its reasons); the log of the last batch may end before
    # its tasks' ends are written (the application stopped), so only most parts are found in it
    writers = {hosts[t] for t in tasks if t in hosts}
    assert writers and writers <= {HOST, PEER}, writers
    assert sum(t in hosts for t in tasks) >= len(tasks) // 2, (len(tasks), len(hosts))

    # the oracle: both captures merged, replayed alone in local[*]
    merge_pcaps([tmp_path / "a.pcap", tmp_path / "b.pcap"], tmp_path / "both.pcap")
    assert_whole_windows_replayed(spark, tmp_path / "both.pcap", QUERIES, got, since)


def assert_whole_windows_replayed(spark, capture, queries: dict[str, str], got: dict,
                                  since: float) -> None:
    """Every whole window of ``got`` (query -> its rows over REST and the time they are
    complete before) since ``since`` equals a ``local[*]`` replay of ``capture``."""
    res = replay(capture, [parse_single(sql, name) for name, sql in queries.items()],
                 capture.parent / "replay", spark,
                 settings=Settings(initial_queries=None, planner={"measure_tuples": 0}))
    assert res.error is None
    truth = {q.name: rows_of(q, t) for q, t in res.answers}
    for name, (rows, before) in got.items():
        want = whole_windows(truth[name], since, before)
        assert whole_windows(rows, since, before) == want, name
        assert want  # not vacuous


def bare_python(where) -> str:
    """A Python of this version with none of flowsieve, numba, pandas, pyarrow or pyspark (a
    virtual environment without the system's packages): the executors' Python of a cluster
    that flowsieve was never installed on."""
    home = where / "bare"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv",
                    "--without-pip", str(home)], check=True, timeout=120)
    python = str(home / "bin" / "python")
    found = subprocess.run(
        [python, "-c", "import importlib.util as u; print([m for m in ('collector', 'numba', "
         "'pandas', 'pyarrow', 'pyspark') if u.find_spec(m)])"],
        cwd=where, capture_output=True, text=True, timeout=60, env={"PATH": os.defpath})
    assert found.stdout.strip() == "[]", (found.stdout, found.stderr)
    return python


SQL_QUERIES = {
    **QUERIES,
    "top_dst": "SELECT time/5 AS t, dst_ip, count(*) AS n FROM packets GROUP BY time/5, dst_ip "
               "ORDER BY n DESC LIMIT 3",
    "tcp_srcs": "SELECT time/5 AS t, dst_port, count(DISTINCT src_ip) AS s FROM packets "
                "WHERE protocol = 6 GROUP BY time/5, dst_port",
}


def test_spark_s_engine_answers_on_workers_without_flowsieve(tmp_path, cluster, spark):
    """``spark.answer_engine: sql`` on the cluster, its executors' Python one with no
    flowsieve, numba, pandas, pyarrow or pyspark (a Python task there could not even start):
    a daemon following a growing capture answers plain, ranked and distinct-count queries on
    both workers, every whole window equal to a ``local[*]`` replay of the capture."""
    python = bare_python(tmp_path)
    results, checkpoints, events = tmp_path / "results", tmp_path / "ck", tmp_path / "events"
    events.mkdir()
    port = free_port()
    (tmp_path / "control.yaml").write_text(cluster.control_yaml(
        port, results, checkpoints, events, tmp_path / "spool", engine="sql") + f"""
initial_queries: null
sources:
  - {{type: pcap, name: traffic, path: {tmp_path / 'a.pcap'}, follow: true}}
""")
    feeder = Feeder(tmp_path / "a.pcap", per_tick=20)
    control = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    try:
        cluster.start("control", cluster.run_cmd, {
            "CONFIG": str(tmp_path / "control.yaml"), "SPARK_LOCAL_IP": cluster.host,
            "PYSPARK_PYTHON": python})
        wait_for(lambda: control.get("/healthz").status_code == 200, 240, "the API")
        for name, sql in SQL_QUERIES.items():
            r = control.post("/queries", json={"name": name, "sql": sql})
            assert r.status_code == 201, r.text
        since = time.time()
        feeder.start()
        target = (int(since) // PERIOD + 4) * PERIOD  # three whole windows answered
        wait_for(lambda: (answers(control, "all5s")[1] or 0) >= target, 300,
                 f"windows before {target} answered")
        got = {n: answers(control, n) for n in SQL_QUERIES}
    finally:
        feeder.stop.set()
        control.close()
        cluster.stop_daemons()
    hosts = answer_task_hosts(events)
    assert set(hosts.values()) == {cluster.host, cluster.peer}, hosts
    assert list(results.glob("query=*/part-*.parquet"))
    assert_whole_windows_replayed(spark, tmp_path / "a.pcap", SQL_QUERIES, got, since)


@pytest.mark.long
def test_a_window_of_four_million_groups_on_the_cluster(tmp_path, cluster, big_window):
    """A query with 4 million groups in one window (every packet its own (source,
    destination, source port)) through the daemon on the cluster, the driver at
    ``spark.driver_memory: 512m``: every group answered once by the executors, and the daemon's
    Python process never above 1 GiB resident while it does."""
    from collector.daemon.results import read_results
    from tests.helpers import BIG_WINDOW, PeakRss
    results, events = tmp_path / "results", tmp_path / "events"
    events.mkdir()
    (tmp_path / "q.sql").write_text(
        "-- name: pairs\nSELECT time/60 AS t, src_ip, dst_ip, src_port, count(*) AS n "
        "FROM packets GROUP BY time/60, src_ip, dst_ip, src_port;\n")
    port = free_port()
    (tmp_path / "control.yaml").write_text(cluster.control_yaml(
        port, results, tmp_path / "checkpoints", events, driver_memory="512m",
        jvm="") + f"""\
initial_queries: {tmp_path / 'q.sql'}
sources:
  - {{type: pcap, name: groups, path: {big_window}, loop: false, restamp: false}}
""")
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    try:
        shell = cluster.start("control", cluster.run_cmd, {
            "CONFIG": str(tmp_path / "control.yaml"), "SPARK_LOCAL_IP": cluster.host})
        rss = PeakRss(shell.pid)  # bash runs README's one command in its own process
        wait_for(lambda: metric(client.get("/metrics").text,
                                "flowsieve_query_windows_closed_total",
                                'query="pairs"') >= 1, 900, "the window answered")
        peak = rss.stop()
    finally:
        client.close()
        cluster.stop_daemons()  # Spark's event log complete once its application ends
    assert 0 < peak < 1 << 30, f"the daemon's peak RSS: {peak / 2**20:.0f} MiB"
    q = parse_single("SELECT time/60 AS t, src_ip, dst_ip, src_port, count(*) AS n "
                     "FROM packets GROUP BY time/60, src_ip, dst_ip, src_port", "pairs")
    got = read_results(results, q)
    assert got.num_rows == BIG_WINDOW
    assert got.group_by(["src_ip", "dst_ip", "src_port"]).aggregate([]).num_rows == BIG_WINDOW
    assert got.column("n").to_pylist() == [1] * BIG_WINDOW
    hosts = answer_task_hosts(events)  # Spark's executors answered and wrote it
    writers = {hosts[int(pq.read_metadata(p).metadata[b"flowsieve.task"])]
               for p in results.glob("query=pairs/part-*.parquet")}
    assert writers <= {cluster.host, cluster.peer} and writers
