"""Independent reference decoding with dpkt, for differential tests.

Only dpkt's parsing is used (not flowsieve's); where dpkt's model differs from DESIGN's field
definitions the adjustment is written here and explained.
"""

from __future__ import annotations

import ipaddress
import socket

import dpkt


def ip_text(raw: bytes) -> str:
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw)
    addr = ipaddress.IPv6Address(raw)
    return str(addr.ipv4_mapped) if addr.ipv4_mapped else str(addr)


def link(buf: bytes, linktype: int):
    """(outer vlan, inner vlan, network-layer object or None) per dpkt."""
    if linktype == 1:
        eth = dpkt.ethernet.Ethernet(buf)
        tags = [t.id for t in getattr(eth, "vlan_tags", [])]
        return (tags[0] if tags else None, tags[1] if len(tags) > 1 else None, eth.data)
    if linktype == 113:
        return None, None, dpkt.sll.SLL(buf).data
    raise ValueError(f"linktype {linktype}")


def fields_of(ts: float, buf: bytes, linktype: int) -> dict:
    """The DESIGN fields of one packet, decoded by dpkt."""
    out = {"time": int(ts), "wirelen": None, "vlan": None, "vlan_inner": None,
           "ip_version": None, "src_ip": None, "dst_ip": None, "protocol": None, "ttl": None,
           "src_port": None, "dst_port": None, "tcp_flags": None, "icmp_type": None,
           "icmp_code": None, "dns_qr": None, "dns_id": None, "dns_qname": None}
    try:
        vlan, vlan2, net = link(buf, linktype)
    except (dpkt.UnpackError, ValueError):
        return out
    out["vlan"], out["vlan_inner"] = vlan, vlan2
    l4 = None
    if isinstance(net, dpkt.ip.IP):
        out.update(ip_version=4, src_ip=ip_text(net.src), dst_ip=ip_text(net.dst),
                   protocol=net.p, ttl=net.ttl)
        first = net.offset == 0
        l4 = net.data if first else None
        if first and isinstance(l4, bytes) and net.p in (6, 17):
            # dpkt leaves every fragment undecoded; a first fragment still carries the header
            try:
                l4 = (dpkt.tcp.TCP if net.p == 6 else dpkt.udp.UDP)(l4)
            except dpkt.UnpackError:
                l4 = None
    elif isinstance(net, dpkt.ip6.IP6):
        # dpkt's IP6.p is the final upper-layer protocol after the extension headers it knows
        out.update(ip_version=6, src_ip=ip_text(net.src), dst_ip=ip_text(net.dst),
                   protocol=net.p, ttl=net.hlim)
        frag = net.extension_hdrs.get(dpkt.ip.IP_PROTO_FRAGMENT) if hasattr(
            net, "extension_hdrs") else None
        l4 = net.data if frag is None or frag.frag_off == 0 else None
    if isinstance(l4, dpkt.tcp.TCP | dpkt.udp.UDP):
        out["src_port"], out["dst_port"] = l4.sport, l4.dport
        if isinstance(l4, dpkt.tcp.TCP):
            out["tcp_flags"] = l4.flags & 0xFF
        if {l4.sport, l4.dport} & {53, 5353}:
            payload = bytes(l4.data)
            if isinstance(l4, dpkt.tcp.TCP):
                payload = payload[2:]
            if len(payload) >= 12:
                try:
                    d = dpkt.dns.DNS(payload)
                    out["dns_qr"], out["dns_id"] = d.qr, d.id
                    if d.qd:
                        out["dns_qname"] = d.qd[0].name.lower()
                except (dpkt.UnpackError, IndexError):
                    # e.g. the first IPv6 fragment of a large response: the whole message does
                    # not parse, but DESIGN takes the header and question from first fragments
                    out["dns_qr"] = payload[2] >> 7
                    out["dns_id"] = int.from_bytes(payload[:2], "big")
                    if int.from_bytes(payload[4:6], "big"):
                        out["dns_qname"] = dpkt.dns.unpack_name(payload, 12)[0].lower()
    elif isinstance(l4, dpkt.icmp.ICMP | dpkt.icmp6.ICMP6):
        out["icmp_type"], out["icmp_code"] = l4.type, l4.code
    return out


def packets(path) -> list[dict]:
    """Every packet of a pcap file, decoded by dpkt."""
    out = []
    with open(path, "rb") as fh:
        r = dpkt.pcap.Reader(fh)
        lt = r.datalink()
        for ts, buf in r:
            f = fields_of(float(ts), buf, lt)
            out.append(f)
    return out
