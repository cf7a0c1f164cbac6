"""The workloads tests/test_prepare.py runs, each in a fresh process whose numba cache is the one
``compile_kernels`` filled (``python -m tests.kernel_workloads NAME FOLDER``): what users run,
on other captures and queries than the warm-up's. The test compares the cache's indexes before
and after: a workload must compile nothing new.

- ``decode``: ``flowsieve decode`` (the CLI's own code, in this process) of every test capture
  of each stream: classic pcap (microsecond, nanosecond, big-endian, cut short), pcapng, export
  captures and payload files of many exporters, sFlow datagrams of every structure; from files
  and from standard input; every field, payloads, enrichment fields of three MMDB databases and
  a networks table; csv, json and Parquet.
- ``engines``: the engine as ``replay`` runs it (a plan measured on the capture; a large
  file's byte ranges read apart) with broad query sets of each stream over many captures
  (Arrow spool files once), and each spool's answer tasks as Spark's Python workers run them
  (``derive.answer_locally``); the daemon (``Collector``: its sources' threads, a file and
  NetFlow and sFlow listeners, Spark off). The LFTA merges with its generic kernel only: a
  key layout's own is compiled per layout of the queries, by design (tests/test_prepare.py).
"""

from __future__ import annotations

import io
import os
import socket
import sys
import threading
import time
from pathlib import Path

from tests.helpers import DATA, ROOT

PCAPS = sorted((DATA / "pcap").glob("*.pcap*"))
EXPORTS = sorted((DATA / "netflow").rglob("*.pcap"))
FLOW_PORTS = "2055,4739,9995,9996,9990,9991,9992"
MMDB = DATA / "mmdb"
NETWORKS = """\
10.0.0.0/8: {name: private, role: lan}
192.168.0.0/16: {name: home, role: lan, site: house}
208.80.152.0/22: {name: wikimedia, role: cdn}
2001:db8::/32: documentation
"""

