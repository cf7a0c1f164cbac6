"""NetFlow v5/v9/IPFIX decoding against others' exports and tools (tshark's cflow dissector,
nfdump's CSV of the same export)."""

from __future__ import annotations

import csv
import struct
from pathlib import Path

import pytest

from capture.netflow import (
    Datagrams,
    Decoder,
    FlowBatch,
    TemplateStore,
    capture_flows,
)
from tests.flowtools import (
    FLOW_PORTS,
    HEX,
    LOGSTASH,
    PAIRS,
    as_nfdump,
    merged,
    read_hex,
    split_payloads,
    tshark_flows,
    tshark_records,
    write_pcap,
)
from tests.helpers import SHARED, flow_data, need_tool, samples

SHARED_NF = SHARED / "netflow"
PCAPS = samples("netflow", "*.pcap", exclude=set(PAIRS.values()))


def export_capture(name: str, tmp_path: Path) -> Path:
    """A shared export capture, with its template capture merged in front (PAIRS)."""
    path = flow_data(name)
    if name in PAIRS:
        need_tool("mergecap")
        path = merged(tmp_path, flow_data(PAIRS[name]), path)
    return path


def decode_all(path: Path, decoder: Decoder | None = None) -> tuple[FlowBatch, Decoder]:
    d = decoder or Decoder()
    fb = FlowBatch.concat(list(capture_flows(path, FLOW_PORTS, d)))
    return fb, d


@pytest.mark.parametrize("name", PCAPS)
def test_record_counts_equal_tshark(name, tmp_path):
    need_tool("tshark")
    path = export_capture(name, tmp_path)
    fb, d = decode_all(path)
    assert not d.errors, d.errors
    expected = tshark_records(path)
    assert expected > 0
    assert len(fb) + d.options_records == expected


def _payload_sets():
    """logstash .dat files (template files ahead of their data files) and pynetflow hex."""
    files = sorted(p.name for p in LOGSTASH.glob("*.dat"))
    out = []
    for f in files:
        if "_data" in f and "_tpl" not in f:
            continue
        group = [f] + ([g for g in files if "_tpl" in f and g.startswith(f.split("_tpl")[0])
                        and "_data" in g and g != f])
        out.append(("logstash", tuple(group)))
    hexes = {p.stem for p in HEX.glob("*.hex")}
    for h in sorted(hexes):
        if h in ("PACKETS_V9", "PACKET_IPFIX", "PACKET_IPFIX_ETHER"):
            continue
        group = [h]
        if h == "PACKET_V9_TEMPLATE":
            group.append("PACKETS_V9")
        if h == "PACKET_IPFIX_TEMPLATE":
            group.append("PACKET_IPFIX")
        if h == "PACKET_IPFIX_TEMPLATE_ETHER":
            group.append("PACKET_IPFIX_ETHER")
        out.append(("hex", tuple(group)))
    return out


def _payloads(kind, group) -> list[bytes]:
    if kind == "logstash":
        return [x for f in group for x in split_payloads((LOGSTASH / f).read_bytes())]
    return [x for h in group for x in read_hex(HEX / f"{h}.hex")]


INVALID = {  # file -> reasons its bad input is counted under
    "netflow5_test_invalid01.dat": {"v5_count": 1},
    "netflow5_test_invalid02.dat": {"v5_count": 1},
    "PACKET_INVALID": {"unknown_version": 1},
    "PACKET_V1": {"unknown_version": 1},  # NetFlow v1 is not collected
    # the data set of template 280 has no template in the capture
    "ipfix_test_netscaler_tpl.dat": {"template_missing": 1},
    # five data sets of template 260 (source id 0x01020000) that no file defines
    "PACKET_V9_WITH_ZEROS": {"template_missing": 5},
}


# The v9 header counts 2 records but the datagram holds 3 templates and 2 data sets: tshark stops
# at the count, nfdump decodes the data (2 flows, shared SOURCES.md), and so does flowsieve.
BEYOND_COUNT = {"netflow9_test_invalid01.dat": 2}


@pytest.mark.parametrize("kind,group", _payload_sets(), ids=lambda g: "+".join(g)
                         if isinstance(g, tuple) else g)
