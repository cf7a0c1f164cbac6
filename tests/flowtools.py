"""Helpers of the NetFlow/IPFIX tests: payload files, pcaps of payloads, tshark's record count,
nfdump's CSV."""

from __future__ import annotations

import datetime as dt
import re
import subprocess
from pathlib import Path

import dpkt

from tests.helpers import DATA

FLOW_PORTS = (2055, 4739, 9995, 9996, 9990, 9991, 9992)
# template capture fed ahead of each data capture (SOURCES.md pairs them)
PAIRS = {"data.pcap": "template.pcap", "options-data.pcap": "options-template.pcap",
         "ipfixprobe-data.pcap": "ipfixprobe-templates.pcap",
         "juniper-cpid-data.pcap": "juniper-cpid-template.pcap"}


def split_payloads(b: bytes) -> list[bytes]:
    """Concatenated export datagrams, split by the v5 count or the IPFIX length (a v9 file is
    one datagram), as SOURCES.md says."""
    out, p = [], 0
    while p < len(b):
        v = int.from_bytes(b[p:p + 2], "big")
        n = len(b) - p
        if v == 5 and n >= 24:
            n = 24 + 48 * int.from_bytes(b[p + 2:p + 4], "big")
        elif v == 10 and n >= 4:
            n = int.from_bytes(b[p + 2:p + 4], "big")
        if n <= 0 or p + n > len(b):
            n = len(b) - p
        out.append(b[p:p + n])
        p += n
    return out


def read_hex(path: Path) -> list[bytes]:
    return [bytes.fromhex(line.strip()) for line in path.read_text().splitlines()
            if line.strip()]


def write_pcap(path: Path, payloads: list[bytes], port: int = 2055, src: str = "192.0.2.1",
               t0: float = 1_700_000_000.0) -> Path:
    """A pcap of UDP datagrams carrying ``payloads`` to ``port`` (Ethernet/IPv4)."""
    import socket
    with open(path, "wb") as f:
        w = dpkt.pcap.Writer(f)
        for i, pl in enumerate(payloads):
            udp = dpkt.udp.UDP(sport=40000, dport=port, data=pl)
            udp.ulen = 8 + len(pl)
            ip = dpkt.ip.IP(src=socket.inet_aton(src), dst=socket.inet_aton("192.0.2.2"),
                            p=17, data=udp)
            ip.len = 20 + udp.ulen
            eth = dpkt.ethernet.Ethernet(src=b"\x02" * 6, dst=b"\x04" * 6, data=ip)
            w.writepkt(bytes(eth), ts=t0 + i * 0.001)
    return path


def tshark_records(path: Path, ports=FLOW_PORTS) -> int:
    """Data records (flows and options data) that tshark's cflow dissector decodes."""
    args = ["tshark", "-2", "-n", "-r", str(path), "-V"]
    for p in ports:
        args += ["-d", f"udp.port=={p},cflow"]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    sets = sum(int(m) for m in re.findall(r"^\s+(?:Flow)?Set \d+ \[id=\d+\] \((\d+) flows?\)",
                                          out, re.M))
    return sets + len(re.findall(r"^\s+pdu \d+/\d+", out, re.M))


def merged(tmp: Path, first: Path, second: Path) -> Path:
    out = tmp / f"{first.stem}+{second.stem}.pcap"
    subprocess.run(["mergecap", "-a", "-F", "pcap", "-w", str(out), str(first), str(second)],
                   check=True)
    return out


FLAGS = "CEUAPRSF"
PROTOCOLS = {"TCP": 6, "UDP": 17, "ICMP": 1, "ICMP6": 58, "IGMP": 2, "EIGRP": 88}


def flags_text(v: int) -> str:
    """nfdump's %flg: CWR ECE URG ACK PSH RST SYN FIN, '.' where unset."""
    return "".join(c if v & (0x80 >> i) else "." for i, c in enumerate(FLAGS))


