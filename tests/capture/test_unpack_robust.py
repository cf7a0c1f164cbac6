"""Bad packets never crash the unpack kernel: mutated and truncated real frames, unpacked with
numba's bounds checking on (an out-of-bounds read raises IndexError instead of reading junk)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import DATA, ROOT

SCRIPT = r"""
import struct, sys
import numpy as np
from capture.pcap import open_capture
from capture.unpack import unpack

rng = np.random.default_rng(20261121)
frames = []
for name in sys.argv[1:]:
    for raw in open_capture(name):
        for i in range(len(raw)):
            o = int(raw.offset[i])
            frames.append((int(raw.linktype[i]), raw.buf[o:o + raw.caplen[i]].tobytes()))
out = {}
for k in range(20000):
    lt, f = frames[rng.integers(len(frames))]
    b = bytearray(f)
    for _ in range(int(rng.integers(0, 6))):  # flip bytes, biased to the headers
        if b:
            b[int(rng.integers(0, min(len(b), 80)))] = int(rng.integers(0, 256))
    b = bytes(b[: int(rng.integers(0, len(b) + 1))])  # truncate anywhere
    out.setdefault(lt, []).append(b)
total = 0
for lt, recs in out.items():
    body = b"".join(struct.pack("<IIII", 1, 0, len(r), len(r) + 10) + r for r in recs)
    pcap = struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, lt) + body
    for raw in open_capture(pcap, batch_size=997):
        tb = unpack(raw)
        assert len(tb) == len(raw)
        assert (tb.column("caplen") <= 65535 + 10).all()
        total += len(tb)
print(total)
"""


@pytest.mark.slow  # compiles every kernel again with bounds checks
@pytest.mark.timeout(600)  # a hang fails the test instead of stalling CI
def test_mutated_frames_with_bounds_checking(tmp_path):
    names = [str(DATA / "pcap" / n) for n in ("ok.pcap", "wikipedia.pcap", "icmp6.pcap",
                                              "mixed-vlan-mpls.pcap", "q-in-q.pcap",
                                              "ipv6-http-atomic-frag.pcap",
                                              "tcp-handshake-nano.pcap", "dns_tcp.pcap")]
    env = {**os.environ, "NUMBA_BOUNDSCHECK": "1", "NUMBA_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, *names], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[-1]) == 20000