PACKET_QUERIES = """
-- name: dns_sel
SELECT ts, src_ip, dst_port FROM packets WHERE protocol = 17 AND dst_port = 53;
-- name: tcp_top
SELECT time/60 AS t, dst_port, count(*) AS n, avg(wirelen) AS mean, min(wirelen) AS lo,
       max(wirelen) AS hi
FROM packets WHERE protocol = 6 GROUP BY time/60, dst_port
HAVING count(*) >= 2 ORDER BY n DESC LIMIT 3;
-- name: wiki_names
SELECT time/60 AS t, count(*) AS n FROM packets WHERE regexp(dns_qname, 'wiki') GROUP BY time/60;
-- name: fanout
SELECT time/10 AS t, src_ip, count(DISTINCT dst_ip) AS dsts, count(DISTINCT dst_port) AS ports,
       count(*) AS n, sum(wirelen) AS bytes
FROM packets WHERE protocol = 17 OR protocol = 6 GROUP BY time/10, src_ip;
-- name: fanin
SELECT time/10 AS t, dst_ip, count(DISTINCT src_ip) AS srcs FROM packets
WHERE dst_port < 1024 GROUP BY time/10, dst_ip HAVING count(DISTINCT src_ip) >= 2;
-- name: syn_ports
SELECT time/10 AS t, dst_ip, count(DISTINCT dst_port) AS ports FROM packets
WHERE (tcp_flags & 18) = 2 GROUP BY time/10, dst_ip ORDER BY ports DESC LIMIT 2;
-- name: nets
SELECT time/10 AS t, prefix(dst_ip, 24) AS net, count(DISTINCT src_ip) AS srcs, count(*) AS n
FROM packets WHERE protocol = 17 GROUP BY time/10, prefix(dst_ip, 24);
-- name: lens
SELECT time/10 AS t, sum(ip_len) AS ipb, min(ip_len) AS lo, max(ip_len) AS hi, count(*) AS n
FROM packets GROUP BY time/10;
-- name: fanout_approx
SELECT time/10 AS t, src_ip, approx_count_distinct(dst_ip) AS dsts, count(*) AS n
FROM packets WHERE protocol = 17 OR protocol = 6 GROUP BY time/10, src_ip
HAVING approx_count_distinct(dst_ip) >= 1;
-- name: names_approx
SELECT time/10 AS t, approx_count_distinct(dns_qname) AS names FROM packets GROUP BY time/10;
-- name: ssh_banner
SELECT ts, src_ip, payload FROM packets WHERE contains(payload, 'SSH-2.0');
-- name: ttls
SELECT time/10 AS t, dns_an_name, dns_an_addr, count(DISTINCT dns_an_ttl) AS ttls,
       min(wirelen) AS lo
FROM packets WHERE regexp(dns_an_name, '.') GROUP BY time/10, dns_an_name, dns_an_addr;
-- name: vlans
SELECT time/5 AS t, vlan, mpls_label, ip_version, count(*) AS n FROM packets
WHERE vlan >= 0 OR mpls_label >= 0 OR ip_version = 6 GROUP BY time/5, vlan, mpls_label, ip_version;
-- name: web
SELECT time/30 AS t, dst_port, count(*) AS n FROM packets
WHERE dst_port IN (21, 22, 23, 25, 53, 67, 68, 80, 110, 123, 137, 143, 161, 389, 443, 445, 993,
                   995, 1723, 3389, 5353) GROUP BY time/30, dst_port;
-- name: half_open
WITH syn AS (SELECT time/10 AS t, dst_ip, count(*) AS n FROM packets
             WHERE (tcp_flags & 18) = 2 GROUP BY time/10, dst_ip),
     synack AS (SELECT time/10 AS t, src_ip, count(*) AS n FROM packets
                WHERE (tcp_flags & 18) = 18 GROUP BY time/10, src_ip)
SELECT syn.t AS t, syn.dst_ip AS host, syn.n AS syns, synack.n AS acks,
       syn.n - coalesce(synack.n, 0) AS open
FROM syn LEFT JOIN synack ON syn.t = synack.t AND syn.dst_ip = synack.src_ip;
-- name: asym
WITH o AS (SELECT time/10 AS t, src_ip, sum(wirelen) AS bytes, count(*) AS n FROM packets
           WHERE protocol = 17 GROUP BY time/10, src_ip),
     i AS (SELECT time/10 AS t, dst_ip, count(*) AS n FROM packets WHERE protocol = 17
           GROUP BY time/10, dst_ip)
SELECT o.t AS t, o.src_ip AS host, o.bytes / o.n AS mean, o.n - i.n AS d
FROM o JOIN i ON i.dst_ip = o.src_ip AND o.t = i.t WHERE o.n >= 2 AND o.n - i.n != 0;
-- name: geo
SELECT time/60 AS t, src_country, dst_country, dst_continent, count(*) AS n FROM packets
GROUP BY time/60, src_country, dst_country, dst_continent;
-- name: cities
SELECT time/60 AS t, dst_city, dst_region, src_net_site, count(DISTINCT src_ip) AS srcs
FROM packets WHERE dst_asn >= 0 OR dst_net_name = 'wikimedia' GROUP BY time/60, dst_city,
dst_region, src_net_site;
"""

FLOW_QUERIES = """
-- name: by_proto
SELECT time/60 AS t, protocol, count(*) AS flows, sum(packets) AS pkts, sum(est_bytes) AS bytes
FROM flows GROUP BY time/60, protocol;
-- name: tcp443
SELECT src_ip, dst_ip, bytes FROM flows WHERE protocol = 6 AND src_port = 443;
-- name: pairs
SELECT time/86400 AS t, src_ip, dst_ip, count(*) AS flows, sum(packets) AS pkts,
       sum(bytes) AS bytes
FROM flows GROUP BY time/86400, src_ip, dst_ip;
-- name: exporters
SELECT time/300 AS t, exporter, input_if, output_if, count(DISTINCT dst_port) AS ports
FROM flows WHERE tcp_flags & 2 != 0 OR protocol = 17 GROUP BY time/300, exporter, input_if,
output_if ORDER BY ports DESC LIMIT 5;
-- name: flow_as
SELECT time/3600 AS t, src_asn, dst_asn, dst_country, sum(bytes) AS bytes FROM flows
WHERE NOT in_prefix(src_ip, '10.0.0.0/8') GROUP BY time/3600, src_asn, dst_asn, dst_country;
"""

