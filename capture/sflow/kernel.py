"""The numba kernels: a batch of sFlow v5 datagrams walked sample by sample, record by record
(XDR: big-endian 32-bit words, opaque data padded to four bytes).

``count_samples`` sizes the tables (flow and counter samples per datagram); ``decode_sflow``
fills them: one row per datagram, flow sample and counter sample. A flow sample's raw packet
header is not copied: its row says where it lies in the datagram buffer, and the packet kernel
unpacks it there. Every length is checked against its container; a sample or record that runs
past it drops the whole datagram (its rows are taken back) with a reason, a record of a format
this decoder does not know, or too short for its format, is skipped by its length and counted.
"""

from __future__ import annotations

import numpy as np

from capture.jit import kernel, kernel_inline
from capture.sflow.elements import (
    COUNTER_SAMPLE,
    COUNTER_SAMPLE_EXPANDED,
    CS,
    DG,
    E_AGENT,
    E_SAMPLE_COUNT,
    E_SAMPLE_LENGTH,
    E_SHORT,
    E_VERSION,
    ETHERNET_COLS,
    ETHERNET_IF,
    EXT_GATEWAY,
    EXT_ROUTER,
    EXT_SWITCH,
    FI,
    FLOW_SAMPLE,
    FLOW_SAMPLE_EXPANDED,
    FS,
    GENERIC_COLS,
    GENERIC_IF,
    GENERIC_WIDE,
    K_COUNTER_RECORD,
    K_FLOW_RECORD,
    K_RECORD_SHORT,
    K_SAMPLE,
    RAW_HEADER,
    SAMPLED_ETHERNET,
    SAMPLED_IPV4,
    SAMPLED_IPV6,
)
from capture.unpack import _be32

# column numbers as plain ints (numba folds them)
D_STATUS, D_SUB, D_SEQ, D_UP, D_SAMPLES, D_FLOWS, D_COUNTERS = (
    DG["status"], DG["sub_agent"], DG["sequence"], DG["uptime_ms"], DG["samples"], DG["flows"],
    DG["counters"])
F_DG, F_HOFF, F_HLEN, F_FLEN, F_STRIP, F_HPROTO = (
    FS["dgram"], FS["header_off"], FS["header_len"], FS["frame_length"], FS["stripped"],
    FS["header_protocol"])
F_SEQ, F_STYPE, F_SID, F_RATE, F_POOL, F_DROPS = (
    FS["sample_seq"], FS["source_id_type"], FS["source_id"], FS["sampling_rate"],
    FS["sample_pool"], FS["drops"])
F_INF, F_INV, F_OUTF, F_OUTV = (FS["input_if_format"], FS["input_if_value"],
                                FS["output_if_format"], FS["output_if_value"])
F_SVLAN, F_SPRI, F_DVLAN, F_DPRI, F_SMASK, F_DMASK = (
    FS["src_vlan"], FS["src_priority"], FS["dst_vlan"], FS["dst_priority"], FS["src_mask"],
    FS["dst_mask"])
F_RAS, F_SAS, F_SPAS, F_DPAS, F_DAS, F_PLEN, F_COMM, F_LPREF = (
    FS["router_as"], FS["src_as"], FS["src_peer_as"], FS["dst_peer_as"], FS["dst_as"],
    FS["as_path_len"], FS["community"], FS["local_pref"])
F_ILEN, F_IPROTO, F_ISPORT, F_IDPORT, F_IFLAGS, F_ITOS, F_IVER, F_ELEN, F_ETYPE = (
    FS["ip_length"], FS["ip_protocol"], FS["ip_src_port"], FS["ip_dst_port"],
    FS["ip_tcp_flags"], FS["ip_tos"], FS["ip_version"], FS["eth_length"], FS["eth_type"])
I_NH, I_BGP, I_SRC, I_DST = FI["next_hop"], FI["bgp_next_hop"], FI["ip_src"], FI["ip_dst"]
C_DG, C_SEQ, C_STYPE, C_SID = CS["dgram"], CS["sample_seq"], CS["source_id_type"], CS["source_id"]
GENERIC_AT = np.array([CS[c] for c in GENERIC_COLS], np.int64)
GENERIC_W8 = np.array([c in GENERIC_WIDE for c in GENERIC_COLS], np.bool_)
ETHERNET_AT = np.array([CS[c] for c in ETHERNET_COLS], np.int64)
GENERIC_BYTES = 4 * len(GENERIC_COLS) + 4 * len(GENERIC_WIDE)  # 88
ETHERNET_BYTES = 4 * len(ETHERNET_COLS)  # 52


