"""Synthetic NetFlow v9 and IPFIX exports for the benchmarks: a softflowd-like IPv4 template
(addresses, ms times, counters, interfaces, ports, protocol, flags, TOS; 45-byte records) and
datagrams of up to 30 records with seeded, Zipf-ish traffic, plus a paced UDP sender."""

from __future__ import annotations

import socket
import struct
import time

import numpy as np

# (element id, length): what softflowd's IPv4 template 1024 carries
FIELDS = ((8, 4), (12, 4), (152, 8), (153, 8), (1, 4), (2, 4), (10, 4), (14, 4), (7, 2),
          (11, 2), (4, 1), (6, 1), (5, 1), (61, 1), (60, 1))
RECORD = sum(ln for _, ln in FIELDS)
TEMPLATE_ID = 1024
PER_DATAGRAM = 30


def template_set(version: int) -> bytes:
    body = struct.pack(">HH", TEMPLATE_ID, len(FIELDS)) + b"".join(
        struct.pack(">HH", *f) for f in FIELDS)
    return struct.pack(">HH", 0 if version == 9 else 2, 4 + len(body)) + body


def records(n: int, seed: int = 7, t0_ms: int = 1_700_000_000_000) -> np.ndarray:
    """``n`` records as an (n, RECORD) byte matrix."""
    rng = np.random.default_rng(seed)
    out = np.zeros((n, RECORD), np.uint8)
    src = (0x0A000000 + rng.zipf(1.3, n) % 65536).astype(">u4")
    dst = (0xC0A80000 + rng.integers(0, 4096, n)).astype(">u4")
    start = (t0_ms + np.sort(rng.integers(0, 60_000, n))).astype(">u8")
    end = start + rng.integers(0, 5000, n).astype(">u8")
    pkts = rng.integers(1, 200, n).astype(">u4")
    byts = (pkts * rng.integers(40, 1500, n)).astype(">u4")
    cols = [src, dst, start, end, byts, pkts, rng.integers(1, 8, n).astype(">u4"),
            rng.integers(1, 8, n).astype(">u4"), rng.integers(1024, 65535, n).astype(">u2"),
            rng.choice(np.array([53, 80, 443, 22, 123, 8080], ">u2"), n),
            rng.choice(np.array([6, 17, 1], "u1"), n, p=[0.6, 0.35, 0.05]),
            rng.integers(0, 64, n).astype("u1"), np.zeros(n, "u1"), np.zeros(n, "u1"),
            np.full(n, 4, "u1")]
    pos = 0
    for c in cols:
        w = c.dtype.itemsize
        out[:, pos:pos + w] = c.view(np.uint8).reshape(n, w)
        pos += w
    return out


def datagrams(version: int, n_records: int, seed: int = 7, domain: int = 1,
              with_template_every: int = 0) -> list[bytes]:
    """Export datagrams of ``n_records`` records (sequence numbers set; the first datagram, and
    every ``with_template_every``-th, also carries the template)."""
    recs = records(n_records, seed)
    out = []
    seq = 0
    for k, i in enumerate(range(0, n_records, PER_DATAGRAM)):
        chunk = recs[i:i + PER_DATAGRAM]
        data = struct.pack(">HH", TEMPLATE_ID, 4 + chunk.size) + chunk.tobytes()
        sets = data
        if k == 0 or (with_template_every and k % with_template_every == 0):
            sets = template_set(version) + data
        if version == 9:
            hdr = struct.pack(">HHIIII", 9, len(chunk) + (sets is not data), 3_600_000,
                              1_700_000_060, k, domain)
        else:
            hdr = struct.pack(">HHIII", 10, 16 + len(sets), 1_700_000_060, seq, domain)
        seq += len(chunk)
        out.append(hdr + sets)
    return out


def send_paced(payloads: list[bytes], dest: tuple[str, int], rate_flows: float,
               seconds: float, per_datagram: int = PER_DATAGRAM) -> dict:
    """Send ``payloads`` in a loop at ``rate_flows`` records/s for ``seconds``, rewriting the
    sequence numbers so that they stay continuous. Returns what was sent."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    bufs = [bytearray(p) for p in payloads[1:]]  # the first carries the template
    s.sendto(payloads[0], dest)
    version = payloads[0][1]
    sent_dgrams, sent_records = 1, per_datagram
    seq_v9, seq_ipfix = 1, per_datagram
    dgram_rate = rate_flows / per_datagram
    t0 = time.perf_counter()
    i = 0
    while True:
        now = time.perf_counter() - t0
        if now >= seconds:
            break
        due = int(now * dgram_rate) + 1
        while sent_dgrams < due:
            b = bufs[i % len(bufs)]
            i += 1
            if version == 9:
                struct.pack_into(">I", b, 12, seq_v9 & 0xFFFFFFFF)
                seq_v9 += 1
            else:
                struct.pack_into(">I", b, 8, seq_ipfix & 0xFFFFFFFF)
                seq_ipfix += per_datagram
            s.sendto(b, dest)
            sent_dgrams += 1
            sent_records += per_datagram
        time.sleep(0.0005)
    s.close()
    elapsed = time.perf_counter() - t0
    return {"datagrams": sent_dgrams, "records": sent_records, "seconds": elapsed}
