"""sFlow v5 datagrams built field by field (sflow_version_5.txt's XDR structures), for the
structures no shared capture holds (counter samples, samples without a raw header, IPv6 next
hops, several AS path segments, unknown records): tshark dissects what these build, and the
tests compare the decoder with tshark, never with this module."""

from __future__ import annotations

import ipaddress
import struct
from pathlib import Path

import dpkt


def _pad(b: bytes) -> bytes:
    return b + b"\0" * (-len(b) % 4)


def address(ip: str | None) -> bytes:
    if ip is None:
        return struct.pack(">I", 0)
    a = ipaddress.ip_address(ip)
    return struct.pack(">I", 1 if a.version == 4 else 2) + a.packed


def record(fmt: int, body: bytes, enterprise: int = 0) -> bytes:
    body = _pad(body)
    return struct.pack(">II", (enterprise << 12) | fmt, len(body)) + body


def raw_header(frame: bytes, protocol: int = 1, frame_length: int | None = None,
               stripped: int = 4, max_header: int = 128) -> bytes:
    head = frame[:max_header]
    length = len(frame) + stripped if frame_length is None else frame_length
    return record(1, struct.pack(">IIII", protocol, length, stripped, len(head)) + head)


def sampled_ethernet(length: int, src_mac: bytes, dst_mac: bytes, eth_type: int) -> bytes:
    return record(2, struct.pack(">I", length) + src_mac + b"\0\0" + dst_mac + b"\0\0" +
                  struct.pack(">I", eth_type))


def sampled_ip(length: int, proto: int, src: str, dst: str, sport: int, dport: int,
               tcp_flags: int, tos: int) -> bytes:
    s, d = ipaddress.ip_address(src), ipaddress.ip_address(dst)
    return record(3 if s.version == 4 else 4,
                  struct.pack(">II", length, proto) + s.packed + d.packed +
                  struct.pack(">IIII", sport, dport, tcp_flags, tos))


def ext_switch(src_vlan: int, src_pri: int, dst_vlan: int, dst_pri: int) -> bytes:
    return record(1001, struct.pack(">IIII", src_vlan, src_pri, dst_vlan, dst_pri))


def ext_router(next_hop: str, src_mask: int, dst_mask: int) -> bytes:
    return record(1002, address(next_hop) + struct.pack(">II", src_mask, dst_mask))


def ext_gateway(next_hop: str, as_: int, src_as: int, src_peer_as: int,
                segments: list[tuple[int, list[int]]], communities: list[int],
                local_pref: int) -> bytes:
    body = address(next_hop) + struct.pack(">IIII", as_, src_as, src_peer_as, len(segments))
    for kind, ases in segments:
        body += struct.pack(">II", kind, len(ases)) + b"".join(struct.pack(">I", a)
                                                               for a in ases)
    body += struct.pack(">I", len(communities)) + b"".join(struct.pack(">I", c)
                                                          for c in communities)
    return record(1003, body + struct.pack(">I", local_pref))


def flow_sample(seq: int, source: tuple[int, int], rate: int, pool: int, drops: int,
                inp: tuple[int, int], out: tuple[int, int], records: list[bytes],
                expanded: bool = False) -> bytes:
    """``source`` (type, index), ``inp``/``out`` (format, value)."""
    if expanded:
        body = struct.pack(">IIIIIIIIII", seq, source[0], source[1], rate, pool, drops,
                           inp[0], inp[1], out[0], out[1])
        fmt = 3
    else:
        body = struct.pack(">IIIIIII", seq, (source[0] << 24) | source[1], rate, pool, drops,
                           (inp[0] << 30) | inp[1], (out[0] << 30) | out[1])
        fmt = 1
    return record(fmt, body + struct.pack(">I", len(records)) + b"".join(records))


