"""Live capture in a network namespace: tcpreplay sends shared captures over a veth pair and
flowsieve captures them through its TPACKET_V3 ring, with the plan's kernel filter attached.

Needs root, `ip` and tcpreplay (FLOWSIEVE_STRICT=1: never skipped)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from capture.bpf import compile_filter
from capture.live import LiveCapture, RingConfig
from capture.pcap import open_capture
from capture.unpack import unpack
from collector.pipeline.compiled_prefilter import compile_prefilter
from collector.pipeline.prefilter import run_prefilter
from collector.pipeline.residual import Residual
from planner.plan import build_plan
from planner.query import parse_queries
from tests.helpers import ROOT, capture, need, need_tool

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def veth():
    """(capture side in this namespace, namespace, sending side inside it)."""
    need(os.geteuid() == 0, "live capture tests need root (network namespaces)")
    need(shutil.which("ip") is not None, "iproute2 is not installed")
    need_tool("tcpreplay")
    tag = f"fs{os.getpid() % 100000}"
    ns, a, b = f"{tag}ns", f"{tag}a", f"{tag}b"

    def sh(*cmd, check=True):
        return subprocess.run(cmd, check=check, capture_output=True, text=True)
    sh("ip", "netns", "add", ns)
    try:
        sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        sh("ip", "link", "set", b, "netns", ns)
        # no addresses and no IPv6: the kernel itself sends nothing on the pair
        sh("sysctl", "-qw", f"net.ipv6.conf.{a}.disable_ipv6=1")
        sh("ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv6.conf.{b}.disable_ipv6=1")
        sh("ip", "link", "set", a, "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", b, "up")
        yield a, ns, b
    finally:
        sh("ip", "link", "del", a, check=False)
        sh("ip", "netns", "del", ns, check=False)


def replay(veth, name, *extra, pps=5000):
    _, ns, b = veth
    rate = ["--topspeed"] if pps is None else ["--pps", str(pps)]
    out = subprocess.run(["ip", "netns", "exec", ns, "tcpreplay", "-i", b, *rate, *extra,
                          str(capture(name))], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    sent = int(re.search(r"Successful packets:\s+(\d+)", out.stdout).group(1))
    failed = int(re.search(r"Failed packets:\s+(\d+)", out.stdout).group(1))
    assert failed == 0, out.stdout
    return sent


class Capturing:
    """A LiveCapture read by a thread while the test sends."""

    def __init__(self, cap: LiveCapture):
        self.cap, self.stop, self.records = cap, threading.Event(), []
        self.cap.open()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self):
        for raw in self.cap.batches(self.stop, poll_s=0.05):
            if raw is not None:
                self.records.extend(raw.records())

    def settle(self, limit_s: float = 120.0) -> None:
        """Wait until every frame the kernel accepted has reached the reader (the ring hands
        over a partly filled block after its timeout); ``limit_s`` only bounds a hang, so a
        busy machine makes the test slower, never wrong."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            k = self.cap.stats()
            if len(self.records) >= k.packets - k.drops:
                return
            time.sleep(0.05)

    def finish(self):
        self.settle()
        self.stop.set()
        self.thread.join()
        self.cap.close()
        return self.records


def frames(name):
    return [rec for raw in open_capture(capture(name)) for rec in raw.records()]


@pytest.mark.parametrize("name", ["ok.pcap", "icmp_dot1q.pcap", "q-in-q.pcap",
                                  "wikipedia.pcap", "icmp6.pcap"])
def test_frames_arrive_as_sent(veth, name):
    """Every frame arrives byte for byte, VLAN tags included (veth strips the outer tag into
    the ring's metadata; flowsieve puts it back as libpcap does), and PACKET_STATISTICS agrees."""
    c = Capturing(LiveCapture(veth[0], ring=RingConfig(1 << 20, 8)))
    sent = replay(veth, name)
    got = c.finish()
    ref = frames(name)
    assert sent == len(ref)
    assert [g[4] for g in got] == [r[4] for r in ref]
    assert [g[1] for g in got] == [r[1] for r in ref]
    assert c.cap.kernel.packets == len(ref) and c.cap.kernel.drops == 0


