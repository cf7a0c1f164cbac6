"""The field catalogue: the one declaration of every field flowsieve knows.

Offsets in the unpack kernels, Arrow schemas, query validation, ``decode`` headers and the docs
are all derived from this table; nothing else re-types a field.
"""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

# Kinds: how a field is held in numba (column) and in Arrow/Spark.
INT32, INT64, IP, TS, STRING, BYTES = "int32", "int64", "ip", "ts", "string", "bytes"
# text held as an integer code (a country's two letters): an integer through the pipeline, the
# text in answers; the code is a function of the text alone (``code_of``), so it is the same
# on every probe and after every reload of a database
CODE = "code"

# NULL in an integer column of a TupleBatch: every catalogue integer is non-negative.
NULL_INT = -1

ARROW_TYPES = {
    INT32: pa.int32(),
    INT64: pa.int64(),
    IP: pa.binary(),  # 16 bytes; IPv4 as IPv4-mapped (::ffff:a.b.c.d)
    TS: pa.timestamp("us", tz="UTC"),
    STRING: pa.string(),
    BYTES: pa.binary(),
    CODE: pa.string(),
}


@dataclass(frozen=True)
class Field:
    """One catalogue field."""

    name: str
    stream: str  # "packets", "flows", "samples" or "counters"
    kind: str  # INT32, INT64, IP, TS, STRING
    group: str  # protocol-layer group the unpack kernel extracts together
    cost: float  # unpack cost alone (relative ops)
    group_cost: float  # marginal cost once its group is unpacked
    groupable: bool
    measure: bool
    doc: str
    # a small integer code: its values lie below this (0: not small); the LFTA aggregates a
    # node keyed only on such fields in a directly indexed array (a value outside, or NULL,
    # takes the hash table: a wrong bound costs speed, never an answer)
    values: int = 0
    # a CODE field's codes: "letters" (two letters as 16 bits, decoded by arithmetic) or
    # "text" (a hash of the text; decoded through the dictionary the probes publish)
    codec: str = ""

    @property
    def arrow_type(self) -> pa.DataType:
        return ARROW_TYPES[self.kind]

    @property
    def variable_offset(self) -> bool:
        """Fields found by walking variable-length data (names, DNS answers past the question
        section): expensive to unpack and to test, never prefilter bits."""
        return self.kind in (STRING, BYTES) or self.group == "dns_an"


def _f(name, stream, kind, group, cost, group_cost, groupable, measure, doc, values=0):
    return Field(name, stream, kind, group, cost, group_cost, groupable, measure, doc, values)