def test_payload_files_decode_as_tshark_counts(kind, group, tmp_path):
    """Every payload decodes; the records equal tshark's count of the same datagrams put into
    a pcap (the invalid ones are counted by reason instead)."""
    need_tool("tshark")
    payloads = _payloads(kind, group)
    d = Decoder()
    fb = d.decode(Datagrams.from_payloads(payloads, "192.0.2.1"))
    d.finish()
    expected_errors = INVALID.get(group[0], {})
    assert d.errors == expected_errors
    if group[0] in INVALID and group[0] != "ipfix_test_netscaler_tpl.dat":
        assert len(fb) == 0
        return
    if group[0] in BEYOND_COUNT:
        assert len(fb) == BEYOND_COUNT[group[0]]
        return
    pcap = write_pcap(tmp_path / "x.pcap", payloads)
    assert len(fb) + d.options_records == tshark_records(pcap)
    assert len(fb) > 0


def _nfdump_rows(path: Path) -> list[tuple]:
    rows = []
    for r in csv.reader(path.open()):
        ts, te, pr, sa, sp, da, dp, pkt, byt, flg = (x.strip() for x in r)
        rows.append((ts, te, pr, sa, sp, da, dp, int(pkt), int(byt), flg))
    return sorted(rows)






@pytest.mark.parametrize("src", ["test", "ok"])
@pytest.mark.parametrize("version", ["v5", "v9", "v10"])
def test_softflowd_exports_equal_nfdump(src, version):
    """Field by field: first/last seen (ms), protocol, addresses, ports (ICMP type.code),
    packets, bytes, TCP flags, as nfcapd stored the same export."""
    base = f"softflowd-generated/softflowd-{src}-{version}"
    export = flow_data(f"{base}-export.pcap")
    fb, d = decode_all(export)
    assert not d.errors
    want = _nfdump_rows(flow_data(f"{base}-nfdump-flows.csv"))
    got = [as_nfdump(r) for r in fb.rows()]
    if version == "v9":
        # nfdump 1.7.1 ignores element 139 (icmpTypeCodeIPv6) in v9 and prints 0.0; the
        # ICMPv6 type and code are checked against tshark instead
        import subprocess
        need_tool("tshark")
        out = subprocess.run(["tshark", "-2", "-n", "-r", str(export), "-T", "fields", "-e",
                              "cflow.icmp_ipv6_type", "-e", "cflow.icmp_ipv6_code"],
                             capture_output=True, text=True, check=True).stdout
        shark = sorted((int(t), int(c)) for line in out.splitlines() if line.strip()
                       for t, c in zip(line.split("\t")[0].split(","),
                                       line.split("\t")[1].split(","), strict=True))
        mine = sorted((r["icmp_type"], r["icmp_code"]) for r in fb.rows()
                      if r["protocol"] == 58)
        assert mine == shark
        got = [g[:6] + ("0.0",) + g[7:] if g[2] == "ICMP6" else g for g in got]
    assert sorted(got) == want
    rows = fb.rows()
    assert {r["version"] for r in rows} == {int(version[1:])}
    assert all(r["sampling_interval"] == 1 and r["est_bytes"] == r["bytes"] for r in rows)


# -- sampling --------------------------------------------------------------------------------
def _v5_with_sampling(interval: int, mode: int = 1) -> bytes:
    pkt = bytearray(read_hex(HEX / "PACKET_V5.hex")[0])
    pkt[22:24] = struct.pack(">H", (mode << 14) | interval)
    return bytes(pkt)


def test_v5_header_sampling_scales_estimates():
    d = Decoder()
    fb = d.decode(Datagrams.from_payloads([_v5_with_sampling(100)]))
    rows = fb.rows()
    assert len(rows) == 3
    for r in rows:
        assert r["sampling_interval"] == 100
        assert r["est_packets"] == 100 * r["packets"] and r["est_bytes"] == 100 * r["bytes"]
    # no sampling in the header: 1, and not counted as unknown
    d = Decoder()
    rows = d.decode(Datagrams.from_payloads([_v5_with_sampling(0, 0)])).rows()
    assert {r["sampling_interval"] for r in rows} == {1}
    assert d.streams()[0]["records_sampling_unknown"] == 0


def test_sampling_override_per_exporter():
    d = Decoder(sampling_override={"192.0.2.9": 64})
    a = d.decode(Datagrams.from_payloads([_v5_with_sampling(100)], "192.0.2.9")).rows()
    b = d.decode(Datagrams.from_payloads([_v5_with_sampling(100)], "192.0.2.10")).rows()
    assert {r["sampling_interval"] for r in a} == {64}
    assert {r["sampling_interval"] for r in b} == {100}


