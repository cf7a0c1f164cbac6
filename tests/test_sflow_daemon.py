"""The daemon's sFlow listener (``type: sflow``): datagrams from an agent over loopback answered by
a query FROM samples and one FROM counters; a clean stop commits each agent's datagram and
sample sequences, and what the agent sent while the daemon was down is counted as lost after
the restart (as the NetFlow listener counts it); GET /exporters shows the agent.

The same daemon enriches (issue 46; one daemon for both, the suite's time): a second agent's
samples grouped by ``src_asn`` (the agent's own AS where its gateway record sent one:
enrich.asn_precedence) and ``dst_country`` equal a truth computed with the ``maxminddb``
reader; the database file is replaced while the daemon runs and the samples after the reload
take the new one's answers, with no stop; its input interfaces are named by SNMP from a real
snmpd in a namespace the test made (the agent's address polled there: ``host``). GET
/enrichment shows what is loaded."""

from __future__ import annotations

import os
import socket
import time
from collections import Counter

import httpx
import maxminddb
import pytest

from tests import sflowgen as g
from tests.enrichtools import oracle, write_db
from tests.processes import (
    answers,
    daemon_config,
    daemon_ready,
    free_port,
    metric,
    start_daemon,
    stop_daemon,
    wait_for,
)
from tests.snmptools import COMMUNITY, LINKS, snmp_agent  # noqa: F401

pytestmark = pytest.mark.slow

AGENT = "192.0.2.77"
GEO_AGENT = "192.0.2.9"  # the enrichment part's agent
QUERIES = """-- name: per_agent
SELECT time/2 AS t, agent, count(*) AS n, sum(est_packets) AS p, sum(wirelen) AS b
FROM samples WHERE agent = '192.0.2.77' GROUP BY time/2, agent;
-- name: https_out
SELECT time/2 AS t, dst_port, count(*) AS n FROM samples WHERE protocol = 6 AND src_port = 443
GROUP BY time/2, dst_port;
-- name: ifaces
SELECT time/2 AS t, agent, if_index, max(in_octets) AS octets FROM counters
GROUP BY time/2, agent, if_index;
-- name: by_asn
SELECT time/2 AS t, src_asn, count(*) AS n FROM samples WHERE agent = '192.0.2.9'
GROUP BY time/2, src_asn;
-- name: to_country
SELECT time/2 AS t, dst_country, count(*) AS n FROM samples
WHERE dst_country != 'US' AND agent = '192.0.2.9' GROUP BY time/2, dst_country;
-- name: by_link
SELECT time/2 AS t, in_if_name, in_if_description, in_if_speed, count(*) AS n FROM samples
WHERE agent = '192.0.2.9' GROUP BY time/2, in_if_name, in_if_description, in_if_speed;
"""
SAMPLES_PER_DATAGRAM = 3
RATE = 10


def datagram(seq: int, uptime_ms: int) -> bytes:
    """Datagram ``seq``: three flow samples of data source 7 (numbered on from the datagrams
    before it) and a counter sample of interface 7 whose octets grow with ``seq``."""
    first = (seq - 1) * SAMPLES_PER_DATAGRAM + 1
    generic = dict.fromkeys(g.GENERIC, 0)
    generic.update(if_index=7, if_type=6, if_speed=10**9, if_status=3, in_octets=1000 * seq)
    return g.datagram(AGENT, 0, seq, uptime_ms, [
        *(g.flow_sample(s, (0, 7), RATE, RATE * s, 0, (0, 7), (0, 9),
                        [g.raw_header(g.frame(), stripped=4)])
          for s in range(first, first + SAMPLES_PER_DATAGRAM)),
        g.counter_sample(seq, (0, 7), [g.generic_if(generic)])])


def send(port: int, seqs, t0: float) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for seq in seqs:
            s.sendto(datagram(seq, 3_600_000 + int((time.time() - t0) * 1000)),
                     ("127.0.0.1", port))
            time.sleep(0.01)


HOSTS = ["198.51.100.7", "203.0.113.9", "192.0.2.200", "2001:db8:1::5", "2001:db8:2::9",
         "100.64.3.3"]
GATEWAY_AS = 7018  # what the agent's extended gateway record says for some samples