P = "packets"
PACKET_FIELDS: tuple[Field, ...] = (
    _f("ts", P, TS, "meta", 1, 0, False, False, "capture time (ns in numba, µs in Spark)"),
    _f("time", P, INT64, "meta", 1, 0, False, False, "epoch seconds, floor(ts)"),
    _f("iface", P, INT32, "meta", 1, 0, True, False, "pcapng interface id or source index"),
    _f("caplen", P, INT32, "meta", 1, 0, False, True, "captured length"),
    _f("wirelen", P, INT32, "meta", 1, 0, False, True, "original length on the wire"),
    _f("eth_type", P, INT32, "link", 2, 1, True, False, "EtherType after VLAN/MPLS", values=65536),
    _f("vlan", P, INT32, "link", 3, 1, True, False, "outer VLAN id", values=4096),
    _f("vlan_inner", P, INT32, "link", 3, 1, True, False, "inner VLAN id", values=4096),
    _f("mpls_label", P, INT32, "link", 3, 1, True, False, "top MPLS label"),
    _f("ip_version", P, INT32, "ip", 3, 1, True, False, "4 or 6", values=16),
    _f("src_ip", P, IP, "ip", 4, 1, True, False, "source address"),
    _f("dst_ip", P, IP, "ip", 4, 1, True, False, "destination address"),
    _f("protocol", P, INT32, "ip", 3, 1, True, False,
       "final upper-layer protocol (after IPv6 extension headers)", values=256),
    _f("ttl", P, INT32, "ip", 3, 1, True, False, "IPv4 TTL or IPv6 hop limit", values=256),
    _f("tos", P, INT32, "ip", 3, 1, True, False, "IPv4 TOS or IPv6 traffic class", values=256),
    _f("ip_id", P, INT32, "ip", 3, 1, True, False, "IPv4 identification / IPv6 fragment id"),
    _f("frag_offset", P, INT32, "ip", 3, 1, True, False, "fragment offset in bytes"),
    _f("more_fragments", P, INT32, "ip", 3, 1, True, False, "MF flag (0/1)", values=2),
    _f("dont_fragment", P, INT32, "ip", 3, 1, True, False, "DF flag (0/1)", values=2),
    _f("ip_len", P, INT32, "ip", 3, 1, True, True,
       "IP packet length: IPv4 total length, IPv6 payload length + 40"),
    _f("src_port", P, INT32, "l4", 4, 1, True, False, "TCP, UDP or SCTP source port",
       values=65536),
    _f("dst_port", P, INT32, "l4", 4, 1, True, False, "TCP, UDP or SCTP destination port",
       values=65536),
    _f("tcp_flags", P, INT32, "l4", 4, 1, True, False, "TCP flags byte (CWR..FIN)", values=256),
    _f("icmp_type", P, INT32, "l4", 4, 1, True, False, "ICMP / ICMPv6 type", values=256),
    _f("icmp_code", P, INT32, "l4", 4, 1, True, False, "ICMP / ICMPv6 code", values=256),
    _f("dns_id", P, INT32, "dns", 5, 1, True, False, "DNS transaction id"),
    _f("dns_qr", P, INT32, "dns", 5, 1, True, False, "DNS QR bit (0 query, 1 response)", values=2),
    _f("dns_opcode", P, INT32, "dns", 5, 1, True, False, "DNS opcode", values=16),
    _f("dns_rcode", P, INT32, "dns", 5, 1, True, False, "DNS response code", values=16),
    _f("dns_qdcount", P, INT32, "dns", 5, 1, True, False, "DNS question count"),
    _f("dns_ancount", P, INT32, "dns", 5, 1, True, False, "DNS answer count"),
    _f("dns_qname", P, STRING, "dns_name", 40, 40, True, False,
       "first query name, lower case, no trailing dot"),
    _f("dns_an_type", P, INT32, "dns_an", 40, 1, True, False, "first answer record's type",
       values=65536),
    _f("dns_an_ttl", P, INT32, "dns_an", 40, 1, True, False,
       "first answer record's TTL in seconds (0 when its top bit is set, RFC 2181)"),
    _f("dns_an_name", P, STRING, "dns_an", 60, 20, True, False,
       "first answer record's owner name, lower case, no trailing dot"),
    _f("dns_an_addr", P, IP, "dns_an", 40, 1, True, False,
       "first answer record's address (A or AAAA)"),
    _f("payload", P, BYTES, "payload", 30, 30, False, False,
       "captured bytes after the TCP, UDP, SCTP or ICMP header (contains() tests them)"),
)

