"""Running flowsieve as a user does, in processes of its own: the daemon (configuration, start,
stop, its metrics), a capture fed in real time, answers over REST, and one-line CLI errors. A
test that uses these is slow by construction (tests/conftest.py)."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import dpkt
import httpx
from scapy.utils import RawPcapReader

from tests.helpers import ROOT, capture


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(fn, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = fn()
            if last:
                return last
        except httpx.HTTPError as e:
            last = e
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last})")


def metric(text: str, name: str, labels: str = "") -> float:
    for line in text.splitlines():
        if line.startswith(name + (labels and "{" + labels + "}")) and not line.startswith("#"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# A test daemon's JVM (driver and local executors) compiles with C1 alone: it answers a few
# thousand packets for a minute, and HotSpot's optimizing compiler (C2) spent a fifth of the
# CPU of such a test compiling code that ran a few times (tests/test_kill.py and
# tests/test_sflow_daemon.py: 232 against 291-312 CPU seconds). The daemon of a user keeps
# HotSpot's defaults; CI's install lane runs it that way.
TEST_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def daemon_config(tmp_path, sources: list[str], queries: str | None) -> tuple[Path, int]:
    """A test daemon's configuration (a small local Spark, 1 s trigger, ``TEST_JVM``) with
    these source lines (YAML flow mappings) and queries; its path and API port."""
    port = free_port()
    initial = "null"
    if queries is not None:
        (tmp_path / "q.sql").write_text(queries)
        initial = str(tmp_path / "q.sql")
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"""
var_dir: {tmp_path / 'var'}
api: {{host: 127.0.0.1, port: {port}}}
spark: {{master: "local[2]", driver_memory: 1g, shuffle_partitions: 2, trigger_s: 1,
        extra: {{spark.driver.extraJavaOptions: "{TEST_JVM}"}}}}
initial_queries: {initial}
sources:
""" + "".join(f"  - {line}\n" for line in sources))
    return cfg, port


def cli(*args: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """``flowsieve ARGS`` in a subprocess, output captured (text unless ``text=False``), for a
    command that starts no JVM: ``decode``, ``plan``, or ``run``/``replay`` refused before
    Spark starts (in the fast lane a JVM cannot start: tests/lanes.py). A hang fails at
    ``timeout``, not a slow machine."""
    return _cli(args, timeout, kw)


def cli_spark(*args: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """``flowsieve run`` or ``replay`` that starts Spark: a test that calls it is slow."""
    return _cli(args, timeout, kw)


def _cli(args, timeout: float, kw: dict) -> subprocess.CompletedProcess:
    kw.setdefault("text", True)
    return subprocess.run([sys.executable, "-m", "api.cli", *args], capture_output=True,
                          cwd=ROOT, timeout=timeout, **kw)


def start_daemon(cfg: Path, log, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "api.cli", "run", "--config", str(cfg)],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def daemon_ready(proc: subprocess.Popen, base: str, log: Path) -> bool:
    """Whether the daemon at ``base`` answers /readyz 200; its log's end if it has exited."""
    assert proc.poll() is None, log.read_text()[-3000:]
    return httpx.get(f"{base}/readyz", timeout=5).status_code == 200


