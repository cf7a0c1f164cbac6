"""Helpers of the NetFlow/IPFIX tests: payload files, pcaps of payloads, tshark's record count,
nfdump's CSV."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import dpkt

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
