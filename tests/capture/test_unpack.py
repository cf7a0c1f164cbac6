"""The numba unpack kernel, field by field, against dpkt on every readable capture."""

from __future__ import annotations

import numpy as np
import pytest

from capture.pcap import PcapReader
from capture.unpack import unpack
from collector.results import format_ip
from tests.conftest import DATA, capture
from tests.reference import packets

CORRUPT = {"unexpected_eof_on_second_packet.pcap", "partial_first_header.pcap",
           "bad_first_header.pcap"}
CAPTURES = sorted(p.name for p in (DATA / "pcap").glob("*.pcap") if p.name not in CORRUPT)
CAPTURES.append("test.pcap")  # GPL: read from ../shared/data


def ours(path, groups=None) -> list[dict]:
    rows = []
    for raw in PcapReader(path, batch_size=50):
        tb = unpack(raw, groups)
        names = ["time", "vlan", "vlan_inner", "ip_version", "src_ip", "dst_ip", "protocol",
                 "ttl", "src_port", "dst_port", "tcp_flags", "icmp_type", "icmp_code",
                 "dns_qr", "dns_id", "dns_qname"]
        cols = {k: tb.arrow(k).to_pylist() for k in names}
        for i in range(len(tb)):
            rows.append({k: format_ip(v[i]) if k.endswith("_ip") else v[i]
                         for k, v in cols.items()})
    return rows


@pytest.mark.parametrize("name", CAPTURES)
def test_fields_equal_dpkt(name):
    """Every packet: VLANs, addresses, protocol, TTL, ports, flags, ICMP, DNS equal dpkt's.

    IPv6 fragments: dpkt cannot parse a DNS message cut by fragmentation; DESIGN takes the DNS
    header and question from a first fragment, and the reference decodes that question with
    dpkt's own name decoder (tests/reference.py)."""
    path = capture(name)
    ref = packets(path)
    got = ours(path)
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        b = {k: v for k, v in b.items() if k in a}
        assert a == b, f"packet {i + 1} of {name}"


def test_dns_groups_only_when_asked():
    """Without the dns groups the DNS columns stay NULL (group unpacking)."""
    tb = unpack(next(iter(PcapReader(capture("dns_udp.pcap")))), {"meta", "ip", "l4"})
    assert tb.arrow("dns_qr").null_count == len(tb)
    assert "dns_qname" not in tb.strings
    assert tb.arrow("dst_port").to_pylist() == [53, 43966]


def test_ipv4_mapped_and_nulls():
    """IPv4 addresses are IPv4-mapped; non-IP frames have NULL addresses (ARP here)."""
    tb = unpack(next(iter(PcapReader(capture("802.1ad_QinQ.pcap")))))
    assert tb.arrow("src_ip").null_count == len(tb)
    assert tb.arrow("vlan").to_pylist() == [200, 200]
    assert tb.arrow("vlan_inner").to_pylist() == [2001, 2001]
    tb = unpack(next(iter(PcapReader(capture("dns_udp.pcap")))))
    assert bytes(tb.column("src_ip")[0][:12]) == b"\0" * 10 + b"\xff\xff"
    assert np.all(tb.column("ip_version") == 4)