def records(version: int) -> dict:
    """Networks around the hosts (the last host in none); version 2 moves them elsewhere."""
    out = {}
    for i, h in enumerate(HOSTS[:-1]):
        net = f"{h}/{24 if '.' in h else 48}"
        asn = [64496, 3320, 15169, 1221, 13335][(i + version) % 5]
        country = ["NL", "DE", "US", "JP", "BR"][(i + 2 * version) % 5]
        out[net] = {"autonomous_system_number": asn, "country": {"iso_code": country}}
    return out


def sample(k: int) -> tuple[str, str, bool]:
    """Sample k's source, destination (of the source's family), and whether its gateway
    record names an AS."""
    src = HOSTS[k % len(HOSTS)]
    same = [h for h in HOSTS if (":" in h) == (":" in src)]
    return src, same[(3 * k + 1) % len(same)], k % 4 == 0


LINK_INDEX: dict[str, int] = {}  # the agent's links' ifIndexes (set by the test)


def in_link(k: int) -> str:
    return "fsup0" if k % 2 else "fscust1"


def enrich_datagram(seq: int) -> bytes:
    out = []
    for j in range(3):
        k = 3 * (seq - 1) + j
        src, dst, gw = sample(k)
        recs = [g.sampled_ip(100, 17, src, dst, 5000, 53, 0, 0)]
        if gw:
            recs.append(g.ext_gateway("192.0.2.1", 65000, GATEWAY_AS, 0, [(2, [3356])], [],
                                      100))
        out.append(g.flow_sample(k + 1, (0, 3), 1, k + 1, 0, (0, LINK_INDEX[in_link(k)]),
                                 (0, 4), recs))
    return g.datagram(GEO_AGENT, 0, seq, 1000 + seq, out)


def send_enriched(port: int, seqs) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for seq in seqs:
            s.sendto(enrich_datagram(seq), ("127.0.0.1", port))
            time.sleep(0.01)


def truth(db, seqs) -> tuple[Counter, Counter]:
    asn, country = Counter(), Counter()
    with maxminddb.open_database(str(db)) as r:
        for seq in seqs:
            for j in range(3):
                src, dst, gw = sample(3 * (seq - 1) + j)
                asn[GATEWAY_AS if gw else oracle(r, src, ("autonomous_system_number",))] += 1
                c = oracle(r, dst, ("country", "iso_code"))
                if c is not None and c != "US":
                    country[c] += 1
    return asn, country


