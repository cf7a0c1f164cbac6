"""What the tests share: the data folders, the strict-mode rule for needs, captures by name,
generated captures of many groups, a process's peak RSS."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
SHARED = ROOT.parent / "shared" / "data"
STRICT = os.environ.get("FLOWSIEVE_STRICT") == "1"


def need(condition: bool, reason: str) -> None:
    """Skip with a visible reason, except under FLOWSIEVE_STRICT=1 where nothing may skip."""
    if condition:
        return
    if STRICT:
        pytest.fail(f"FLOWSIEVE_STRICT=1 and {reason}")
    pytest.skip(reason)


def need_tool(name: str) -> str:
    path = shutil.which(name)
    need(path is not None, f"{name} is not installed (apt-get install -y {name})")
    return path


def capture(name: str) -> Path:
    """A capture from tests/data (permissive licences) or ../shared/data (GPL samples)."""
    return _sample("pcap", name, "GPL")


def flow_data(rel: str) -> Path:
    """A NetFlow/IPFIX sample from tests/data/netflow or ../shared/data/netflow (AGPL/GPL)."""
    return _sample("netflow", rel, "AGPL/GPL")


def _sample(kind: str, rel: str, licence: str) -> Path:
    local = DATA / kind / rel
    if local.exists():
        return local
    shared = SHARED / kind / rel
    need(shared.exists(), f"{shared} is absent ({licence} sample, not copied into the "
         "repository)")
    return shared


def samples(kind: str, pattern: str, exclude: frozenset[str] | set[str] = frozenset()):
    """Parameters for every sample file of ``kind`` (pcap, netflow) in tests/data and in
    ../shared/data. When ../shared/data is absent its (GPL) samples are one visibly skipped
    parameter, never a silently shorter list (and under FLOWSIEVE_STRICT=1 a failure)."""
    names = {p.name for p in (DATA / kind).glob(pattern)}
    if (SHARED / kind).is_dir():
        names |= {p.name for p in (SHARED / kind).glob(pattern)}
        return sorted(names - set(exclude))
    missing = pytest.param(None, id="shared-absent", marks=pytest.mark.skip(
        reason=f"{SHARED / kind} is absent: its GPL/AGPL samples are not tested"))
    return [*sorted(names - set(exclude)), missing]


def many_groups(path: Path, n: int, t0_s: int = 1_700_000_040) -> None:
    """``n`` UDP packets in one minute from ``t0_s`` (a minute boundary), each its own
    (source, destination, source port): a window of ``n`` groups."""
    import numpy as np

    from bench.traces import write_pcap
    i = np.arange(n)
    src = np.zeros((n, 16), np.uint8)
    src[:, 10:12] = 0xFF
    src[:, 12:] = (0x0A000000 + i // 7).astype(">u4").view(np.uint8).reshape(-1, 4)
    dst = src.copy()
    dst[:, 12] = 192
    write_pcap(path, {
        "ts_us": t0_s * 1_000_000 + i * (50_000_000 // n), "wirelen": np.full(n, 60),
        "ipv": np.full(n, 4), "proto": np.full(n, 17), "src": src, "dst": dst,
        "ttl": np.full(n, 64), "sport": 1024 + i % 7, "dport": np.full(n, 9999),
        "flags": np.zeros(n, np.int64), "icmp_type": np.zeros(n, np.int64),
        "qname": np.full(n, -1), "dns_qr": np.zeros(n, np.int64)}, 128)


BIG_WINDOW = 4_000_000  # groups in one window (issue 41)


class PeakRss:
    """The peak resident memory of a running process (its kernel's high-water mark, read until
    it exits)."""

    def __init__(self, pid: int):
        self.pid, self.peak = pid, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                with open(f"/proc/{self.pid}/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            self.peak = max(self.peak, int(line.split()[1]) * 1024)
            except (FileNotFoundError, ProcessLookupError):
                return

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak


Q123 = """-- name: udp_bw
SELECT time/60 AS t, src_ip, dst_ip, sum(wirelen) AS bytes, count(*) AS pkts
FROM packets WHERE protocol = 17 GROUP BY time/60, src_ip, dst_ip;
-- name: dns_req
SELECT time/60 AS t, src_ip, dst_ip, sum(wirelen) AS bytes, count(*) AS pkts
FROM packets WHERE protocol = 17 AND dst_port = 53 AND dns_qr = 0 GROUP BY time/60, src_ip, dst_ip;
-- name: dns_resp
SELECT time/60 AS t, src_ip, dst_ip, sum(wirelen) AS bytes, count(*) AS pkts
FROM packets WHERE protocol = 17 AND src_port = 53 AND dns_qr = 1 GROUP BY time/60, src_ip, dst_ip;
"""
