"""The numba kernel: a batch of export datagrams walked set by set, every data record decoded
through its template's compiled field table. It stops where Python must act (template and
options sets, options data, data without its template) and is resumed after that set."""

from __future__ import annotations

import numpy as np

from capture.jit import allocating, allocating_inline
from capture.netflow.elements import (
    C_BYTES,
    C_DOMAIN,
    C_DPORT,
    C_EBYTES,
    C_EPKTS,
    C_EXPORT,
    C_FIRST,
    C_ICC,
    C_ICT,
    C_IPV,
    C_LAST,
    C_PKTS,
    C_PROTO,
    C_SAMPLING,
    C_TID,
    C_TIME,
    C_VERSION,
    DONE,
    E_IPFIX_LEN,
    E_RECORD,
    E_RESERVED,
    E_SET_END,
    E_SET_LEN,
    E_SHORT,
    E_TRAILING,
    E_V5_COUNT,
    E_VERSION,
    KIND_OPTIONS,
    N_TEMP,
    NTP_EPOCH,
    OP_ICMP_TC,
    OP_IP4,
    OP_IP6,
    OP_MS,
    OP_NTP,
    OP_SEC,
    OP_SKIP,
    OP_TCP_FLAGS,
    OP_UINT,
    OP_UINT_FB,
    REPLAY,
    S_CUR_RECS,
    S_CUR_SEQ,
    S_CUR_UNKNOWN,
    S_DGRAMS,
    S_DOMAIN,
    S_EXP,
    S_GAPS,
    S_KNOWN,
    S_LAST_NS,
    S_LOST,
    S_NEXT,
    S_RECORDS,
    S_REORDER,
    S_UNKNOWN_SAMPLING,
    S_VERSION,
    STOP_FULL,
    STOP_NO_TEMPLATE,
    STOP_OPTIONS,
    STOP_STREAMS,
    STOP_TEMPLATE,
    T_DELTA_FIRST,
    T_DELTA_LAST,
    T_DUR,
    T_DUR_US,
    T_INIT,
    T_INTERVAL,
    T_SAMPLER,
    T_SPACE,
    T_UP_FIRST,
    T_UP_LAST,
    V5_HEADER,
    V5_RECORD,
    VARLEN,
)


@allocating_inline
def _be(buf, p, n):
    v = np.int64(0)
    for k in range(n):
        v = (v << 8) | np.int64(buf[p + k])
    return v


# int64 readers of their own (unpack's _be16 is int32): the decode figures in bench/results were
# measured with these; swapping in unpack's made no difference a quick comparison could see
@allocating_inline
def _be16(buf, p):
    return (np.int64(buf[p]) << 8) | np.int64(buf[p + 1])


@allocating_inline
def _be32(buf, p):
    return (np.int64(buf[p]) << 24) | (np.int64(buf[p + 1]) << 16) | \
        (np.int64(buf[p + 2]) << 8) | np.int64(buf[p + 3])


@allocating
def _header(buf, base, length):
    """(version, header length, message end, export ns, uptime ms, seq, domain, count) or a
    negative error reason in the first slot."""
    if length < 4:
        return -1 - E_SHORT, 0, 0, 0, 0, 0, 0, 0
    ver = _be16(buf, base)
    if ver == 5:
        if length < V5_HEADER:
            return -1 - E_SHORT, 0, 0, 0, 0, 0, 0, 0
        count = _be16(buf, base + 2)
        if count == 0 or V5_HEADER + V5_RECORD * count > length:
            return -1 - E_V5_COUNT, 0, 0, 0, 0, 0, 0, 0
        ns = _be32(buf, base + 8) * 1_000_000_000 + _be32(buf, base + 12)
        dom = (np.int64(buf[base + 20]) << 8) | np.int64(buf[base + 21])
        return 5, V5_HEADER, base + V5_HEADER + V5_RECORD * count, ns, _be32(buf, base + 4), \
            _be32(buf, base + 16), dom, count
    if ver == 9:
        if length < 20:
            return -1 - E_SHORT, 0, 0, 0, 0, 0, 0, 0
        return 9, 20, base + length, _be32(buf, base + 8) * 1_000_000_000, \
            _be32(buf, base + 4), _be32(buf, base + 12), _be32(buf, base + 16), \
            _be16(buf, base + 2)
    if ver == 10:
        if length < 16:
            return -1 - E_SHORT, 0, 0, 0, 0, 0, 0, 0
        mlen = _be16(buf, base + 2)
        if mlen < 16 or mlen > length:
            return -1 - E_IPFIX_LEN, 0, 0, 0, 0, 0, 0, 0
        return 10, 16, base + mlen, _be32(buf, base + 4) * 1_000_000_000, -1, \
            _be32(buf, base + 8), _be32(buf, base + 12), 0
    return -1 - E_VERSION, 0, 0, 0, 0, 0, 0, 0


