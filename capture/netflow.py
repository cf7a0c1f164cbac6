"""NetFlow v5, v9 and IPFIX: export datagrams in, flow records (catalogue columns) out.

One numba kernel walks a batch of datagrams set by set and decodes every data record through its
template's compiled field table (an operation, a target column and a length per field; IPFIX
variable-length fields read their length in line). NetFlow v5 is a built-in template. Whatever is
rare and stateful — template and options-template sets, options data (sampling), data whose
template has not arrived yet — makes the kernel return where it stopped; Python handles that one
set and the kernel resumes after it, so in-datagram order is kept (a data set before its template
in the same datagram waits in the pending buffer and is decoded when the template comes).

State is kept per exporter address and per export stream (exporter, version, source id /
observation domain): templates, sampling, sequence numbers. ``TemplateStore.save``/``load`` keep
templates and sampling across restarts (under ``var/``).

Sampling rule: a configured per-exporter override wins; then the record's own sampling fields
(samplingInterval 34, samplerRandomInterval 50, samplingPacketInterval/Space 305/306); then the
options data of its sampler id (48/302), then the stream's latest options sampling; for v5 the
header's interval (0 means unsampled: 1). When none is known the record gets
``default_sampling_interval`` (1: the exporter is assumed unsampled, as nfdump and pmacct do) and
is counted in ``sampling_unknown``. ``est_packets``/``est_bytes`` = ``packets``/``bytes`` ×
``sampling_interval``.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numba as nb
import numpy as np
import pyarrow as pa
from numba import types
from numba.typed import Dict

from capture.fields import IP, NULL_INT, TS, fields
from capture.unpack import _ip_binary

F = fields("flows")
FLOW_INT_FIELDS: tuple[str, ...] = tuple(n for n, f in F.items() if f.kind != IP)
FLOW_INT_INDEX: dict[str, int] = {n: i for i, n in enumerate(FLOW_INT_FIELDS)}
FLOW_IP_FIELDS: tuple[str, ...] = ("exporter", "src_ip", "dst_ip", "next_hop")
_I = FLOW_INT_INDEX
C_DOMAIN, C_VERSION, C_TID = _I["observation_domain"], _I["version"], _I["template_id"]
C_FIRST, C_LAST, C_EXPORT, C_TIME = _I["first_switched"], _I["last_switched"], \
    _I["export_time"], _I["time"]
C_IPV, C_PROTO, C_DPORT = _I["ip_version"], _I["protocol"], _I["dst_port"]
C_ICT, C_ICC = _I["icmp_type"], _I["icmp_code"]
C_PKTS, C_BYTES, C_SAMPLING = _I["packets"], _I["bytes"], _I["sampling_interval"]
C_EPKTS, C_EBYTES = _I["est_packets"], _I["est_bytes"]

# Field operations of a compiled template.
(OP_SKIP, OP_UINT, OP_UINT_FB, OP_IP4, OP_IP6, OP_SEC, OP_MS, OP_NTP, OP_UPTIME, OP_DELTA_US,
 OP_SYSINIT, OP_DUR_MS, OP_DUR_US, OP_ICMP_TC, OP_SAMPLER_ID, OP_SAMPLING, OP_SPACE,
 OP_TCP_FLAGS) = range(18)
VARLEN = 65535
# Per-record temporaries (indices of the kernel's scratch vector).
T_UP_FIRST, T_UP_LAST, T_DELTA_FIRST, T_DELTA_LAST, T_INIT, T_DUR, T_SAMPLER, T_INTERVAL, \
    T_SPACE, T_DUR_US = range(10)
N_TEMP = 10

# Information elements flowsieve maps (IANA IPFIX ids; NetFlow v9 types below 128 are the same).
# id -> (operation, target): target is a catalogue field, or for times/temporaries a name.
IE: dict[int, tuple[int, str]] = {
    1: (OP_UINT, "bytes"), 2: (OP_UINT, "packets"),
    85: (OP_UINT_FB, "bytes"), 86: (OP_UINT_FB, "packets"),  # octet/packetTotalCount
    231: (OP_UINT_FB, "bytes"), 298: (OP_UINT_FB, "packets"),  # initiatorOctets/Packets (NSEL)
    4: (OP_UINT, "protocol"), 5: (OP_UINT, "tos"), 6: (OP_TCP_FLAGS, "tcp_flags"),
    7: (OP_UINT, "src_port"), 11: (OP_UINT, "dst_port"),
    180: (OP_UINT_FB, "src_port"), 181: (OP_UINT_FB, "dst_port"),  # udp ports
    182: (OP_UINT_FB, "src_port"), 183: (OP_UINT_FB, "dst_port"),  # tcp ports
    8: (OP_IP4, "src_ip"), 12: (OP_IP4, "dst_ip"), 15: (OP_IP4, "next_hop"),
    27: (OP_IP6, "src_ip"), 28: (OP_IP6, "dst_ip"), 62: (OP_IP6, "next_hop"),
    9: (OP_UINT, "src_mask"), 13: (OP_UINT, "dst_mask"),
    29: (OP_UINT, "src_mask"), 30: (OP_UINT, "dst_mask"),
    10: (OP_UINT, "input_if"), 14: (OP_UINT, "output_if"),
    252: (OP_UINT_FB, "input_if"), 253: (OP_UINT_FB, "output_if"),  # physical interfaces
    16: (OP_UINT, "src_as"), 17: (OP_UINT, "dst_as"),
    60: (OP_UINT, "ip_version"), 61: (OP_UINT, "direction"),
    32: (OP_ICMP_TC, ""), 139: (OP_ICMP_TC, ""),
    176: (OP_UINT, "icmp_type"), 177: (OP_UINT, "icmp_code"),
    178: (OP_UINT, "icmp_type"), 179: (OP_UINT, "icmp_code"),
    22: (OP_UPTIME, "first"), 21: (OP_UPTIME, "last"),
    150: (OP_SEC, "first_switched"), 151: (OP_SEC, "last_switched"),
    152: (OP_MS, "first_switched"), 153: (OP_MS, "last_switched"),
    154: (OP_NTP, "first_switched"), 155: (OP_NTP, "last_switched"),
    156: (OP_NTP, "first_switched"), 157: (OP_NTP, "last_switched"),
    158: (OP_DELTA_US, "first"), 159: (OP_DELTA_US, "last"),
    160: (OP_SYSINIT, ""), 161: (OP_DUR_MS, ""), 162: (OP_DUR_US, ""),
    34: (OP_SAMPLING, ""), 50: (OP_SAMPLING, ""), 305: (OP_SAMPLING, ""),
    306: (OP_SPACE, ""), 48: (OP_SAMPLER_ID, ""), 302: (OP_SAMPLER_ID, ""),
}
# Lengths an operation accepts (others are skipped and counted as field_length).
_IP_OPS = {OP_IP4: 4, OP_IP6: 16}
_TIME_LEN = {OP_SEC: (4,), OP_MS: (8,), OP_NTP: (8,)}

# v5 header and the v5 record as a template (v9 element ids; 0 = padding).
V5_HEADER, V5_RECORD = 24, 48
V5_FIELDS = ((8, 4), (12, 4), (15, 4), (10, 2), (14, 2), (2, 4), (1, 4), (22, 4), (21, 4),
             (7, 2), (11, 2), (0, 1), (6, 1), (4, 1), (5, 1), (16, 2), (17, 2), (9, 1), (13, 1),
             (0, 2))
MAX_TEMPLATE_FIELDS = 1024  # real templates have tens; a larger count is refused
MAX_EXPORTERS = 8191  # template keys pack the exporter index in 13 bits
VCODE = {5: 0, 9: 1, 10: 2}

# Kernel stop codes.
DONE, STOP_TEMPLATE, STOP_NO_TEMPLATE, STOP_OPTIONS, STOP_FULL, STOP_STREAMS = range(6)
KIND_DATA, KIND_OPTIONS = 0, 1
# Error reasons counted by the kernel (index -> metric label).
KERNEL_REASONS = ("short_datagram", "unknown_version", "v5_count", "ipfix_length",
                  "set_length", "set_past_end", "reserved_set", "record_truncated",
                  "trailing_bytes")
(E_SHORT, E_VERSION, E_V5_COUNT, E_IPFIX_LEN, E_SET_LEN, E_SET_END, E_RESERVED, E_RECORD,
 E_TRAILING) = range(len(KERNEL_REASONS))
# Per-stream state columns.
(S_EXP, S_VERSION, S_DOMAIN, S_NEXT, S_KNOWN, S_LOST, S_GAPS, S_REORDER, S_DGRAMS, S_RECORDS,
 S_LAST_NS, S_CUR_RECS, S_CUR_UNKNOWN, S_CUR_SEQ, S_UNKNOWN_SAMPLING, S_OPTIONS) = range(16)
N_STATE = 16
REPLAY = 1  # datagram flag: a pending set decoded late (no sequence accounting)
NTP_EPOCH = 2208988800  # seconds from 1900 to 1970


@dataclass
class Datagrams:
    """Export datagrams of one batch: payload bytes in place, exporter address, arrival time."""

    buf: np.ndarray  # uint8
    offset: np.ndarray  # int64
    length: np.ndarray  # int32
    exporter: np.ndarray  # (n, 16) uint8, IPv4 as IPv4-mapped
    ts_ns: np.ndarray  # int64 arrival (capture) time
    flags: np.ndarray | None = None  # uint8 per datagram (REPLAY)

    def __len__(self) -> int:
        return len(self.offset)

    @classmethod
    def from_payloads(cls, payloads: list[bytes], exporter: str = "127.0.0.1",
                      ts_ns: int | None = None) -> Datagrams:
        """Datagrams from raw payloads (files of export bytes, tests)."""
        n = len(payloads)
        lengths = np.array([len(p) for p in payloads], dtype=np.int32)
        offset = np.zeros(n, np.int64)
        if n:
            offset[1:] = np.cumsum(lengths[:-1])
        buf = np.frombuffer(b"".join(payloads), dtype=np.uint8).copy() if n else \
            np.zeros(0, np.uint8)
        exp = np.tile(np.frombuffer(address_bytes(exporter), np.uint8), (n, 1))
        ts = np.full(n, time.time_ns() if ts_ns is None else ts_ns, np.int64)
        return cls(buf, offset, lengths, exp, ts)


def address_bytes(addr: str) -> bytes:
    """An IPv4 or IPv6 address as 16 bytes (IPv4-mapped)."""
    if ":" in addr:
        return socket.inet_pton(socket.AF_INET6, addr)
    return b"\0" * 10 + b"\xff\xff" + socket.inet_aton(addr)


def address_text(b: bytes) -> str:
    if b[:12] == b"\0" * 10 + b"\xff\xff":
        return socket.inet_ntoa(b[12:])
    return socket.inet_ntop(socket.AF_INET6, b)


# --------------------------------------------------------------------------- the kernel
@nb.njit(cache=True, inline="always")
def _be(buf, p, n):
    v = np.int64(0)
    for k in range(n):
        v = (v << 8) | np.int64(buf[p + k])
    return v


@nb.njit(cache=True, inline="always")
def _be16(buf, p):
    return (np.int64(buf[p]) << 8) | np.int64(buf[p + 1])


@nb.njit(cache=True, inline="always")
def _be32(buf, p):
    return (np.int64(buf[p]) << 24) | (np.int64(buf[p + 1]) << 16) | \
        (np.int64(buf[p + 2]) << 8) | np.int64(buf[p + 3])


@nb.njit(cache=True)
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


@nb.njit(cache=True)
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


@nb.njit(cache=True, inline="always")
def _relative_ns(ver, export_ns, uptime, up_ms, delta_us, init_ms):
    """A time given relative to sysUpTime or to the export time, in absolute ns (-1: none)."""
    if up_ms >= 0:
        return _uptime_ns(ver, export_ns, uptime, up_ms, init_ms)
    if delta_us >= 0:
        return export_ns - delta_us * 1000
    return np.int64(-1)


@nb.njit(cache=True)
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


@nb.njit(cache=True)
def _all_zero(buf, p, e):
    for k in range(p, e):
        if buf[k] != 0:
            return False
    return True


@nb.njit(cache=True)
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
            n, _ = _records(buf, base + hlen, mend, 0, t_fstart, t_fn, t_minlen, f_op, f_col,
                            f_len, ver, export_ns, uptime, domain, 0, d_expaddr[i], ints, ips,
                            ipset, n, tmp, sampling, row, smp_dict, smp_base)
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


# --------------------------------------------------------------------------- flow records
@dataclass
class FlowBatch:
    """Flow records of one batch, keyed by catalogue field name (NULL = -1 for integers; times
    in ns). Same interface as the packets stream's TupleBatch."""

    ints: np.ndarray  # (len(FLOW_INT_FIELDS), n) int64
    ips: np.ndarray  # (4, n, 16) uint8: exporter, src_ip, dst_ip, next_hop
    ipset: np.ndarray  # (4, n) bool
    stream: str = "flows"
    strings: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return self.ints.shape[1]

    @property
    def time(self) -> np.ndarray:
        return self.ints[C_TIME]

    def column(self, name: str) -> np.ndarray:
        if name in FLOW_IP_FIELDS:
            return self.ips[FLOW_IP_FIELDS.index(name)]
        return self.ints[FLOW_INT_INDEX[name]]

    def ip_valid(self) -> np.ndarray:
        return self.ipset[1]

    def arrow(self, name: str) -> pa.Array:
        f = F[name]
        if f.kind == IP:
            k = FLOW_IP_FIELDS.index(name)
            return _ip_binary(self.ips[k], self.ipset[k])
        col = self.ints[FLOW_INT_INDEX[name]]
        if f.kind == TS:
            return pa.array(col // 1000, type=pa.timestamp("us", tz="UTC"), mask=col < 0)
        return pa.array(col, type=f.arrow_type, mask=col < 0)

    def take(self, idx: np.ndarray) -> FlowBatch:
        return FlowBatch(self.ints[:, idx], self.ips[:, idx], self.ipset[:, idx])

    @classmethod
    def concat(cls, batches: list[FlowBatch]) -> FlowBatch:
        if not batches:
            return empty_flows(0)
        return cls(np.concatenate([b.ints for b in batches], axis=1),
                   np.concatenate([b.ips for b in batches], axis=1),
                   np.concatenate([b.ipset for b in batches], axis=1))

    def rows(self) -> list[dict]:
        """Records as dicts of Python values (addresses as text, times in ns): tests, tools."""
        out = []
        for i in range(len(self)):
            r = {}
            for name in F:
                if name in FLOW_IP_FIELDS:
                    k = FLOW_IP_FIELDS.index(name)
                    r[name] = address_text(self.ips[k, i].tobytes()) if self.ipset[k, i] \
                        else None
                else:
                    v = int(self.ints[FLOW_INT_INDEX[name], i])
                    r[name] = None if v < 0 else v
            out.append(r)
        return out


def empty_flows(n: int) -> FlowBatch:
    return FlowBatch(np.full((len(FLOW_INT_FIELDS), n), NULL_INT, np.int64),
                     np.zeros((4, n, 16), np.uint8), np.zeros((4, n), np.bool_))


# --------------------------------------------------------------------------- templates
@dataclass
class Template:
    """A data or options template as the exporter sent it."""

    exporter: str
    version: int
    domain: int
    template_id: int
    fields: tuple[tuple[int, int, int], ...]  # (element id, enterprise number, length)
    kind: int = KIND_DATA
    scope_count: int = 0
    learned_ns: int = 0

    def to_json(self) -> dict:
        return {"exporter": self.exporter, "version": self.version, "domain": self.domain,
                "template_id": self.template_id, "kind": "options" if self.kind else "data",
                "scope_count": self.scope_count, "fields": [list(f) for f in self.fields],
                "learned_ns": self.learned_ns}

    @classmethod
    def from_json(cls, d: dict) -> Template:
        return cls(d["exporter"], d["version"], d["domain"], d["template_id"],
                   tuple(tuple(f) for f in d["fields"]),
                   KIND_OPTIONS if d["kind"] == "options" else KIND_DATA, d["scope_count"],
                   d.get("learned_ns", 0))


def _target(op: int, name: str) -> int:
    if op in (OP_IP4, OP_IP6):
        return FLOW_IP_FIELDS.index(name)
    if op in (OP_UINT, OP_UINT_FB, OP_TCP_FLAGS, OP_SEC, OP_MS, OP_NTP):
        return FLOW_INT_INDEX[name]
    return {OP_UPTIME: {"first": T_UP_FIRST, "last": T_UP_LAST}.get(name, -1),
            OP_DELTA_US: {"first": T_DELTA_FIRST, "last": T_DELTA_LAST}.get(name, -1),
            OP_SYSINIT: T_INIT, OP_DUR_MS: T_DUR, OP_DUR_US: T_DUR_US, OP_SAMPLER_ID: T_SAMPLER,
            OP_SAMPLING: T_INTERVAL, OP_SPACE: T_SPACE, OP_ICMP_TC: 0}[op]


def compile_fields(fields_: tuple[tuple[int, int, int], ...],
                   enterprise: dict[tuple[int, int], str]) -> list[tuple[int, int, int]]:
    """(operation, target, length) per field; unknown or ill-sized fields are skipped."""
    out = []
    for ie, pen, ln in fields_:
        if pen:
            name = enterprise.get((pen, ie))
            if name is None:
                op, name = OP_SKIP, ""
            else:
                kind = F[name].kind
                op = (OP_IP6 if ln == 16 else OP_IP4) if kind == IP else \
                    (OP_MS if kind == TS else OP_UINT)
        else:
            op, name = IE.get(ie, (OP_SKIP, ""))
        if op in _IP_OPS and ln != _IP_OPS[op]:
            op = OP_SKIP
        elif op in _TIME_LEN and ln not in _TIME_LEN[op]:
            op = OP_SKIP
        elif op != OP_SKIP and (ln == VARLEN or ln > 8 or ln == 0) and op not in _IP_OPS:
            op = OP_SKIP
        out.append((op, _target(op, name) if op != OP_SKIP else 0, ln))
    return out


V5_TEMPLATE = tuple((ie, 0, ln) for ie, ln in V5_FIELDS)


class DecoderError(ValueError):
    pass


class TemplateStore:
    """Templates and options sampling per export stream, as exporters sent them (the decoder
    compiles them for the kernel); saved and loaded as JSON."""

    def __init__(self, enterprise: dict[tuple[int, int], str] | None = None):
        self.enterprise = dict(enterprise or {})
        self.templates: dict[tuple[str, int, int, int], Template] = {}
        # (exporter, version, domain, sampler id or 0) -> interval
        self.sampling: dict[tuple[str, int, int, int], int] = {}
        self.dirty = False

    def learn(self, t: Template) -> bool:
        """Add or replace a template; True when it changed."""
        key = (t.exporter, t.version, t.domain, t.template_id)
        old = self.templates.get(key)
        if old is not None and old.fields == t.fields and old.kind == t.kind:
            return False
        self.templates[key] = t
        self.dirty = True
        return True

    def withdraw(self, exporter: str, version: int, domain: int, template_id: int | None,
                 kind: int) -> list[tuple[str, int, int, int]]:
        """Remove one template, or every template of a kind (IPFIX withdraw-all); the keys
        removed."""
        keys = [k for k, t in self.templates.items()
                if k[:3] == (exporter, version, domain) and t.kind == kind
                and (template_id is None or k[3] == template_id)]
        for k in keys:
            del self.templates[k]
        if keys:
            self.dirty = True
        return keys

    def set_sampling(self, exporter: str, version: int, domain: int, sampler: int,
                     interval: int) -> None:
        key = (exporter, version, domain, sampler)
        if self.sampling.get(key) != interval:
            self.sampling[key] = interval
            self.dirty = True

    # persistence
    def save(self, path: str | os.PathLike) -> None:
        path = Path(path)
        doc = {"version": 1,
               "templates": [t.to_json() for t in self.templates.values()],
               "sampling": [{"exporter": e, "version": v, "domain": d, "sampler": s,
                             "interval": i} for (e, v, d, s), i in self.sampling.items()]}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)
        self.dirty = False

    def load(self, path: str | os.PathLike) -> int:
        """Templates saved by ``save``; a missing file is an empty store."""
        try:
            doc = json.loads(Path(path).read_text())
        except FileNotFoundError:
            return 0
        except (OSError, ValueError) as e:
            raise DecoderError(f"template state {path} is unreadable: {e}") from e
        for d in doc.get("templates", []):
            t = Template.from_json(d)
            self.templates[(t.exporter, t.version, t.domain, t.template_id)] = t
        for d in doc.get("sampling", []):
            self.sampling[(d["exporter"], d["version"], d["domain"], d["sampler"])] = \
                d["interval"]
        return len(self.templates)