QUERIES = """
-- name: web
SELECT time/5, count(*) FROM packets WHERE protocol = 6 AND dst_port IN (80, 443) GROUP BY time/5;
-- name: dns
SELECT time/5, count(*) FROM packets WHERE protocol = 17 AND dst_port = 53 GROUP BY time/5;
-- name: pings
SELECT time/5, count(*) FROM packets WHERE icmp_type = 8 GROUP BY time/5;
"""


def accepted(plan, records) -> np.ndarray:
    """Per query, how many of the records the prefilter and residual accept (offline)."""
    from capture.records import RawBatch
    buf = b"".join(r[4] for r in records)
    lens = np.array([len(r[4]) for r in records], np.int32)
    offs = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    n = len(records)
    raw = RawBatch(np.frombuffer(buf, np.uint8), offs, lens,
                   np.array([r[1] for r in records], np.int32),
                   np.array([r[0] for r in records], np.int64), np.ones(n, np.int32),
                   np.zeros(n, np.int32))
    tb = unpack(raw)
    cp = compile_prefilter(plan, "packets")
    _, Q = run_prefilter(cp, tb, None)
    Residual(plan, "packets").apply(tb, Q)
    return np.array([int(((Q[:, 0] >> np.uint64(s)) & np.uint64(1)).sum()) for s in range(3)])


def test_kernel_filter_from_the_plan(veth):
    """The plan's BPF filter in the kernel: exactly the frames tcpdump's reading of the same
    expression keeps reach user space (fewer than were sent), and every query counts what it
    counts on the whole file."""
    plan = build_plan(parse_queries(QUERIES))
    assert plan.bpf
    name = "ok.pcap"
    c = Capturing(LiveCapture(veth[0], bpf=plan.bpf, ring=RingConfig(1 << 20, 8)))
    sent = replay(veth, name)
    got = c.finish()
    expr = compile_filter(plan.bpf).expr
    td = subprocess.run([need_tool("tcpdump"), "-r", str(capture(name)), "-w", "-", expr],
                        capture_output=True, timeout=60)
    assert td.returncode == 0, td.stderr
    kept = [rec[4] for raw in open_capture(td.stdout) for rec in raw.records()]
    assert [g[4] for g in got] == kept
    assert 0 < len(got) < sent
    assert c.cap.kernel.packets == len(got)
    assert (accepted(plan, got) == accepted(plan, frames(name))).all()
    assert accepted(plan, frames(name)).sum() > 0


def test_filter_swapped_while_capturing(veth):
    """set_filter replaces the kernel filter on the open socket (a plan rebuild)."""
    udp = build_plan(parse_queries("SELECT time/5, count(*) FROM packets WHERE protocol = 17 "
                                   "GROUP BY time/5"))
    tcp = build_plan(parse_queries("SELECT time/5, count(*) FROM packets WHERE protocol = 6 "
                                   "GROUP BY time/5"))
    cap = LiveCapture(veth[0], bpf=udp.bpf, ring=RingConfig(1 << 20, 8))
    c = Capturing(cap)
    replay(veth, "ok.pcap")
    c.settle()
    first = len(c.records)
    cap.set_filter(tcp.bpf)
    replay(veth, "ok.pcap")
    got = c.finish()
    ref = frames("ok.pcap")
    protos = [int(p) for raw in open_capture(capture("ok.pcap"))
              for p in unpack(raw, ["protocol"]).column("protocol")]
    n_udp, n_tcp = protos.count(17), protos.count(6)
    assert first == n_udp and len(got) - first == n_tcp
    assert [g[4] for g in got[:first]] == [r[4] for r, p in zip(ref, protos, strict=True)
                                          if p == 17]