def stop_daemon(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM, and SIGKILL if it does not stop within ``timeout`` (a minute)."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def descendants(pid: int) -> dict[int, str]:
    """Every process under ``pid`` (from /proc): pid -> command line."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(d))
    out: dict[int, str] = {}
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            try:
                out[c] = Path(f"/proc/{c}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            todo.append(c)
    return out


def running(pid: int) -> bool:
    """The process exists and is no zombie (an exited child not yet reaped is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def v5_now(template: bytes, seq: int, now: float) -> bytes:
    """A NetFlow v5 datagram with the records of ``template`` (a real export), every flow
    starting and ending at ``now``: sys_uptime and the records' first/last made equal."""
    import struct
    d = bytearray(template)
    uptime = struct.unpack_from(">I", d, 4)[0]
    struct.pack_into(">III", d, 8, int(now), int(now % 1 * 1e9), seq)
    for i in range(struct.unpack_from(">H", d, 2)[0]):
        struct.pack_into(">II", d, 24 + 48 * i + 24, uptime, uptime)
    return bytes(d)


PERIOD = 5  # the window of the queries of the tests that share these helpers


class Feeder(threading.Thread):
    """Appends the sample capture's packets to a pcap in a loop, ``per_tick`` every ``tick``
    seconds (about 200 packets/s), stamped with the wall clock spread over the tick just past:
    never later than written, so a packet stamped after a registration returned was read (and
    processed) under the plan that registration made."""

    def __init__(self, path, per_tick: int = 40, tick: float = 0.2, inject=None):
        super().__init__(daemon=True)
        self.inject = inject  # () -> frames written besides, each tick (an attack's)
        src = capture("ok.pcap")
        with open(src, "rb") as fh:
            self.frames = [buf for _, buf in dpkt.pcap.Reader(fh)]
        self.wirelens = [meta.wirelen for _, meta in RawPcapReader(str(src))]
        self.path, self.per_tick, self.tick = path, per_tick, tick
        self.written = 0
        self.stop = threading.Event()
        with open(path, "wb") as f:
            dpkt.pcap.Writer(f, snaplen=262144)

    def run(self) -> None:
        i = 0
        with open(self.path, "ab") as f:
            while not self.stop.is_set():
                t0 = time.time()
                extra = self.inject() if self.inject is not None else []
                frames = [(self.frames[k], self.wirelens[k]) for k in
                          (n % len(self.frames) for n in range(i, i + self.per_tick))]
                frames += [(buf, len(buf)) for buf in extra]
                for j, (buf, wirelen) in enumerate(frames):
                    ts = t0 - self.tick + (j + 1) * self.tick / len(frames)
                    sec = int(ts)
                    f.write(struct.pack("<IIII", sec, int((ts - sec) * 1e6), len(buf),
                                        wirelen) + buf)
                i += self.per_tick
                f.flush()
                self.written = i
                self.stop.wait(self.tick)


def answers(client: httpx.Client, name: str) -> tuple[list[dict], float]:
    """A query's rows over REST (its output columns: the window's start and end, which every
    row also carries, checked against its bucket) and the time before which they are
    complete."""
    r = client.get(f"/queries/{name}/results", params={"order": "oldest", "limit": 100_000})
    r.raise_for_status()
    body = r.json()
    assert body["next_cursor"] is None
    rows = []
    for row in body["rows"]:
        start = datetime.fromisoformat(row.pop("window_start")).timestamp()
        end = datetime.fromisoformat(row.pop("window_end")).timestamp()
        assert start == row["t"] * (end - start), row
        rows.append(row)
    return rows, body["complete_before"]


def stop_and_drain(feeder: Feeder, client: httpx.Client, name: str) -> float:
    """Stop a feeder and wait until ``name`` answered every window up to it; the end of the
    last window (epoch s)."""
    feeder.stop.set()
    feeder.join(10)
    last = (int(time.time()) // PERIOD + 1) * PERIOD
    wait_for(lambda: (answers(client, name)[1] or 0) >= last, 240, "every window answered")
    return last


def no_server_errors(log: Path) -> None:
    """No request the daemon served (its log, uvicorn's access lines) answered 500, and no
    exception escaped a route."""
    text = log.read_text(errors="replace")
    bad = [ln for ln in text.splitlines()
           if '" 500 ' in ln or "Exception in ASGI application" in ln]
    assert not bad, bad[:5]


def whole_windows(rows: list[dict], since: float, before: float, period: int = PERIOD
                  ) -> list[dict]:
    """Rows of the windows starting at or after ``since`` and before ``before``."""
    return sorted((r for r in rows if since <= r["t"] * period < before),
                  key=lambda r: sorted((k, str(v)) for k, v in r.items()))


def one_error_line(out: subprocess.CompletedProcess, *fragments: str) -> str:
    """A failed command: exit code 1, nothing on stdout, exactly one line `error: …` on stderr,
    no traceback."""
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert "Traceback" not in out.stderr
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


def wait_until(cond, what: str, timeout: float = 30) -> None:
    """``cond()`` true within ``timeout`` (polled every 20 ms): a hang fails, never a slow
    machine's pace."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.02)


class Receiver:
    """A webhook receiver on a loopback port: fails its first ``fail`` requests with 503,
    then keeps every notification (body, headers)."""

    def __init__(self, fail: int = 0):
        self.fail, self.got, self.calls = fail, [], 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.calls += 1
                if outer.calls <= outer.fail:
                    self.send_response(503)
                    self.end_headers()
                    return
                outer.got.append((body, dict(self.headers)))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args):
                pass
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def events(self) -> list[dict]:
        """The alert notifications heard, each carrying its idempotency key in its header
        too, and a repeat of one (a resend after a crash) always with the same body."""
        import json
        by_key: dict[str, set[bytes]] = {}
        out = []
        for body, headers in self.got:
            event = json.loads(body)
            assert headers["X-Flowsieve-Idempotency-Key"] == event["idempotency_key"]
            by_key.setdefault(event["idempotency_key"], set()).add(body)
            out.append(event)
        assert all(len(bodies) == 1 for bodies in by_key.values())
        return out

    def close(self):
        self.server.shutdown()
        self.server.server_close()



def start_alertmanager(folder: Path, webhook_url: str, group_by: list[str]
                       ) -> tuple[str, subprocess.Popen]:
    """A real Alertmanager on a loopback port (its own data folder, no cluster) routing every
    alert, resolutions included, to ``webhook_url``; its base URL and process once ready."""
    from tests.helpers import need_tool
    exe = need_tool("prometheus-alertmanager")
    port = free_port()
    cfg = folder / "alertmanager.yml"
    cfg.write_text(f"""
route: {{receiver: test, group_by: [{", ".join(group_by)}], group_wait: 0s,
        group_interval: 1s, repeat_interval: 1h}}
receivers:
  - name: test
    webhook_configs: [{{url: "{webhook_url}", send_resolved: true}}]
""")
    log = open(folder / "alertmanager.log", "w")  # noqa: SIM115 - the process holds it
    proc = subprocess.Popen([exe, f"--config.file={cfg}", f"--storage.path={folder / 'am'}",
                             f"--web.listen-address=127.0.0.1:{port}",
                             "--cluster.listen-address="], stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(base + "/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False
    try:
        wait_until(ready, "Alertmanager ready")
    except AssertionError:
        proc.kill()
        raise
    return base, proc