F = "flows"
FLOW_FIELDS: tuple[Field, ...] = (
    _f("exporter", F, IP, "flow", 1, 0, True, False, "exporter address"),
    _f("observation_domain", F, INT64, "flow", 1, 0, True, False,
       "v9 source id or IPFIX observation domain"),
    _f("version", F, INT32, "flow", 1, 0, True, False, "5, 9 or 10", values=16),
    _f("template_id", F, INT32, "flow", 1, 0, True, False, "template of the record"),
    _f("first_switched", F, TS, "flow", 1, 0, False, False, "flow start"),
    _f("last_switched", F, TS, "flow", 1, 0, False, False, "flow end"),
    _f("export_time", F, TS, "flow", 1, 0, False, False, "export time of the datagram"),
    _f("time", F, INT64, "flow", 1, 0, False, False, "epoch seconds of first_switched"),
    _f("ip_version", F, INT32, "flow", 1, 0, True, False, "4 or 6", values=16),
    _f("src_ip", F, IP, "flow", 1, 0, True, False, "source address"),
    _f("dst_ip", F, IP, "flow", 1, 0, True, False, "destination address"),
    _f("next_hop", F, IP, "flow", 1, 0, True, False, "next-hop address"),
    _f("src_port", F, INT32, "flow", 1, 0, True, False, "source port", values=65536),
    _f("dst_port", F, INT32, "flow", 1, 0, True, False, "destination port", values=65536),
    _f("protocol", F, INT32, "flow", 1, 0, True, False, "IP protocol", values=256),
    _f("tos", F, INT32, "flow", 1, 0, True, False, "type of service", values=256),
    _f("tcp_flags", F, INT32, "flow", 1, 0, True, False, "cumulative TCP flags", values=256),
    _f("icmp_type", F, INT32, "flow", 1, 0, True, False, "ICMP type", values=256),
    _f("icmp_code", F, INT32, "flow", 1, 0, True, False, "ICMP code", values=256),
    _f("packets", F, INT64, "flow", 1, 0, False, True, "packets as exported"),
    _f("bytes", F, INT64, "flow", 1, 0, False, True, "bytes as exported"),
    _f("sampling_interval", F, INT64, "flow", 1, 0, True, False, "1 when unsampled"),
    _f("est_packets", F, INT64, "flow", 1, 0, False, True, "packets × sampling_interval"),
    _f("est_bytes", F, INT64, "flow", 1, 0, False, True, "bytes × sampling_interval"),
    _f("input_if", F, INT64, "flow", 1, 0, True, False, "input interface index"),
    _f("output_if", F, INT64, "flow", 1, 0, True, False, "output interface index"),
    _f("src_as", F, INT64, "flow", 1, 0, True, False, "source AS"),
    _f("dst_as", F, INT64, "flow", 1, 0, True, False, "destination AS"),
    _f("src_mask", F, INT32, "flow", 1, 0, True, False, "source prefix length", values=129),
    _f("dst_mask", F, INT32, "flow", 1, 0, True, False, "destination prefix length", values=129),
    _f("direction", F, INT32, "flow", 1, 0, True, False, "0 ingress, 1 egress", values=2),
)