# --------------------------------------------------------------------------- the decoder
class _KernelTables:
    """Templates as the kernel reads them: per-slot and per-field arrays grown in place, and a
    typed dict from kernel key to slot. A learned template appends a slot; a replaced or
    withdrawn one leaves garbage until the decoder rebuilds (rarely: see ``garbage``)."""

    def __init__(self):
        self.tdict = Dict.empty(types.int64, types.int64)
        self.t = np.zeros((4, 64), np.int64)  # fstart, fn, minlen, kind per slot
        self.f = np.zeros((3, 1024), np.int64)  # op, target, length per field
        self.nt = self.nf = self.garbage = 0
        self.put(-1, compile_fields(V5_TEMPLATE, {}), KIND_DATA)  # slot 0: NetFlow v5

    def put(self, key: int, cf: list[tuple[int, int, int]], kind: int) -> None:
        if self.nt == self.t.shape[1]:
            self.t = np.concatenate([self.t, np.zeros_like(self.t)], axis=1)
        while self.nf + len(cf) > self.f.shape[1]:
            self.f = np.concatenate([self.f, np.zeros_like(self.f)], axis=1)
        if cf:
            self.f[:, self.nf:self.nf + len(cf)] = np.array(cf, np.int64).T
        minlen = sum(1 if ln == VARLEN else ln for _, _, ln in cf)
        self.t[:, self.nt] = (self.nf, len(cf), minlen, kind)
        if key >= 0:
            if key in self.tdict:
                self.garbage += 1
            self.tdict[key] = self.nt
        self.nt += 1
        self.nf += len(cf)

    def drop(self, key: int) -> None:
        if key in self.tdict:
            del self.tdict[key]
            self.garbage += 1

    def args(self):
        return (self.tdict, self.t[0], self.t[1], self.t[2], self.t[3], self.f[0], self.f[1],
                self.f[2])


