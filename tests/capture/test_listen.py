"""The UDP listener on real loopback sockets, and softflowd exporting live to flowsieve and to
nfcapd in the same test."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from capture.listen import FlowListener, parse_address
from capture.netflow import Decoder, FlowBatch
from tests.flowtools import HEX, read_hex
from tests.helpers import capture, need_tool


def test_parse_address():
    assert parse_address("0.0.0.0:2055") == (socket.AF_INET, "0.0.0.0", 2055)
    assert parse_address("[::]:4739") == (socket.AF_INET6, "::", 4739)
    assert parse_address(":9995") == (socket.AF_INET, "0.0.0.0", 9995)
    for bad in ("2055", "host:2055", "[::1]:99999", "1.2.3.4:x"):
        with pytest.raises(ValueError):
            parse_address(bad)


def _collect(listener: FlowListener, decoder: Decoder, stop: threading.Event, out: list):
    for dg in listener.batches(stop, poll_s=0.05, linger_s=0.01):
        if dg is not None:
            out.append(decoder.decode(dg))


def test_ipv4_and_ipv6_exporters():
    v5 = read_hex(HEX / "PACKET_V5.hex")[0]
    lst = FlowListener(["127.0.0.1:0", "[::1]:0"], rcvbuf=1 << 20)
    lst.open()
    assert lst.receive_buffer() >= 1 << 20
    d, out, stop = Decoder(), [], threading.Event()
    t = threading.Thread(target=_collect, args=(lst, d, stop, out))
    t.start()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s4, \
            socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s6:
        for _ in range(50):
            s4.sendto(v5, lst.bound[0])
            s6.sendto(v5, lst.bound[1])
    assert wait_for(lambda: lst.stats.datagrams >= 100)
    stop.set()
    t.join()
    fb = FlowBatch.concat(out)
    assert len(fb) == 300
    assert sorted({r["exporter"] for r in fb.rows()}) == ["127.0.0.1", "::1"]
    assert {s["exporter"]: s["datagrams"] for s in d.streams()} == {"127.0.0.1": 50, "::1": 50}
    assert lst.stats.kernel_drops == 0


def test_kernel_receive_drops_are_counted():
    """A small receive buffer that is not drained overflows: SO_RXQ_OVFL reports the drops, and
    received + dropped = sent."""
    payload = read_hex(HEX / "PACKET_V9_TEMPLATE.hex")[0]
    lst = FlowListener(["127.0.0.1:0"], rcvbuf=1 << 16)
    lst.open()
    sent = 2000
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _ in range(sent):
            s.sendto(payload, lst.bound[0])
    stop, out = threading.Event(), []
    t = threading.Thread(target=_collect, args=(lst, Decoder(), stop, out))
    t.start()
    assert wait_for(lambda: udp_queue(lst.bound[0][1]) == 0)  # the buffer is drained
    assert wait_for(lambda: lst.stats.datagrams + lst.stats.kernel_drops == sent)
    stop.set()
    t.join()
    assert lst.stats.kernel_drops > 0
    assert lst.stats.datagrams + lst.stats.kernel_drops == sent


def wait_for(cond, limit_s: float = 120.0) -> bool:
    """Poll ``cond`` until it holds; ``limit_s`` only bounds a hang (a busy machine makes the
    test slower, never wrong)."""
    deadline = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def udp_queue(port: int) -> int | None:
    """Bytes waiting in the receive queue of the IPv4 UDP socket bound to ``port`` on this
    machine (/proc/net/udp), or None when no socket is bound to it."""
    with open("/proc/net/udp") as f:
        next(f)
        for line in f:
            cols = line.split()
            if int(cols[1].split(":")[1], 16) == port:
                return int(cols[4].split(":")[1], 16)
    return None


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


NFDUMP_FMT = "fmt:%ts,%te,%pr,%sa,%sp,%da,%dp,%pkt,%byt"


@pytest.mark.slow
@pytest.mark.parametrize("version", ["5", "9", "10"])
def test_live_softflowd_to_flowsieve_and_nfcapd(version, tmp_path):
    """softflowd exports a capture's flows twice, to flowsieve's listener and to nfcapd; the
    flows flowsieve decodes equal what ``nfdump -r`` prints."""
    for tool in ("softflowd", "nfcapd", "nfdump"):
        need_tool(tool)
    pcap = capture("test.pcap")
    port = _free_udp_port()
    nport = _free_udp_port()
    lst = FlowListener([f"127.0.0.1:{port}"])
    lst.open()
    d, out, stop = Decoder(), [], threading.Event()
    t = threading.Thread(target=_collect, args=(lst, d, stop, out))
    t.start()
    flows_dir = tmp_path / "nf"
    flows_dir.mkdir()
    nf = subprocess.Popen(["nfcapd", "-b", "127.0.0.1", "-p", str(nport), "-w", str(flows_dir),
                           "-t", "60", "-I", "t"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: udp_queue(nport) is not None)  # nfcapd is listening
        for dest in (port, nport):
            subprocess.run(["softflowd", "-d", "-r", str(pcap), "-n", f"127.0.0.1:{dest}",
                            "-v", version, "-a", "-A", "milli", "-p",
                            str(tmp_path / "sf.pid")], check=True, capture_output=True,
                           timeout=60)
        # both receivers have read every datagram before nfcapd is told to write its file
        assert wait_for(lambda: udp_queue(nport) == 0 and udp_queue(port) == 0)
    finally:
        nf.send_signal(signal.SIGTERM)
        nf.wait(timeout=30)
        stop.set()
        t.join()
    files = sorted(Path(flows_dir).glob("nfcapd.*"))
    assert files
    text = subprocess.run(["nfdump", "-6", "-q", "-r", str(files[-1]), "-o", NFDUMP_FMT],
                          capture_output=True, text=True, check=True,
                          env={**os.environ, "TZ": "UTC"}).stdout
    want = sorted(tuple(x.strip() for x in line.split(",")) for line in text.splitlines()
                  if line.strip())
    from tests.flowtools import as_nfdump
    got = [as_nfdump(r)[:9] for r in FlowBatch.concat(out).rows()]
    got = sorted(tuple(str(x) for x in g) for g in got)
    if version == "9":  # nfdump 1.7.1 ignores icmpTypeCodeIPv6 (139) in v9
        got = sorted(g[:6] + ("0.0",) + g[7:] if g[2] == "ICMP6" else g for g in got)
    assert len(got) == len(want) > 0
    assert got == want
    assert not d.errors


class _FailingOnce:
    """A listener socket whose first receive fails as the kernel can (ENOBUFS): fault injection
    around the real socket, which then goes on receiving."""

    def __init__(self, sock):
        self.sock, self.failed = sock, False

    def fileno(self):
        return self.sock.fileno()

    def recvmsg_into(self, *args):
        if not self.failed:
            self.failed = True
            raise OSError(errno.ENOBUFS, "No buffer space available")
        return self.sock.recvmsg_into(*args)

    def close(self):
        self.sock.close()


def test_receive_errors_are_counted_and_receiving_goes_on():
    v5 = read_hex(HEX / "PACKET_V5.hex")[0]
    lst = FlowListener(["127.0.0.1:0"], rcvbuf=1 << 20)
    lst.open()
    lst.socks = [_FailingOnce(s) for s in lst.socks]
    d, out, stop = Decoder(), [], threading.Event()
    t = threading.Thread(target=_collect, args=(lst, d, stop, out))
    t.start()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _ in range(5):
            s.sendto(v5, lst.bound[0])
            time.sleep(0.05)
    assert wait_for(lambda: lst.stats.datagrams >= 5)
    stop.set()
    t.join()
    lst.close()
    assert lst.stats.errors == {"ENOBUFS": 1}
    assert lst.stats.datagrams == 5 and len(FlowBatch.concat(out)) == 15
