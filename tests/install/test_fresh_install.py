"""CI's install lane (``make test-install``, run by ``.ci/run`` after ``make test``): the product
as a user installs it, never with the development extras that every other test has.

From a clean clone of this checkout's commit:
- ``make run``: its own install step (``pip install -e '.[live]'``, then ``flowsieve
  prepare``) and the daemon on config.example.yaml (the embedded defaults) until every shipped
  query has answered a window, then SIGTERM; then ``flowsieve replay`` of the shipped capture
  in that environment, its answers equal to dpkt's;
- the image's way: an environment made from ``deploy/requirements.lock`` alone (hashes
  required) and the package built as a wheel, ``flowsieve prepare`` with the image's cache
  folders, ``flowsieve run`` with no config at all, and the same replay;
- ten stops in a row under traffic, the first with no JVM class-data archive and no numba
  cache: each within ``shutdown_timeout_s``, exit status 0, no Java stack line and no Python
  traceback in the log, no process of the daemon's tree left.

A runtime import missing from the dependencies fails here: Spark's answer batches fail (the
daemon's readiness says why), and no query answers."""

from __future__ import annotations

import csv
import io
import os
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import dpkt
import httpx
import pytest
from scapy.utils import RawPcapReader

from tests.helpers import ROOT
from tests.pipelines import reference
from tests.processes import descendants, free_port, metric, running, wait_for

pytestmark = pytest.mark.slow

SHIPPED = ("udp_bw", "dns_req", "dns_resp")  # collector/data/example.sql
SHUTDOWN_S = 20  # the embedded default shutdown_timeout_s
# a Java stack line, a Python traceback, an uncaught Java exception, an ERROR of anyone
BAD_LINE = re.compile(r"^\s+at [\w$.<>/]+\(.*\)\s*$|Exception in thread|Traceback \(most recent"
                      r"|^Caused by: | ERROR |^ERROR")


