"""sFlow that pmacct's ``pmacctd`` (plugin sfprobe) exports of the test captures, at sampling
rate 1: decoded as tshark dissects it, every sample one of the capture's packets with the
packet's fields (NULL where they lie beyond the sampled header), and the same counts and bytes
per flow as pmacct's own collector ``sfacctd`` prints."""

from __future__ import annotations

import collections
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from capture.pcap import open_capture
from capture.sflow.batch import table_rows
from capture.unpack import unpack
from tests.helpers import capture, need_tool
from tests.sflowgen import udp_pcap
from tests.sflowtools import assert_equal_tshark, decoded, pmacctd_sflow

CAPTURES = ("ok.pcap", "bro.org.pcap", "mixed-vlan-mpls.pcap", "icmp6.pcap", "q-in-q.pcap",
            "var-services-std-ports.pcap", "wikipedia.pcap", "ipv6-fragmented-dns.pcap")


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    """Each capture's sFlow export (pmacctd's, concurrently), as a capture of its datagrams."""
    work = tmp_path_factory.mktemp("pmacct")
    with ThreadPoolExecutor(len(CAPTURES)) as pool:
        got = dict(zip(CAPTURES, pool.map(
            lambda n: pmacctd_sflow(capture(n).resolve(), work), CAPTURES), strict=True))
    return {n: udp_pcap(work / f"{n}.sflow.pcap", d) for n, d in got.items()}


def packets(name: str) -> list[dict]:
    rows = []
    for raw in open_capture(capture(name)):
        rows += table_rows(unpack(raw), "packets")
    return rows


@pytest.mark.parametrize("name", CAPTURES)
def test_pmacct_exports_equal_tshark(exports, name):
    flows, _ = assert_equal_tshark(exports[name])  # and the counter samples pmacctd sends,
    assert flows  # when its timer comes round


@pytest.mark.parametrize("name", CAPTURES)
def test_each_sample_is_the_captures_packet(exports, name):
    """pmacctd samples IPv4 and IPv6 packets only (ARP and 802.3 frames are left out) and,
    at the end of a file, drops the samples that had not filled a datagram yet: the samples are
    the capture's IP packets in order, but those last ones. Each field equals the packet's, or
    is NULL when the packet's bytes for it lie beyond the sampled header (128 bytes: a DNS
    name or answer cut there is NULL, not garbage)."""
    samples, _, dec = decoded(exports[name])
    ip = [p for p in packets(name) if p["ip_version"] is not None]
    assert 0 < len(samples) <= len(ip)
    per_datagram = max(s["samples"]["flow"] for s in dec.streams()) / \
        max(1, min(s["datagrams"] for s in dec.streams()))
    assert len(ip) - len(samples) < max(8, 2 * per_datagram), "more than the last datagram"
    cut = 0
    for i, (s, p) in enumerate(zip(samples, ip, strict=False)):
        assert s["wirelen"] == p["wirelen"] and s["frame_length"] == p["wirelen"] + 4, i
        assert (s["sampling_rate"], s["est_packets"], s["est_bytes"]) == (1, 1, p["wirelen"])
        for k, v in p.items():
            if k in ("ts", "time", "iface", "caplen", "payload") or s[k] == v:
                continue
            assert s[k] is None and s["caplen"] < p["caplen"], \
                f"sample {i}: {k} = {s[k]!r}, the packet's {v!r}"
            cut += 1
    if name == "ipv6-fragmented-dns.pcap":
        assert cut  # its DNS answers lie beyond 128 bytes


def test_ok_pcap_loses_only_its_last_four_packets(exports):
    """ok.pcap (851 packets, all IP) gives 847 samples: the 4 left out are its last 4,
    pmacctd's partial datagram at the end of the file."""
    samples, _, dec = decoded(exports["ok.pcap"])
    assert len(samples) == 847 and len(samples) / 851 >= 0.98
    [agent] = dec.streams()
    # 130 datagrams of flow samples, and of counter samples as many as its timer sent
    assert agent["datagrams"] >= 130 and agent["sequence"]["lost"] == 0
    ip = packets("ok.pcap")
    key = ("src_ip", "dst_ip", "protocol", "src_port", "dst_port", "ip_id", "wirelen")
    assert [[s[k] for k in key] for s in samples] == [[p[k] for k in key] for p in ip[:847]]


SFACCTD_CONF = """daemonize: false
plugins: print
pcap_savefile: {capture}
pcap_savefile_wait: false
aggregate: src_host, dst_host, src_port, dst_port, proto
print_output: csv
print_output_file: {out}
print_refresh_time: 60
"""


@pytest.mark.parametrize("name", ("ok.pcap", "bro.org.pcap", "var-services-std-ports.pcap"))
def test_flows_equal_sfacctd(exports, name, tmp_path):
    """pmacct's collector reads the same export capture: per (source, destination, ports,
    protocol) its packets equal the sum of est_packets, its bytes that of frame_length (it
    counts the frame as exported, FCS included) times the rate."""
    out = tmp_path / "sfacctd.csv"
    conf = tmp_path / "sfacctd.conf"
    conf.write_text(SFACCTD_CONF.format(capture=exports[name], out=out))
    subprocess.run([need_tool("sfacctd"), "-f", str(conf)], capture_output=True, timeout=120)
    theirs = {}
    for line in out.read_text().splitlines()[1:]:
        src, dst, sport, dport, proto, pkts, nbytes = line.split(",")
        num = int(proto) if proto.isdigit() else socket.getprotobyname(proto)
        theirs[(src, dst, int(sport), int(dport), num)] = (int(pkts), int(nbytes))
    samples, _, _ = decoded(exports[name])
    ours: dict = collections.defaultdict(lambda: [0, 0])
    for s in samples:
        k = (s["src_ip"], s["dst_ip"], s["src_port"] or 0, s["dst_port"] or 0, s["protocol"])
        ours[k][0] += s["est_packets"]
        ours[k][1] += s["frame_length"] * s["sampling_rate"]
    assert {k: tuple(v) for k, v in ours.items()} == theirs