@dataclass
class _Pending:
    key: tuple[str, int, int, int]
    exp: int
    header: bytes
    data: bytes
    addr: bytes
    ts_ns: int
    done: bool = False

    @property
    def size(self) -> int:
        return len(self.header) + len(self.data)


class Decoder:
    """Decodes batches of export datagrams; keeps templates, sampling, sequence state and
    counters per exporter and export stream."""

    def __init__(self, store: TemplateStore | None = None, *,
                 sampling_override: dict[str, int] | None = None,
                 default_sampling_interval: int = 1, pending_max_bytes: int = 4 << 20,
                 pending_ttl_s: float = 300.0, max_templates: int = 65536):
        self.store = store or TemplateStore()
        self.max_templates = max_templates
        self.exporters: dict[bytes, int] = {}
        self.exporter_names: list[str] = []
        self._exp_index: dict[str, int] = {}
        self.override = np.zeros(MAX_EXPORTERS + 1, np.int64)
        self.sampling_override = {address_bytes(k): int(v)
                                  for k, v in (sampling_override or {}).items()}
        self.default_interval = int(default_sampling_interval)
        self.st_dict = Dict.empty(types.int64, types.int64)
        self.st = np.zeros((64, N_STATE), np.int64)
        self.st_n = np.zeros(1, np.int64)
        self.errors: dict[str, int] = {}
        self._errs = np.zeros(len(KERNEL_REASONS), np.int64)
        # held data sets: by template key, and in arrival order (for eviction and expiry)
        self._held: dict[tuple[str, int, int, int], list[_Pending]] = {}
        self._order: deque[_Pending] = deque()
        self.pending_sets = 0
        self.pending_bytes = 0
        self.pending_max_bytes = pending_max_bytes
        self.pending_ttl_ns = int(pending_ttl_s * 1e9)
        self.bad_templates: set[tuple[str, int, int, int]] = set()
        self.options_records = 0
        self.templates_changed = 0
        self._now = 0
        self.sdict = Dict.empty(types.int64, types.int64)  # stream key << 16 | sampler -> interval
        for exp in {t.exporter for t in self.store.templates.values()} | \
                {k[0] for k in self.store.sampling}:
            self._exporter(address_bytes(exp))
        self._rebuild_tables()

    def _rebuild_tables(self) -> None:
        self.tables = _KernelTables()
        for t in self.store.templates.values():
            self._put(t)
        for (exp, ver, dom, sampler), interval in self.store.sampling.items():
            self._put_sampling(exp, ver, dom, sampler, interval)

    def _stream_key(self, exporter: str, version: int, domain: int) -> int:
        return ((self._exp_index[exporter] * 4 + VCODE[version]) << 32) | domain

    def _put(self, t: Template) -> None:
        key = (self._stream_key(t.exporter, t.version, t.domain) << 16) | t.template_id
        self.tables.put(key, compile_fields(t.fields, self.store.enterprise), t.kind)

    def _put_sampling(self, exporter, version, domain, sampler, interval) -> None:
        self.store.set_sampling(exporter, version, domain, sampler, interval)
        self.sdict[(self._stream_key(exporter, version, domain) << 16)
                   | ((sampler + 1) & 0xFFFF if sampler else 0)] = interval

    @property
    def pending(self) -> list[_Pending]:
        """The data sets waiting for their template, oldest first."""
        return [x for x in self._order if not x.done]

    # -- exporters and streams
    def _exporter(self, addr: bytes) -> int:
        e = self.exporters.get(addr)
        if e is None:
            if len(self.exporter_names) >= MAX_EXPORTERS:
                return -1
            e = len(self.exporter_names)
            self.exporters[addr] = e
            self.exporter_names.append(address_text(addr))
            self._exp_index[self.exporter_names[-1]] = e
            self.override[e] = self.sampling_override.get(addr, 0)
        return e

    def _count(self, reason: str, n: int = 1) -> None:
        self.errors[reason] = self.errors.get(reason, 0) + n

    # -- decoding
    def decode(self, dg: Datagrams) -> FlowBatch:
        """The flow records of a batch of datagrams (in order)."""
        n = len(dg)
        if n == 0:
            return empty_flows(0)
        self._now = max(self._now, int(dg.ts_ns.max()))
        uniq, inv = np.unique(np.ascontiguousarray(dg.exporter).view("V16").ravel(),
                              return_inverse=True)
        idx = np.array([self._exporter(u.tobytes()) for u in uniq], np.int64)
        exp = idx[inv.reshape(-1)]
        flags = dg.flags if dg.flags is not None else np.zeros(n, np.uint8)
        if (exp < 0).any():
            self._count("too_many_exporters", int((exp < 0).sum()))
            keep = exp >= 0
            dg = Datagrams(dg.buf, dg.offset[keep], dg.length[keep], dg.exporter[keep],
                           dg.ts_ns[keep], flags[keep])
            exp, flags = exp[keep], flags[keep]
        cap = max(256, int(dg.length.sum()) // 40)
        self._out = [np.full((len(FLOW_INT_FIELDS), cap), NULL_INT, np.int64),
                     np.zeros((4, cap, 16), np.uint8), np.zeros((4, cap), np.bool_), 0]
        self._run(dg, exp, flags)
        self._expire()
        ints, ips, ipset, k = self._out
        self._out = None
        return FlowBatch(ints[:, :k], ips[:, :k], ipset[:, :k])

    def _grow(self, need: int) -> None:
        ints, ips, ipset, k = self._out
        cap = max(2 * ints.shape[1], k + need)
        ni = np.full((ints.shape[0], cap), NULL_INT, np.int64)
        ni[:, :k] = ints[:, :k]
        np_ = np.zeros((4, cap, 16), np.uint8)
        np_[:, :k] = ips[:, :k]
        ns = np.zeros((4, cap), np.bool_)
        ns[:, :k] = ipset[:, :k]
        self._out = [ni, np_, ns, k]

    def _run(self, dg: Datagrams, exp: np.ndarray, flags: np.ndarray) -> None:
        d, p = 0, 0
        exp = exp.astype(np.int32)
        addrs = np.ascontiguousarray(dg.exporter)
        while True:
            if self.tables.garbage > 2 * len(self.tables.tdict) + 256:
                self._rebuild_tables()
            ints, ips, ipset, k = self._out
            code, d, p, k, slot, key = decode_kernel(
                dg.buf, dg.offset, dg.length, exp, dg.ts_ns, flags, addrs, d, p,
                *self.tables.args(), self.st_dict, self.st, self.st_n, self.sdict,
                self.override, self.default_interval, ints, ips, ipset, k, self._errs)
            self._out[3] = k
            if code == DONE:
                break
            if code == STOP_FULL:
                self._grow(max(1024, int(dg.length[d]) // 4))
                continue
            if code == STOP_STREAMS:
                self.st = np.concatenate([self.st, np.zeros_like(self.st)])
                continue
            base = int(dg.offset[d])
            buf = dg.buf
            ver = (int(buf[base]) << 8) | int(buf[base + 1])
            slen = (int(buf[base + p + 2]) << 8) | int(buf[base + p + 3])
            body = buf[base + p:base + p + slen].tobytes()
            domain = int(self.st[slot, S_DOMAIN])
            exporter = self.exporter_names[int(exp[d])]
            if code == STOP_TEMPLATE:
                self._templates(exporter, ver, domain, body, int(dg.ts_ns[d]))
            elif code == STOP_OPTIONS:
                self._options(exporter, ver, domain, key & 0xFFFF, body, slot,
                              not flags[d] & REPLAY)
            elif code == STOP_NO_TEMPLATE:
                tkey = (exporter, ver, domain, key & 0xFFFF)
                if tkey in self.bad_templates:
                    self._count("template_invalid_data")
                else:
                    hl = 20 if ver == 9 else 16
                    self._hold(_Pending(tkey, int(exp[d]), buf[base:base + hl].tobytes(),
                                        body, addrs[d].tobytes(), int(dg.ts_ns[d])))
                    if not flags[d] & REPLAY:
                        self.st[slot, S_CUR_UNKNOWN] = 1
            p += slen
        self._flush_errs()

    def _flush_errs(self) -> None:
        for i, v in enumerate(self._errs):
            if v:
                self._count(KERNEL_REASONS[i], int(v))
        self._errs[:] = 0

    # -- template sets (rare: Python)
    def _templates(self, exporter: str, ver: int, domain: int, body: bytes, ts_ns: int) -> None:
        sid = int.from_bytes(body[0:2], "big")
        options = sid in (1, 3)
        p, end = 4, len(body)
        learned = []
        while end - p >= 4:
            tid = int.from_bytes(body[p:p + 2], "big")
            count = int.from_bytes(body[p + 2:p + 4], "big")
            if ver == 9 and options:
                if end - p < 6:
                    break
                scope_len, opt_len = count, int.from_bytes(body[p + 4:p + 6], "big")
                p += 6
                if scope_len % 4 or opt_len % 4 or p + scope_len + opt_len > end:
                    self._count("template_truncated")
                    return
                nf, scope = (scope_len + opt_len) // 4, scope_len // 4
            elif ver == 10 and options:
                p += 4
                if count == 0:
                    self._withdraw(exporter, ver, domain, tid, KIND_OPTIONS)
                    continue
                if end - p < 2:
                    self._count("template_truncated")
                    return
                nf, scope = count, int.from_bytes(body[p:p + 2], "big")
                p += 2
                if scope == 0 or scope > nf:
                    self._count("template_scope")
                    return
            else:
                p += 4
                if count == 0:
                    if ver == 10:
                        self._withdraw(exporter, ver, domain, tid, KIND_DATA)
                        continue
                    self._count("template_no_fields")
                    continue
                nf, scope = count, 0
            if nf > MAX_TEMPLATE_FIELDS:
                self._count("template_too_many_fields")
                self.bad_templates.add((exporter, ver, domain, tid))
                return
            flds = []
            for _ in range(nf):
                if p + 4 > end:
                    self._count("template_truncated")
                    return
                ie = int.from_bytes(body[p:p + 2], "big")
                ln = int.from_bytes(body[p + 2:p + 4], "big")
                p += 4
                pen = 0
                if ver == 10 and ie & 0x8000:
                    if p + 4 > end:
                        self._count("template_truncated")
                        return
                    pen = int.from_bytes(body[p:p + 4], "big")
                    ie &= 0x7FFF
                    p += 4
                elif ver == 9 and len(flds) < scope:
                    pen = 0xFFFFFFFF  # v9 scope types are not information elements
                if ver == 9 and ln == VARLEN:
                    ln = VARLEN - 1  # v9 has no variable-length encoding
                flds.append((ie, pen, ln))
            key = (exporter, ver, domain, tid)
            if tid < 256:
                self._count("template_id")
                continue
            if sum(1 if ln == VARLEN else ln for _, _, ln in flds) == 0:
                self._count("template_zero_length")
                self.bad_templates.add(key)
                continue
            self.bad_templates.discard(key)
            t = Template(exporter, ver, domain, tid, tuple(flds),
                         KIND_OPTIONS if options else KIND_DATA, scope, ts_ns)
            if key not in self.store.templates and \
                    len(self.store.templates) >= self.max_templates:
                self._count("too_many_templates")
                continue
            if self.store.learn(t):
                self.templates_changed += 1
                self._put(t)
            learned.append(key)
        for key in learned:
            self._release(key)

    def _withdraw(self, exporter, ver, domain, tid, kind) -> None:
        all_ = tid == (2 if kind == KIND_DATA else 3)
        for key in self.store.withdraw(exporter, ver, domain, None if all_ else tid, kind):
            self.tables.drop((self._stream_key(*key[:3]) << 16) | key[3])

    def _options(self, exporter: str, ver: int, domain: int, tid: int, body: bytes, slot: int,
                 count_seq: bool) -> None:
        """Options data: sampling interval / space / sampler id per record."""
        t = self.store.templates[(exporter, ver, domain, tid)]
        p, end = 4, len(body)
        minlen = sum(1 if ln == VARLEN else ln for _, _, ln in t.fields)
        n = 0
        while end - p >= minlen:
            vals: dict[int, int] = {}
            for ie, pen, ln in t.fields:
                if ln == VARLEN:
                    if p >= end:
                        self._count("record_truncated")
                        return
                    ln = body[p]
                    p += 1
                    if ln == 255:
                        ln = int.from_bytes(body[p:p + 2], "big")
                        p += 2
                if p + ln > end:
                    self._count("record_truncated")
                    return
                if pen == 0 and ln <= 8:
                    vals.setdefault(ie, int.from_bytes(body[p:p + ln], "big"))
                p += ln
            n += 1
            interval = vals.get(34) or vals.get(50) or vals.get(305)
            if interval and 306 in vals and 305 in vals:
                interval = (vals[305] + vals[306]) // vals[305]
            if vals.get(309) and vals.get(310):  # random n-out-of-N
                interval = max(1, vals[310] // vals[309])
            if interval:
                sampler = vals.get(48, vals.get(302, 0))
                self._put_sampling(exporter, ver, domain, 0, interval)
                if sampler:
                    self._put_sampling(exporter, ver, domain, sampler, interval)
        self.options_records += n
        self.st[slot, S_OPTIONS] += n
        if count_seq:
            self.st[slot, S_CUR_RECS] += n
            self.st[slot, S_RECORDS] += n

    # -- pending data (template not seen yet)
    def _hold(self, item: _Pending) -> None:
        if item.size > self.pending_max_bytes:
            self._count("template_missing")
            return
        self._held.setdefault(item.key, []).append(item)
        self._order.append(item)
        self.pending_sets += 1
        self.pending_bytes += item.size
        while self.pending_bytes > self.pending_max_bytes:
            self._discard(self._oldest(), "pending_evicted")

    def _oldest(self) -> _Pending:
        while self._order[0].done:
            self._order.popleft()
        return self._order[0]

    def _discard(self, item: _Pending, reason: str | None) -> None:
        """Take a held set out of the buffer (counted under ``reason`` unless released)."""
        item.done = True
        self.pending_sets -= 1
        self.pending_bytes -= item.size
        held = self._held[item.key]
        held.remove(item)
        if not held:
            del self._held[item.key]
        if reason:
            self._count(reason)

    def _release(self, key) -> None:
        """Decode the held sets of a template that just arrived."""
        ready = list(self._held.get(key, ()))
        if not ready:
            return
        payloads = []
        for x in ready:
            self._discard(x, None)
            h = bytearray(x.header)
            if x.key[1] == 10:
                h[2:4] = (len(h) + len(x.data)).to_bytes(2, "big")
            payloads.append(bytes(h) + x.data)
        dg = Datagrams.from_payloads(payloads)
        dg.exporter = np.array([np.frombuffer(x.addr, np.uint8) for x in ready])
        dg.ts_ns = np.array([x.ts_ns for x in ready], np.int64)
        self._run(dg, np.array([x.exp for x in ready], np.int64),
                  np.full(len(ready), REPLAY, np.uint8))

    def _expire(self) -> None:
        limit = self._now - self.pending_ttl_ns
        while self.pending_sets and self._oldest().ts_ns < limit:
            self._discard(self._oldest(), "template_missing")

    def finish(self) -> None:
        """End of input: what still waits for a template is counted as missing."""
        while self.pending_sets:
            self._discard(self._oldest(), "template_missing")
        self._order.clear()

    # -- state for the API
    def streams(self) -> list[dict]:
        out = []
        for slot in range(int(self.st_n[0])):
            r = self.st[slot]
            exporter = self.exporter_names[int(r[S_EXP])]
            ver, dom = int(r[S_VERSION]), int(r[S_DOMAIN])
            tpls = sorted(t.template_id for (e, v, d, _), t in self.store.templates.items()
                          if (e, v, d) == (exporter, ver, dom))
            smp = {str(s or "default"): i for (e, v, d, s), i in self.store.sampling.items()
                   if (e, v, d) == (exporter, ver, dom)}
            out.append({"exporter": exporter, "version": ver, "observation_domain": dom,
                        "datagrams": int(r[S_DGRAMS]), "records": int(r[S_RECORDS]),
                        "options_records": int(r[S_OPTIONS]),
                        "last_seen_ns": int(r[S_LAST_NS]) or None,
                        "sequence": {"lost": int(r[S_LOST]), "gaps": int(r[S_GAPS]),
                                     "out_of_order": int(r[S_REORDER]),
                                     "unit": "datagrams" if ver == 9 else "records"},
                        "templates": tpls, "sampling": smp,
                        "sampling_override": int(self.override[int(r[S_EXP])]) or None,
                        "records_sampling_unknown": int(r[S_UNKNOWN_SAMPLING])})
        return out


# --------------------------------------------------------------------------- captures of exports
@nb.njit(cache=True)
def _udp_payloads(buf, offset, caplen, linktype, ports, out_off, out_len, out_addr, out_rec):
    """UDP payloads sent to one of ``ports`` (IPv4, IPv6, VLAN-tagged, cooked or raw links);
    IP fragments are skipped. Returns the number found."""
    n = 0
    for r in range(offset.shape[0]):
        s = offset[r]
        e = s + caplen[r]
        lt = linktype[r]
        et = -1
        p = s
        if lt == 1:
            if e - p < 14:
                continue
            et = _be16(buf, p + 12)
            p += 14
            while (et == 0x8100 or et == 0x88A8) and e - p >= 4:
                et = _be16(buf, p + 2)
                p += 4
        elif lt == 113:
            if e - p < 16:
                continue
            et = _be16(buf, p + 14)
            p += 16
        elif lt == 276:
            if e - p < 20:
                continue
            et = _be16(buf, p)
            p += 20
        elif lt == 101 or lt == 12:
            if e - p < 1:
                continue
            et = 0x0800 if (buf[p] >> 4) == 4 else 0x86DD
        elif lt == 0 or lt == 108:
            if e - p < 4:
                continue
            fam = np.int64(buf[p]) | (np.int64(buf[p + 3]))
            et = 0x0800 if fam == 2 else 0x86DD
            p += 4
        else:
            continue
        if et == 0x0800:
            if e - p < 20 or (buf[p] >> 4) != 4:
                continue
            ihl = (np.int64(buf[p]) & 0xF) * 4
            if buf[p + 9] != 17 or (_be16(buf, p + 6) & 0x3FFF) != 0 or e - p < ihl + 8:
                continue
            for b in range(10):
                out_addr[n, b] = 0
            out_addr[n, 10] = 0xFF
            out_addr[n, 11] = 0xFF
            for b in range(4):
                out_addr[n, 12 + b] = buf[p + 12 + b]
            u = p + ihl
        elif et == 0x86DD:
            if e - p < 48:
                continue
            nh = buf[p + 6]
            u = p + 40
            while (nh == 0 or nh == 43 or nh == 60) and e - u >= 8:
                nh = buf[u]
                u += (np.int64(buf[u + 1]) + 1) * 8
            if nh != 17 or e - u < 8:
                continue
            for b in range(16):
                out_addr[n, b] = buf[p + 8 + b]
        else:
            continue
        dport = _be16(buf, u + 2)
        hit = False
        for k in range(ports.shape[0]):
            if ports[k] == dport:
                hit = True
        if not hit:
            continue
        ulen = _be16(buf, u + 4) - 8
        avail = e - (u + 8)
        out_off[n] = u + 8
        out_len[n] = min(ulen, avail) if ulen >= 0 else avail
        out_rec[n] = r
        n += 1
    return n


def export_datagrams(raw, ports) -> Datagrams:
    """The export datagrams of a batch of captured packets (UDP to the flow ports)."""
    m = len(raw)
    off, ln = np.empty(m, np.int64), np.empty(m, np.int32)
    addr, rec = np.zeros((m, 16), np.uint8), np.empty(m, np.int64)
    n = _udp_payloads(raw.buf, raw.offset, raw.caplen, raw.linktype,
                      np.array(list(ports), np.int64), off, ln, addr, rec)
    return Datagrams(raw.buf, off[:n], ln[:n], addr[:n], raw.ts_ns[rec[:n]])


def capture_flows(path, ports, decoder: Decoder | None = None, batch_size: int = 4096):
    """Flow records of a capture of export datagrams, batch by batch (``decode --stream flows``
    and ``replay``): the same decoder as the listener."""
    from capture.pcap import open_capture
    decoder = decoder or Decoder()
    for raw in open_capture(path, batch_size):
        fb = decoder.decode(export_datagrams(raw, ports))
        if len(fb):
            yield fb
    decoder.finish()