S = "samples"
# sFlow flow samples: every packets field (of the sampled header), then the sample's own
SFLOW_SAMPLE_FIELDS: tuple[Field, ...] = (
    _f("agent", S, IP, "sflow", 1, 0, True, False, "the agent address of the datagram"),
    _f("sub_agent", S, INT64, "sflow", 1, 0, True, False, "the sub-agent id of the datagram"),
    _f("source_id_type", S, INT32, "sflow", 1, 0, True, False,
       "data source type: 0 ifIndex, 1 smonVlanDataSource, 2 entPhysicalEntry", values=256),
    _f("source_id", S, INT64, "sflow", 1, 0, True, False, "data source index"),
    _f("sampling_rate", S, INT64, "sflow", 1, 0, True, False,
       "1 in this many packets was sampled"),
    _f("sample_pool", S, INT64, "sflow", 1, 0, False, False,
       "packets that could have been sampled (the data source's total, wraps at 2^32)"),
    _f("drops", S, INT64, "sflow", 1, 0, False, False,
       "samples the agent dropped for lack of resources (total, wraps at 2^32)"),
    _f("input_if", S, INT64, "sflow", 1, 0, True, False,
       "input interface index (NULL when unknown or not an index)"),
    _f("output_if", S, INT64, "sflow", 1, 0, True, False,
       "output interface index (NULL when discarded, several or unknown)"),
    _f("output_if_format", S, INT32, "sflow", 1, 0, True, False,
       "0 one interface, 1 packet discarded, 2 several interfaces", values=4),
    _f("discard_reason", S, INT32, "sflow", 1, 0, True, False,
       "why the packet was discarded (output_if_format 1; ICMP unreachable codes, 256 ...)"),
    _f("header_protocol", S, INT32, "sflow", 1, 0, True, False,
       "the sampled header's protocol: 1 Ethernet, 11 IPv4, 12 IPv6, 15 802.11 ...",
       values=256),
    _f("frame_length", S, INT64, "sflow", 1, 0, False, True,
       "the sampled packet's length as exported (Ethernet: with its FCS)"),
    _f("src_vlan", S, INT32, "sflow", 1, 0, True, False, "extended switch: incoming VLAN",
       values=4096),
    _f("dst_vlan", S, INT32, "sflow", 1, 0, True, False, "extended switch: outgoing VLAN",
       values=4096),
    _f("src_priority", S, INT32, "sflow", 1, 0, True, False,
       "extended switch: incoming 802.1p priority", values=8),
    _f("dst_priority", S, INT32, "sflow", 1, 0, True, False,
       "extended switch: outgoing 802.1p priority", values=8),
    _f("next_hop", S, IP, "sflow", 1, 0, True, False, "extended router: next hop"),
    _f("src_mask", S, INT32, "sflow", 1, 0, True, False,
       "extended router: source prefix length", values=129),
    _f("dst_mask", S, INT32, "sflow", 1, 0, True, False,
       "extended router: destination prefix length", values=129),
    _f("bgp_next_hop", S, IP, "sflow", 1, 0, True, False, "extended gateway: BGP next hop"),
    _f("router_as", S, INT64, "sflow", 1, 0, True, False, "extended gateway: the router's AS"),
    _f("src_as", S, INT64, "sflow", 1, 0, True, False, "extended gateway: source AS"),
    _f("src_peer_as", S, INT64, "sflow", 1, 0, True, False, "extended gateway: source peer AS"),
    _f("dst_peer_as", S, INT64, "sflow", 1, 0, True, False,
       "extended gateway: first AS of the destination path"),
    _f("dst_as", S, INT64, "sflow", 1, 0, True, False,
       "extended gateway: last AS of the destination path (the origin)"),
    _f("as_path_len", S, INT32, "sflow", 1, 0, True, False,
       "extended gateway: ASes in the destination path", values=256),
    _f("community", S, INT64, "sflow", 1, 0, True, False,
       "extended gateway: first BGP community (AS << 16 | value)"),
    _f("local_pref", S, INT64, "sflow", 1, 0, True, False, "extended gateway: local preference"),
    _f("est_packets", S, INT64, "sflow", 1, 0, False, True,
       "packets the sample stands for: sampling_rate"),
    _f("est_bytes", S, INT64, "sflow", 1, 0, False, True, "wirelen × sampling_rate"),
)
SAMPLE_FIELDS: tuple[Field, ...] = tuple(
    Field(f.name, S, f.kind, f.group, f.cost, f.group_cost, f.groupable, f.measure,
          "iface: the source's index" if f.name == "iface" else f.doc, f.values)
    for f in PACKET_FIELDS) + SFLOW_SAMPLE_FIELDS

C = "counters"


def _counter(name, doc, kind=INT64, measure=True, groupable=False, values=0):
    return Field(name, C, kind, "sflow", 1, 0, groupable, measure, doc, values)