def product_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell: none of this test's virtual environment, paths or
    hooks."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYSPARK_PYTHON",
                        "PYSPARK_DRIVER_PYTHON")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.startswith(sys.prefix))
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """A clean clone of the commit under test (uncommitted changes are not in it); the
    class-data archive its install made in the user's cache goes with it."""
    where = tmp_path_factory.mktemp("clone") / "flowsieve"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(where)],
                   check=True, timeout=300)
    yield where
    python = where / ".venv" / "bin" / "python"
    if python.exists():
        out = subprocess.run([str(python), "-c", "from collector.config import cache_dir\n"
                              "from collector.spark.session import class_archive_path\n"
                              "print(class_archive_path(cache_dir()))"], cwd=where,
                             capture_output=True, text=True, env=product_env(), timeout=120)
        if out.returncode == 0 and out.stdout.strip():
            Path(out.stdout.strip()).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def made(clone, tmp_path_factory) -> dict:
    """``make run`` on the clone, as a user runs it: install, prepare, the daemon until every
    shipped query has answered, then SIGTERM. What it did."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("make-run") / "make-run.log"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        make = subprocess.Popen(["make", "run"], cwd=clone, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env=product_env(FLOWSIEVE_API__PORT=str(port)))
        try:
            out = answer_every_shipped_query(make, port, log_path, timeout=900)
        finally:
            if make.poll() is None:
                os.killpg(make.pid, signal.SIGKILL)
                make.wait()
    return {**out, "log": log_path, "make_status": make.returncode,
            "seconds": time.monotonic() - t0}


def answer_every_shipped_query(proc: subprocess.Popen, port: int, log: Path,
                               timeout: float) -> dict:
    """Wait until every shipped query has answered a window, then stop the daemon (the
    ``flowsieve`` process under ``proc``, or ``proc`` itself) with SIGTERM: its rows, exit
    status, stop time and the processes of its tree."""
    base = f"http://127.0.0.1:{port}"

    def rows() -> dict | None:
        assert proc.poll() is None, log.read_text()[-4000:]
        health = httpx.get(f"{base}/healthz", timeout=10).json()
        # a failed answer batch is never waited out: it says why (a module not installed)
        assert not health["spark_failures"], health["spark_failures"]
        got = {}
        for name in SHIPPED:
            r = httpx.get(f"{base}/queries/{name}/results", timeout=10)
            if r.status_code != 200 or not r.json()["rows"]:
                return None
            got[name] = r.json()["rows"]
        return got
    try:
        answered = wait_for(rows, timeout, "every shipped query to answer a window")
    except AssertionError as e:
        why = ""
        try:
            why = httpx.get(f"{base}/readyz", timeout=10).text
        except httpx.HTTPError:
            pass
        raise AssertionError(f"no answer from every shipped query ({e}); /readyz: {why}; "
                             f"log: {log.read_text()[-3000:]}") from None
    metrics = httpx.get(f"{base}/metrics", timeout=10).text
    daemon = daemon_process(proc)
    stopped = stop(daemon, proc)
    return {"rows": answered, "metrics": metrics, **stopped}


def daemon_process(proc: subprocess.Popen) -> int:
    """The ``flowsieve run`` process: ``proc`` or its child (``make run``'s)."""
    if b"flowsieve" in Path(f"/proc/{proc.pid}/cmdline").read_bytes() and \
            b"make" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
        return proc.pid
    tree = descendants(proc.pid)
    return next(p for p, cmd in sorted(tree.items())
                if " run" in cmd and "flowsieve" in cmd and "make" not in cmd.split()[0])


def stop(daemon: int, proc: subprocess.Popen) -> dict:
    """SIGTERM to the daemon; how long it took, its exit status, what of its tree ran on."""
    tree = descendants(daemon)
    assert any("java" in c for c in tree.values()), tree  # the JVM is its child
    t0 = time.monotonic()
    os.kill(daemon, signal.SIGTERM)
    status = proc.wait(timeout=SHUTDOWN_S + 60)
    seconds = time.monotonic() - t0
    deadline = time.monotonic() + 10  # a worker reading its end of a closed socket
    while time.monotonic() < deadline and any(running(p) for p in tree):
        time.sleep(0.2)
    return {"status": status, "stop_s": seconds,
            "left": {p: c for p, c in tree.items() if running(p)}}


def check_clean_stop(out: dict, log: Path) -> None:
    text = log.read_text(errors="replace")
    assert out["status"] == 0, text[-3000:]
    assert out["stop_s"] <= SHUTDOWN_S, (out["stop_s"], text[-3000:])
    assert not out["left"], out["left"]
    lines = text.splitlines()
    bad = [k for k, ln in enumerate(lines) if BAD_LINE.search(ln)]
    # the first bad line with what came before and after it
    assert not bad, f"{len(bad)} bad lines; from the first:\n" + \
        "\n".join(lines[max(0, bad[0] - 5):bad[0] + 40])
    assert "stopped in" in text


def replay_answers(flowsieve: Path, cwd: Path, env: dict) -> dict:
    """``flowsieve replay`` of the shipped capture and queries: its CSV rows as dpkt's
    reference shapes them."""
    data = cwd / "collector" / "data" if (cwd / "collector").exists() else ROOT / "collector" \
        / "data"
    out = subprocess.run([str(flowsieve), "replay", str(data / "sample.pcap"), "--queries",
                          str(data / "example.sql"), "--format", "csv"], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got: dict = {q: {} for q in SHIPPED}
    for row in csv.DictReader(io.StringIO(out.stdout)):
        got[row["query"]][(int(row["t"]), row["src_ip"], row["dst_ip"])] = (
            int(row["pkts"]), int(row["bytes"]))
    return got


def truth() -> dict:
    """dpkt's answers of the shipped capture (a copy of ok.pcap)."""
    path = ROOT / "collector" / "data" / "sample.pcap"
    with open(path, "rb") as fh:
        frames = [(ts, buf) for ts, buf in dpkt.pcap.Reader(fh)]
    wire = [meta.wirelen for _, meta in RawPcapReader(str(path))]
    return reference([(ts, buf, w) for (ts, buf), w in zip(frames, wire, strict=True)])


def test_make_run_on_a_clean_clone_answers_every_shipped_query(made):
    for name in SHIPPED:
        assert made["rows"][name], name
        for row in made["rows"][name]:
            assert row["pkts"] > 0 and row["bytes"] > 0, row
    assert "flowsieve_spark_batch_errors_total{" not in made["metrics"]
    check_clean_stop(made, made["log"])
    assert made["make_status"] == 0
    text = made["log"].read_text()
    assert "flowsieve prepare" in text and "kernels" in text  # the install step prepared


def test_replay_in_the_environment_make_run_made(made, clone):
    assert replay_answers(clone / ".venv" / "bin" / "flowsieve", clone, product_env()) == \
        truth()


@pytest.fixture(scope="module")
def locked(clone, tmp_path_factory) -> dict:
    """The image's install outside Docker: the lock's packages (hashes required), the package
    as a wheel, ``flowsieve prepare`` into the image's cache folders (here temporary)."""
    home = tmp_path_factory.mktemp("lock")
    venv = home / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    # pip's cache as make's installs left it (the image's --no-cache-dir keeps its layer small):
    # the hashes are checked all the same, and PySpark's wheel is not built again from its
    # source archive (23 s of downloads and 31 s of building here)
    pip = [str(venv / "bin" / "pip"), "install", "--quiet"]
    env = product_env(NUMBA_CACHE_DIR=str(home / "cache" / "numba"),
                      XDG_CACHE_HOME=str(home / "cache"))
    for args in (["--require-hashes", "-r", str(clone / "deploy" / "requirements.lock")],
                 ["--no-deps", f"{clone}[live]"]):
        r = subprocess.run(pip + args, capture_output=True, text=True, timeout=1800, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([str(venv / "bin" / "flowsieve"), "prepare"], capture_output=True,
                       text=True, timeout=1800, env=env, cwd=home)
    assert r.returncode == 0, r.stderr[-3000:]
    assert list((home / "cache" / "numba").rglob("*.nbc"))
    assert list((home / "cache" / "flowsieve").glob("spark-*-job-classes.jsa"))
    return {"venv": venv, "env": env, "home": home}


def test_the_locked_environment_runs_the_daemon_on_its_embedded_defaults(locked):
    port = free_port()
    run = locked["home"] / "run"
    run.mkdir()
    log_path = run / "daemon.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(locked["venv"] / "bin" / "flowsieve"), "run"], cwd=run,
                                stdout=log, stderr=subprocess.STDOUT,
                                env={**locked["env"], "FLOWSIEVE_API__PORT": str(port)})
        try:
            out = answer_every_shipped_query(proc, port, log_path, timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert all(out["rows"][name] for name in SHIPPED)
    assert "flowsieve_spark_batch_errors_total{" not in out["metrics"]
    check_clean_stop(out, log_path)


def test_replay_in_the_locked_environment(locked):
    assert replay_answers(locked["venv"] / "bin" / "flowsieve", locked["home"],
                          locked["env"]) == truth()


def dense_capture(path: Path, n: int = 100_000) -> None:
    """ok.pcap's frames again and again with varied IPv4 sources, stamped within one second:
    looped and re-stamped, a source of n packets/s whose groups keep Spark busy."""
    with open(ROOT / "collector" / "data" / "sample.pcap", "rb") as fh:
        frames = [bytes(buf) for _, buf in dpkt.pcap.Reader(fh)]
    with open(path, "wb") as f:
        f.write(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 262144, 1))
        for i in range(n):
            b = bytearray(frames[i % len(frames)])
            if len(b) > 34 and b[12:14] == b"\x08\x00":
                b[26:30] = struct.pack(">I", 0x0A000000 | (i * 2654435761) % (1 << 20))
            us = i * 1_000_000 // n
            f.write(struct.pack("<IIII", 1_700_000_000, us, len(b), len(b)) + b)


def test_ten_stops_in_a_row_under_traffic(made, clone, tmp_path):
    """The daemon of ``make run``'s environment, under a looped capture of 100k packets/s
    whose packets fall in a million groups (more than Spark merges in the meantime: a backlog
    it works through from start to stop): each start waits until the daemon is ready and reads
    packets, lets them come for 5 s, and stops, Spark mid-batch. The first start has no
    class-data archive and no numba cache (a JVM that wrote its archive at exit ran past the
    deadline; kernels compile as the first batches come)."""
    dense_capture(tmp_path / "dense.pcap")
    (tmp_path / "q.sql").write_text(
        (clone / "collector" / "data" / "example.sql").read_text() + """
-- name: pairs
SELECT time/5 AS t, src_ip, dst_ip, count(*) AS pkts, sum(wirelen) AS bytes FROM packets
GROUP BY time/5, src_ip, dst_ip;
""")
    port = free_port()
    archive = tmp_path / "no-archive"
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"""
var_dir: {tmp_path / 'var'}
api: {{port: {port}}}
spark: {{class_archive_dir: {archive}}}
initial_queries: {tmp_path / 'q.sql'}
sources:
  - {{type: pcap, name: dense, path: {tmp_path / 'dense.pcap'}, loop: true, restamp: true}}
""")
    env = product_env(NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    base = f"http://127.0.0.1:{port}"
    flowsieve = clone / ".venv" / "bin" / "flowsieve"
    times = []
    for k in range(10):
        log_path = tmp_path / f"daemon-{k}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen([str(flowsieve), "run", "--config", str(cfg)], cwd=clone,
                                    stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                wait_for(lambda p=proc, lp=log_path: busy(p, lp, base), 600,
                         f"start {k}: ready, packets read")
                time.sleep(5)  # traffic spooled meanwhile: Spark has a batch to run
                out = stop(proc.pid, proc)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        assert not list(archive.glob("*.jsa*")), f"stop {k}: a class-data archive written"
        check_clean_stop(out, log_path)
        times.append(round(out["stop_s"], 1))
    sys.stderr.write(f"ten stops under traffic: {times} s (bound {SHUTDOWN_S} s)\n")


def busy(proc: subprocess.Popen, log: Path, base: str) -> bool:
    """The daemon runs, is ready (Spark runs its streaming queries), and reads packets."""
    assert proc.poll() is None, log.read_text()[-3000:]
    if httpx.get(f"{base}/readyz", timeout=10).status_code != 200:
        return False
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return metric(text, "flowsieve_packets_in_total", 'source="dense"') > 0