@kernel_inline
def _be64(buf, p):
    return (_be32(buf, p) << 32) | _be32(buf, p + 4)


@kernel_inline
def _ip4(buf, p, out, row):
    """An IPv4 address at ``p`` into ``out[row]``, IPv4-mapped."""
    for b in range(10):
        out[row, b] = 0
    out[row, 10] = 0xFF
    out[row, 11] = 0xFF
    for b in range(4):
        out[row, 12 + b] = buf[p + b]


@kernel_inline
def _ip6(buf, p, out, row):
    for b in range(16):
        out[row, b] = buf[p + b]


@kernel_inline
def _address(buf, p, end, out, row):
    """An XDR ``address`` (type 1 IPv4, 2 IPv6) at ``p``: (bytes it takes, whether it was an
    address); bytes -1 when it runs past ``end`` or its type is unknown."""
    if end - p < 4:
        return -1, False
    t = _be32(buf, p)
    if t == 1 and end - p >= 8:
        _ip4(buf, p + 4, out, row)
        return 8, True
    if t == 2 and end - p >= 20:
        _ip6(buf, p + 4, out, row)
        return 20, True
    if t == 0:  # UNKNOWN: no address follows
        return 4, False
    return -1, False


@kernel_inline
def _data_source(buf, s, expanded):
    """A sample's data source after its sequence number at ``s``: (type, index, offset of what
    follows); the compact form packs them in one word (8 bits of type, 24 of index)."""
    if expanded:
        return _be32(buf, s + 4), _be32(buf, s + 8), s + 12
    src = _be32(buf, s + 4)
    return src >> 24, src & 0xFFFFFF, s + 8


@kernel_inline
def _header(buf, offset, length, d):
    """(agent type, offset of the sub-agent id) of datagram ``d``, or (-reason, 0)."""
    p = offset[d]
    end = p + length[d]
    if end - p < 8:
        return -E_SHORT, 0
    if _be32(buf, p) != 5:
        return -E_VERSION, 0
    t = _be32(buf, p + 4)
    if t == 1:
        q = p + 12
    elif t == 2:
        q = p + 24
    else:
        return -E_AGENT, 0
    if end - q < 16:
        return -E_SHORT, 0
    return t, q


@kernel
def count_samples(buf, offset, length, flows, counters):
    """Flow and counter samples of each datagram, by their framing only (the tables' sizes)."""
    for d in range(offset.shape[0]):
        flows[d] = 0
        counters[d] = 0
        t, q = _header(buf, offset, length, d)
        if t < 0:
            continue
        end = offset[d] + length[d]
        ns = _be32(buf, q + 12)
        p = q + 16
        k = 0
        while k < ns and end - p >= 8:
            fmt = _be32(buf, p)
            slen = _be32(buf, p + 4)
            if slen > end - p - 8:
                break
            if fmt == FLOW_SAMPLE or fmt == FLOW_SAMPLE_EXPANDED:
                flows[d] += 1
            elif fmt == COUNTER_SAMPLE or fmt == COUNTER_SAMPLE_EXPANDED:
                counters[d] += 1
            p += 8 + slen
            k += 1