def test_unknown_sampling_rule_is_counted():
    payloads = read_hex(HEX / "PACKET_V9_TEMPLATE.hex")
    d = Decoder(default_sampling_interval=10)
    rows = d.decode(Datagrams.from_payloads(payloads)).rows()
    assert {r["sampling_interval"] for r in rows} == {10}
    assert d.streams()[0]["records_sampling_unknown"] == len(rows) == 8


def _tshark_intervals(path: Path) -> list[int]:
    import re
    import subprocess
    out = subprocess.run(["tshark", "-2", "-n", "-r", str(path), "-V"], capture_output=True,
                         text=True, check=True).stdout
    return [int(x) for x in re.findall(r"^\s+Sampling interval: (\d+)", out, re.M)]


def test_options_sampling_v9(tmp_path):
    """Options data carry the sampling interval (tshark shows the same): later records get it,
    a data set that came before its template is decoded with it, est_* are scaled."""
    need_tool("tshark")
    need_tool("mergecap")
    one = flow_data("data+templates.pcap")  # options 256 (interval 100) and data 257
    assert _tshark_intervals(one) == [100]
    fb, d = decode_all(one)
    rows = fb.rows()
    assert len(rows) == 21 and {r["sampling_interval"] for r in rows} == {100}
    assert all(r["est_bytes"] == 100 * r["bytes"] for r in rows)
    assert d.streams()[0]["sampling"] == {"default": 100}
    # akvorado's pairs: options template + options data (sampler 1, 30000), then template + data
    a = merged(tmp_path, flow_data("options-template.pcap"), flow_data("options-data.pcap"))
    b = merged(tmp_path, flow_data("template.pcap"), flow_data("data.pcap"))
    path = merged(tmp_path, a, b)
    assert set(_tshark_intervals(path)) == {30000}
    fb, d = decode_all(path)
    assert [r["sampling_interval"] for r in fb.rows()] == [30000] * 4
    assert d.streams()[0]["records_sampling_unknown"] == 0


# -- sequence numbers -----------------------------------------------------------------------
def test_sequence_loss_v5():
    """netflow5.dat: 12 consecutive softflowd datagrams; leaving one out loses its records."""
    dgs = split_payloads((LOGSTASH / "netflow5.dat").read_bytes())
    assert len(dgs) == 12
    d = Decoder()
    d.decode(Datagrams.from_payloads(dgs))
    assert d.streams()[0]["sequence"]["lost"] == 0
    missing = int.from_bytes(dgs[5][2:4], "big")
    d = Decoder()
    d.decode(Datagrams.from_payloads(dgs[:5] + dgs[6:]))
    seq = d.streams()[0]["sequence"]
    assert (seq["lost"], seq["gaps"]) == (missing, 1)


def _tshark_sequence(path: Path, port: int) -> tuple[int, int]:
    """(units lost, out-of-order) from tshark's "FlowSequence: N (expected M)" annotations."""
    import re
    import subprocess
    out = subprocess.run(["tshark", "-2", "-n", "-r", str(path), "-V", "-d",
                          f"udp.port=={port},cflow"], capture_output=True, text=True,
                         check=True).stdout
    lost = ooo = 0
    for got, exp in re.findall(r"FlowSequence: (\d+) \(expected (\d+)\)", out):
        d = (int(got) - int(exp)) & 0xFFFFFFFF
        if d < 0x80000000:
            lost += d
        else:
            ooo += 1
    return lost, ooo


@pytest.mark.parametrize("name,drop", [("ipfix.dat", None), ("ipfix.dat", 1)])
def test_sequence_loss_equals_tshark(name, drop, tmp_path):
    """softflowd's exports as captured, and with a datagram left out: lost units and
    out-of-order datagrams equal what tshark's sequence analysis expects."""
    need_tool("tshark")
    dgs = split_payloads((LOGSTASH / name).read_bytes())
    if drop is not None:
        dgs = dgs[:drop] + dgs[drop + 1:]
    d = Decoder()
    d.decode(Datagrams.from_payloads(dgs, "192.0.2.1"))
    seq = d.streams()[0]["sequence"]
    assert (seq["lost"], seq["out_of_order"]) == _tshark_sequence(
        write_pcap(tmp_path / "x.pcap", dgs), 2055)