# tshark cflow field -> flows catalogue field (the values both decode from the same element)
SHARK_FIELDS = {
    "cflow.srcaddr": "src_ip", "cflow.srcaddrv6": "src_ip",
    "cflow.dstaddr": "dst_ip", "cflow.dstaddrv6": "dst_ip",
    "cflow.nexthop": "next_hop", "cflow.nexthopv6": "next_hop",
    "cflow.srcport": "src_port", "cflow.dstport": "dst_port", "cflow.protocol": "protocol",
    "cflow.tos": "tos", "cflow.tcpflags": "tcp_flags",
    "cflow.packets": "packets", "cflow.packets64": "packets",
    "cflow.octets": "bytes", "cflow.octets64": "bytes",
    "cflow.inputint": "input_if", "cflow.outputint": "output_if",
    "cflow.srcas": "src_as", "cflow.dstas": "dst_as",
    "cflow.srcmask": "src_mask", "cflow.dstmask": "dst_mask",
    "cflow.srcmaskv6": "src_mask", "cflow.dstmaskv6": "dst_mask",
    "cflow.direction": "direction", "cflow.ip_version": "ip_version",
}


def tshark_flows(path: Path, ports=FLOW_PORTS) -> list[dict]:
    """Every flow record tshark's cflow dissector decodes, as {catalogue field: value} over the
    fields of SHARK_FIELDS the record has (options data records are left out)."""
    import json
    args = ["tshark", "-2", "-n", "-r", str(path), "-T", "json", "--no-duplicate-keys"]
    for p in ports:
        args += ["-d", f"udp.port=={p},cflow"]
    doc = json.loads(subprocess.run(args, capture_output=True, text=True, check=True).stdout)
    cflows = []
    for pkt in doc:
        layers = pkt["_source"]["layers"].get("cflow", [])
        cflows += layers if isinstance(layers, list) else [layers]
    options = {int(m.group(1)) for c in cflows for key in c
               if (m := re.search(r"\(Options Template\): (\d+)$", key))}
    out = []
    for cflow in cflows:
        for key, value in cflow.items():
            if key.startswith("pdu "):  # a v5 record
                out.append(_shark_record(value))
            m = re.match(r"(?:Flow)?Set \d+ \[id=(\d+)\] \(\d+ flows?\)", key)
            if not m or int(m.group(1)) in options:
                continue
            for sets in value if isinstance(value, list) else [value]:
                for name, rec in sets.items():
                    if name.startswith("Flow ") and isinstance(rec, dict):
                        out.append(_shark_record(rec))
    return out


def _shark_record(rec: dict) -> dict:
    r = {}
    for key, field in SHARK_FIELDS.items():
        if key not in rec:
            continue
        v = rec[key]
        if isinstance(v, list):  # an element twice in a template: tshark shows both
            v = v[0]
        if field.endswith(("_ip", "next_hop")):
            # a template with both IPv4 and IPv6 addresses (Cisco) fills one family and
            # zeroes the other: the record's address is the one that is set
            if field not in r or r[field] in ("0.0.0.0", "::"):
                r[field] = v
        else:
            r[field] = int(v, 0)
    return r


LOGSTASH = DATA / "netflow" / "logstash-dat"
HEX = DATA / "netflow" / "python-netflow-hex"


def ms_text(ns: int) -> str:
    t = dt.datetime.fromtimestamp(ns // 1_000_000 / 1000, dt.UTC)
    return t.strftime("%Y-%m-%d %H:%M:%S.") + f"{ns // 1_000_000 % 1000:03d}"


def as_nfdump(r: dict) -> tuple:
    proto = {v: k for k, v in PROTOCOLS.items()}.get(r["protocol"], str(r["protocol"]))
    icmp = r["protocol"] in (1, 58)
    dp = f"{r['icmp_type']}.{r['icmp_code']}" if icmp else str(r["dst_port"])
    return (ms_text(r["first_switched"]), ms_text(r["last_switched"]), proto, r["src_ip"],
            "0" if icmp else str(r["src_port"]), r["dst_ip"], dp, r["packets"], r["bytes"],
            flags_text(r["tcp_flags"] or 0))