@kernel_inline
def _flow_records(buf, q, se, nrec, fs, fips, fipset, row, skips):
    """The records of one flow sample; False when one runs past the sample."""
    seen_header = False
    for _ in range(nrec):
        if se - q < 8:
            return False
        fmt = _be32(buf, q)
        rlen = _be32(buf, q + 4)
        r = q + 8
        re = r + rlen
        if rlen > se - r:
            return False
        q = re
        if fmt == RAW_HEADER:
            if rlen < 16:
                skips[K_RECORD_SHORT] += 1
                continue
            hlen = _be32(buf, r + 12)
            if hlen > rlen - 16:
                skips[K_RECORD_SHORT] += 1
                continue
            if seen_header:  # a second header: the first stands (none seen in practice)
                continue
            seen_header = True
            fs[F_HPROTO, row] = _be32(buf, r)
            fs[F_FLEN, row] = _be32(buf, r + 4)
            fs[F_STRIP, row] = _be32(buf, r + 8)
            fs[F_HLEN, row] = hlen
            fs[F_HOFF, row] = r + 16
        elif fmt == SAMPLED_ETHERNET:
            if rlen < 24:
                skips[K_RECORD_SHORT] += 1
                continue
            fs[F_ELEN, row] = _be32(buf, r)
            fs[F_ETYPE, row] = _be32(buf, r + 20)
        elif fmt == SAMPLED_IPV4 or fmt == SAMPLED_IPV6:
            v6 = fmt == SAMPLED_IPV6
            if rlen < (56 if v6 else 32):
                skips[K_RECORD_SHORT] += 1
                continue
            fs[F_IVER, row] = 6 if v6 else 4
            fs[F_ILEN, row] = _be32(buf, r)
            fs[F_IPROTO, row] = _be32(buf, r + 4)
            if v6:
                _ip6(buf, r + 8, fips[I_SRC], row)
                _ip6(buf, r + 24, fips[I_DST], row)
                a = r + 40
            else:
                _ip4(buf, r + 8, fips[I_SRC], row)
                _ip4(buf, r + 12, fips[I_DST], row)
                a = r + 16
            fipset[I_SRC, row] = True
            fipset[I_DST, row] = True
            fs[F_ISPORT, row] = _be32(buf, a)
            fs[F_IDPORT, row] = _be32(buf, a + 4)
            fs[F_IFLAGS, row] = _be32(buf, a + 8)
            fs[F_ITOS, row] = _be32(buf, a + 12)
        elif fmt == EXT_SWITCH:
            if rlen < 16:
                skips[K_RECORD_SHORT] += 1
                continue
            fs[F_SVLAN, row] = _be32(buf, r)
            fs[F_SPRI, row] = _be32(buf, r + 4)
            fs[F_DVLAN, row] = _be32(buf, r + 8)
            fs[F_DPRI, row] = _be32(buf, r + 12)
        elif fmt == EXT_ROUTER:
            n, ok = _address(buf, r, re, fips[I_NH], row)
            if n < 0 or re - (r + n) < 8:
                skips[K_RECORD_SHORT] += 1
                continue
            fipset[I_NH, row] = ok
            fs[F_SMASK, row] = _be32(buf, r + n)
            fs[F_DMASK, row] = _be32(buf, r + n + 4)
        elif fmt == EXT_GATEWAY:
            n, ok = _address(buf, r, re, fips[I_BGP], row)
            a = r + n
            if n < 0 or re - a < 16:
                skips[K_RECORD_SHORT] += 1
                continue
            ras = _be32(buf, a)
            sas = _be32(buf, a + 4)
            spas = _be32(buf, a + 8)
            nseg = _be32(buf, a + 12)
            a += 16
            first = np.int64(-1)
            last = np.int64(-1)
            plen = np.int64(0)
            good = True
            for _s in range(nseg):
                if re - a < 8:
                    good = False
                    break
                cnt = _be32(buf, a + 4)
                if cnt > (re - a - 8) // 4:
                    good = False
                    break
                for j in range(cnt):
                    v = _be32(buf, a + 8 + 4 * j)
                    if first < 0:
                        first = v
                    last = v
                plen += cnt
                a += 8 + 4 * cnt
            if not good or re - a < 4:
                skips[K_RECORD_SHORT] += 1
                continue
            ncomm = _be32(buf, a)
            if ncomm > (re - a - 8) // 4:  # the communities, then local_pref
                skips[K_RECORD_SHORT] += 1
                continue
            fipset[I_BGP, row] = ok
            fs[F_RAS, row] = ras
            fs[F_SAS, row] = sas
            fs[F_SPAS, row] = spas
            fs[F_DPAS, row] = first
            fs[F_DAS, row] = last
            fs[F_PLEN, row] = plen
            fs[F_COMM, row] = _be32(buf, a + 4) if ncomm > 0 else -1
            fs[F_LPREF, row] = _be32(buf, a + 4 + 4 * ncomm)
        else:
            skips[K_FLOW_RECORD] += 1
    return True


@kernel_inline
def _counter_records(buf, q, se, nrec, cs, row, skips):
    """The records of one counter sample; False when one runs past the sample."""
    for _ in range(nrec):
        if se - q < 8:
            return False
        fmt = _be32(buf, q)
        rlen = _be32(buf, q + 4)
        r = q + 8
        if rlen > se - r:
            return False
        q = r + rlen
        if fmt == GENERIC_IF:
            if rlen < GENERIC_BYTES:
                skips[K_RECORD_SHORT] += 1
                continue
            a = r
            for j in range(GENERIC_AT.shape[0]):
                if GENERIC_W8[j]:
                    cs[GENERIC_AT[j], row] = _be64(buf, a)
                    a += 8
                else:
                    cs[GENERIC_AT[j], row] = _be32(buf, a)
                    a += 4
        elif fmt == ETHERNET_IF:
            if rlen < ETHERNET_BYTES:
                skips[K_RECORD_SHORT] += 1
                continue
            for j in range(ETHERNET_AT.shape[0]):
                cs[ETHERNET_AT[j], row] = _be32(buf, r + 4 * j)
        else:
            skips[K_COUNTER_RECORD] += 1
    return True