# sFlow counter samples: generic interface counters (RFC 2233) and Ethernet's (RFC 2358);
# NULL where the sample had no such record. Counters are totals since the agent started: a
# window's max - min is what passed in it
COUNTER_FIELDS: tuple[Field, ...] = (
    Field("ts", C, TS, "meta", 1, 0, False, False, "arrival time of the datagram"),
    Field("time", C, INT64, "meta", 1, 0, False, False, "epoch seconds, floor(ts)"),
    _counter("agent", "the agent address of the datagram", IP, False, True),
    _counter("sub_agent", "the sub-agent id of the datagram", measure=False, groupable=True),
    _counter("source_id_type", "data source type (0 ifIndex)", INT32, False, True, 256),
    _counter("source_id", "data source index", measure=False, groupable=True),
    _counter("if_index", "interface index", measure=False, groupable=True),
    _counter("if_type", "interface type (IANAifType: 6 ethernetCsmacd)", INT32, False, True),
    _counter("if_speed", "interface speed in bits per second", measure=True, groupable=True),
    _counter("if_direction", "0 unknown, 1 full duplex, 2 half, 3 in, 4 out", INT32, False,
             True, 8),
    _counter("if_admin_up", "administratively up (0/1)", INT32, False, True, 2),
    _counter("if_oper_up", "operationally up (0/1)", INT32, False, True, 2),
    _counter("in_octets", "octets received"),
    _counter("in_ucast_pkts", "unicast packets received"),
    _counter("in_mcast_pkts", "multicast packets received"),
    _counter("in_bcast_pkts", "broadcast packets received"),
    _counter("in_discards", "inbound packets discarded"),
    _counter("in_errors", "inbound packets with errors"),
    _counter("in_unknown_protos", "inbound packets of unknown protocols"),
    _counter("out_octets", "octets sent"),
    _counter("out_ucast_pkts", "unicast packets sent"),
    _counter("out_mcast_pkts", "multicast packets sent"),
    _counter("out_bcast_pkts", "broadcast packets sent"),
    _counter("out_discards", "outbound packets discarded"),
    _counter("out_errors", "outbound packets with errors"),
    _counter("promiscuous", "promiscuous mode (1 true, 2 false)", INT32, False, True, 4),
    _counter("alignment_errors", "Ethernet: dot3StatsAlignmentErrors"),
    _counter("fcs_errors", "Ethernet: dot3StatsFCSErrors"),
    _counter("single_collisions", "Ethernet: dot3StatsSingleCollisionFrames"),
    _counter("multiple_collisions", "Ethernet: dot3StatsMultipleCollisionFrames"),
    _counter("sqe_test_errors", "Ethernet: dot3StatsSQETestErrors"),
    _counter("deferred_transmissions", "Ethernet: dot3StatsDeferredTransmissions"),
    _counter("late_collisions", "Ethernet: dot3StatsLateCollisions"),
    _counter("excessive_collisions", "Ethernet: dot3StatsExcessiveCollisions"),
    _counter("mac_transmit_errors", "Ethernet: dot3StatsInternalMacTransmitErrors"),
    _counter("carrier_sense_errors", "Ethernet: dot3StatsCarrierSenseErrors"),
    _counter("frame_too_longs", "Ethernet: dot3StatsFrameTooLongs"),
    _counter("mac_receive_errors", "Ethernet: dot3StatsInternalMacReceiveErrors"),
    _counter("symbol_errors", "Ethernet: dot3StatsSymbolErrors"),
)

# Cost of finding a group's header (walking the layers in front of it), paid once when the group
# is unpacked as a whole; a field unpacked alone pays its own ``cost``, which includes that walk.
# Prefilter paper, section 2.4: the planner covers the fields a plan needs with groups and single
# fields by weighted set cover (planner/field_groups.py).
GROUP_BASE: dict[str, float] = {
    "meta": 0, "link": 1, "ip": 2, "l4": 3, "dns": 4, "dns_name": 0, "dns_an": 40, "payload": 3,
    "flow": 0, "sflow": 0,
}



@dataclass(frozen=True)
class Enriched:
    """Where an enrichment field comes from (capture/enrich/): an attribute of the database
    configured as ``enrich.<database>``, looked up by ``address``; ``exported``: the field of
    the same meaning an exporter may send, which takes precedence by ``enrich.asn_precedence``."""

    database: str
    attribute: str
    address: str
    exported: str | None = None
    index: str | None = None  # an interface's: its ifIndex field (with the device's address)

    def describe(self) -> str:
        of = f"{self.address}'s {self.index}" if self.index else self.address
        text = f"enrich.{self.database} ({self.attribute}) of {of}"
        return f"{self.exported} as exported, else {text}" if self.exported else text