@pytest.mark.parametrize("name,port", [
    ("pmacct-101-NFv9-CISCO-cust_primitives-traffic-00.pcap", 9991),
    ("pmacct-102-NFv9-CISCO-f2rd-pretag-sampling-reload-traffic-00.pcap", 9991),
    ("pmacct-111-IPFIXv10-NFv9-IPv6-IPv4-mix_sources-traffic-01.pcap", 9991)])
def test_sequence_of_captures_equals_tshark(name, port):
    need_tool("tshark")
    path = flow_data(name)
    _, d = decode_all(path)
    lost = sum(s["sequence"]["lost"] for s in d.streams())
    ooo = sum(s["sequence"]["out_of_order"] for s in d.streams())
    assert (lost, ooo) == _tshark_sequence(path, port)


@pytest.mark.parametrize("name", ["netflow5.dat", "ipfix.dat"])
def test_sequence_state_resumes_across_a_restart(name, tmp_path):
    """A durable flow source commits each stream's next sequence number; the decoder of the
    restarted daemon resumes it, so the next export is checked against it: the gap counts what
    the restart lost (here a datagram sent while it was down), or the export is out of order.
    The two decoders together count what tshark's sequence analysis finds in the exports
    without that datagram (v5, which tshark does not analyse: its header's record count)."""
    need_tool("tshark")
    dgs = split_payloads((LOGSTASH / name).read_bytes())
    before = Decoder()
    before.decode(Datagrams.from_payloads(dgs[:1], "192.0.2.1"))
    state = before.sequences()
    assert [(e["exporter"], e["version"]) for e in state] == \
        [("192.0.2.1", 5 if name == "netflow5.dat" else 10)]
    before.store.save(tmp_path / "templates.json")
    store = TemplateStore()
    store.load(tmp_path / "templates.json")
    after = Decoder(store)
    assert after.resume_sequences(state) == 1
    after.decode(Datagrams.from_payloads(dgs[2:], "192.0.2.1"))  # dgs[1] was lost

    def counted(*decoders) -> tuple[int, int]:
        seqs = [s["sequence"] for d in decoders for s in d.streams()]
        return sum(q["lost"] for q in seqs), sum(q["out_of_order"] for q in seqs)
    if name == "netflow5.dat":
        assert counted(before, after) == (int.from_bytes(dgs[1][2:4], "big"), 0)
    else:  # softflowd's IPFIX numbering runs backwards here: out of order, as tshark says
        assert counted(before, after) == _tshark_sequence(
            write_pcap(tmp_path / "x.pcap", dgs[:1] + dgs[2:]), 2055)
    fresh = Decoder(store)  # without the state nothing would be seen
    fresh.decode(Datagrams.from_payloads(dgs[2:], "192.0.2.1"))
    assert counted(fresh) == (0, 0) != counted(before, after)


def test_sequence_v9_counts_datagrams():
    dgs = read_hex(HEX / "PACKET_V9_TEMPLATE.hex") + read_hex(HEX / "PACKETS_V9.hex")
    d = Decoder()
    d.decode(Datagrams.from_payloads(dgs))
    seqs = [int.from_bytes(x[12:16], "big") for x in dgs]
    gaps = sum(1 for a, b in zip(seqs, seqs[1:], strict=False) if b != a + 1)
    lost = sum(b - a - 1 for a, b in zip(seqs, seqs[1:], strict=False) if b > a + 1)
    st = d.streams()[0]["sequence"]
    assert (st["lost"], st["gaps"], st["unit"]) == (lost, gaps, "datagrams")


# -- templates: order, pending data, withdrawal, persistence -------------------------------
def test_data_before_template_is_held_then_decoded():
    tpl = read_hex(HEX / "PACKET_V9_TEMPLATE.hex")
    data = read_hex(HEX / "PACKETS_V9.hex")
    d = Decoder()
    assert len(d.decode(Datagrams.from_payloads(data))) == 0
    assert len(d.pending) == 3
    fb = d.decode(Datagrams.from_payloads(tpl))
    assert len(fb) == 8 + 36 and not d.pending and not d.errors
    ref = Decoder()
    want = FlowBatch.concat([ref.decode(Datagrams.from_payloads(tpl + data))]).rows()
    key = lambda r: (r["first_switched"], r["src_ip"], r["dst_ip"], r["src_port"], r["bytes"])  # noqa: E731
    assert sorted(fb.rows(), key=key) == sorted(want, key=key)


