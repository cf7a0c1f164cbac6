"""Queries over enrichment fields through ``replay`` (Spark included) equal a truth computed per
packet with dpkt and the ``maxminddb`` reader: AS numbers and countries from a database written
by ``mmdb-writer`` around the capture's addresses, grouped, filtered (a prefilter bit), selected."""

from __future__ import annotations

import random
import socket
from collections import Counter

import dpkt
import maxminddb
import pytest

from api.replay import replay
from collector.config import Settings
from planner.query import parse_queries
from tests.enrichtools import oracle, random_networks, write_db
from tests.helpers import capture
from tests.reference import rows_of

pytestmark = pytest.mark.slow

COUNTRIES = ["NL", "DE", "US", "JP", "BR"]
QUERIES = """-- name: by_asn
SELECT time/86400 AS t, src_asn, count(*) AS n, sum(ip_len) AS b FROM packets
GROUP BY time/86400, src_asn;
-- name: to_countries
SELECT time/86400 AS t, dst_country, dst_asn, count(*) AS n FROM packets
WHERE dst_country IN ('NL', 'DE') OR dst_asn = {asn} GROUP BY time/86400, dst_country, dst_asn;
-- name: not_us
SELECT time/86400 AS t, src_country, count(*) AS n FROM packets WHERE src_country != 'US'
GROUP BY time/86400, src_country;
-- name: picked
SELECT src_ip, src_asn, dst_country FROM packets WHERE src_asn = {asn};
"""


def ip_packets(path):
    """(src, dst, ip_len) of each packet; None for a frame without IP (dpkt)."""
    out = []
    with open(path, "rb") as f:
        for _, buf in dpkt.pcap.Reader(f):
            ip = dpkt.ethernet.Ethernet(buf).data
            if isinstance(ip, dpkt.ip.IP):
                out.append((socket.inet_ntop(socket.AF_INET, ip.src),
                            socket.inet_ntop(socket.AF_INET, ip.dst), ip.len))
            elif isinstance(ip, dpkt.ip6.IP6):
                out.append((socket.inet_ntop(socket.AF_INET6, ip.src),
                            socket.inet_ntop(socket.AF_INET6, ip.dst), ip.plen + 40))
            else:
                out.append(None)
    return out


def database(path, packets, seed=4):
    """Random networks, then one around each address of the capture (a random length; a
    later one wins where they overlap): AS numbers and countries in one record."""
    rng = random.Random(seed)
    addrs = sorted({a for p in packets if p for a in p[:2]})
    nets = random_networks(3000, seed)
    for a in addrs:
        length = rng.randint(8, 30) if ":" not in a else rng.randint(16, 120)
        nets.append(f"{a}/{length}")
    records = {}
    for net in nets:
        if rng.random() < 0.1:
            continue  # some addresses in no network
        records[net] = {"autonomous_system_number": rng.choice([3320, 15169, 1221, 64500]),
                        "country": {"iso_code": rng.choice(COUNTRIES)}}
    # the most frequent source: a record without either value (NULL, not "no network")
    top = Counter(p[0] for p in packets if p).most_common(1)[0][0]
    records[f"{top}/{128 if ':' in top else 32}"] = {"note": "neither"}
    return write_db(path, records)


def test_enriched_queries_equal_maxminddb_per_packet(spark, tmp_path):
    pcap = capture("ok.pcap")
    packets = ip_packets(pcap)
    db = database(tmp_path / "geo.mmdb", packets)
    with maxminddb.open_database(str(db)) as reader:
        def asn(a):
            return oracle(reader, a, ("autonomous_system_number",)) if a else None

        def country(a):
            return oracle(reader, a, ("country", "iso_code")) if a else None
        look = [(asn(p[0]), asn(p[1]), country(p[0]), country(p[1]), p[2], p[0]) if p else
                (None, None, None, None, None, None) for p in packets]
    picked_asn = Counter(x[0] for x in look if x[0]).most_common(1)[0][0]
    # the truth: NULL fields group as NULL and no predicate holds on them
    want = {"by_asn": Counter(), "to_countries": Counter(), "not_us": Counter()}
    bytes_of: Counter = Counter()
    picked = []
    for s_asn, d_asn, s_c, d_c, ip_len, src in look:
        want["by_asn"][s_asn] += 1
        bytes_of[s_asn] += ip_len or 0
        if d_c in ("NL", "DE") or d_asn == picked_asn:
            want["to_countries"][(d_c, d_asn)] += 1
        if s_c is not None and s_c != "US":
            want["not_us"][s_c] += 1
        if s_asn == picked_asn:
            picked.append((src, s_asn, d_c))
    settings = Settings(initial_queries=None, planner={"measure_tuples": 0},
                        enrich={"asn": str(db), "country": str(db)})
    queries = parse_queries(QUERIES.format(asn=picked_asn))
    res = replay(pcap, queries, tmp_path / "work", spark, settings=settings)
    assert res.error is None
    got = {q.name: rows_of(q, t) for q, t in res.answers}
    assert Counter({r["src_asn"]: r["n"] for r in got["by_asn"]}) == want["by_asn"]
    assert {r["src_asn"]: r["b"] for r in got["by_asn"]} == dict(bytes_of)
    assert Counter({(r["dst_country"], r["dst_asn"]): r["n"] for r in got["to_countries"]}) \
        == want["to_countries"]
    assert Counter({r["src_country"]: r["n"] for r in got["not_us"]}) == want["not_us"]
    assert sorted((r["src_ip"], r["src_asn"], r["dst_country"]) for r in got["picked"]) == \
        sorted(picked)
    # not vacuous: several ASes and countries, NULLs among them
    assert len(want["by_asn"]) >= 4 and None in want["by_asn"]
    assert len(want["not_us"]) >= 3 and want["to_countries"]