# enrichment fields: computed after unpack for the fields a plan reads, then ordinary fields
ENRICHED: dict[str, dict[str, Enriched]] = {}


# (field suffix, database, attribute, kind, small-code bound, meaning); each for src_ and dst_
ENRICHMENTS = (
    ("asn", "asn", "asn", INT64, 0, "AS number"),
    ("as_name", "asn", "as_name", CODE, 0, "AS name (the database's organisation)"),
    ("country", "country", "country", CODE, 1 << 16,
     "country: ISO 3166-1 alpha-2 code ('NL')"),
    ("continent", "country", "continent", CODE, 1 << 16, "continent code ('EU')"),
    ("city", "city", "city", CODE, 0, "city (English name)"),
    ("region", "city", "region", CODE, 0,
     "region: the first subdivision's ISO 3166-2 code without its country ('NH', 'ENG')"),
    ("net_name", "networks", "name", CODE, 0, "name of the network (enrich.networks)"),
    ("net_role", "networks", "role", CODE, 0, "role of the network (enrich.networks)"),
    ("net_site", "networks", "site", CODE, 0, "site of the network (enrich.networks)"),
)
LETTERS = frozenset({"country", "continent"})  # codes of two letters; the others: text codes


def _enriched(stream: str, exported: bool) -> tuple[Field, ...]:
    out = []
    table = ENRICHED.setdefault(stream, {})
    for side, word in (("src", "source"), ("dst", "destination")):
        addr = f"{side}_ip"
        for suffix, database, attribute, kind, values, doc in ENRICHMENTS:
            name = f"{side}_{suffix}"
            sent = f"{side}_as" if exported and suffix == "asn" else None
            table[name] = Enriched(database, attribute, addr, sent)
            out.append(Field(name, stream, kind, "enrich", 6, 6, True, False,
                             f"{word} {doc}" + (" (enrich.asn_precedence)" if sent else ""),
                             values, "letters" if attribute in LETTERS else
                             "text" if kind == CODE else ""))
    if stream in (F, S):  # the exporter's (agent's) interfaces: SNMP and enrich.interfaces
        device = "exporter" if stream == F else "agent"
        for side, word, index in (("in", "input", "input_if"), ("out", "output", "output_if")):
            for attribute, kind, doc in (
                    ("name", CODE, "interface's name (ifName)"),
                    ("description", CODE, "interface's description (ifAlias)"),
                    ("speed", INT64, "interface's speed in bits per second (ifHighSpeed)")):
                name = f"{side}_if_{attribute}"
                table[name] = Enriched("interfaces", attribute, device, index=index)
                out.append(Field(name, stream, kind, "enrich", 6, 6, True, False,
                                 f"the {word} {doc}", 0, "text" if kind == CODE else ""))
    return tuple(out)


STREAMS: dict[str, dict[str, Field]] = {
    P: {f.name: f for f in PACKET_FIELDS + _enriched(P, False)},
    F: {f.name: f for f in FLOW_FIELDS + _enriched(F, True)},
    S: {f.name: f for f in SAMPLE_FIELDS + _enriched(S, True)},
    C: {f.name: f for f in COUNTER_FIELDS},
}


# the names of enrichment fields (a name means the same in every stream it is in): a batch that
# was not enriched holds them as NULL
ENRICHED_NAMES = frozenset(n for table in ENRICHED.values() for n in table)


def decoded_fields(stream: str) -> dict[str, Field]:
    """A stream's fields its decoder or unpack kernel writes: all but the enrichment fields."""
    return {n: f for n, f in fields(stream).items() if n not in ENRICHED_NAMES}