def test_ring_overflow_is_counted(veth):
    """A ring too small for a burst: the kernel drops, PACKET_STATISTICS counts it, and what
    was delivered plus what was dropped is what passed the filter."""
    cap = LiveCapture(veth[0], ring=RingConfig(1 << 16, 2, block_timeout_ms=1000)).open()
    try:
        sent = replay(veth, "ok.pcap", "--loop", "5", pps=None)  # nobody reads meanwhile
        time.sleep(0.2)
        stop = threading.Event()
        got = 0
        idle = 0
        for raw in cap.batches(stop, poll_s=0.05):
            if raw is None:
                idle += 1
                if idle > 30:
                    break
            else:
                got += len(raw)
        k = cap.stats()
    finally:
        cap.close()
    assert k.drops > 0
    assert k.packets == sent
    assert got == k.packets - k.drops


def test_daemon_exports_kernel_statistics(veth, tmp_path):
    """An interface source in the collector: packets flow into the engine and the kernel's
    counters appear in /metrics; stopping commits the time of the last packet with the LFTA's
    partials, and a restart says since when nothing was captured."""
    import json

    from prometheus_client import generate_latest

    from collector.config import load_settings
    from collector.daemon.service import Collector
    qfile = tmp_path / "q.sql"
    qfile.write_text(QUERIES)
    settings = load_settings(None, var_dir=tmp_path / "var", initial_queries=str(qfile),
                             sources=[{"type": "interface", "name": "veth",
                                       "interface": veth[0], "ring_block_size": 1 << 20,
                                       "ring_blocks": 8}])
    col = Collector(settings)
    started_ns = time.time_ns()
    col.start(with_spark=False)
    try:
        opened = time.monotonic() + 120  # the source thread opens the socket
        while col.sources[0].capture.sock is None and time.monotonic() < opened:
            time.sleep(0.05)
        sent = replay(veth, "ok.pcap")
        deadline = time.time() + 120  # bounds a hang: a cold numba compile takes seconds
        text = ""
        while time.time() < deadline:
            text = generate_latest(col.metrics.registry).decode()
            m = re.search(r'flowsieve_capture_kernel_packets_total\{source="veth"\} (\S+)', text)
            if m and float(m.group(1)) > 0 and col.engines[0].tuples_in >= float(m.group(1)):
                break
            time.sleep(0.2)
    finally:
        col.stop()
    passed = float(m.group(1))
    assert 0 < passed < sent  # the plan's filter dropped what no query wants
    assert col.engines[0].tuples_in == passed
    assert 'flowsieve_capture_kernel_drops_total{source="veth"} 0.0' in text
    state = tmp_path / "var" / "state" / "veth.json"
    assert state.exists()  # stop() waited for the source's last commit
    position = json.loads(state.read_text())["position"]
    assert started_ns <= position["last_ns"] <= time.time_ns()
    assert col.sources[0].resume(position).startswith("nothing was captured for")


CAPTURING_AS_NOBODY = r"""
import json, subprocess, sys, threading, time
from collector.daemon.process import raise_capture_capabilities, effective_capabilities
from capture.listen import FlowListener
from capture.live import LiveCapture, RingConfig
iface, want = sys.argv[1], int(sys.argv[2])
out = {"raised": raise_capture_capabilities(), "effective": sorted(effective_capabilities())}
# what it starts (the JVM, and through it Spark's Python workers) holds nothing
status = subprocess.run(["cat", "/proc/self/status"], capture_output=True, text=True).stdout
out["child"] = {k: v.strip() for k, v in (ln.split(":", 1) for ln in status.splitlines()
                                          if ln.startswith(("CapPrm", "CapEff", "CapAmb")))}
listener = FlowListener(["127.0.0.1:0"], rcvbuf=32 << 20)
listener.open()
out["rcvbuf"] = listener.socks[0].getsockopt(1, 8) // 2  # SOL_SOCKET, SO_RCVBUF
listener.close()
try:
    cap = LiveCapture(iface, ring=RingConfig(1 << 20, 8)).open()
except OSError as e:
    out["error"] = str(e)
    print(json.dumps(out), flush=True)
    sys.exit(0)
print("ready", flush=True)
stop, got = threading.Event(), 0
deadline = time.monotonic() + 120
for raw in cap.batches(stop, poll_s=0.05):
    got += len(raw) if raw is not None else 0
    if got >= want or time.monotonic() > deadline:
        break
cap.close()
out["captured"] = got
print(json.dumps(out), flush=True)
"""


