"""Independent reference decoding with dpkt, for differential tests.

Only dpkt's parsing is used (not flowsieve's); where dpkt's model differs from DESIGN's field
definitions the adjustment is written here and explained.
"""

from __future__ import annotations

import ipaddress
import socket
import struct

import dpkt


def ip_text(raw: bytes) -> str:
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw)
    addr = ipaddress.IPv6Address(raw)
    return str(addr.ipv4_mapped) if addr.ipv4_mapped else str(addr)


def link(buf: bytes, linktype: int):
    """(outer vlan, inner vlan, mpls label, eth_type, network-layer object or None) per dpkt.

    DESIGN's ``eth_type`` is the EtherType after VLAN tags and MPLS labels; behind MPLS dpkt
    keeps 0x8847 and guesses IPv4/IPv6 from the payload, so the reference takes the type of what
    dpkt decoded there."""
    vlan = vlan2 = mpls = None
    if linktype == 1:
        eth = dpkt.ethernet.Ethernet(buf)
        tags = [t.id for t in getattr(eth, "vlan_tags", [])]
        vlan = tags[0] if tags else None
        vlan2 = tags[1] if len(tags) > 1 else None
        et, net = eth.type, eth.data
        vtags = getattr(eth, "vlan_tags", [])
        if vtags:  # dpkt keeps the outer type of a tag stack; the innermost tag names the payload
            et = vtags[-1].type
        labels = getattr(eth, "mpls_labels", [])
        if labels:
            mpls = labels[0].val
    elif linktype == 113:
        sll = dpkt.sll.SLL(buf)
        et, net = sll.ethtype, sll.data
    elif linktype == 276:
        sll2 = dpkt.sll2.SLL2(buf)
        et, net = sll2.ethtype, sll2.data
    elif linktype in (101, 12):
        v = buf[0] >> 4 if buf else 0
        et = {4: 0x0800, 6: 0x86DD}.get(v)
        net = dpkt.ip.IP(buf) if v == 4 else dpkt.ip6.IP6(buf) if v == 6 else None
    elif linktype in (0, 108):
        lo = dpkt.loopback.Loopback(buf)
        net = lo.data
        et = 0x0800 if lo.family == 2 else 0x86DD if lo.family in (24, 28, 30) else None
        if et is None:
            net = None
    else:
        raise ValueError(f"linktype {linktype}")
    if et in (0x8847, 0x8848) and not isinstance(net, dpkt.ip.IP | dpkt.ip6.IP6):
        # dpkt recognises IPv4 behind MPLS only as 0x45 (no options) and guesses Ethernet
        # otherwise; DESIGN takes the first nibble, so the reference hands the payload after
        # the label stack to dpkt's IPv4 decoder itself
        payload = buf[14 + 4 * len(eth.vlan_tags if hasattr(eth, "vlan_tags") else [])
                      + 4 * len(labels):]
        if payload and payload[0] >> 4 == 4:
            net = dpkt.ip.IP(payload)
    if et in (0x8847, 0x8848):
        et = 0x0800 if isinstance(net, dpkt.ip.IP) else 0x86DD if isinstance(
            net, dpkt.ip6.IP6) else et
    return vlan, vlan2, mpls, et, net


FIELDS = ("time", "caplen", "eth_type", "vlan", "vlan_inner", "mpls_label", "ip_version",
          "src_ip", "dst_ip", "protocol", "ttl", "tos", "ip_id", "frag_offset", "more_fragments",
          "dont_fragment", "ip_len", "src_port", "dst_port", "tcp_flags", "icmp_type", "icmp_code",
          "dns_id", "dns_qr", "dns_opcode", "dns_rcode", "dns_qdcount", "dns_ancount",
          "dns_qname", "dns_an_type", "dns_an_ttl", "dns_an_name", "dns_an_addr", "payload")


