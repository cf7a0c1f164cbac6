"""The numba unpack kernel, field by field, against dpkt on every readable capture."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capture.fields import IP, fields, ip_text
from capture.pcap import open_capture
from capture.unpack import unpack
from tests.helpers import capture, samples
from tests.reference import FIELDS, packets

CORRUPT = {"unexpected_eof_on_second_packet.pcap", "partial_first_header.pcap",
           "bad_first_header.pcap", "dhcp-trunc.pcapng"}
CAPTURES = samples("pcap", "*.pcap*", exclude=CORRUPT)


def ours(path, groups=None) -> list[dict]:
    rows = []
    for raw in open_capture(path, batch_size=50):
        tb = unpack(raw, groups)
        names = FIELDS
        cols = {k: tb.arrow(k).to_pylist() for k in names}
        for i in range(len(tb)):
            rows.append({k: ip_text(v[i]) if fields("packets")[k].kind == IP else v[i]
                         for k, v in cols.items()})
    return rows


@pytest.mark.parametrize("name", CAPTURES)
def test_fields_equal_dpkt(name):
    """Every packet, every field but the metadata: link, IP, fragmentation, L4, DNS header and
    question name equal dpkt's (pcap and pcapng).

    IPv6 fragments: dpkt cannot parse a DNS message cut by fragmentation; DESIGN takes the DNS
    header and question from a first fragment, and the reference decodes that question with
    dpkt's own name decoder (tests/reference.py)."""
    path = capture(name)
    ref = packets(path)
    got = ours(path)
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        b = {k: v for k, v in b.items() if k in a}
        if name.endswith(".pcapng"):
            # dpkt applies the first interface's if_tsresol to every interface; pcapng times
            # are checked against tshark in test_pcapng.py
            a, b = {**a, "time": None}, {**b, "time": None}
        assert a == b, f"packet {i + 1} of {name}"


@settings(max_examples=40, deadline=None)
@given(st.sets(st.sampled_from(list(fields("packets"))), max_size=12),
       st.sampled_from(["ok.pcap", "dns_tcp.pcap", "mixed-vlan-mpls.pcap", "icmp6.pcap",
                        "ipv6-fragmented-dns.pcap"]))
def test_field_subsets_equal_full_unpack(want, name):
    """Group unpacking: a subset of fields comes out exactly as in a full unpack (the full
    unpack equals dpkt above), and every other column is NULL."""
    for raw in open_capture(capture(name)):
        full, part = unpack(raw), unpack(raw, want)
        for f in fields("packets"):
            got = part.arrow(f)
            if f in want or f in ("ts", "time") or (f == "ip_version" and
                                                   want & {"src_ip", "dst_ip"}):
                assert got.equals(full.arrow(f)), f
            else:
                assert got.null_count == len(part), f


def test_unknown_field_is_refused():
    with pytest.raises(KeyError, match="unknown packets field"):
        unpack(next(iter(open_capture(capture("ok.pcap")))), {"ip"})


def test_ipv4_mapped_and_nulls():
    """IPv4 addresses are IPv4-mapped; non-IP frames have NULL addresses (ARP here)."""
    tb = unpack(next(iter(open_capture(capture("802.1ad_QinQ.pcap")))))
    assert tb.arrow("src_ip").null_count == len(tb)
    assert tb.arrow("vlan").to_pylist() == [200, 200]
    assert tb.arrow("vlan_inner").to_pylist() == [2001, 2001]
    tb = unpack(next(iter(open_capture(capture("dns_udp.pcap")))))
    assert bytes(tb.column("src_ip")[0][:12]) == b"\0" * 10 + b"\xff\xff"
    assert np.all(tb.column("ip_version") == 4)


# ipv6-fragmented-dns.pcap is left to the dpkt test above: tshark dissects its DNS on the
# reassembled last fragment, DESIGN takes what the first fragment carries
DNS_CAPTURES = ["dns_udp.pcap", "dns_tcp.pcap", "wikipedia.pcap", "ok.pcap",
                "var-services-std-ports.pcap", "test.pcap"]


@pytest.mark.parametrize("name", DNS_CAPTURES)
def test_dns_answer_fields_equal_tshark(name):
    """dns_an_type, dns_an_ttl, dns_an_name and dns_an_addr are the first answer record's, as
    tshark decodes it (its first dns.resp.*; dns.a / dns.aaaa when that record is one)."""
    import subprocess
    path = capture(name)
    out = subprocess.run(
        ["tshark", "-r", str(path), "-T", "fields", "-E", "occurrence=f", "-E", "separator=|",
         "-e", "dns.count.answers", "-e", "dns.resp.type", "-e", "dns.resp.ttl",
         "-e", "dns.resp.name", "-e", "dns.a", "-e", "dns.aaaa"],
        capture_output=True, text=True, check=True, timeout=120).stdout.splitlines()
    got = [(r["dns_an_type"], r["dns_an_ttl"], r["dns_an_name"], r["dns_an_addr"])
           for r in ours(path)]
    assert len(got) == len(out)
    answers = 0
    for i, (line, ours_) in enumerate(zip(out, got, strict=True)):
        count, typ, ttl, rname, a, aaaa = line.split("|")
        if not count or int(count) == 0 or not typ:
            assert ours_ == (None, None, None, None), f"packet {i + 1}"
            continue
        answers += 1
        typ = int(typ)
        addr = (a if typ == 1 else aaaa if typ == 28 else "") or None
        want = (typ, int(ttl), rname.lower().rstrip("."), addr)
        if want[2] == "<root>":
            want = (want[0], want[1], "", want[3])
        if typ == 33:  # tshark splits an SRV owner into service, protocol and name fields
            want = (want[0], want[1], ours_[2], want[3])
        assert ours_ == want, f"packet {i + 1} of {name}"
    assert answers, f"{name} holds DNS answers"
