"""sFlow v5's numbers (sflow.org, sflow_version_5.txt) and the kernel's output layout: the
columns of its datagram, flow-sample and counter-sample tables and its reasons."""

from __future__ import annotations

from capture.fields import COUNTER_FIELDS

# sample formats (enterprise 0)
FLOW_SAMPLE, COUNTER_SAMPLE, FLOW_SAMPLE_EXPANDED, COUNTER_SAMPLE_EXPANDED = 1, 2, 3, 4
# flow record formats (enterprise 0)
RAW_HEADER, SAMPLED_ETHERNET, SAMPLED_IPV4, SAMPLED_IPV6 = 1, 2, 3, 4
EXT_SWITCH, EXT_ROUTER, EXT_GATEWAY = 1001, 1002, 1003
# counter record formats (enterprise 0)
GENERIC_IF, ETHERNET_IF = 1, 2

# header_protocol -> the pcap link type the packet kernel walks (-1: not walked)
HEADER_LINKTYPE: dict[int, int] = {1: 1, 11: 101, 12: 101, 15: 105}

# the datagram table: one row per datagram
DG_COLS = ("status", "sub_agent", "sequence", "uptime_ms", "samples", "flows", "counters",
           "skipped")
DG = {c: i for i, c in enumerate(DG_COLS)}

# the flow-sample table: one row per flow sample (where in the datagram buffer its raw header
# is; the sample's fields; the extended records' fields; a sampled IPv4/IPv6/Ethernet record's)
FS_COLS = (
    "dgram", "header_off", "header_len", "frame_length", "stripped", "header_protocol",
    "sample_seq", "source_id_type", "source_id", "sampling_rate", "sample_pool", "drops",
    "input_if_format", "input_if_value", "output_if_format", "output_if_value",
    "src_vlan", "src_priority", "dst_vlan", "dst_priority", "src_mask", "dst_mask",
    "router_as", "src_as", "src_peer_as", "dst_peer_as", "dst_as", "as_path_len",
    "community", "local_pref",
    "ip_length", "ip_protocol", "ip_src_port", "ip_dst_port", "ip_tcp_flags", "ip_tos",
    "ip_version", "eth_length", "eth_type",
)
FS = {c: i for i, c in enumerate(FS_COLS)}
# addresses of a flow sample: (4, n, 16) and whether each is set
FS_IPS = ("next_hop", "bgp_next_hop", "ip_src", "ip_dst")
FI = {c: i for i, c in enumerate(FS_IPS)}

# the counter-sample table: one row per counter sample; a counters field of the catalogue
# is the column of its name
CS_COLS = ("dgram", "sample_seq", "source_id_type", "source_id", "if_status") + tuple(
    f.name for f in COUNTER_FIELDS if f.name not in (
        "ts", "time", "agent", "sub_agent", "source_id_type", "source_id", "if_admin_up",
        "if_oper_up"))
CS = {c: i for i, c in enumerate(CS_COLS)}
GENERIC_COLS = ("if_index", "if_type", "if_speed", "if_direction", "if_status", "in_octets",
                "in_ucast_pkts", "in_mcast_pkts", "in_bcast_pkts", "in_discards", "in_errors",
                "in_unknown_protos", "out_octets", "out_ucast_pkts", "out_mcast_pkts",
                "out_bcast_pkts", "out_discards", "out_errors", "promiscuous")
# the 8-byte counters of the generic record; the others are 4 bytes
GENERIC_WIDE = ("if_speed", "in_octets", "out_octets")
ETHERNET_COLS = ("alignment_errors", "fcs_errors", "single_collisions", "multiple_collisions",
                 "sqe_test_errors", "deferred_transmissions", "late_collisions",
                 "excessive_collisions", "mac_transmit_errors", "carrier_sense_errors",
                 "frame_too_longs", "mac_receive_errors", "symbol_errors")

# why a whole datagram is dropped (DG "status"; 0 is decoded)
DATAGRAM_REASONS = ("", "sflow_short", "sflow_version", "sflow_agent_address",
                    "sflow_sample_length", "sflow_sample_count")
E_SHORT, E_VERSION, E_AGENT, E_SAMPLE_LENGTH, E_SAMPLE_COUNT = range(1, 6)
REASON_TEXT = {
    "sflow_short": "datagram shorter than its header",
    "sflow_version": "not sFlow version 5",
    "sflow_agent_address": "agent address type neither 1 (IPv4) nor 2 (IPv6)",
    "sflow_sample_length": "a sample or record runs past the end of its datagram or sample",
    "sflow_sample_count": "fewer samples than the header says",
    "sflow_too_many_agents": "more agents than max_agents: decoded, no sequence kept",
}
# what is skipped inside a decoded datagram (by its length), counted by reason
SKIP_REASONS = ("sflow_unknown_sample", "sflow_unknown_flow_record",
                "sflow_unknown_counter_record", "sflow_record_short")
K_SAMPLE, K_FLOW_RECORD, K_COUNTER_RECORD, K_RECORD_SHORT = range(4)

# smallest sizes: a flow sample (compact) 8 + 32 bytes, a counter sample 8 + 12
MIN_SAMPLE = 20
