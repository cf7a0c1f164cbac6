"""The classic pcap reader against dpkt's reader and libpcap's documented behaviour."""

from __future__ import annotations

import dpkt
import numpy as np
import pytest
from scapy.utils import RawPcapReader

from capture.errors import DecodeError
from capture.pcap import open_capture, split_pcap
from tests.helpers import capture, samples

READABLE = samples("pcap", "*.pcap", exclude={"unexpected_eof_on_second_packet.pcap",
                                             "partial_first_header.pcap",
                                             "bad_first_header.pcap"})


def _records(path, batch_size=65536, **kw):
    r = open_capture(path, batch_size=batch_size, **kw)
    out = [(ts, wirelen, data) for raw in r for ts, wirelen, _, _, data in raw.records()]
    return r, out


@pytest.mark.parametrize("name", READABLE)
def test_records_equal_dpkt(name):
    """Every record's bytes, wire length and timestamp equal what dpkt's reader returns."""
    path = capture(name)
    # small batches and 64 KiB windows exercise batch and window boundaries
    _, ours = _records(path, batch_size=7, window=1 << 16)
    with open(path, "rb") as fh:
        ref = dpkt.pcap.Reader(fh)
        exp = [(ts, buf) for ts, buf in ref]
    # dpkt's reader does not return the original length; scapy's raw reader does
    wire = [meta.wirelen for _, meta in RawPcapReader(str(path))]
    assert len(ours) == len(exp) == len(wire)
    for (ts_ns, wirelen, data), (ts, buf), ref_wirelen in zip(ours, exp, wire, strict=True):
        assert data == buf
        assert abs(ts_ns / 1e9 - float(ts)) < 2e-6
        assert wirelen == ref_wirelen


def test_big_endian_file():
    """pptp.pcap is written big-endian (magic a1b2c3d4 in network order)."""
    r = open_capture(capture("pptp.pcap"))
    assert r.big and not r.nano
    assert sum(len(b) for b in r) == 23


def test_nanosecond_file():
    r = open_capture(capture("tcp-handshake-nano.pcap"))
    batches = list(r)
    assert r.nano and r.linktype == 113
    with open(capture("tcp-handshake-nano.pcap"), "rb") as fh:
        # dpkt gives nanosecond files as Decimal seconds
        exp = [ts for ts, _ in dpkt.pcap.Reader(fh)]
    got = np.concatenate([b.ts_ns for b in batches])
    # exact to the nanosecond: dpkt returns these as Decimal seconds
    assert [int(t) for t in got] == [int(t * 1_000_000_000) for t in exp]


@pytest.mark.parametrize("name,good,offset,reason", [
    # libpcap: "truncated dump file; tried to read 78 captured bytes, only got 36"
    ("unexpected_eof_on_second_packet.pcap", 1, 248, "truncated record data"),
    # libpcap: "tried to read 16 header bytes, only got 11": the header starts at byte 24
    ("partial_first_header.pcap", 0, 24, "truncated record header"),
    # libpcap: "invalid packet capture length 2368110654, bigger than snaplen of 262144";
    # one zero-length record is read first
    ("bad_first_header.pcap", 1, 40, "caplen larger than the snapshot length"),
])
def test_corrupt_files_give_records_then_error(name, good, offset, reason):
    """Every record before the fault is delivered, then a DecodeError with offset and reason."""
    r = open_capture(capture(name))
    got = 0
    with pytest.raises(DecodeError) as e:
        for raw in r:
            got += len(raw)
    assert got == good
    assert e.value.offset == offset
    assert reason in str(e.value)
    assert sum(r.stats.errors.values()) == 1


def test_caplen_beyond_snaplen_is_read_like_libpcap():
    """trunc-hdr.pcap: snaplen 1 but caplen 8; libpcap (and tshark) read the record."""
    r = open_capture(capture("trunc-hdr.pcap"))
    raws = list(r)
    assert sum(len(b) for b in raws) == 1 and int(raws[0].caplen[0]) == 8


def test_not_a_pcap(tmp_path):
    p = tmp_path / "x.pcap"
    p.write_bytes(b"hello world, this is not a capture file")
    with pytest.raises(DecodeError, match="not a pcap or pcapng file"):
        open_capture(p)
    p.write_bytes(b"\xd4\xc3")
    with pytest.raises(DecodeError, match="too short"):
        open_capture(p)


@pytest.mark.parametrize("name", ["wikipedia.pcap", "test.pcap", "pptp.pcap",
                                  "tcp-handshake-nano.pcap"])
@pytest.mark.parametrize("parts", [2, 3, 7])
def test_byte_ranges_hold_every_record_once(name, parts):
    """``split_pcap``'s ranges, read one after another, give dpkt's records in order: every
    boundary is a record boundary and no record is read twice or missed."""
    path = capture(name)
    ranges = split_pcap(path, parts)
    assert 1 < len(ranges) <= parts
    assert ranges[0][0] == 24
    assert all(a[1] == b[0] for a, b in zip(ranges[:-1], ranges[1:], strict=True))
    ours = [rec for rg in ranges for rec in _records(path, byte_range=rg)[1]]
    with open(path, "rb") as fh:
        exp = [buf for _, buf in dpkt.pcap.Reader(fh)]
    assert [data for _, _, data in ours] == exp


def test_byte_ranges_of_what_cannot_be_split(tmp_path):
    """A pcapng file, a file too small for the minimum range and a fault before the first
    boundary give one range: one reader reports what the file is."""
    whole = [(24, 2**63 - 1)]
    assert split_pcap(capture("dhcp.pcapng"), 4) == whole
    assert split_pcap(capture("wikipedia.pcap"), 4, min_bytes=1 << 30) == whole
    assert split_pcap(capture("partial_first_header.pcap"), 2) == whole
    assert split_pcap(tmp_path / "missing.pcap", 2) == whole


def test_fault_in_the_last_range_is_reported_at_its_offset(tmp_path):
    """A file cut inside its last record: the ranges before it read whole, the last gives the
    records up to the fault and the DecodeError the whole file gives."""
    data = capture("wikipedia.pcap").read_bytes()
    cut = tmp_path / "cut.pcap"
    cut.write_bytes(data[:-7])
    with pytest.raises(DecodeError) as whole:
        for _ in open_capture(cut):
            pass
    ranges = split_pcap(cut, 3)
    assert len(ranges) == 3
    got = 0
    for rg in ranges[:-1]:
        got += sum(len(b) for b in open_capture(cut, byte_range=rg))
    with pytest.raises(DecodeError) as last:
        for b in open_capture(cut, byte_range=ranges[-1]):
            got += len(b)
    assert last.value.offset == whole.value.offset and last.value.kind == whole.value.kind
    with open(capture("wikipedia.pcap"), "rb") as fh:
        assert got == sum(1 for _ in dpkt.pcap.Reader(fh)) - 1