def test_pending_expires_and_is_bounded():
    data = read_hex(HEX / "PACKETS_V9.hex")
    d = Decoder(pending_ttl_s=10)
    d.decode(Datagrams.from_payloads(data[:1], ts_ns=0))
    d.decode(Datagrams.from_payloads(data[1:2], ts_ns=20_000_000_000))
    assert d.errors == {"template_missing": 1} and len(d.pending) == 1
    small = Decoder(pending_max_bytes=600)
    small.decode(Datagrams.from_payloads(data))
    assert small.errors == {"pending_evicted": 2} and len(small.pending) == 1
    small.finish()
    assert small.errors["template_missing"] == 1


def _ipfix_withdrawal(template_id: int, domain: int, seq: int) -> bytes:
    body = struct.pack(">HH", template_id, 0)
    s = struct.pack(">HH", 2, 4 + len(body)) + body
    return struct.pack(">HHIII", 10, 16 + len(s), 1_700_000_000, seq, domain) + s


def test_ipfix_template_withdrawal():
    dgs = read_hex(HEX / "PACKET_IPFIX_TEMPLATE.hex")
    data = read_hex(HEX / "PACKET_IPFIX.hex")
    d = Decoder()
    d.decode(Datagrams.from_payloads(dgs))
    tids = sorted(k[3] for k, t in d.store.templates.items() if t.kind == 0)
    domain = d.streams()[0]["observation_domain"]
    assert len(d.decode(Datagrams.from_payloads(data))) > 0
    d.decode(Datagrams.from_payloads([_ipfix_withdrawal(tids[0], domain, 0)]))
    assert tids[0] not in d.streams()[0]["templates"]
    d.decode(Datagrams.from_payloads([_ipfix_withdrawal(2, domain, 0)]))  # all data templates
    assert not any(t.kind == 0 for t in d.store.templates.values())
    assert any(t.kind == 1 for t in d.store.templates.values())  # options templates stay
    assert len(d.decode(Datagrams.from_payloads(data))) == 0 and d.pending


def test_templates_persist_across_restart(tmp_path):
    tpl = read_hex(HEX / "PACKET_V9_TEMPLATE.hex")
    data = read_hex(HEX / "PACKETS_V9.hex")
    d = Decoder()
    d.decode(Datagrams.from_payloads(tpl))
    assert d.store.dirty
    d.store.save(tmp_path / "templates.json")
    store = TemplateStore()
    assert store.load(tmp_path / "templates.json") == 2
    after = Decoder(store)
    assert len(after.decode(Datagrams.from_payloads(data))) == 36
    assert not after.pending


# -- bad input --------------------------------------------------------------------------------
def _v9(sets: bytes, seq: int = 1, count: int = 1) -> bytes:
    return struct.pack(">HHIIII", 9, count, 1000, 1_700_000_000, seq, 0) + sets


def _v9_template(tid: int, flds: list[tuple[int, int]]) -> bytes:
    body = struct.pack(">HH", tid, len(flds)) + b"".join(struct.pack(">HH", *f) for f in flds)
    return struct.pack(">HH", 0, 4 + len(body)) + body


CASES = {
    "short_datagram": [b"\x00\x09\x00"],
    "unknown_version": [b"\x00\x07" + b"\x00" * 30],
    "v5_count": [struct.pack(">HH", 5, 3) + b"\x00" * 40],
    "ipfix_length": [struct.pack(">HHIII", 10, 500, 0, 0, 0)],
    "set_length": [_v9(struct.pack(">HH", 300, 2) + b"\x01" * 8)],
    "set_past_end": [_v9(struct.pack(">HH", 300, 400) + b"\x01" * 8)],
    "template_no_fields": [_v9(_v9_template(300, []))],
    "template_too_many_fields": [_v9(_v9_template(300, [(8, 4)] * 5000))],
    "template_zero_length": [_v9(_v9_template(300, [(8, 0), (12, 0)]))],
    "template_id": [_v9(_v9_template(7, [(8, 4)]))],
    "template_truncated": [_v9(struct.pack(">HHHH", 0, 12, 300, 5) + b"\x00\x08\x00\x04")],
    "reserved_set": [_v9(struct.pack(">HH", 77, 8) + b"\x00" * 4)],
}


