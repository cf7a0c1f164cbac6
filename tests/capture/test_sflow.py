"""sFlow v5 against tshark's sFlow dissector: every field of every flow and counter sample, on
the vendors' datagrams of ../shared/data/sflow (Akvorado's, AGPL: read there, never copied) and on
datagrams built for the structures they lack; the packet fields of a sampled header as tshark
dissects the header. Sequence accounting and bad input by hand-worked cases."""

from __future__ import annotations

import struct

import pytest

from capture.sflow import SflowDecoder
from tests import sflowgen as g
from tests.helpers import samples
from tests.sflowtools import assert_equal_tshark, decoded


@pytest.mark.parametrize("name", samples("sflow", "*.pcap"))
def test_vendor_datagrams_equal_tshark(name):
    """Each vendor datagram's samples, field by field, as tshark dissects them."""
    from tests.helpers import _sample
    flows, _ = assert_equal_tshark(_sample("sflow", name, "AGPL"))
    assert flows and all(f["agent"] for f in flows)


def test_generated_datagrams_equal_tshark(tmp_path):
    """Counter samples (generic and Ethernet, compact and expanded), samples without a raw
    header (sampled IPv4, IPv6, Ethernet), IPv6 agents and next hops, a path of two segments,
    communities, a raw IPv4 header, a truncated IPv6 header; unknown records and samples
    skipped and counted."""
    flows, counters = assert_equal_tshark(g.every_structure(tmp_path))
    assert len(flows) == 6 and len(counters) == 2
    assert (flows[5]["eth_type"], flows[5]["dst_port"], flows[5]["tcp_flags"]) == \
        (0x0800, 40000, 0x02)  # the 802.11 data frame's LLC/SNAP, IPv4, TCP SYN
    _, _, dec = decoded(tmp_path / "structures.pcap")
    assert dec.all_errors == {"sflow_unknown_flow_record": 1, "sflow_unknown_sample": 1}
    # by hand: the path of two segments, its ends, the first community
    f = flows[0]
    assert (f["dst_peer_as"], f["dst_as"], f["as_path_len"]) == (64510, 64514, 5)
    assert f["community"] == (64500 << 16) | 7 and f["next_hop"] == "2001:db8::fe"
    assert (f["vlan"], f["vlan_inner"]) == (300, 42)
    # the IPv6 header cut at 60 bytes: its TCP ports are there, its payload is short
    assert flows[3]["src_port"] == 443 and flows[3]["caplen"] == 60
    assert flows[1]["tcp_flags"] == 0x12  # sampled IPv6: SYN|ACK, the spec's 32-bit word
    assert counters[0]["in_octets"] == (1 << 40) + 5 and counters[0]["if_oper_up"] == 1
    assert counters[1]["if_index"] is None and counters[1]["symbol_errors"] == 0


def _decode(dec: SflowDecoder, payloads: list[bytes]):
    from capture.netflow.batch import Datagrams
    d = dec.decode(Datagrams.from_payloads(payloads, exporter="192.0.2.1"))
    return d.samples(), d.counters()


def test_sequences_count_loss_late_arrivals_and_restarts():
    """Worked by hand: datagrams 1, 2, 4 (one lost), 3 (late: its uptime a second behind),
    then the agent restarts (its uptime an hour back: 1 is a new sequence, nothing lost);
    samples 10, 11 then 15 (three lost);
    two sub-agents of one agent are two sequences."""
    dec = SflowDecoder()
    h = 3_600_000  # an hour up (ms)
    _decode(dec, [g.one("192.0.2.10", 1, h + 1000, [10]), g.one("192.0.2.10", 2, h + 2000, [11]),
                  g.one("192.0.2.10", 4, h + 4000, [15]), g.one("192.0.2.10", 3, h + 3000, []),
                  g.one("192.0.2.10", 1, h + 4000, [12], sub=1)])
    _decode(dec, [g.one("192.0.2.10", 1, 20_000, [1]), g.one("192.0.2.10", 2, 21_000, [2])])
    [a0, a1] = dec.streams()
    assert (a0["sub_agent"], a1["sub_agent"]) == (0, 1)
    assert a0["sequence"] == {"next": 3, "lost": 1, "gaps": 1, "out_of_order": 1,
                              "restarts": 1, "unit": "datagrams"}
    assert a0["datagrams"] == 6 and a0["samples"] == {"flow": 5, "lost": 3, "counter": 0}
    assert a1["sequence"]["lost"] == 0 and a1["samples"]["flow"] == 1


def test_a_committed_position_counts_what_a_restart_lost():
    """A decoder resumed from another's committed sequences counts the gap at each stream's
    next datagram (as the NetFlow listener does); an agent that restarted meanwhile (its
    uptime lower than committed) loses nothing."""
    first = SflowDecoder()
    _decode(first, [g.one("192.0.2.10", 1, 1000, [10]), g.one("2001:db8::1", 8, 9_000_000, [3])])
    state = first.sequences()
    second = SflowDecoder()
    assert second.resume_sequences(state) == 4
    _decode(second, [g.one("192.0.2.10", 4, 5000, [20]), g.one("2001:db8::1", 1, 100, [1])])
    by_agent = {s["agent"]: s for s in second.streams()}
    assert by_agent["192.0.2.10"]["sequence"]["lost"] == 2  # datagrams 2 and 3
    assert by_agent["192.0.2.10"]["samples"]["lost"] == 9  # samples 11..19
    assert by_agent["2001:db8::1"]["sequence"]["lost"] == 0
    assert by_agent["2001:db8::1"]["sequence"]["restarts"] == 1


def test_bad_datagrams_are_dropped_whole_and_counted_by_reason():
    """Every cut of a good datagram, a wrong version, an unknown agent address type, a sample
    count above what is there, a record longer than its sample: each datagram is dropped (no
    rows of it) and counted under its reason; the good datagrams beside them decode."""
    good = g.one("192.0.2.10", 1, 1000, [10, 11])
    cuts = [good[:n] for n in range(len(good))]
    wrong_version = struct.pack(">I", 4) + good[4:]
    bad_agent = good[:4] + struct.pack(">I", 3) + good[8:]
    too_many = good[:24] + struct.pack(">I", 3) + good[28:]
    record = bytearray(good)
    # the first sample's first record's length (after 28 + 8 + 32 bytes of headers) made long
    struct.pack_into(">I", record, 28 + 8 + 32 + 4, 10_000)
    dec = SflowDecoder()
    sb, _ = _decode(dec, [good, *cuts, wrong_version, bad_agent, too_many, bytes(record), good])
    assert len(sb) == 4  # the two good datagrams' samples
    errors = dec.all_errors
    assert errors["sflow_version"] == 1 and errors["sflow_agent_address"] == 1
    assert errors["sflow_sample_count"] >= 2  # too_many, and the cut right after a sample
    assert sum(errors.values()) == len(cuts) + 4
    assert set(errors) <= {"sflow_short", "sflow_version", "sflow_agent_address",
                           "sflow_sample_length", "sflow_sample_count"}
    assert dec.streams()[0]["last_error"].startswith("sflow")
