"""Fuzzing the sFlow decoder: 100,000 mutated datagrams (the vendors' of ../shared/data/sflow
when present, and the built ones of every structure), seeded so every run is the same. Nothing
may crash or hang; every datagram is decoded or counted under a reason; a decoded datagram's rows
are sane."""

from __future__ import annotations

import numpy as np
import pytest

from capture.fields import fields
from capture.netflow.batch import Datagrams
from capture.netflow.exports import export_datagrams
from capture.pcap import open_capture
from capture.sflow import SflowDecoder
from capture.sflow.elements import DATAGRAM_REASONS, SKIP_REASONS
from tests.helpers import SHARED
from tests.sflowgen import every_structure, one

N = 100_000
BATCH = 5_000


def seeds(tmp_path) -> list[bytes]:
    out = []
    paths = [every_structure(tmp_path), *sorted((SHARED / "sflow").glob("*.pcap"))]
    for path in paths:
        for raw in open_capture(path):
            dg = export_datagrams(raw, [6343])
            out += [bytes(dg.buf[o:o + n]) for o, n in zip(dg.offset, dg.length, strict=True)]
    return out + [one("192.0.2.10", 1, 1000, [1, 2, 3])]


def mutate(rng: np.random.Generator, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(int(rng.integers(1, 6))):
        op = int(rng.integers(0, 4))
        pos = int(rng.integers(0, max(1, len(b))))
        if op == 0 and b:
            b[min(pos, len(b) - 1)] = int(rng.integers(0, 256))
        elif op == 1:
            del b[pos:]
        elif op == 2:
            b[pos:pos] = rng.integers(0, 256, int(rng.integers(1, 32)), np.uint8).tobytes()
        elif len(b) >= pos + 4:  # a 32-bit length, count or format word
            v = int(rng.choice([0, 1, 2, 3, 4, 5, 0x7FFFFFFF, 0xFFFFFFFF, 1001, 1003,
                                int(rng.integers(0, 1 << 32))]))
            pos -= pos % 4
            b[pos:pos + 4] = v.to_bytes(4, "big")
    return bytes(b)


@pytest.mark.timeout(600)  # a hang fails the test instead of stalling CI
def test_100k_mutated_datagrams_never_crash(tmp_path):
    rng = np.random.default_rng(45)
    base = seeds(tmp_path)
    dec = SflowDecoder()
    dropped = 0
    for _ in range(N // BATCH):
        payloads = [mutate(rng, base[int(i)]) for i in rng.integers(0, len(base), BATCH)]
        before = sum(dec.errors.get(r, 0) for r in DATAGRAM_REASONS[1:])
        d = dec.decode(Datagrams.from_payloads(payloads))
        sb, cb = d.samples(), d.counters()
        dropped += sum(dec.errors.get(r, 0) for r in DATAGRAM_REASONS[1:]) - before
        for batch in (sb, cb):  # every column readable
            for name in fields(batch.stream):
                batch.arrow(name)
        wire, cap = sb.column("wirelen"), sb.column("caplen")
        assert ((wire < 0) | (wire >= cap)).all()
        assert (sb.column("src_port") <= 65535).all()
        assert (cb.column("if_index") >= -1).all()
    seen = sum(s["datagrams"] for s in dec.streams())
    untracked = dec.errors.get("sflow_too_many_agents", 0)
    assert seen + untracked + dropped == N  # every datagram decoded or counted
    assert set(dec.all_errors) <= {*DATAGRAM_REASONS[1:], *SKIP_REASONS}
    assert dropped > N // 10 and seen > N // 10  # the mutations hit both