@pytest.mark.parametrize("reason", sorted(CASES))
def test_bad_input_is_counted_by_reason(reason):
    d = Decoder()
    fb = d.decode(Datagrams.from_payloads(CASES[reason]))
    d.finish()
    assert len(fb) == 0
    assert d.errors == {reason: 1}


def test_zero_length_fields_are_skipped():
    """A template whose fields include zero-length ones still decodes its records."""
    tpl = _v9(_v9_template(300, [(8, 4), (99, 0), (12, 4), (2, 4)]))
    rec = bytes([10, 0, 0, 1, 10, 0, 0, 2]) + struct.pack(">I", 7)
    data = _v9(struct.pack(">HH", 300, 4 + len(rec)) + rec, seq=2)
    d = Decoder()
    rows = d.decode(Datagrams.from_payloads([tpl, data])).rows()
    assert [(r["src_ip"], r["dst_ip"], r["packets"]) for r in rows] == \
        [("10.0.0.1", "10.0.0.2", 7)]
    assert not d.errors


def test_record_cut_inside_variable_length_field():
    """IPFIX: a variable-length field whose length runs past the set is counted."""
    tpl_body = struct.pack(">HH", 400, 2) + struct.pack(">HH", 8, 4) + struct.pack(">HH", 82,
                                                                                  65535)
    tset = struct.pack(">HH", 2, 4 + len(tpl_body)) + tpl_body
    rec = bytes([10, 0, 0, 1, 200]) + b"x" * 10
    dset = struct.pack(">HH", 400, 4 + len(rec)) + rec
    msg = struct.pack(">HHIII", 10, 16 + len(tset) + len(dset), 0, 0, 1) + tset + dset
    d = Decoder()
    assert len(d.decode(Datagrams.from_payloads([msg]))) == 0
    assert d.errors == {"record_truncated": 1}


def test_sampling_persists_across_restart(tmp_path):
    """Options sampling (30000, tshark-checked above) and templates saved before a restart
    apply to data that comes after it, before the exporter sends its options again."""
    need_tool("mergecap")
    a = merged(tmp_path, flow_data("options-template.pcap"), flow_data("options-data.pcap"))
    first = merged(tmp_path, a, flow_data("template.pcap"))
    _, d = decode_all(first)
    d.store.save(tmp_path / "t.json")
    store = TemplateStore()
    store.load(tmp_path / "t.json")
    fb, again = decode_all(flow_data("data.pcap"), Decoder(store))
    assert [r["sampling_interval"] for r in fb.rows()] == [30000] * 4
    assert again.streams()[0]["records_sampling_unknown"] == 0


def test_template_count_is_bounded():
    """An exporter spraying template ids cannot grow the state without bound."""
    tpls = [_v9(_v9_template(300 + i, [(8, 4), (12, 4)]), seq=i) for i in range(20)]
    d = Decoder(max_templates=8)
    d.decode(Datagrams.from_payloads(tpls))
    assert len(d.store.templates) == 8
    assert d.errors == {"too_many_templates": 12}


@pytest.mark.parametrize("name", [n for n in PCAPS if n != "options-data.pcap"])  # no flows
def test_field_values_equal_tshark(name, tmp_path):
    """Field by field, each record's addresses, ports, protocol, TOS, flags, counters,
    interfaces, AS numbers, masks and direction equal what tshark's cflow dissector decodes
    from the same element (pmacct, akvorado, Juniper and scapy captures)."""
    need_tool("tshark")
    path = export_capture(name, tmp_path)
    fb, _ = decode_all(path)
    want = tshark_flows(path)
    got = [{k: r[k] for k in w} for r, w in zip(_in_order(fb.rows(), want), want, strict=True)]
    assert sorted(map(_key, got)) == sorted(map(_key, want))
    assert want and all(want)


def _key(r: dict) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in r.items()))


def _in_order(rows: list[dict], want: list[dict]) -> list[dict]:
    """Our records lined up with tshark's: the same count, matched by their shared fields (data
    held for a late template comes out later than tshark shows it)."""
    assert len(rows) == len(want)
    left = list(rows)
    out = []
    for w in want:
        k = next((i for i, r in enumerate(left) if all(r[f] == v for f, v in w.items())), 0)
        out.append(left.pop(k))
    return out