GENERIC = ("if_index", "if_type", "if_speed", "if_direction", "if_status", "in_octets",
           "in_ucast_pkts", "in_mcast_pkts", "in_bcast_pkts", "in_discards", "in_errors",
           "in_unknown_protos", "out_octets", "out_ucast_pkts", "out_mcast_pkts",
           "out_bcast_pkts", "out_discards", "out_errors", "promiscuous")
WIDE = ("if_speed", "in_octets", "out_octets")


def generic_if(values: dict[str, int]) -> bytes:
    return record(1, b"".join(struct.pack(">Q" if n in WIDE else ">I", values[n])
                              for n in GENERIC))


def ethernet_if(values: list[int]) -> bytes:
    return record(2, struct.pack(">13I", *values))


def counter_sample(seq: int, source: tuple[int, int], records: list[bytes],
                   expanded: bool = False) -> bytes:
    if expanded:
        body, fmt = struct.pack(">III", seq, source[0], source[1]), 4
    else:
        body, fmt = struct.pack(">II", seq, (source[0] << 24) | source[1]), 2
    return record(fmt, body + struct.pack(">I", len(records)) + b"".join(records))


def datagram(agent: str, sub_agent: int, seq: int, uptime_ms: int, samples: list[bytes],
             count: int | None = None) -> bytes:
    return struct.pack(">I", 5) + address(agent) + struct.pack(
        ">IIII", sub_agent, seq, uptime_ms, len(samples) if count is None else count) + \
        b"".join(samples)


def udp_pcap(path: Path, payloads: list[bytes], t0: float = 1_700_000_000.0,
             src: str = "192.0.2.1", dst: str = "192.0.2.2", port: int = 6343) -> Path:
    """The payloads as UDP datagrams to ``port`` in an Ethernet pcap, a millisecond apart."""
    with open(path, "wb") as f:
        w = dpkt.pcap.Writer(f)
        for i, p in enumerate(payloads):
            udp = dpkt.udp.UDP(sport=40000, dport=port, data=p)
            udp.ulen = 8 + len(p)
            ip = dpkt.ip.IP(src=ipaddress.ip_address(src).packed,
                            dst=ipaddress.ip_address(dst).packed, p=17, data=udp)
            ip.len = 20 + udp.ulen
            eth = dpkt.ethernet.Ethernet(src=b"\x02\0\0\0\0\1", dst=b"\x02\0\0\0\0\2",
                                         type=dpkt.ethernet.ETH_TYPE_IP, data=ip)
            w.writepkt(bytes(eth), ts=t0 + i / 1000)
    return path


ETH_SRC, ETH_DST = b"\x02\0\0\0\0\x0a", b"\x02\0\0\0\0\x0b"


def frame(v6: bool = False, vlans: tuple[int, ...] = ()) -> bytes:
    tcp = dpkt.tcp.TCP(sport=443, dport=50123, flags=dpkt.tcp.TH_ACK | dpkt.tcp.TH_PUSH,
                       data=b"x" * 300)
    if v6:
        ip = dpkt.ip6.IP6(src=bytes.fromhex("20010db8000000000000000000000001"),
                          dst=bytes.fromhex("20010db8000000000000000000000002"), nxt=6,
                          hlim=60, data=tcp)
        ip.plen = len(bytes(tcp))
        et = dpkt.ethernet.ETH_TYPE_IP6
    else:
        ip = dpkt.ip.IP(src=bytes([198, 51, 100, 7]), dst=bytes([203, 0, 113, 9]), p=6,
                        ttl=61, id=4242, tos=0x28, data=tcp)
        ip.len = 20 + len(bytes(tcp))
        et = dpkt.ethernet.ETH_TYPE_IP
    body = bytes(ip)
    tags = b"".join(struct.pack(">HH", 0x8100, v) for v in vlans)
    if vlans:
        return ETH_DST + ETH_SRC + tags[:2] + tags[2:] + struct.pack(">H", et) + body
    return ETH_DST + ETH_SRC + struct.pack(">H", et) + body


