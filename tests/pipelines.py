"""In-process pipeline helpers the collector tests share: captures spread over time, dpkt
references and their answers, the prefilter oracle's atoms and files."""

from __future__ import annotations

import ipaddress
import re
import struct
from collections import defaultdict

import dpkt
from scapy.utils import RawPcapReader

from tests.helpers import capture
from tests.reference import fields_of, rows_of

T0 = 1_700_000_000  # a minute boundary is at T0 - T0 % 60


def spread(tmp_path, name: str, step_s: float) -> tuple:
    """``name``'s packets re-stamped ``step_s`` apart from T0 (several one-minute windows);
    the file and its (timestamp, frame, wire length) records."""
    with open(capture(name), "rb") as fh:
        frames = [buf for _, buf in dpkt.pcap.Reader(fh)]
    wire = [meta.wirelen for _, meta in RawPcapReader(str(capture(name)))]
    recs = [(T0 + i * step_s, f, w) for i, (f, w) in enumerate(zip(frames, wire, strict=True))]
    path = tmp_path / f"spread-{name}"
    with open(path, "wb") as f:
        f.write(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 262144, 1))
        for ts, buf, wl in recs:
            sec = int(ts)
            f.write(struct.pack("<IIII", sec, int(round((ts - sec) * 1e6)), len(buf), wl) + buf)
    return path, recs


def reference(recs) -> dict:
    """Q1-Q3 per (minute, src, dst): (count, sum of wire lengths), from dpkt's fields."""
    out: dict = {q: defaultdict(lambda: [0, 0]) for q in WHERE}
    for ts, buf, wl in recs:
        p = fields_of(ts, buf, 1)
        for q, where in WHERE.items():
            if where(p):
                acc = out[q][(int(ts) // 60, p["src_ip"], p["dst_ip"])]
                acc[0] += 1
                acc[1] += wl
    return {q: {k: tuple(v) for k, v in g.items()} for q, g in out.items()}


def answers_of(pairs) -> dict:
    return {q.name: {(r["t"], r["src_ip"], r["dst_ip"]): (r["pkts"], r["bytes"])
                     for r in rows_of(q, t)} for q, t in pairs}


WHERE = {
    "udp_bw": lambda p: p["protocol"] == 17,
    "dns_req": lambda p: p["protocol"] == 17 and p["dst_port"] == 53 and p["dns_qr"] == 0,
    "dns_resp": lambda p: p["protocol"] == 17 and p["src_port"] == 53 and p["dns_qr"] == 1,
}


def shifted(path, out, seconds: int):
    """A copy of a little-endian microsecond pcap with every record ``seconds`` later."""
    data = bytearray(path.read_bytes())
    pos = 24
    while pos < len(data):
        sec, _, caplen, _ = struct.unpack_from("<IIII", data, pos)
        struct.pack_into("<I", data, pos, sec + seconds)
        pos += 16 + caplen
    out.write_bytes(bytes(data))
    return out


FILES = ("wikipedia.pcap", "ok.pcap", "mixed-vlan-mpls.pcap", "icmp6.pcap")


# (SQL text, python test over a dpkt-decoded packet dict); NULL makes every test false
ATOMS = [
    ("protocol = 17", lambda p: p["protocol"] == 17),
    ("protocol = 6", lambda p: p["protocol"] == 6),
    ("protocol != 6", lambda p: p["protocol"] is not None and p["protocol"] != 6),
    ("dst_port = 53", lambda p: p["dst_port"] == 53),
    ("src_port = 53", lambda p: p["src_port"] == 53),
    ("dst_port IN (80, 443, 5353)", lambda p: p["dst_port"] in (80, 443, 5353)),
    ("dst_port NOT IN (80, 443)", lambda p: p["dst_port"] is not None
     and p["dst_port"] not in (80, 443)),
    ("src_port BETWEEN 1024 AND 65535", lambda p: p["src_port"] is not None
     and 1024 <= p["src_port"] <= 65535),
    ("ttl < 64", lambda p: p["ttl"] is not None and p["ttl"] < 64),
    ("ttl >= 128", lambda p: p["ttl"] is not None and p["ttl"] >= 128),
    ("dns_qr = 0", lambda p: p["dns_qr"] == 0),
    ("dns_qr = 1", lambda p: p["dns_qr"] == 1),
    ("ip_version = 6", lambda p: p["ip_version"] == 6),
    ("vlan = 32", lambda p: p["vlan"] == 32),
    ("(dst_port = 80 OR src_port = 80)", lambda p: 80 in (p["dst_port"], p["src_port"])),
    ("in_prefix(src_ip, '10.0.0.0/8')", lambda p: p["src_ip"] is not None and
     ipaddress.ip_address(p["src_ip"]).version == 4 and
     ipaddress.ip_address(p["src_ip"]) in ipaddress.ip_network("10.0.0.0/8")),
    ("NOT in_prefix(dst_ip, 'fe80::/10')", lambda p: p["dst_ip"] is not None and
     ipaddress.ip_address(p["dst_ip"]) not in ipaddress.ip_network("fe80::/10")),
    ("dst_ip = '8.8.8.8'", lambda p: p["dst_ip"] == "8.8.8.8"),
    ("regexp(dns_qname, 'wiki')", lambda p: p["dns_qname"] is not None
     and re.search("wiki", p["dns_qname"]) is not None),
    ("dns_qname = 'www.google.co.il'", lambda p: p["dns_qname"] == "www.google.co.il"),
    ("(tcp_flags & 18) = 18", lambda p: p["tcp_flags"] is not None
     and p["tcp_flags"] & 18 == 18),
    ("tcp_flags & 4 != 0", lambda p: p["tcp_flags"] is not None and p["tcp_flags"] & 4 != 0),
    ("(tcp_flags & 18) = 2", lambda p: p["tcp_flags"] is not None and p["tcp_flags"] & 18 == 2),
    ("NOT (tcp_flags & 17) = 0", lambda p: p["tcp_flags"] is not None
     and p["tcp_flags"] & 17 != 0),
    ("tcp_flags = 16", lambda p: p["tcp_flags"] == 16),
    ("(ttl & 1) = 0", lambda p: p["ttl"] is not None and p["ttl"] & 1 == 0),
    ("dns_an_type = 1", lambda p: p["dns_an_type"] == 1),
    ("dns_an_ttl < 100", lambda p: p["dns_an_ttl"] is not None and p["dns_an_ttl"] < 100),
    ("regexp(dns_an_name, 'local$')", lambda p: p["dns_an_name"] is not None
     and re.search("local$", p["dns_an_name"]) is not None),
    ("NOT in_prefix(dns_an_addr, '10.0.0.0/8')", lambda p: p["dns_an_addr"] is not None and
     ipaddress.ip_address(p["dns_an_addr"]) not in ipaddress.ip_network("10.0.0.0/8")),
    ("contains(payload, 'HTTP/1.1')", lambda p: p["payload"] is not None
     and b"HTTP/1.1" in p["payload"]),
    ("NOT contains(payload, 'a')", lambda p: p["payload"] is not None and b"a" not in p["payload"]),
    ("contains(dns_qname, 'wiki')", lambda p: p["dns_qname"] is not None
     and "wiki" in p["dns_qname"]),
]
