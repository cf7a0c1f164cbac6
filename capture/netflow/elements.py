"""NetFlow v5/v9 and IPFIX as data: the information elements flowsieve maps (IANA ids; v9 types
below 128 are the same), the field operations of a compiled template, the NetFlow v5 record as a
template, and the kernel's stop codes, error reasons and per-stream state columns."""

from __future__ import annotations

from capture.fields import IP, decoded_fields

F = decoded_fields("flows")  # enrichment fields: capture/enrich/
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
IP_OPS = {OP_IP4: 4, OP_IP6: 16}
TIME_LEN = {OP_SEC: (4,), OP_MS: (8,), OP_NTP: (8,)}

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
# Every reason bad input is counted under (the metric label), and what it means.
REASON_TEXT = {
    "short_datagram": "datagram shorter than its header",
    "unknown_version": "not NetFlow v5, v9 or IPFIX",
    "v5_count": "v5 record count does not fit the datagram",
    "ipfix_length": "IPFIX message length does not match the datagram",
    "set_length": "set length below its header",
    "set_past_end": "set runs past the end of the datagram",
    "reserved_set": "set id reserved by the protocol",
    "record_truncated": "record cut short by the end of its set",
    "trailing_bytes": "bytes after the last set",
    "too_many_exporters": f"more than {MAX_EXPORTERS} exporters",
    "template_invalid_data": "data of a template that was refused",
    "template_truncated": "template cut short by the end of its set",
    "template_scope": "options template scope count out of range",
    "template_no_fields": "template without fields",
    "template_too_many_fields": f"template with more than {MAX_TEMPLATE_FIELDS} fields",
    "template_id": "template id below 256",
    "template_zero_length": "template whose records are empty",
    "too_many_templates": "template count over the decoder's bound",
    "template_missing": "data whose template never came (or too large to hold)",
    "pending_evicted": "data held for its template evicted by newer data",
}
# Per-stream state columns.
(S_EXP, S_VERSION, S_DOMAIN, S_NEXT, S_KNOWN, S_LOST, S_GAPS, S_REORDER, S_DGRAMS, S_RECORDS,
 S_LAST_NS, S_CUR_RECS, S_CUR_UNKNOWN, S_CUR_SEQ, S_UNKNOWN_SAMPLING, S_OPTIONS) = range(16)
N_STATE = 16
REPLAY = 1  # datagram flag: a pending set decoded late (no sequence accounting)
NTP_EPOCH = 2208988800  # seconds from 1900 to 1970