def enriched(stream: str) -> dict[str, Enriched]:
    """A stream's enrichment fields and where each comes from."""
    return ENRICHED.get(stream, {})


def enrichment_inputs(stream: str, names) -> set[str]:
    """The fields enrichment fields among ``names`` are computed from."""
    table = enriched(stream)
    out: set[str] = set()
    for n in names:
        e = table.get(n)
        if e is not None:
            out.add(e.address)
            out.update(f for f in (e.exported, e.index) if f)
    return out


# -- codes of text fields (CODE): a country's two letters as one 16-bit number, 'NL' = 0x4E4C
_TEXTS: dict[int, str] = {}  # the text of each text code made here (queries' constants)


def code_of(text: str, codec: str = "letters") -> int:
    """The code of a text: two ASCII letters (any case) as 16 bits ('NL' = 0x4E4C; ValueError
    otherwise), or for ``codec`` "text" the first 63 bits of the text's BLAKE2b hash (never 0
    or negative): a function of the text alone, so every probe and every reload of a database
    gives a text the same code, and equal texts group together in Spark."""
    if codec == "text":
        code = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(),
                              "big") >> 1 or 1
        _TEXTS.setdefault(code, text)
        return code
    t = text.strip().upper()
    if len(t) != 2 or not (t.isascii() and t.isalpha()):
        raise ValueError(f"{text!r} is not a two-letter code")
    return ord(t[0]) << 8 | ord(t[1])


def code_text(code: int) -> str:
    """The text of a code: a text code's as ``code_of`` saw it, else its two letters."""
    text = _TEXTS.get(code)
    return text if text is not None else chr(code >> 8 & 0xFF) + chr(code & 0xFF)


# the names of CODE fields (a name has one kind in every stream it is in)
CODE_FIELDS = frozenset(f.name for s in STREAMS.values() for f in s.values() if f.kind == CODE)
TEXT_FIELDS = frozenset(f.name for s in STREAMS.values() for f in s.values()
                        if f.codec == "text")


def code_texts(codes: np.ndarray) -> pa.Array:
    """Letter codes (-1 NULL) as their text, without a Python loop."""
    codes = np.asarray(codes, np.int64)
    valid = codes >= 0
    n = len(codes)
    chars = np.empty((n, 2), np.uint8)
    chars[:, 0] = (codes >> 8) & 0xFF
    chars[:, 1] = codes & 0xFF
    lens = np.where(valid, 2, 0)
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(lens, out=offsets[1:])
    data = chars[valid].reshape(-1)
    return pa.Array.from_buffers(
        pa.string(), n, [None if valid.all() else pa.array(valid).buffers()[1],
                         pa.py_buffer(offsets.tobytes()), pa.py_buffer(data.tobytes())],
        null_count=int((~valid).sum()))


def fields(stream: str) -> dict[str, Field]:
    """The catalogue of one stream, by field name, in catalogue order."""
    try:
        return STREAMS[stream]
    except KeyError:
        raise KeyError(f"unknown stream {stream!r} (known: {', '.join(STREAMS)})") from None


def group_fields(stream: str) -> dict[str, list[str]]:
    """Each protocol-layer group of a stream and its fields, in catalogue order."""
    out: dict[str, list[str]] = {}
    for f in fields(stream).values():
        out.setdefault(f.group, []).append(f.name)
    return out


def groupable(stream: str) -> list[Field]:
    """Fields a query may group by, in catalogue order (the spool's key columns)."""
    return [f for f in fields(stream).values() if f.groupable]


def measures(stream: str) -> list[Field]:
    """Fields a query may sum, min, max or average."""
    return [f for f in fields(stream).values() if f.measure]


# Row index of every packets integer field in a TupleBatch's int matrix, in catalogue order.
PACKET_INT_FIELDS: tuple[str, ...] = tuple(f.name for f in PACKET_FIELDS if f.kind == INT32)
PACKET_INT_INDEX: dict[str, int] = {name: i for i, name in enumerate(PACKET_INT_FIELDS)}