@allocating
def _uptime_ns(ver, export_ns, uptime, v, init_ms):
    """Absolute ns of a sysUpTime-relative millisecond time."""
    if ver == 10:
        if init_ms < 0:
            return np.int64(-1)
        return (init_ms + v) * 1_000_000
    d = (uptime - v) & 0xFFFFFFFF
    if d >= 0x80000000:  # the flow time is after the export's uptime (clock skew)
        d -= 0x100000000
    return export_ns - d * 1_000_000


@allocating_inline
def _relative_ns(ver, export_ns, uptime, up_ms, delta_us, init_ms):
    """A time given relative to sysUpTime or to the export time, in absolute ns (-1: none)."""
    if up_ms >= 0:
        return _uptime_ns(ver, export_ns, uptime, up_ms, init_ms)
    if delta_us >= 0:
        return export_ns - delta_us * 1000
    return np.int64(-1)


@allocating
def _records(buf, s, e, slot, t_fstart, t_fn, t_minlen, f_op, f_col, f_len, ver, export_ns,
             uptime, domain, tid, exp_addr, ints, ips, ipset, n, tmp, sampling, st_row,
             smp_dict, smp_base):
    """Decode the data records in buf[s:e] with template ``slot``; return (n, truncated)."""
    fs, fn, minlen = t_fstart[slot], t_fn[slot], t_minlen[slot]
    q = s
    while e - q >= minlen and minlen > 0:
        for k in range(N_TEMP):
            tmp[k] = -1
        for k in range(16):
            ips[0, n, k] = exp_addr[k]
        ipset[0, n] = True
        for k in range(fs, fs + fn):
            ln = f_len[k]
            if ln == VARLEN:
                if q >= e:
                    return n, True
                ln = np.int64(buf[q])
                q += 1
                if ln == 255:
                    if q + 2 > e:
                        return n, True
                    ln = _be16(buf, q)
                    q += 2
            if q + ln > e:
                return n, True
            op = f_op[k]
            c = f_col[k]
            if op == OP_SKIP:
                pass
            elif op == OP_UINT:
                ints[c, n] = _be(buf, q, ln)
            elif op == OP_UINT_FB:
                if ints[c, n] < 0:
                    ints[c, n] = _be(buf, q, ln)
            elif op == OP_TCP_FLAGS:
                ints[c, n] = _be(buf, q, ln) & 0xFF
            elif op == OP_IP4:
                for b in range(10):
                    ips[c, n, b] = 0
                ips[c, n, 10] = 0xFF
                ips[c, n, 11] = 0xFF
                for b in range(4):
                    ips[c, n, 12 + b] = buf[q + b]
                ipset[c, n] = True
                if c != 3 and ints[C_IPV, n] < 0:
                    ints[C_IPV, n] = 4
            elif op == OP_IP6:
                for b in range(16):
                    ips[c, n, b] = buf[q + b]
                ipset[c, n] = True
                if c != 3 and ints[C_IPV, n] < 0:
                    ints[C_IPV, n] = 6
            elif op == OP_SEC:
                ints[c, n] = _be32(buf, q) * 1_000_000_000
            elif op == OP_MS:
                ints[c, n] = _be(buf, q, 8) * 1_000_000
            elif op == OP_NTP:
                sec = _be32(buf, q) - NTP_EPOCH
                frac = _be32(buf, q + 4)
                ints[c, n] = sec * 1_000_000_000 + ((frac * 1_000_000_000) >> 32)
            elif op == OP_ICMP_TC:
                v = _be(buf, q, ln)
                ints[C_ICT, n] = (v >> 8) & 0xFF
                ints[C_ICC, n] = v & 0xFF
            else:  # temporaries: times relative to something, sampling
                tmp[c] = _be(buf, q, ln)
            q += ln
        # times
        if ints[C_FIRST, n] < 0:
            ints[C_FIRST, n] = _relative_ns(ver, export_ns, uptime, tmp[T_UP_FIRST],
                                            tmp[T_DELTA_FIRST], tmp[T_INIT])
        if ints[C_LAST, n] < 0:
            ints[C_LAST, n] = _relative_ns(ver, export_ns, uptime, tmp[T_UP_LAST],
                                           tmp[T_DELTA_LAST], tmp[T_INIT])
            if ints[C_LAST, n] < 0 and ints[C_FIRST, n] >= 0:
                if tmp[T_DUR] >= 0:
                    ints[C_LAST, n] = ints[C_FIRST, n] + tmp[T_DUR] * 1_000_000
                elif tmp[T_DUR_US] >= 0:
                    ints[C_LAST, n] = ints[C_FIRST, n] + tmp[T_DUR_US] * 1000
        ints[C_EXPORT, n] = export_ns
        first = ints[C_FIRST, n]
        ints[C_TIME, n] = (first if first >= 0 else export_ns) // 1_000_000_000
        ints[C_VERSION, n] = ver
        ints[C_DOMAIN, n] = domain
        ints[C_TID, n] = tid
        # ICMP type/code carried in the destination port (Cisco, softflowd)
        pr = ints[C_PROTO, n]
        if (pr == 1 or pr == 58) and ints[C_ICT, n] < 0 and ints[C_DPORT, n] >= 0:
            ints[C_ICT, n] = ints[C_DPORT, n] >> 8
            ints[C_ICC, n] = ints[C_DPORT, n] & 0xFF
        # sampling
        interval = sampling[0]  # override, or the v5 header's interval
        if interval <= 0 and tmp[T_INTERVAL] > 0:
            interval = tmp[T_INTERVAL]
            if tmp[T_SPACE] >= 0:
                interval = (tmp[T_INTERVAL] + tmp[T_SPACE]) // tmp[T_INTERVAL]
        sk = smp_base | ((tmp[T_SAMPLER] + 1) & 0xFFFF)
        if interval <= 0 and tmp[T_SAMPLER] >= 0 and sk in smp_dict:
            interval = smp_dict[sk]
        if interval <= 0 and smp_base in smp_dict:
            interval = smp_dict[smp_base]
        if interval <= 0:
            interval = sampling[1]
            st_row[S_UNKNOWN_SAMPLING] += 1
        ints[C_SAMPLING, n] = interval
        if ints[C_PKTS, n] >= 0:
            ints[C_EPKTS, n] = ints[C_PKTS, n] * interval
        if ints[C_BYTES, n] >= 0:
            ints[C_EBYTES, n] = ints[C_BYTES, n] * interval
        n += 1
    return n, False