SAMPLE_QUERIES = """
-- name: agents
SELECT time/10 AS t, agent, sub_agent, count(*) AS n, sum(est_bytes) AS bytes FROM samples
GROUP BY time/10, agent, sub_agent;
-- name: sampled_ports
SELECT time/10 AS t, dst_port, protocol, approx_count_distinct(src_ip) AS srcs,
       sum(est_packets) AS pkts
FROM samples WHERE src_vlan >= 0 OR protocol = 6 GROUP BY time/10, dst_port, protocol;
-- name: sampled_names
SELECT ts, agent, src_ip, dst_ip, input_if, dst_city FROM samples WHERE dst_port = 443;
-- name: interfaces
SELECT time/60 AS t, agent, if_index, max(in_octets) AS i, max(out_octets) AS o,
       count(*) AS n
FROM counters GROUP BY time/60, agent, if_index;
-- name: errors
SELECT ts, agent, if_index, in_errors FROM counters WHERE in_errors >= 0
"""


def enrich_config(folder: Path) -> dict:
    """Three MMDB databases (AS numbers, countries, cities) and a networks table."""
    networks = folder / "networks.yaml"
    networks.write_text(NETWORKS)
    return {"asn": str(MMDB / "GeoLite2-ASN-Test.mmdb"),
            "country": str(MMDB / "GeoIP2-Country-Test.mmdb"),
            "city": str(MMDB / "GeoLite2-City-Test.mmdb"), "networks": str(networks)}


def flow_captures(folder: Path) -> list[Path]:
    """The export captures, and pcaps of the logstash and python-netflow payload files."""
    from tests.flowtools import HEX, LOGSTASH, read_hex, split_payloads, write_pcap
    out = list(EXPORTS)
    out.append(write_pcap(folder / "logstash.pcap", [
        p for f in sorted(LOGSTASH.glob("*.dat")) for p in split_payloads(f.read_bytes())]))
    out.append(write_pcap(folder / "hex.pcap", [
        p for f in sorted(HEX.glob("*.hex")) for p in read_hex(f)], port=4739))
    return out


def sflow_captures(folder: Path) -> list[Path]:
    from collector.config import data_file
    from tests.sflowgen import every_structure
    return [every_structure(folder), Path(data_file("sample-sflow.pcap"))]


# --------------------------------------------------------------------------- decode
def decode(folder: str) -> None:
    from api.cli import main
    work = Path(folder)
    config = work / "enrich.yaml"
    config.write_text("enrich:\n" + "".join(f"  {k}: {v}\n"
                                             for k, v in enrich_config(work).items()))
    out = str(work / "out")
    for path in PCAPS:
        main(["decode", str(path), "--output", out])
    everything = ("ts,iface,caplen,wirelen,eth_type,vlan,vlan_inner,mpls_label,src_ip,dst_ip,"
                  "protocol,ttl,src_port,dst_port,tcp_flags,dns_qname,dns_an_name,dns_an_addr,"
                  "payload,src_asn,dst_as_name,src_country,dst_city,src_net_name,dst_net_role")
    for name in ("wikipedia.pcap", "pcapng-multi-interface.pcapng", "ipv6-fragmented-dns.pcap"):
        for fmt in ("csv", "json", "parquet"):
            main(["decode", str(DATA / "pcap" / name), "--fields", everything, "--config",
                  str(config), "--format", fmt, "--output", out])
    for path in flow_captures(work):
        main(["decode", str(path), "--stream", "flows", "--flow-ports", FLOW_PORTS,
              "--output", out])
        main(["decode", str(path), "--stream", "flows", "--flow-ports", FLOW_PORTS, "--fields",
              "exporter,src_ip,dst_ip,bytes,src_asn,dst_country,src_net_name", "--config",
              str(config), "--output", out])
    for path in sflow_captures(work):
        for stream in ("samples", "counters"):
            main(["decode", str(path), "--stream", stream, "--output", out])
        main(["decode", str(path), "--stream", "samples", "--fields",
              "agent,src_ip,dst_ip,dns_qname,payload,src_asn,dst_city,dst_net_name",
              "--config", str(config), "--output", out])
    for path in (DATA / "pcap" / "ok.pcap", DATA / "pcap" / "cooper-grill-dvwa.pcapng",
                 Path(sflow_captures(work)[0])):
        stream = "samples" if path.name.startswith("structures") else "packets"
        with _stdin(path):
            main(["decode", "-", "--stream", stream, "--output", out])