# -- IP addresses as the catalogue holds them: 16 bytes, IPv4 as IPv4-mapped (::ffff:a.b.c.d),
# or as a 128-bit integer of the same bytes (predicates, prefixes). The one set of conversions.
IPV4_MAPPED = b"\0" * 10 + b"\xff\xff"


def ip_bytes(text: str) -> bytes:
    """An IPv4 or IPv6 address (a zone after % is dropped) as 16 bytes, IPv4-mapped."""
    addr = ipaddress.ip_address(text.split("%", 1)[0])
    return IPV4_MAPPED + addr.packed if addr.version == 4 else addr.packed


def ip_text(b: bytes | None) -> str | None:
    """Dotted quad for an IPv4-mapped address, RFC 5952 otherwise (None stays None)."""
    if b is None:
        return None
    if len(b) != 16:
        return b.hex()
    if b[:12] == IPV4_MAPPED:
        return ".".join(str(x) for x in b[12:])
    return str(ipaddress.IPv6Address(b))


def ip_int(text: str) -> int:
    """An address as a 128-bit integer (IPv4 as IPv4-mapped)."""
    return int.from_bytes(ip_bytes(text), "big")


def parse_prefix(text: str) -> tuple[int, int]:
    """'10.0.0.0/8' or '2001:db8::/32' as (network over 128 bits, prefix length over 128)."""
    net = ipaddress.ip_network(text, strict=False)
    if net.version == 4:
        return (0xFFFF << 32) | int(net.network_address), 96 + net.prefixlen
    return int(net.network_address), net.prefixlen


def prefix_network(value: int, length: int) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """A 128-bit prefix as the network users write: IPv4-mapped prefixes become IPv4 nets."""
    if value >> 32 == 0xFFFF and length >= 96:
        return ipaddress.IPv4Network((value & 0xFFFFFFFF, length - 96))
    return ipaddress.IPv6Network((value, length))


def prefix_mask(length: int) -> int:
    """The 128-bit mask of a prefix length over 128."""
    return ((1 << 128) - 1) ^ ((1 << (128 - length)) - 1)


def split128(value: int) -> tuple[int, int]:
    """A 128-bit address or mask as its (high, low) 64-bit words, as numba compares them."""
    return value >> 64, value & ((1 << 64) - 1)


# -- group keys: a catalogue field, or an address field cut to a prefix ('src_ip/24', written
# prefix(src_ip, 24) in a query). The length counts bits of the address's own family.
SKETCH = "~"  # a node key '~dst_ip': each row carries a HyperLogLog sketch of dst_ip


def key_field(name: str) -> tuple[str, int | None]:
    """A group key's catalogue field and prefix length: ``'src_ip/24'`` → ``('src_ip', 24)``,
    ``'~dst_ip'`` (a sketch key) → ``('dst_ip', None)``."""
    base, sep, bits = name.lstrip(SKETCH).partition("/")
    return (base, int(bits)) if sep else (base, None)


def key_kind(stream: str, name: str) -> str:
    return fields(stream)[key_field(name)[0]].kind


def is_mapped(a: np.ndarray) -> np.ndarray:
    """Which of (n, 16) addresses are IPv4-mapped."""
    return (a[:, :10] == 0).all(axis=1) & (a[:, 10] == 0xFF) & (a[:, 11] == 0xFF)


def mask_addresses(a: np.ndarray, bits: int) -> np.ndarray:
    """(n, 16) addresses with all but their first ``bits`` bits cleared: of the IPv4 address
    for IPv4-mapped ones (at most 32), of the IPv6 address for the others (at most 128)."""
    out = a.copy()
    mapped = is_mapped(a)
    for length, rows in ((96 + min(bits, 32), mapped), (min(bits, 128), ~mapped)):
        out[rows] &= np.frombuffer(prefix_mask(length).to_bytes(16, "big"), np.uint8)
    return out
