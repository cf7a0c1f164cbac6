"""Numba unpack kernels: a RawBatch of packet records in, a TupleBatch of catalogue columns out.

One pass per batch decodes link (Ethernet, 802.1Q/802.1ad, MPLS, Linux cooked, raw IP, BSD
loopback), IPv4, IPv6 (with its extension-header chain), TCP, UDP, SCTP, ICMP/ICMPv6 and the DNS
header. The DNS groups (header, first query name) are extracted only when the plan asks for them.
Absent values are NULL: -1 in integer columns (every catalogue integer is non-negative).

The kernels allocate nothing: they are compiled as ``capture/jit.py``'s ``kernel``, without
numba's runtime.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pyarrow as pa

from capture.batch import TupleBatch, validity_buffer
from capture.fields import (
    NULL_INT,
    PACKET_FIELDS,
    PACKET_INT_FIELDS,
    PACKET_INT_INDEX,
    enriched,
)
from capture.jit import kernel, kernel_inline, readonly
from capture.records import PREFETCH, touch_ahead

_I = PACKET_INT_INDEX
C_IFACE, C_CAPLEN, C_WIRELEN = _I["iface"], _I["caplen"], _I["wirelen"]
C_ETH, C_VLAN, C_VLAN2, C_MPLS = _I["eth_type"], _I["vlan"], _I["vlan_inner"], _I["mpls_label"]
C_IPV, C_PROTO, C_TTL, C_TOS = _I["ip_version"], _I["protocol"], _I["ttl"], _I["tos"]
C_IPID, C_FOFF, C_MF, C_DF, C_IPLEN = _I["ip_id"], _I["frag_offset"], _I["more_fragments"], \
    _I["dont_fragment"], _I["ip_len"]
C_SPORT, C_DPORT, C_TCPF = _I["src_port"], _I["dst_port"], _I["tcp_flags"]
C_ICT, C_ICC = _I["icmp_type"], _I["icmp_code"]
C_DID, C_DQR, C_DOP, C_DRC, C_DQD, C_DAN = _I["dns_id"], _I["dns_qr"], _I["dns_opcode"], \
    _I["dns_rcode"], _I["dns_qdcount"], _I["dns_ancount"]
C_ANTYPE, C_ANTTL = _I["dns_an_type"], _I["dns_an_ttl"]
MAX_QUESTIONS = 16  # questions skipped to reach the first answer (real messages carry one)

QNAME_STRIDE = 1024  # 255 bytes of name, each byte at most 4 characters (\DDD escapes)


@kernel_inline
def _be16(buf, p):
    return (np.int32(buf[p]) << 8) | np.int32(buf[p + 1])


@kernel_inline
def _be32(buf, p):
    return (np.int64(buf[p]) << 24) | (np.int64(buf[p + 1]) << 16) | \
        (np.int64(buf[p + 2]) << 8) | np.int64(buf[p + 3])


@kernel_inline
def _put(ints, want, c, i, v):
    if want[c]:
        ints[c, i] = v


@kernel
def _skip_name(buf, q, end):
    """The offset after the (possibly compressed) name at ``q``, or -1 past ``end``."""
    for _ in range(128):  # at most 127 labels fit in 255 bytes
        if q >= end:
            return -1
        ln = np.int32(buf[q])
        if ln == 0:
            return q + 1
        if (ln & 0xC0) == 0xC0:
            return q + 2 if q + 2 <= end else -1
        if (ln & 0xC0) != 0:
            return -1
        q += 1 + ln
    return -1


@kernel
def _qname(buf, dns, end, out, row):
    """Write the first query name at dns+12 into out[row]; return its length or -1."""
    return _name(buf, dns, dns + 12, end, out, row)


@kernel
def _name(buf, dns, q, end, out, row):
    """Write the name at ``q`` of the DNS message at ``dns`` into out[row], following
    compression pointers (bounded); return its length or -1."""
    n = 0
    hops = 0
    raw = 0
    while True:
        if q >= end:
            return -1
        ln = np.int32(buf[q])
        if ln == 0:
            return n
        if (ln & 0xC0) == 0xC0:  # compression pointer (rare in a question; followed, bounded)
            if q + 1 >= end:
                return -1
            q = dns + (((ln & 0x3F) << 8) | np.int32(buf[q + 1]))
            hops += 1
            if hops > 16:
                return -1
            continue
        if (ln & 0xC0) != 0 or q + 1 + ln > end:
            return -1
        raw += ln + 1
        if raw > 255:
            return -1
        if n > 0:
            out[row, n] = 46  # '.'
            n += 1
        for k in range(q + 1, q + 1 + ln):
            c = np.int32(buf[k])
            if 65 <= c <= 90:
                c += 32
            if c == 46 or c == 92:  # '.' or '\' inside a label
                out[row, n] = 92
                out[row, n + 1] = c
                n += 2
            elif c < 33 or c > 126:  # dig's \DDD for bytes that are not printable ASCII
                out[row, n] = 92
                out[row, n + 1] = 48 + c // 100
                out[row, n + 2] = 48 + (c // 10) % 10
                out[row, n + 3] = 48 + c % 10
                n += 4
            else:
                out[row, n] = c
                n += 1
        q += 1 + ln


@kernel
def _answer(buf, d, qd, end, ints, want, i, an_addr, an_ok, an_len, an_buf):
    """The first answer record of the message at ``d``: its type, TTL, owner name and (A or
    AAAA) address, from what was captured (the address only when its data is whole)."""
    q = d + 12
    for _ in range(min(qd, MAX_QUESTIONS)):
        q = _skip_name(buf, q, end)
        if q < 0 or q + 4 > end:
            return
        q += 4
    if qd > MAX_QUESTIONS:
        return
    r = _skip_name(buf, q, end)
    if r < 0 or r + 10 > end:
        return
    typ = _be16(buf, r)
    ttl = _be32(buf, r + 4)
    rdlen = np.int64(_be16(buf, r + 8))
    _put(ints, want, C_ANTYPE, i, typ)
    _put(ints, want, C_ANTTL, i, 0 if ttl >= 0x80000000 else ttl)
    if an_len.shape[0]:
        an_len[i] = _name(buf, d, q, end, an_buf, i)
    rd = r + 10
    if an_addr.shape[0] and rd + rdlen <= end:
        if typ == 1 and rdlen == 4:
            an_addr[i, 10] = 0xFF
            an_addr[i, 11] = 0xFF
            for k in range(4):
                an_addr[i, 12 + k] = buf[rd + k]
            an_ok[i] = True
        elif typ == 28 and rdlen == 16:
            for k in range(16):
                an_addr[i, k] = buf[rd + k]
            an_ok[i] = True


@kernel_inline
def _dns(buf, d, end, ints, want, i, want_qname, qn_len, qn_buf, want_an, an_addr, an_ok,
         an_len, an_buf):
    if d + 12 > end:
        return
    flags = _be16(buf, d + 2)
    qd = _be16(buf, d + 4)
    an = _be16(buf, d + 6)
    _put(ints, want, C_DID, i, _be16(buf, d))
    _put(ints, want, C_DQR, i, (flags >> 15) & 1)
    _put(ints, want, C_DOP, i, (flags >> 11) & 0xF)
    _put(ints, want, C_DRC, i, flags & 0xF)
    _put(ints, want, C_DQD, i, qd)
    _put(ints, want, C_DAN, i, an)
    if want_qname and qd > 0:
        qn_len[i] = _qname(buf, d, end, qn_buf, i)
    if want_an and an > 0:
        _answer(buf, d, qd, end, ints, want, i, an_addr, an_ok, an_len, an_buf)


@kernel_inline
def _l4(buf, p, end, proto, ints, want, i):
    """Ports, TCP flags, ICMP type and code of the L4 header at ``p``."""
    if proto == 6 or proto == 17 or proto == 132:
        if p + 4 > end:
            return
        _put(ints, want, C_SPORT, i, _be16(buf, p))
        _put(ints, want, C_DPORT, i, _be16(buf, p + 2))
        if proto == 6 and p + 14 <= end:
            _put(ints, want, C_TCPF, i, buf[p + 13])
    elif proto == 1 or proto == 58:
        if p + 2 > end:
            return
        _put(ints, want, C_ICT, i, buf[p])
        _put(ints, want, C_ICC, i, buf[p + 1])


@kernel
def unpack_deep(buf, l4_at, l4_end, l4_proto, ints, want, want_dns, want_qname, qn_len,
                qn_buf, want_an, an_addr, an_ok, an_len, an_buf, pl_off, pl_len):
    """The variable-offset fields after the L4 header, in a pass of their own over the
    packets the first pass found an L4 header in (``l4_at`` >= 0): the payload's offset and
    length (after TCP's own header length) and the DNS message of port 53/5353. (In the
    first pass, these columns' arrays made numba's loop three times slower per packet even
    for packets without DNS.)"""
    for i in range(l4_at.shape[0]):
        p = l4_at[i]
        if p < 0:
            continue
        end = l4_end[i]
        proto = l4_proto[i]
        if pl_len.shape[0]:
            head = 8 if proto == 17 or proto == 1 or proto == 58 else 12 if proto == 132 \
                else -1
            if proto == 6 and p + 14 <= end:
                hl = (np.int64(buf[p + 12]) >> 4) * 4
                head = hl if hl >= 20 else -1
            if head > 0 and p + head <= end:
                pl_off[i] = p + head
                pl_len[i] = end - p - head
        if not want_dns or not (proto == 6 or proto == 17) or p + 4 > end:
            continue
        sp = _be16(buf, p)
        dp = _be16(buf, p + 2)
        if not (sp == 53 or dp == 53 or sp == 5353 or dp == 5353):
            continue
        if proto == 6:
            if p + 14 > end:
                continue
            doff = (np.int64(buf[p + 12]) >> 4) * 4
            if doff >= 20 and p + doff + 2 + 12 <= end:
                _dns(buf, p + doff + 2, end, ints, want, i, want_qname, qn_len, qn_buf,
                     want_an, an_addr, an_ok, an_len, an_buf)
        else:
            _dns(buf, p + 8, end, ints, want, i, want_qname, qn_len, qn_buf, want_an, an_addr,
                 an_ok, an_len, an_buf)


@kernel_inline
def link_walk(buf, p, end, linktype):
    """The link layer of one frame (Ethernet, 802.1Q/802.1ad/QinQ tags, MPLS labels, Linux cooked
    v1/v2, raw IP, BSD loopback, 802.11 data frames): (EtherType after the tags and labels or
    -1, offset of the network header, outer VLAN, inner VLAN, top MPLS label; -1 where absent).
    The offset is -1 when the frame is too short for its link header or the link type is
    unknown. The one walk: packets (unpack) and export datagrams (capture/netflow) both use
    it."""
    vlan = -1
    vlan2 = -1
    mpls = -1
    et = -1
    if linktype == 1:
        if p + 14 > end:
            return -1, -1, vlan, vlan2, mpls
        et = _be16(buf, p + 12)
        p += 14
    elif linktype == 113:
        if p + 16 > end:
            return -1, -1, vlan, vlan2, mpls
        et = _be16(buf, p + 14)
        p += 16
    elif linktype == 276:
        if p + 20 > end:
            return -1, -1, vlan, vlan2, mpls
        et = _be16(buf, p)
        p += 20
    elif linktype == 101 or linktype == 12:
        if p + 1 > end:
            return -1, -1, vlan, vlan2, mpls
        v = buf[p] >> 4
        et = 0x0800 if v == 4 else (0x86DD if v == 6 else -1)
    elif linktype == 105:
        # IEEE 802.11: a data frame carrying a body in the clear (not null data, not
        # protected) with an LLC/SNAP header; any other frame has no network layer here
        if p + 24 > end:
            return -1, -1, vlan, vlan2, mpls
        fc0 = buf[p]
        fc1 = buf[p + 1]
        if ((fc0 >> 2) & 3) != 2 or (fc0 >> 4) & 4 or fc1 & 0x40:
            return -1, -1, vlan, vlan2, mpls
        q = p + 24
        if (fc1 & 3) == 3:  # to and from the distribution system: a fourth address
            q += 6
        if (fc0 >> 4) & 8:  # QoS data: QoS control, and HT control when Order is set
            q += 2
            if fc1 & 0x80:
                q += 4
        if q + 8 > end or buf[q] != 0xAA or buf[q + 1] != 0xAA or buf[q + 2] != 3:
            return -1, -1, vlan, vlan2, mpls
        et = _be16(buf, q + 6)
        p = q + 8
    elif linktype == 0 or linktype == 108:
        if p + 4 > end:
            return -1, -1, vlan, vlan2, mpls
        # DLT_NULL is in the capturing host's byte order, DLT_LOOP in network order;
        # accept either, as libpcap and dpkt do; IPv6 is 24, 28 or 30 (BSDs, macOS)
        le = _be32(buf, p) if linktype == 108 else (
            np.int64(buf[p]) | (np.int64(buf[p + 1]) << 8) | (np.int64(buf[p + 2]) << 16) |
            (np.int64(buf[p + 3]) << 24))
        be = _be32(buf, p)
        if le == 2 or be == 2:
            et = 0x0800
        elif le == 24 or le == 28 or le == 30 or be == 24 or be == 28 or be == 30:
            et = 0x86DD
        p += 4
    else:
        return -1, -1, vlan, vlan2, mpls
    # VLAN tags (802.1Q, 802.1ad, old QinQ)
    tags = 0
    while (et == 0x8100 or et == 0x88A8 or et == 0x9100) and p + 4 <= end:
        tci = _be16(buf, p) & 0x0FFF
        if tags == 0:
            vlan = tci
        elif tags == 1:
            vlan2 = tci
        tags += 1
        et = _be16(buf, p + 2)
        p += 4
    # MPLS label stack; the payload's first nibble tells IPv4 from IPv6
    if et == 0x8847 or et == 0x8848:
        top = True
        while p + 4 <= end:
            if top:
                mpls = np.int32(_be32(buf, p) >> 12)
                top = False
            bos = buf[p + 2] & 1
            p += 4
            if bos:
                break
        if p < end:
            v = buf[p] >> 4
            if v == 4:
                et = 0x0800
            elif v == 6:
                et = 0x86DD
    return et, p, vlan, vlan2, mpls


@kernel
def unpack_packets(buf, offset, caplen, wirelen, linktypes, ifaces, want, want_src, want_dst,
                   walk_ip, walk_l4, ints, src, dst, l4_at, l4_end, l4_proto):
    """Decode every record of a batch into the caller-allocated columns (NULL = -1), down to
    the L4 header's fixed fields; where ``l4_at`` has room, each packet's L4 header offset,
    end and protocol for ``unpack_deep`` (-1: none).

    ``want`` says which integer columns to write; the walk flags say how deep to decode (the
    plan's unpack groups, chosen by weighted set cover in planner/field_groups.py). Returns a
    checksum of the prefetch loads (see capture/records.py)."""
    deep = l4_at.shape[0] > 0
    sink = np.int64(0)
    ahead = offset[0] if offset.shape[0] else 0
    for i in range(offset.shape[0]):
        p = offset[i]
        end = p + caplen[i]
        ahead, acc = touch_ahead(buf, max(ahead, p), end + PREFETCH, buf.shape[0])
        sink += acc
        linktype = linktypes[i]
        _put(ints, want, C_IFACE, i, ifaces[i])
        _put(ints, want, C_CAPLEN, i, caplen[i])
        _put(ints, want, C_WIRELEN, i, wirelen[i])
        et, p, vlan, vlan2, mpls = link_walk(buf, p, end, linktype)
        if p < 0:
            continue
        if vlan >= 0:
            _put(ints, want, C_VLAN, i, vlan)
        if vlan2 >= 0:
            _put(ints, want, C_VLAN2, i, vlan2)
        if mpls >= 0:
            _put(ints, want, C_MPLS, i, mpls)
        _put(ints, want, C_ETH, i, et)
        if not walk_ip:
            continue
        # --- network layer
        if et == 0x0800:
            if p + 20 > end or (buf[p] >> 4) != 4:
                continue
            ihl = np.int64(buf[p] & 0x0F) * 4
            if ihl < 20:
                continue
            tot = _be16(buf, p + 2)
            ff = _be16(buf, p + 6)
            proto = np.int32(buf[p + 9])
            foff = (ff & 0x1FFF) * 8
            _put(ints, want, C_IPV, i, 4)
            _put(ints, want, C_IPLEN, i, tot)
            _put(ints, want, C_TOS, i, buf[p + 1])
            _put(ints, want, C_IPID, i, _be16(buf, p + 4))
            _put(ints, want, C_DF, i, (ff >> 14) & 1)
            _put(ints, want, C_MF, i, (ff >> 13) & 1)
            _put(ints, want, C_FOFF, i, foff)
            _put(ints, want, C_TTL, i, buf[p + 8])
            _put(ints, want, C_PROTO, i, proto)
            if want_src:
                src[i, 10] = 0xFF
                src[i, 11] = 0xFF
                for k in range(4):
                    src[i, 12 + k] = buf[p + 12 + k]
            if want_dst:
                dst[i, 10] = 0xFF
                dst[i, 11] = 0xFF
                for k in range(4):
                    dst[i, 12 + k] = buf[p + 16 + k]
            l4end = end
            if tot >= ihl and p + tot < end:  # drop Ethernet trailer padding
                l4end = p + tot
            if walk_l4 and foff == 0 and p + ihl <= l4end:
                _l4(buf, p + ihl, l4end, proto, ints, want, i)
                if deep:
                    l4_at[i], l4_end[i], l4_proto[i] = p + ihl, l4end, proto
        elif et == 0x86DD:
            if p + 40 > end or (buf[p] >> 4) != 6:
                continue
            _put(ints, want, C_IPV, i, 6)
            _put(ints, want, C_TOS, i,
                 ((np.int32(buf[p]) & 0x0F) << 4) | (np.int32(buf[p + 1]) >> 4))
            _put(ints, want, C_TTL, i, buf[p + 7])
            if want_src:
                for k in range(16):
                    src[i, k] = buf[p + 8 + k]
            if want_dst:
                for k in range(16):
                    dst[i, k] = buf[p + 24 + k]
            plen = _be16(buf, p + 4)
            _put(ints, want, C_IPLEN, i, plen + 40)
            l4end = end
            if p + 40 + plen < end:
                l4end = p + 40 + plen
            nh = np.int32(buf[p + 6])
            q = p + 40
            first = True
            ok = True
            foff = 0
            mf = 0
            fid = -1
            for _ in range(16):  # extension-header chain, bounded
                if nh == 0 or nh == 43 or nh == 60 or nh == 51:
                    if q + 2 > l4end:
                        ok = False
                        break
                    if nh == 51:
                        hl = (np.int64(buf[q + 1]) + 2) * 4
                    else:
                        hl = (np.int64(buf[q + 1]) + 1) * 8
                    nh = np.int32(buf[q])
                    q += hl
                elif nh == 44:
                    if q + 8 > l4end:
                        ok = False
                        break
                    fo = _be16(buf, q + 2)
                    foff = fo & 0xFFF8
                    mf = fo & 1
                    fid = np.int32(_be32(buf, q + 4) & 0x7FFFFFFF)
                    if foff != 0:
                        first = False
                    nh = np.int32(buf[q])
                    q += 8
                else:
                    break
            if ok and not (nh == 0 or nh == 43 or nh == 60 or nh == 51 or nh == 44):
                _put(ints, want, C_PROTO, i, nh)  # a cut or endless chain: unknown (NULL)
            if ok or fid >= 0:  # no fragment header, or one seen before a cut
                _put(ints, want, C_FOFF, i, foff)
                _put(ints, want, C_MF, i, mf)
                _put(ints, want, C_DF, i, 0)
            if fid >= 0:
                _put(ints, want, C_IPID, i, fid)
            if walk_l4 and ok and first and q <= l4end:
                _l4(buf, q, l4end, nh, ints, want, i)
                if deep:
                    l4_at[i], l4_end[i], l4_proto[i] = q, l4end, nh
    return sink


_GROUP_OF = {f.name: f.group for f in PACKET_FIELDS}
_ENRICHED = frozenset(enriched("packets"))  # computed after unpack (capture/enrich/)
_ALL_FIELDS = frozenset(_GROUP_OF)
_IP_DEEP = {"ip", "l4", "dns", "dns_name", "dns_an", "payload"}
_L4_DEEP = {"l4", "dns", "dns_name", "dns_an", "payload"}


def unpack(raw, want: Iterable[str] | None = None) -> TupleBatch:
    """Unpack a RawBatch; ``want`` (catalogue field names, default all) is what the plan's unpack
    groups extract: other columns stay NULL and layers below them are not decoded. Enrichment
    fields among them are left to capture/enrich/ (their inputs are in ``want``)."""
    n = len(raw)
    names = set(_ALL_FIELDS if want is None else want) - _ENRICHED
    unknown = names - _ALL_FIELDS
    if unknown:
        raise KeyError(f"unknown packets field(s): {', '.join(sorted(unknown))}")
    if names & {"src_ip", "dst_ip"}:
        names.add("ip_version")  # the addresses' validity
    groups = {_GROUP_OF[f] for f in names}
    want_int = np.array([f in names for f in PACKET_INT_FIELDS], dtype=np.bool_)
    want_src, want_dst = "src_ip" in names, "dst_ip" in names
    want_qname = "dns_qname" in names
    want_dns = bool(groups & {"dns", "dns_name", "dns_an"})
    want_an = "dns_an" in groups
    want_an_name, want_an_addr = "dns_an_name" in names, "dns_an_addr" in names
    ints = np.full((len(PACKET_INT_FIELDS), n), NULL_INT, dtype=np.int32)
    src = np.zeros((n if want_src else 0, 16), dtype=np.uint8)
    dst = np.zeros((n if want_dst else 0, 16), dtype=np.uint8)
    qn_len = np.full(n if want_qname else 0, -1, dtype=np.int32)
    # rows are written only for DNS packets and read only up to their length: no zeroing
    qn_buf = np.empty((n if want_qname else 0, QNAME_STRIDE), dtype=np.uint8)
    an_addr = np.zeros((n if want_an_addr else 0, 16), dtype=np.uint8)
    an_ok = np.zeros(n if want_an_addr else 0, dtype=np.bool_)
    an_len = np.full(n if want_an_name else 0, -1, dtype=np.int32)
    an_buf = np.empty((n if want_an_name else 0, QNAME_STRIDE), dtype=np.uint8)
    want_payload = "payload" in names
    pl_off = np.zeros(n if want_payload else 0, dtype=np.int64)
    pl_len = np.full(n if want_payload else 0, -1, dtype=np.int64)
    deep = n if want_dns or want_payload else 0
    l4_at = np.full(deep, -1, np.int64)
    l4_end = np.empty(deep, np.int64)
    l4_proto = np.empty(deep, np.int32)
    buf = readonly(raw.buf)
    unpack_packets(buf, raw.offset, raw.caplen, raw.wirelen, raw.linktype, raw.iface,
                   want_int, want_src, want_dst, bool(groups & _IP_DEEP),
                   bool(groups & _L4_DEEP), ints, src, dst, l4_at, l4_end, l4_proto)
    if deep:
        unpack_deep(buf, l4_at, l4_end, l4_proto, ints, want_int, want_dns, want_qname,
                    qn_len, qn_buf, want_an, an_addr, an_ok, an_len, an_buf, pl_off, pl_len)
    ips = {}
    if want_src:
        ips["src_ip"] = src
    if want_dst:
        ips["dst_ip"] = dst
    strings = {"dns_qname": _strings(qn_buf, qn_len)} if want_qname else {}
    ip_ok = {}
    if want_an_name:
        strings["dns_an_name"] = _strings(an_buf, an_len)
    if want_an_addr:
        ips["dns_an_addr"], ip_ok["dns_an_addr"] = an_addr, an_ok
    if want_payload:
        strings["payload"] = _slices(buf, pl_off, pl_len)
    return TupleBatch("packets", raw.ts_ns.copy(), ints, ips, strings, ip_ok)


@kernel
def _pack_rows(buf, lengths, offsets, data):
    """Rows of a fixed-stride byte matrix, back to back (the Arrow string layout)."""
    pos = 0
    for i in range(lengths.shape[0]):
        offsets[i] = pos
        for k in range(max(lengths[i], 0)):
            data[pos + k] = buf[i, k]
        pos += max(lengths[i], 0)
    offsets[lengths.shape[0]] = pos


@kernel
def _gather(buf, starts, lengths, offsets, data):
    """Slices of ``buf`` back to back (the Arrow binary layout)."""
    pos = 0
    for i in range(lengths.shape[0]):
        offsets[i] = pos
        for k in range(max(lengths[i], 0)):
            data[pos + k] = buf[starts[i] + k]
        pos += max(lengths[i], 0)
    offsets[lengths.shape[0]] = pos


def _slices(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> pa.Array:
    """Slices of the batch's buffer as an Arrow binary array (length -1 = NULL)."""
    n = len(lengths)
    offsets = np.empty(n + 1, dtype=np.int32)
    data = np.empty(int(np.maximum(lengths, 0).sum()), dtype=np.uint8)
    _gather(buf, starts, lengths, offsets, data)
    valid = lengths >= 0
    return pa.Array.from_buffers(pa.binary(), n, [validity_buffer(valid), pa.py_buffer(offsets),
                                                  pa.py_buffer(data)],
                                 null_count=int((~valid).sum()))


def _strings(buf: np.ndarray, lengths: np.ndarray) -> pa.Array:
    """Rows of a fixed-stride byte matrix as an Arrow string array (length -1 = NULL)."""
    n = len(lengths)
    offsets = np.empty(n + 1, dtype=np.int32)
    data = np.empty(int(np.maximum(lengths, 0).sum()), dtype=np.uint8)
    _pack_rows(buf, lengths, offsets, data)
    valid = lengths >= 0
    return pa.Array.from_buffers(pa.string(), n, [validity_buffer(valid), pa.py_buffer(offsets),
                                                  pa.py_buffer(data)],
                                 null_count=int((~valid).sum()))
