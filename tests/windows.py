"""dpkt's answers, per window, of two packet queries over a capture that a test's Feeder is
still writing, and the answers a daemon wrote to its results folder (read from the part files:
a window in two parts is an answer doubled). The crash and disk-full tests check every window
against them after each fault."""

from __future__ import annotations

import struct
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq

from tests.processes import PERIOD
from tests.reference import fields_of

QUERIES = """
-- name: all5s
SELECT time/5 AS t, count(*) AS n, sum(caplen) AS b FROM packets GROUP BY time/5;
-- name: udp_src
SELECT time/5 AS t, src_ip, count(*) AS n, max(caplen) AS m FROM packets
WHERE protocol = 17 GROUP BY time/5, src_ip
"""


def pcap_records(path: Path) -> list[tuple[float, bytes]]:
    """The whole records of a pcap being written (a record cut short at the end is left)."""
    data = path.read_bytes()
    out, at = [], 24
    while at + 16 <= len(data):
        sec, usec, caplen, _ = struct.unpack_from("<IIII", data, at)
        if at + 16 + caplen > len(data):
            break
        out.append((sec + usec / 1e6, data[at + 16: at + 16 + caplen]))
        at += 16 + caplen
    return out


def truth(path: Path) -> dict[str, dict]:
    """dpkt's answers of the queries, per window (``t``), over the capture as it is now."""
    all5s: dict = defaultdict(lambda: [0, 0])
    udp: dict = defaultdict(lambda: [0, 0])
    for ts, buf in pcap_records(path):
        f = fields_of(ts, buf, 1)
        t = f["time"] // PERIOD
        all5s[t][0] += 1
        all5s[t][1] += f["caplen"]
        if f["protocol"] == 17 and f["src_ip"] is not None:
            u = udp[(t, f["src_ip"])]
            u[0] += 1
            u[1] = max(u[1], f["caplen"])
    by_t: dict = defaultdict(set)
    for (t, ip), (n, m) in udp.items():
        by_t[t].add((ip, n, m))
    return {"all5s": {t: {(n, b)} for t, (n, b) in all5s.items()}, "udp_src": dict(by_t)}


def answered(results: Path) -> dict[str, dict]:
    """Every window each query answered, read from its part files (each window once: a
    window in two parts is an answer doubled)."""
    out = {}
    for name, cols in (("all5s", ("n", "b")), ("udp_src", ("src_ip", "n", "m"))):
        windows: dict = {}
        where: dict = {}
        for part in sorted((results / f"query={name}").glob("part-*.parquet")):
            rows = pq.read_table(part).to_pylist()
            got: dict = defaultdict(set)
            for r in rows:
                got[r["t"]].add(tuple(r[c] for c in cols))
            for t, v in got.items():
                assert t not in windows, f"{name}: window {t} answered twice ({where[t]}, " \
                                         f"{part.name})"
                windows[t], where[t] = v, part.name
        out[name] = windows
    return out


def check(results: Path, capture: Path) -> int:
    """Every window answered so far equals the truth; how many windows all5s answered."""
    want, got = truth(capture), answered(results)
    for name in got:
        for t, rows in got[name].items():
            assert rows == want[name].get(t, set()), (name, t, rows, want[name].get(t))
    return len(got["all5s"])


def check_whole(results: Path, capture: Path, written: int) -> None:
    """At the end: every window of the capture answered, each equal to the truth, every
    packet written counted once."""
    check(results, capture)
    got, want = answered(results)["all5s"], truth(capture)["all5s"]
    assert got and sorted(got) == sorted(want), (sorted(got), sorted(want))  # nothing lost
    assert sum(n for rows in got.values() for n, _ in rows) == written