def test_sflow_listener_answers_and_counts_what_a_restart_lost(tmp_path,
                                                              snmp_agent):  # noqa: F811
    links = snmp_agent.links()
    LINK_INDEX.update({name: i for i, (name, _) in links.items()})
    speeds = snmp_agent.speeds()
    db = write_db(tmp_path / "geo.mmdb", records(1))
    first_db = write_db(tmp_path / "geo-1.mmdb", records(1))
    listen = free_port()
    cfg, port = daemon_config(tmp_path, [f"{{type: sflow, name: fabric, listen: "
                                         f"['127.0.0.1:{listen}']}}"], QUERIES)
    cfg.write_text(cfg.read_text() + f"""enrich:
  asn: {db}
  country: {db}
  reload_s: 0.5
  snmp: {{refresh_s: 1, devices: {{{GEO_AGENT}: {{community: {COMMUNITY},
    host: {snmp_agent.address}, port: {snmp_agent.port}}}}}}}
""")
    base = f"http://127.0.0.1:{port}"
    t0 = time.time()
    decoded = [0]

    def value(name: str, labels: str) -> float:
        return metric(httpx.get(f"{base}/metrics", timeout=10).text, name, labels)

    def flow_samples() -> float:
        return value("flowsieve_sflow_samples_total", 'kind="flow",source="fabric"')

    def enriched() -> float:
        return value("flowsieve_enrich_tuples_total", 'stream="samples"')

    logged = tmp_path / "daemon.log"
    with open(logged, "w") as log:
        proc = start_daemon(cfg, log)
        try:
            wait_for(lambda: daemon_ready(proc, base, logged), 240, "the daemon ready")
            send(listen, range(1, 21), t0)
            wait_for(lambda: flow_samples() >= 60, 60, "60 flow samples decoded")
            decoded[0] = flow_samples()
        finally:
            stop_daemon(proc)  # a clean stop: the sequences are committed
        # datagrams 21..25 are sent while the daemon is down: nobody receives them
        proc = start_daemon(cfg, log)
        try:
            wait_for(lambda: daemon_ready(proc, base, logged), 240, "the daemon ready again")
            send(listen, range(26, 31), t0)
            wait_for(lambda: flow_samples() >= 15, 60, "15 more flow samples decoded")
            text = httpx.get(f"{base}/metrics", timeout=10).text
            lost = metric(text, "flowsieve_flow_sequence_lost_total",
                          f'exporter="{AGENT}",source="fabric"')
            samples_lost = metric(text, "flowsieve_sflow_samples_lost_total",
                                  f'agent="{AGENT}",source="fabric"')
            assert (lost, samples_lost) == (5, 15)
            [exp] = httpx.get(f"{base}/exporters", timeout=10).json()
            [st] = exp["streams"]
            assert exp["exporter"] == AGENT and st["protocol"] == "sflow"
            assert st["sequence"]["lost"] == 5 and st["samples"]["lost"] == 15
            assert st["sequence"]["next"] == 31
            # enrichment: what is loaded, then the second agent's samples before and after
            # its database file is replaced (renamed over it, as a download would)
            shown = httpx.get(f"{base}/enrichment", timeout=10).json()
            assert shown["asn_precedence"] == "exporter"
            assert {d["database"]: d.get("networks") for d in shown["databases"]} == \
                {"asn": 5, "country": 5, "interfaces": None}
            wait_for(lambda: value("flowsieve_enrich_snmp_polls_total",
                                   f'device="{GEO_AGENT}",outcome="ok"') >= 1, 60,
                     "the agent's interfaces polled")
            send_enriched(listen, range(1, 21))
            wait_for(lambda: enriched() >= 15 + 60, 60, "60 samples enriched")
            write_db(tmp_path / "geo-2.mmdb", records(2))
            os.replace(tmp_path / "geo-2.mmdb", db)
            wait_for(lambda: value("flowsieve_enrich_reloads_total", 'database="asn"') >= 1 and
                     value("flowsieve_enrich_reloads_total", 'database="country"') >= 1,
                     60, "the databases reloaded")
            send_enriched(listen, range(21, 41))
            wait_for(lambda: enriched() >= 15 + 120, 60, "120 samples enriched")
            # every window answered: the samples of both runs, the counters' growing octets
            client = httpx.Client(base_url=base, timeout=30)
            end = time.time()
            found = {}
            for q in ("per_agent", "https_out", "ifaces", "by_asn", "to_country", "by_link"):
                wait_for(lambda q=q: (answers(client, q)[1] or 0) > end, 120,
                         f"{q}'s windows closed")  # each stream's Spark query
                found[q] = answers(client, q)[0]
            client.close()
        finally:
            stop_daemon(proc)
    rows, https, ifaces = found["per_agent"], found["https_out"], found["ifaces"]
    assert decoded[0] == 60
    n = sum(r["n"] for r in rows)
    assert n == 75 and {r["agent"] for r in rows} == {AGENT}
    assert sum(r["p"] for r in rows) == 75 * RATE
    assert sum(r["b"] for r in rows) == 75 * len(g.frame())  # the frame, FCS stripped
    assert sum(r["n"] for r in https) == 75 and {r["dst_port"] for r in https} == {50123}
    assert max(r["octets"] for r in ifaces) == 30_000 and {r["if_index"] for r in ifaces} == {7}
    # enrichment: each half with its database, the interfaces as the agent names them
    a1, c1 = truth(first_db, range(1, 21))
    a2, c2 = truth(db, range(21, 41))
    got_asn, got_country, got_links = Counter(), Counter(), Counter()
    for r in found["by_asn"]:
        got_asn[r["src_asn"]] += r["n"]
    for r in found["to_country"]:
        got_country[r["dst_country"]] += r["n"]
    for r in found["by_link"]:
        got_links[(r["in_if_name"], r["in_if_description"], r["in_if_speed"])] += r["n"]
    want_links = Counter()
    for k in range(120):
        name = in_link(k)
        want_links[(name, LINKS[name], speeds[LINK_INDEX[name]] or None)] += 1
    assert got_asn == a1 + a2
    assert got_country == c1 + c2
    assert got_links == want_links
    assert a1 != a2 and None in got_asn and GATEWAY_AS in got_asn  # not vacuous