def fields_of(ts: float, buf: bytes, linktype: int) -> dict:
    """The DESIGN fields of one packet, decoded by dpkt."""
    out = dict.fromkeys(FIELDS)
    out["time"], out["caplen"] = int(ts), len(buf)
    try:
        out["vlan"], out["vlan_inner"], out["mpls_label"], out["eth_type"], net = \
            link(buf, linktype)
    except (dpkt.UnpackError, ValueError, IndexError):
        return out
    l4 = None
    if isinstance(net, dpkt.ip.IP):
        # dpkt's IP.offset counts 8-byte units; DESIGN's frag_offset is in bytes
        out.update(ip_version=4, src_ip=ip_text(net.src), dst_ip=ip_text(net.dst),
                   protocol=net.p, ttl=net.ttl, tos=net.tos, ip_id=net.id,
                   frag_offset=net.offset * 8, more_fragments=net.mf, dont_fragment=net.df,
                   ip_len=net.len)
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
                   protocol=net.p, ttl=net.hlim, tos=(net.fc if hasattr(net, "fc") else
                                                       (net._v_fc_flow >> 20) & 0xFF),
                   frag_offset=0, more_fragments=0, dont_fragment=0, ip_len=net.plen + 40)
        frag = net.extension_hdrs.get(dpkt.ip.IP_PROTO_FRAGMENT) if hasattr(
            net, "extension_hdrs") else None
        if frag is not None:
            out.update(frag_offset=frag.frag_off * 8, more_fragments=frag.m_flag,
                       ip_id=frag.id & 0x7FFFFFFF)
        l4 = net.data if frag is None or frag.frag_off == 0 else None
    if isinstance(l4, dpkt.tcp.TCP | dpkt.udp.UDP):
        # after the header (TCP's data offset, UDP's 8); none when the header is cut short
        cut = isinstance(l4, dpkt.tcp.TCP) and len(l4.opts) < l4.off * 4 - 20
        out["payload"] = None if cut else bytes(l4.data)
    elif isinstance(l4, dpkt.sctp.SCTP):
        out["payload"] = bytes(l4)[12:]
    elif isinstance(l4, dpkt.icmp.ICMP | dpkt.icmp6.ICMP6):
        out["payload"] = bytes(l4)[8:] if len(bytes(l4)) >= 8 else None
    if isinstance(l4, dpkt.tcp.TCP | dpkt.udp.UDP | dpkt.sctp.SCTP):
        out["src_port"], out["dst_port"] = l4.sport, l4.dport
        if isinstance(l4, dpkt.tcp.TCP):
            out["tcp_flags"] = l4.flags & 0xFF
        if isinstance(l4, dpkt.tcp.TCP | dpkt.udp.UDP) and {l4.sport, l4.dport} & {53, 5353}:
            payload = bytes(l4.data)
            if isinstance(l4, dpkt.tcp.TCP):
                payload = payload[2:]
            if len(payload) >= 12:
                out.update(_dns(payload))
    elif isinstance(l4, dpkt.icmp.ICMP | dpkt.icmp6.ICMP6):
        out["icmp_type"], out["icmp_code"] = l4.type, l4.code
    return out


def _rr(rr) -> dict:
    """DESIGN's answer fields of a dpkt resource record (TTL: RFC 2181's top-bit rule; the
    address only when the record's data is whole)."""
    addr = None
    if rr.type == dpkt.dns.DNS_A and len(rr.rdata) == 4 and rr.rlen == 4:
        addr = ip_text(rr.rdata)
    elif rr.type == dpkt.dns.DNS_AAAA and len(rr.rdata) == 16 and rr.rlen == 16:
        addr = ip_text(rr.rdata)
    return {"dns_an_type": rr.type, "dns_an_ttl": 0 if rr.ttl >= 2**31 else rr.ttl,
            "dns_an_name": rr.name.lower(), "dns_an_addr": addr}


def _first_answer(payload: bytes, qd: int) -> dict:
    """The first answer of a message dpkt cannot parse whole (cut by fragmentation): dpkt's
    own question and record decoders from the header on."""
    try:
        d, off = dpkt.dns.DNS(), 12
        for _ in range(qd):
            _, off = d.unpack_q(payload, off)
        rr, _ = d.unpack_rr(payload, off)
        return _rr(rr)
    except (dpkt.UnpackError, IndexError, ValueError, struct.error):
        return {}


def _dns(payload: bytes) -> dict:
    try:
        d = dpkt.dns.DNS(payload)
        return {"dns_qr": d.qr, "dns_id": d.id, "dns_opcode": d.opcode, "dns_rcode": d.rcode,
                "dns_qdcount": len(d.qd), "dns_ancount": len(d.an),
                "dns_qname": d.qd[0].name.lower() if d.qd else None,
                **(_rr(d.an[0]) if d.an else {})}
    except (dpkt.UnpackError, IndexError):
        # e.g. the first IPv6 fragment of a large response: the whole message does not
        # parse, but DESIGN takes the header and question from first fragments; dpkt's
        # header-only parse gives the header fields
        h = dpkt.dns.DNS()
        dpkt.Packet.unpack(h, payload[:12])
        qd = int.from_bytes(payload[4:6], "big")
        name = None
        if qd:
            try:
                name = dpkt.dns.unpack_name(payload, 12)[0].lower()
            except (dpkt.UnpackError, IndexError):
                name = None
        an = int.from_bytes(payload[6:8], "big")
        return {"dns_qr": h.qr, "dns_id": h.id, "dns_opcode": h.opcode, "dns_rcode": h.rcode,
                "dns_qdcount": qd, "dns_ancount": an, "dns_qname": name,
                **(_first_answer(payload, qd) if an else {})}


def packets(path) -> list[dict]:
    """Every packet of a pcap or pcapng file, decoded by dpkt."""
    out = []
    with open(path, "rb") as fh:
        magic = fh.read(4)
        fh.seek(0)
        r = (dpkt.pcapng.Reader if magic == b"\x0a\x0d\x0d\x0a" else dpkt.pcap.Reader)(fh)
        lt = r.datalink()
        for ts, buf in r:
            out.append(fields_of(float(ts), buf, lt))
    return out


def rows_of(query, table) -> list[dict]:
    """An answer table's rows as dicts of the query's own output columns (for comparing with
    a reference; the answer path itself never makes a Python object per row)."""
    names = [o.name for o in query.outputs]
    have = [n for n in names if n in table.column_names]
    return [{n: r.get(n) for n in names} for r in table.select(have).to_pylist()]