class _stdin:
    """``path``'s bytes as this process's standard input, through a pipe written in pieces."""

    def __init__(self, path: Path):
        self.data = path.read_bytes()

    def __enter__(self):
        r, w = os.pipe()

        def write() -> None:
            with open(w, "wb", buffering=0) as f:
                for k in range(0, len(self.data), 4096):
                    f.write(self.data[k:k + 4096])
                    time.sleep(0.001)
        self.writer = threading.Thread(target=write, daemon=True)
        self.writer.start()
        self.saved = sys.stdin
        sys.stdin = io.TextIOWrapper(open(r, "rb"))
        return self

    def __exit__(self, *exc) -> None:
        self.writer.join()
        sys.stdin.close()
        sys.stdin = self.saved


# --------------------------------------------------------------------------- engines
def _batches(stream: str, capture: Path, batch_size: int):
    from capture.netflow import capture_flows
    from capture.pcap import open_capture
    from capture.sflow import DEFAULT_SFLOW_PORTS, capture_sflow
    if stream == "packets":
        return open_capture(capture, batch_size)
    if stream == "flows":
        return capture_flows(capture, [int(p) for p in FLOW_PORTS.split(",")],
                             batch_size=batch_size)
    batches = capture_sflow(capture, DEFAULT_SFLOW_PORTS, batch_size=batch_size)
    return batches if stream == "samples" else (b.counters() for b in batches)


def replayed(capture: Path, queries: list, work: Path, settings) -> None:
    """``replay``'s capture side (its measured plan, an engine per stream, read ahead), then
    the answer tasks over its spool."""
    from contextlib import closing

    from api.replay import measured_plan, replay_plan_options
    from capture.errors import DecodeError
    from collector.daemon.sources import ahead
    from collector.metrics import Metrics
    from collector.pipeline.engine import Engine
    from collector.pipeline.spool import Spool
    from planner.plan import build_plan
    spool = Spool(work / "spool", settings.spool.max_bytes, "block", 0.0,
                  format=settings.spool.format, probe="workload")
    plan = build_plan(queries, **replay_plan_options(settings))
    plan = measured_plan(capture, queries, plan, spool, settings,
                         flow_ports=[int(p) for p in FLOW_PORTS.split(",")])
    for stream in plan.streams():
        engine = Engine(spool, stream, Metrics(), "replay", settings.spark.watermark_delay_s,
                        asc=settings.asc, lfta=settings.lfta, residual=settings.residual,
                        om=settings.om, finite=True)
        engine.set_plan(plan)
        try:
            with closing(ahead(_batches(stream, capture, settings.batch_size),
                               engine.prepare)) as read:
                for batch, tuples in read:
                    engine.process(batch, "replay", prepared=tuples)
        except DecodeError:
            pass
        engine.finish()
    answered(work / "spool", plan)


def answered(root: Path, plan) -> None:
    """What Spark's answer tasks compute, over every spool file of ``plan``'s folders."""
    import pyarrow as pa

    from collector.pipeline.spool import list_files, read_spool_file
    from collector.spark.derive import Folder, answer_locally
    slots = [(qp.slot, qp.query) for qp in plan.queries]
    for stream in plan.streams():
        for folder in plan.folders(stream):
            files = list_files(root / stream / folder)
            if files:
                answer_locally(pa.concat_tables([read_spool_file(f) for f in files]),
                               Folder(stream, folder, tuple(sorted(
                                   (s, q) for s, q in slots
                                   if q.stream == stream and q.folder == folder))))