@kernel
def decode_sflow(buf, offset, length, dg, agent, fs, fips, fipset, cs, skipped):
    """Decode every datagram into the caller's tables (integers -1 where absent; ``fs``, ``cs``
    sized by ``count_samples``). Returns (flow rows, counter rows) written."""
    nf = 0
    nc = 0
    skips = skipped  # counted as they come, given back when their datagram is dropped
    for d in range(offset.shape[0]):
        for c in range(dg.shape[0]):
            dg[c, d] = -1
        dg[D_STATUS, d] = 0
        t, q = _header(buf, offset, length, d)
        if t < 0:
            dg[D_STATUS, d] = -t
            continue
        p = offset[d]
        end = p + length[d]
        if t == 1:
            _ip4(buf, p + 8, agent, d)
        else:
            _ip6(buf, p + 8, agent, d)
        dg[D_SUB, d] = _be32(buf, q)
        dg[D_SEQ, d] = _be32(buf, q + 4)
        dg[D_UP, d] = _be32(buf, q + 8)
        ns = _be32(buf, q + 12)
        dg[D_SAMPLES, d] = ns
        p = q + 16
        nf0 = nf
        nc0 = nc
        s0, s1, s2, s3 = skips[0], skips[1], skips[2], skips[3]
        status = 0
        k = 0
        while k < ns:
            if end - p < 8:
                status = E_SAMPLE_COUNT if p == end else E_SAMPLE_LENGTH
                break
            fmt = _be32(buf, p)
            slen = _be32(buf, p + 4)
            s = p + 8
            se = s + slen
            if slen > end - s:
                status = E_SAMPLE_LENGTH
                break
            p = se
            k += 1
            if fmt == FLOW_SAMPLE or fmt == FLOW_SAMPLE_EXPANDED:
                exp = fmt == FLOW_SAMPLE_EXPANDED
                if slen < (44 if exp else 32):
                    status = E_SAMPLE_LENGTH
                    break
                for c in range(fs.shape[0]):
                    fs[c, nf] = -1
                for c in range(fipset.shape[0]):
                    fipset[c, nf] = False
                fs[F_DG, nf] = d
                fs[F_SEQ, nf] = _be32(buf, s)
                fs[F_STYPE, nf], fs[F_SID, nf], a = _data_source(buf, s, exp)
                fs[F_RATE, nf] = _be32(buf, a)
                fs[F_POOL, nf] = _be32(buf, a + 4)
                fs[F_DROPS, nf] = _be32(buf, a + 8)
                if exp:
                    fs[F_INF, nf] = _be32(buf, a + 12)
                    fs[F_INV, nf] = _be32(buf, a + 16)
                    fs[F_OUTF, nf] = _be32(buf, a + 20)
                    fs[F_OUTV, nf] = _be32(buf, a + 24)
                    a += 28
                else:
                    v = _be32(buf, a + 12)
                    fs[F_INF, nf] = v >> 30
                    fs[F_INV, nf] = v & 0x3FFFFFFF
                    v = _be32(buf, a + 16)
                    fs[F_OUTF, nf] = v >> 30
                    fs[F_OUTV, nf] = v & 0x3FFFFFFF
                    a += 20
                nrec = _be32(buf, a)
                if not _flow_records(buf, a + 4, se, nrec, fs, fips, fipset, nf, skips):
                    status = E_SAMPLE_LENGTH
                    break
                nf += 1
            elif fmt == COUNTER_SAMPLE or fmt == COUNTER_SAMPLE_EXPANDED:
                exp = fmt == COUNTER_SAMPLE_EXPANDED
                if slen < (16 if exp else 12):
                    status = E_SAMPLE_LENGTH
                    break
                for c in range(cs.shape[0]):
                    cs[c, nc] = -1
                cs[C_DG, nc] = d
                cs[C_SEQ, nc] = _be32(buf, s)
                cs[C_STYPE, nc], cs[C_SID, nc], a = _data_source(buf, s, exp)
                nrec = _be32(buf, a)
                if not _counter_records(buf, a + 4, se, nrec, cs, nc, skips):
                    status = E_SAMPLE_LENGTH
                    break
                nc += 1
            else:
                skips[K_SAMPLE] += 1
        if status:
            dg[D_STATUS, d] = status
            nf = nf0
            nc = nc0
            skips[0], skips[1], skips[2], skips[3] = s0, s1, s2, s3
            continue
        dg[D_FLOWS, d] = nf - nf0
        dg[D_COUNTERS, d] = nc - nc0
    return nf, nc
