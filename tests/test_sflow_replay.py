"""Queries FROM samples over pmacctd's sFlow export of a capture (sampling rate 1) answer as the
same queries FROM packets over the packets that came through, once time is collapsed (a sample
carries its datagram's time, and pmacctd exports a file faster than its packets' own pace):
both through ``replay``, Spark included. And a query FROM counters over the same export."""

from __future__ import annotations

from pathlib import Path

import dpkt
import pytest

from api.replay import replay
from collector.config import Settings
from planner.query import parse_queries
from tests.helpers import capture
from tests.reference import rows_of
from tests.sflowgen import udp_pcap
from tests.sflowtools import decoded, pmacctd_sflow

pytestmark = pytest.mark.slow

# every window one day: the packets' (2018) and the datagrams' (2023) each fall in one
QUERIES = """-- name: pairs
SELECT time/86400 AS t, src_ip, dst_ip, count(*) AS n, sum(wirelen) AS b FROM {s}
WHERE protocol = 17 GROUP BY time/86400, src_ip, dst_ip;
-- name: dns
SELECT time/86400 AS t, src_ip, dst_ip, count(*) AS n FROM {s}
WHERE protocol = 17 AND dst_port = 53 AND dns_qr = 0 GROUP BY time/86400, src_ip, dst_ip;
-- name: ports
SELECT time/86400 AS t, protocol, dst_port, count(*) AS n, max(wirelen) AS m, min(ip_len) AS l
FROM {s} GROUP BY time/86400, protocol, dst_port;
-- name: names
SELECT time/86400 AS t, dns_qname, count(*) AS n FROM {s} WHERE dns_qr = 1
GROUP BY time/86400, dns_qname;
-- name: big_tcp
SELECT src_ip, src_port, dst_port, wirelen FROM {s} WHERE protocol = 6 AND wirelen > 1400;
"""


def first_packets(src: Path, n: int, out: Path) -> Path:
    with open(src, "rb") as f, open(out, "wb") as g:
        reader = dpkt.pcap.Reader(f)
        writer = dpkt.pcap.Writer(g, linktype=reader.datalink())
        for i, (ts, buf) in enumerate(reader):
            if i == n:
                break
            writer.writepkt(buf, ts=ts)
    return out


def answers_of(path: Path, stream: str, work: Path, spark) -> dict[str, list]:
    queries = parse_queries(QUERIES.format(s=stream))
    res = replay(path, queries, work, spark,
                 settings=Settings(initial_queries=None, planner={"measure_tuples": 0}))
    assert res.error is None
    out = {}
    for q, table in res.answers:
        rows = [{k: v for k, v in r.items() if k != "t"} for r in rows_of(q, table)]
        out[q.name] = sorted(rows, key=lambda r: sorted((k, str(v)) for k, v in r.items()))
    return out


def test_queries_from_samples_equal_the_same_queries_from_packets(spark, tmp_path):
    original = capture("ok.pcap").resolve()
    export = udp_pcap(tmp_path / "export.pcap", pmacctd_sflow(original, tmp_path))
    samples, _, _ = decoded(export)
    # ok.pcap's packets are all IP: what came through is its first len(samples) (the rest,
    # pmacctd's last unfilled datagram, never left it)
    came = first_packets(original, len(samples), tmp_path / "came.pcap")
    want = answers_of(came, "packets", tmp_path / "packets", spark)
    got = answers_of(export, "samples", tmp_path / "samples", spark)
    assert got == want
    assert all(want.values())  # not vacuous
    # the counters of pmacctd's interface, when its timer sent one: FROM counters answers them
    counters = parse_queries("-- name: octets\nSELECT time/86400 AS t, agent, if_index, "
                             "max(in_octets) AS o, count(*) AS n FROM counters "
                             "GROUP BY time/86400, agent, if_index;\n")
    res = replay(export, counters, tmp_path / "counters", spark,
                 settings=Settings(initial_queries=None, planner={"measure_tuples": 0}),
                 sflow_ports=[6343])
    assert res.error is None
    _, cs, _ = decoded(export)
    rows = rows_of(counters[0], res.answers[0][1])
    assert sum(r["n"] for r in rows) == len(cs)
    if cs:
        assert {r["o"] for r in rows} == {max(c["in_octets"] for c in cs)}