@allocating
def _all_zero(buf, p, e):
    for k in range(p, e):
        if buf[k] != 0:
            return False
    return True


@allocating
def decode_kernel(buf, d_off, d_len, d_exp, d_ts, d_flags, d_expaddr, start_d, start_p,
                  tpl_dict, t_fstart, t_fn, t_minlen, t_kind, f_op, f_col, f_len,
                  st_dict, st, st_n, smp_dict, override, default_interval,
                  ints, ips, ipset, n, errs):
    """Decode datagrams from (start_d, start_p) on. Returns (code, datagram, set offset, n,
    stream slot, key): where it stopped and why (DONE when all are decoded)."""
    tmp = np.empty(N_TEMP, np.int64)
    sampling = np.empty(2, np.int64)
    cap = ints.shape[1]
    nd = d_off.shape[0]
    i = start_d
    p = start_p
    while i < nd:
        base = d_off[i]
        ver, hlen, mend, export_ns, uptime, seq, domain, count = _header(buf, base, d_len[i])
        if ver < 0:
            errs[-1 - ver] += 1
            i += 1
            p = 0
            continue
        exp = d_exp[i]
        vcode = 0 if ver == 5 else (1 if ver == 9 else 2)
        skey = ((np.int64(exp) * 4 + vcode) << 32) | domain
        if skey in st_dict:
            slot = st_dict[skey]
        else:
            if st_n[0] >= st.shape[0]:
                return STOP_STREAMS, i, p, n, -1, skey
            slot = st_n[0]
            st_n[0] += 1
            st_dict[skey] = slot
            st[slot, S_EXP] = exp
            st[slot, S_VERSION] = ver
            st[slot, S_DOMAIN] = domain
        row = st[slot]
        if p == 0:  # a fresh datagram: sequence accounting
            p = hlen
            if (d_flags[i] & REPLAY) == 0:
                row[S_DGRAMS] += 1
                row[S_LAST_NS] = max(row[S_LAST_NS], d_ts[i])
                if row[S_KNOWN] != 0:
                    d = (seq - row[S_NEXT]) & 0xFFFFFFFF
                    if 0 < d < 0x80000000:
                        row[S_LOST] += d
                        row[S_GAPS] += 1
                    elif d != 0:
                        row[S_REORDER] += 1
                if ver == 5:
                    row[S_NEXT] = (seq + count) & 0xFFFFFFFF
                    row[S_KNOWN] = 1
                elif ver == 9:
                    row[S_NEXT] = (seq + 1) & 0xFFFFFFFF
                    row[S_KNOWN] = 1
                else:
                    row[S_CUR_SEQ] = seq
                    row[S_CUR_RECS] = 0
                    row[S_CUR_UNKNOWN] = 0
                if ver == 10 and mend < base + d_len[i]:
                    errs[E_TRAILING] += 1
        smp_base = skey << 16
        ov = override[exp]
        sampling[1] = default_interval
        if ver == 5:
            if cap - n < count:
                return STOP_FULL, i, 0 if p == hlen else p, n, slot, 0
            hs = _be16(buf, base + 22) & 0x3FFF
            sampling[0] = ov if ov > 0 else (hs if hs > 0 else 1)
            # np.int64(0), not 0: a literal argument is a signature of its own (numba
            # compiled _records twice, 2 s)
            n, _ = _records(buf, base + hlen, mend, np.int64(0), t_fstart, t_fn, t_minlen,
                            f_op, f_col, f_len, ver, export_ns, uptime, domain, np.int64(0),
                            d_expaddr[i], ints, ips, ipset, n, tmp, sampling, row, smp_dict,
                            smp_base)
            row[S_RECORDS] += count
            i += 1
            p = 0
            continue
        sampling[0] = ov
        vkey = (np.int64(exp) * 4 + vcode) << 48
        tpl_lo, tpl_hi = (0, 1) if ver == 9 else (2, 3)
        while p + 4 <= mend - base:
            sp = base + p
            sid = _be16(buf, sp)
            slen = _be16(buf, sp + 2)
            if slen < 4:
                if not _all_zero(buf, sp, mend):
                    errs[E_SET_LEN] += 1
                p = mend - base
                break
            if p + slen > mend - base:
                errs[E_SET_END] += 1
                p = mend - base
                break
            if sid == tpl_lo or sid == tpl_hi:
                return STOP_TEMPLATE, i, p, n, slot, 0
            if sid < 256:
                errs[E_RESERVED] += 1
                p += slen
                continue
            key = vkey | (domain << 16) | sid
            if key not in tpl_dict:
                return STOP_NO_TEMPLATE, i, p, n, slot, key
            ts = tpl_dict[key]
            if t_kind[ts] == KIND_OPTIONS:
                return STOP_OPTIONS, i, p, n, slot, key
            if t_minlen[ts] > 0 and n + (slen - 4) // t_minlen[ts] > cap:
                return STOP_FULL, i, p, n, slot, key
            n0 = n
            n, trunc = _records(buf, sp + 4, sp + slen, ts, t_fstart, t_fn, t_minlen, f_op,
                                f_col, f_len, ver, export_ns, uptime, domain, sid,
                                d_expaddr[i], ints, ips, ipset, n, tmp, sampling, row,
                                smp_dict, smp_base)
            if trunc:
                errs[E_RECORD] += 1
            row[S_RECORDS] += n - n0
            row[S_CUR_RECS] += n - n0
            p += slen
        if ver == 10 and (d_flags[i] & REPLAY) == 0:
            if row[S_CUR_UNKNOWN] == 0:
                row[S_NEXT] = (row[S_CUR_SEQ] + row[S_CUR_RECS]) & 0xFFFFFFFF
                row[S_KNOWN] = 1
            else:
                row[S_KNOWN] = 0
        i += 1
        p = 0
    return DONE, i, 0, n, -1, 0
