"""Queries over enrichment fields through ``replay`` (Spark included) equal a truth computed per
packet with dpkt and the ``maxminddb`` reader: AS numbers and countries from a database written
by ``mmdb-writer`` around the capture's addresses, grouped, filtered (a prefilter bit), selected."""

from __future__ import annotations

import ipaddress
import random
import socket
from collections import Counter

import dpkt
import maxminddb
import pytest
import yaml

from api.replay import replay
from collector.config import Settings
from planner.query import parse_queries
from tests.enrichtools import oracle, random_networks, write_db
from tests.helpers import capture
from tests.reference import rows_of

pytestmark = pytest.mark.slow

COUNTRIES = ["NL", "DE", "US", "JP", "BR"]
ORGS = {3320: "Deutsche Telekom AG", 15169: "Google LLC", 1221: "Telstra", 64500: "Zürich Net"}
CITIES = ["Amsterdam", "Berlin", "São Paulo", "Tokyo", "Boston"]
NETWORKS = {"0.0.0.0/1": {"name": "low", "role": "upstream"}, "10.0.0.0/8": {"name": "corp"},
            "192.168.0.0/16": {"name": "home", "role": "internal", "site": "ams1"},
            "192.168.1.0/24": {"site": "lab"}, "::/0": {"name": "v6"},
            "fe80::/10": {"name": "link-local", "role": "internal"}}
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
SELECT src_ip, src_asn, dst_country, src_as_name FROM packets WHERE src_asn = {asn};
-- name: names
SELECT time/86400 AS t, src_as_name, dst_city, dst_net_name, count(*) AS n FROM packets
WHERE src_as_name != 'Telstra' GROUP BY time/86400, src_as_name, dst_city, dst_net_name;
-- name: sites
SELECT time/86400 AS t, src_net_site, src_net_role, count(*) AS n FROM packets
GROUP BY time/86400, src_net_site, src_net_role;
-- name: spread
SELECT time/86400 AS t, src_country, count(DISTINCT dst_as_name) AS d FROM packets
GROUP BY time/86400, src_country;
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
        asn = rng.choice(list(ORGS))
        records[net] = {"autonomous_system_number": asn,
                        "autonomous_system_organization": ORGS[asn],
                        "country": {"iso_code": rng.choice(COUNTRIES)},
                        "city": {"names": {"en": rng.choice(CITIES)}}}
    # the most frequent source: a record without either value (NULL, not "no network")
    top = Counter(p[0] for p in packets if p).most_common(1)[0][0]
    records[f"{top}/{128 if ':' in top else 32}"] = {"note": "neither"}
    return write_db(path, records)


def network(addr, attribute):
    """The most specific of NETWORKS holding ``addr`` (by brute force), and its value."""
    if addr is None:
        return None
    a = ipaddress.ip_address(addr)
    best = max((ipaddress.ip_network(n) for n in NETWORKS
                if ipaddress.ip_network(n).version == a.version and a in ipaddress.ip_network(n)),
               key=lambda n: n.prefixlen, default=None)
    return NETWORKS[str(best)].get(attribute) if best is not None else None


def test_enriched_queries_equal_maxminddb_per_packet(spark, tmp_path):
    pcap = capture("ok.pcap")
    packets = ip_packets(pcap)
    db = database(tmp_path / "geo.mmdb", packets)
    nets = tmp_path / "networks.yaml"
    nets.write_text(yaml.safe_dump(NETWORKS))
    with maxminddb.open_database(str(db)) as reader:
        def get(a, *path):
            return oracle(reader, a, path) if a else None
        look = [(get(p[0], "autonomous_system_number"), get(p[1], "autonomous_system_number"),
                 get(p[0], "country", "iso_code"), get(p[1], "country", "iso_code"), p[2], p[0])
                if p else (None, None, None, None, None, None) for p in packets]
        names = [(get(p[0], "autonomous_system_organization"), get(p[1], "city", "names", "en"),
                  network(p[1], "name"), network(p[0], "site"), network(p[0], "role"))
                 if p else (None,) * 5 for p in packets]
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
            picked.append((src, s_asn, d_c, ORGS.get(s_asn)))
    spread: dict = {}
    for _, d_asn, s_c, *_rest in look:
        spread.setdefault(s_c, set())
        if d_asn is not None:
            spread[s_c].add(ORGS[d_asn])
    want_names, want_sites = Counter(), Counter()
    for s_org, d_city, d_net, s_site, s_role in names:
        if s_org is not None and s_org != "Telstra":
            want_names[(s_org, d_city, d_net)] += 1
        want_sites[(s_site, s_role)] += 1
    settings = Settings(initial_queries=None, planner={"measure_tuples": 0},
                        enrich={"asn": str(db), "country": str(db), "city": str(db),
                                "networks": str(nets)})
    queries = parse_queries(QUERIES.format(asn=picked_asn))
    res = replay(pcap, queries, tmp_path / "work", spark, settings=settings)
    assert res.error is None
    got = {q.name: rows_of(q, t) for q, t in res.answers}
    assert Counter({r["src_asn"]: r["n"] for r in got["by_asn"]}) == want["by_asn"]
    assert {r["src_asn"]: r["b"] for r in got["by_asn"]} == dict(bytes_of)
    assert Counter({(r["dst_country"], r["dst_asn"]): r["n"] for r in got["to_countries"]}) \
        == want["to_countries"]
    assert Counter({r["src_country"]: r["n"] for r in got["not_us"]}) == want["not_us"]
    assert sorted((r["src_ip"], r["src_asn"], r["dst_country"], r["src_as_name"])
                  for r in got["picked"]) == sorted(picked)
    assert Counter({(r["src_as_name"], r["dst_city"], r["dst_net_name"]): r["n"]
                    for r in got["names"]}) == want_names
    assert Counter({(r["src_net_site"], r["src_net_role"]): r["n"]
                    for r in got["sites"]}) == want_sites
    assert {r["src_country"]: r["d"] for r in got["spread"]} == \
        {c: len(v) for c, v in spread.items()}
    assert len(want_names) >= 4 and len(want_sites) >= 3
    # not vacuous: several ASes and countries, NULLs among them
    assert len(want["by_asn"]) >= 4 and None in want["by_asn"]
    assert len(want["not_us"]) >= 3 and want["to_countries"]