def interpreter_copy(folder, caps: str | None) -> str:
    """This interpreter's binary copied, with ``caps`` as file capabilities (the image's
    dedicated interpreter) or none."""
    import sys
    exe = folder / ("python-caps" if caps else "python-plain")
    shutil.copy2(os.path.realpath(sys.executable), exe)
    os.chmod(exe, 0o755)
    if caps:
        subprocess.run(["setcap", caps, str(exe)], check=True)
    return str(exe)


def test_a_non_root_daemon_captures_with_the_images_privileges(veth, tmp_path_factory):
    """The image's privilege set, tried as a user who is not root (setpriv): the capture
    capabilities in the bounding set (compose's cap_add) and as permitted-only file
    capabilities of the daemon's interpreter. It opens AF_PACKET on the veth and captures
    every frame tcpreplay sends, raises its receive buffer beyond net.core.rmem_max, and a
    process it starts holds no capability. The plain interpreter cannot capture (one clear
    error) and its receive buffer is clamped, with a warning."""
    import json
    import sys
    import tempfile

    need_tool("setcap")
    need_tool("setpriv")
    folder = Path(tempfile.mkdtemp(prefix="flowsieve-caps-"))  # nobody reads it
    os.chmod(folder, 0o755)
    cache = folder / "numba"
    cache.mkdir(mode=0o777)
    os.chmod(cache, 0o777)
    try:
        site = [p for p in sys.path if p.endswith("site-packages")]
        env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join([str(ROOT), *site]),
               "NUMBA_CACHE_DIR": str(cache), "HOME": str(folder)}
        user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                "--inh-caps=-all", "--bounding-set=-all,+net_raw,+net_admin", "--"]
        rmem_max = int(Path("/proc/sys/net/core/rmem_max").read_text())
        assert rmem_max < 32 << 20  # else the buffer test proves nothing

        plain = subprocess.run([*user, interpreter_copy(folder, None), "-c",
                                CAPTURING_AS_NOBODY, veth[0], "1"], env=env, cwd=folder,
                               capture_output=True, text=True, timeout=300)
        assert plain.returncode == 0, plain.stderr[-3000:]
        out = json.loads(plain.stdout.splitlines()[-1])
        assert out["raised"] == [] and out["effective"] == []
        assert "needs CAP_NET_RAW" in out["error"]
        assert out["rcvbuf"] <= rmem_max
        assert "the receive buffer is" in plain.stderr and "CAP_NET_ADMIN" in plain.stderr

        name = "wikipedia.pcap"
        want = len(frames(name))
        proc = subprocess.Popen([*user, interpreter_copy(folder, "cap_net_raw,cap_net_admin+p"),
                                 "-c", CAPTURING_AS_NOBODY, veth[0], str(want)], env=env,
                                cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        try:
            line = proc.stdout.readline()
            assert line.strip() == "ready", line + proc.stderr.read()[-3000:]
            sent = replay(veth, name)
            stdout, stderr = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        out = json.loads(stdout.splitlines()[-1])
        assert sorted(out["raised"]) == ["CAP_NET_ADMIN", "CAP_NET_RAW"]
        assert out["captured"] == sent == want
        assert out["rcvbuf"] == 32 << 20  # SO_RCVBUFFORCE: beyond rmem_max
        assert "the receive buffer is" not in stderr
        assert out["child"] == {"CapPrm": "0000000000000000", "CapEff": "0000000000000000",
                                "CapAmb": "0000000000000000"}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