def wifi_frame() -> bytes:
    """An 802.11 QoS data frame to the distribution system: LLC/SNAP, IPv4, a TCP SYN."""
    from scapy.all import LLC, SNAP, TCP, Dot11, Dot11QoS, raw
    from scapy.layers.inet import IP
    return raw(Dot11(type=2, subtype=8, FCfield=1, addr1="02:00:00:00:00:01",
                     addr2="02:00:00:00:00:02", addr3="02:00:00:00:00:03") / Dot11QoS() /
               LLC(dsap=0xAA, ssap=0xAA, ctrl=3) / SNAP(OUI=0, code=0x0800) /
               IP(src="198.51.100.20", dst="203.0.113.30", ttl=50) /
               TCP(sport=8443, dport=40000, flags="S"))


def every_structure(tmp_path: Path) -> Path:
    """Datagrams of every structure the vendors' captures lack."""
    generic = {n: 1000 + i for i, n in enumerate(GENERIC)}
    generic.update(if_speed=10_000_000_000, in_octets=(1 << 40) + 5, if_status=3,
                   promiscuous=2, if_direction=1, if_type=6)
    unknown = record(7, b"\1\2\3\4\5", enterprise=4413)  # a vendor's record: skipped
    dgs = [
        datagram("192.0.2.10", 3, 100, 5_000, [
            flow_sample(1, (0, 7), 512, 51200, 2, (0, 7), (0, 9), [
                raw_header(frame(vlans=(300, 42)), stripped=4),
                ext_switch(300, 5, 301, 6),
                ext_router("2001:db8::fe", 48, 64),
                ext_gateway("198.51.100.254", 64500, 64501, 64502,
                              [(2, [64510, 64511]), (1, [64512, 64513, 64514])],
                              [(64500 << 16) | 7, (64500 << 16) | 8], 250),
                unknown]),
            counter_sample(11, (0, 7), [generic_if(generic),
                                          ethernet_if(list(range(1, 14)))]),
            record(9, b"\0" * 12, enterprise=9),  # a vendor's sample: skipped
        ]),
        datagram("2001:db8::10", 0, 7, 6_000, [
            flow_sample(5, (0, 3), 100, 700, 0, (0, 1), (1, 258), [
                sampled_ip(1400, 6, "2001:db8::a", "2001:db8::b", 443, 50000, 0x12, 3)],
                expanded=True),
            flow_sample(6, (0, 3), 100, 800, 0, (0, 1), (2, 3), [
                sampled_ethernet(1518, ETH_SRC, ETH_DST, 0x0800),
                sampled_ip(1500, 17, "192.0.2.50", "192.0.2.60", 53, 5353, 0, 0)]),
            flow_sample(7, (0, 3), 100, 900, 0, (0, 1), (0, 2), [
                raw_header(frame(v6=True), stripped=4, max_header=60)], expanded=True),
            counter_sample(12, (0, 3), [ethernet_if([0] * 13)], expanded=True),
        ]),
        datagram("192.0.2.11", 0, 1, 1_000, [
            flow_sample(1, (0, 2), 1, 1, 0, (0, 1), (0, 2), [
                raw_header(bytes(dpkt.ip.IP(src=bytes([10, 0, 0, 1]), dst=bytes([10, 0, 0, 2]),
                                              p=17, data=dpkt.udp.UDP(sport=1, dport=2))),
                             protocol=11, stripped=0)])]),
        datagram("192.0.2.11", 0, 2, 1_010, [
            flow_sample(2, (0, 2), 1, 2, 0, (0, 1), (0, 2), [
                raw_header(wifi_frame(), protocol=15, stripped=4)])]),
    ]
    return udp_pcap(tmp_path / "structures.pcap", dgs)


def one(agent: str, seq: int, uptime: int, sample_seqs: list[int], sub: int = 0,
         source: int = 7) -> bytes:
    return datagram(agent, sub, seq, uptime, [
        flow_sample(s, (0, source), 10, 10 * s, 0, (0, 1), (0, 2),
                      [raw_header(frame())]) for s in sample_seqs])