def _link_frames(payload: bytes):
    """(name, linktype, frame) of one export datagram behind each link layer unpack knows."""
    from scapy.compat import raw
    from scapy.contrib.mpls import MPLS
    from scapy.layers.inet import IP, UDP
    from scapy.layers.inet6 import IPv6
    from scapy.layers.l2 import CookedLinux, CookedLinuxV2, Dot1AD, Dot1Q, Ether
    udp = UDP(sport=40000, dport=2055) / payload
    v4 = IP(src="192.0.2.7", dst="192.0.2.2") / udp
    v6 = IPv6(src="2001:db8::7", dst="2001:db8::2") / udp
    yield "ether", 1, raw(Ether() / v4), "192.0.2.7"
    yield "vlan", 1, raw(Ether() / Dot1Q(vlan=10) / v4), "192.0.2.7"
    yield "qinq", 1, raw(Ether() / Dot1AD(vlan=10) / Dot1Q(vlan=20) / v4), "192.0.2.7"
    yield "qinq-9100", 1, raw(Ether(type=0x9100) / Dot1Q(vlan=20) / v6), "2001:db8::7"
    yield "mpls", 1, raw(Ether(type=0x8847) / MPLS(label=100, s=0) / MPLS(label=200, s=1) / v4), \
        "192.0.2.7"
    yield "sll", 113, raw(CookedLinux(proto=0x0800) / v4), "192.0.2.7"
    yield "sll2", 276, raw(CookedLinuxV2(proto=0x86DD) / v6), "2001:db8::7"
    yield "null", 0, struct.pack("<I", 2) + raw(v4), "192.0.2.7"
    yield "null-v6", 0, struct.pack("<I", 30) + raw(v6), "2001:db8::7"
    yield "loop", 108, struct.pack(">I", 2) + raw(v4), "192.0.2.7"
    yield "raw-v4", 101, raw(v4), "192.0.2.7"
    yield "raw-v6", 101, raw(v6), "2001:db8::7"


def test_export_datagrams_behind_every_link_layer(tmp_path):
    """An export datagram decodes to the same records behind VLAN, QinQ, MPLS, Linux cooked,
    BSD loopback and raw IP links (the one link-layer walk of capture/unpack.py), with the
    exporter address of its IP header."""
    payload = read_hex(HEX / "PACKET_V5.hex")[0]
    plain = Decoder().decode(Datagrams.from_payloads([payload])).rows()
    assert len(plain) == 3
    for name, linktype, frame, exporter in _link_frames(payload):
        path = tmp_path / f"{name}.pcap"
        path.write_bytes(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 262144, linktype) +
                         struct.pack("<IIII", 1_700_000_000, 0, len(frame), len(frame)) + frame)
        fb, d = decode_all(path)
        rows = fb.rows()
        assert [{**r, "exporter": None} for r in rows] == \
            [{**r, "exporter": None} for r in plain], name
        assert {r["exporter"] for r in rows} == {exporter}, name


def test_bad_template_names_exporter_and_template():
    """A template that claims more fields than its set holds is counted under its reason, and
    the exporter's last error names the exporter and the template id (GET /exporters)."""
    dg = bytearray(read_hex(HEX / "PACKET_V9_TEMPLATE.hex")[0])
    assert struct.unpack_from(">HH", dg, 0) == (9, struct.unpack_from(">H", dg, 2)[0])
    assert struct.unpack_from(">H", dg, 20)[0] == 0  # the first set is a template set
    tid, count = struct.unpack_from(">HH", dg, 24)
    struct.pack_into(">H", dg, 26, count + 100)
    d = Decoder()
    d.decode(Datagrams.from_payloads([bytes(dg)], "192.0.2.9"))
    assert d.errors.get("template_truncated") == 1
    err = d.last_error["192.0.2.9"]
    assert (err.kind, err.exporter, err.template_id) == ("template_truncated", "192.0.2.9", tid)
    assert str(err) == (f"netflow: template cut short by the end of its set "
                        f"(exporter 192.0.2.9, template {tid})")
    (stream,) = d.streams()
    assert stream["last_error"] == str(err)