def engines(folder: str) -> None:
    from capture import enrich
    from collector.config import Settings
    from collector.pipeline import enrichment, lfta_kernels
    from collector.spark.worker import preload
    from planner.query import parse_queries
    lfta_kernels.SPECIALIZE = False
    work = Path(folder)
    settings = Settings(initial_queries=None, enrich=enrich_config(work))
    enrichment.configure(settings.enrich, work / "dictionary")
    packets, flows = parse_queries(PACKET_QUERIES), parse_queries(FLOW_QUERIES)
    sampled = parse_queries(SAMPLE_QUERIES)
    runs = [(DATA / "pcap" / n, packets) for n in (
        "ok.pcap", "wikipedia.pcap", "var-services-std-ports.pcap", "icmp6.pcap",
        "mixed-vlan-mpls.pcap", "tcp-handshake-nano.pcap", "pptp.pcap", "dns_tcp.pcap",
        "cooper-grill-dvwa.pcapng", "pcapng-multi-interface.pcapng",
        "ipv6-fragmented-dns.pcap")]
    runs += [(p, flows) for p in flow_captures(work)]
    runs += [(p, sampled) for p in sflow_captures(work)]
    for k, (capture, queries) in enumerate(runs):
        replayed(capture, queries, work / f"replay-{k}", settings)
    arrow = settings.model_copy(update={"spool": settings.spool.model_copy(
        update={"format": "arrow"}), "batch_size": 64})
    replayed(DATA / "pcap" / "bro.org.pcap", packets, work / "arrow", arrow)
    daemon(work, packets + flows + sampled)
    in_ranges(DATA / "pcap" / "bro.org.pcap")
    preload()
    enrich.configure({})


def in_ranges(capture: Path) -> None:
    """``replay``'s reading processes' share of a large file: its byte ranges, each read
    apart (here in turn) and unpacked."""
    from api.replay import byte_ranges
    from capture.pcap import open_capture
    from capture.unpack import unpack
    from collector.config import Settings
    ranges = byte_ranges(capture, Settings(initial_queries=None, replay_workers=3))
    assert len(ranges) == 3
    for byte_range in ranges:
        for raw in open_capture(capture, 4096, byte_range=byte_range):
            unpack(raw)


def daemon(work: Path, queries: list) -> None:
    """``flowsieve run`` without Spark: a capture file, a NetFlow/IPFIX listener and an sFlow
    listener, each source on its thread feeding its engine, until each has had everything;
    then the spool's answers."""
    from collector.config import SourceConfig, load_settings
    from collector.daemon.service import Collector
    from tests.flowtools import LOGSTASH, split_payloads
    sql = work / "daemon.sql"
    sql.write_text(";\n".join(q.text.strip().rstrip(";") for q in queries) + "\n")
    flows = [p for f in sorted(LOGSTASH.glob("*.dat")) for p in split_payloads(f.read_bytes())]
    sflow = _payloads(sflow_captures(work)[0], 6343)
    c = Collector(load_settings(
        var_dir=work / "var", initial_queries=str(sql), batch_size=256,
        sources=[SourceConfig(type="pcap", name="file", loop=False, restamp=False,
                              path=str(DATA / "pcap" / "wikipedia.pcap")),
                 SourceConfig(type="netflow", name="nf", listen=["127.0.0.1:0"]),
                 SourceConfig(type="sflow", name="sf", listen=["127.0.0.1:0"])],
        enrich=enrich_config(work), spark={"trigger_s": 0.2}))
    c.start(with_sources=True, with_spark=False)
    try:
        deadline = time.monotonic() + 60
        while not all(s.listener.bound for s in c.sources[1:3]) and time.monotonic() < deadline:
            time.sleep(0.05)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for src, payloads in ((c.sources[1], flows), (c.sources[2], sflow)):
                for p in payloads:
                    s.sendto(p, src.listener.bound[0])
                    time.sleep(0.001)
        while time.monotonic() < deadline and not (
                c.source_state.get("file") == "finished"
                and c.sources[1].listener.stats.datagrams >= len(flows)
                and c.sources[2].listener.stats.datagrams >= len(sflow)):
            time.sleep(0.1)
        time.sleep(1.0)  # the flusher's clock and the counters feed
    finally:
        c.stop()
    answered(c.settings.spool_dir, c.engines[0].plan)


def _payloads(capture: Path, port: int) -> list[bytes]:
    from capture.netflow import export_datagrams
    from capture.pcap import open_capture
    out = []
    for raw in open_capture(capture):
        dg = export_datagrams(raw, [port])
        out += [dg.buf[o:o + n].tobytes() for o, n in zip(dg.offset, dg.length, strict=True)]
    return out


if __name__ == "__main__":
    os.chdir(ROOT)
    globals()[sys.argv[1]](sys.argv[2])
