"""pcapng, pipes and growing files: records against dpkt, times and interfaces against tshark."""

from __future__ import annotations

import io
import os
import random
import struct
import subprocess
import threading
import time
from decimal import Decimal

import dpkt
import pytest
from scapy.utils import RawPcapNgReader

from capture.errors import DecodeError
from capture.pcap import open_capture
from capture.pcapng import REASONS
from tests.helpers import DATA, capture, need_tool

PCAPNG = ["pcapng-multi-interface.pcapng", "cooper-grill-dvwa.pcapng", "dhcp.pcapng"]


def ours(source, **kw) -> list[tuple]:
    return [rec for raw in open_capture(source, **kw) for rec in raw.records()]


def tshark_frames(path) -> list[tuple[int, int, int, int]]:
    """(epoch ns, interface id, wire length, captured length) per frame, from tshark."""
    out = subprocess.run([need_tool("tshark"), "-r", str(path), "-T", "fields", "-e",
                          "frame.time_epoch", "-e", "frame.interface_id", "-e", "frame.len",
                          "-e", "frame.cap_len"], capture_output=True, text=True, check=True)
    rows = []
    for line in out.stdout.splitlines():
        ts, ifc, ln, cap = line.split("\t")
        if ifc == "":  # tshark shows a Custom Block as a frame; it is not a packet
            continue
        rows.append((int(Decimal(ts) * 1_000_000_000) if ts else None, int(ifc), int(ln),
                     int(cap)))
    return rows


@pytest.mark.parametrize("name", PCAPNG)
def test_pcapng_equals_dpkt_and_tshark(name):
    """Bytes and wire lengths equal dpkt's pcapng reader; times (to the nanosecond, with each
    interface's if_tsresol) and interface ids equal tshark's."""
    path = capture(name)
    got = ours(path, batch_size=3)
    with open(path, "rb") as fh:
        ref = [buf for _, buf in dpkt.pcapng.Reader(fh)]
    assert [r[4] for r in got] == ref
    assert [(ts, ifc, wl, len(data)) for ts, wl, _, ifc, data in got] == tshark_frames(path)
    assert {r[2] for r in got} == {1}


def test_multi_interface_file_has_two_interfaces():
    r = open_capture(capture("pcapng-multi-interface.pcapng"))
    got = [rec for raw in r for rec in raw.records()]
    assert [(i["section"], i["id"]) for i in r.interfaces] == [(1, 0), (1, 1)]
    assert sorted({rec[3] for rec in got}) == [0, 1]


def _block(btype: int, body: bytes, order: str) -> bytes:
    body += b"\0" * (-len(body) % 4)
    n = len(body) + 12
    return struct.pack(order + "II", btype, n) + body + struct.pack(order + "I", n)


def _opt(code: int, value: bytes, order: str) -> bytes:
    return struct.pack(order + "HH", code, len(value)) + value + b"\0" * (-len(value) % 4)


def _handmade(frames: list[bytes]) -> bytes:
    """Two sections, the first big-endian, the second little-endian, with binary and decimal
    if_tsresol, an if_tsoffset, Simple and obsolete Packet Blocks, statistics, custom and
    unknown blocks: everything a reader must walk or skip."""
    out = b""
    # section 1, big-endian: interface 0 in 2^-20 s, interface 1 in ms with a 100 s offset
    o = ">"
    out += _block(0x0A0D0D0A, struct.pack(o + "IHHq", 0x1A2B3C4D, 1, 0, -1), o)
    out += _block(1, struct.pack(o + "HHI", 1, 0, 0) + _opt(9, b"\x94", o) + _opt(0, b"", o), o)
    out += _block(1, struct.pack(o + "HHI", 1, 0, 96) + _opt(9, b"\x03", o)
                  + _opt(14, struct.pack(o + "q", 100), o) + _opt(0, b"", o), o)
    t = 1_700_000_000 << 20 | 524288  # x.5 s
    out += _block(6, struct.pack(o + "IIIII", 0, t >> 32, t & 0xFFFFFFFF, len(frames[0]),
                                 len(frames[0]) + 4) + frames[0], o)
    out += _block(0x00000BAD, b"custom, copied", o)  # custom block: skipped
    out += _block(0x12345678, b"unknown", o)  # unknown block: skipped
    t = 1_700_000_001_250
    out += _block(6, struct.pack(o + "IIIII", 1, t >> 32, t & 0xFFFFFFFF, 96,
                                 len(frames[1])) + frames[1][:96], o)
    out += _block(5, struct.pack(o + "III", 1, 0, 0), o)  # interface statistics: skipped
    # section 2, little-endian: one microsecond interface; obsolete PB and a Simple PB
    o = "<"
    out += _block(0x0A0D0D0A, struct.pack(o + "IHHq", 0x1A2B3C4D, 1, 0, -1), o)
    out += _block(1, struct.pack(o + "HHI", 1, 0, 0), o)
    t = 1_700_000_002_000_001
    out += _block(2, struct.pack(o + "HHIIII", 0, 0, t >> 32, t & 0xFFFFFFFF, len(frames[2]),
                                 len(frames[2])) + frames[2], o)
    out += _block(3, struct.pack(o + "I", len(frames[3])) + frames[3], o)
    return out


def test_handmade_sections_and_blocks_equal_tshark(tmp_path):
    """A hand-built file of both byte orders and every block kind, read as tshark reads it.

    A Simple Packet Block has no timestamp: flowsieve gives it the previous packet's time
    (tshark prints none). tshark also lists the Custom Block as a frame; it is not a packet."""
    frames = [f.records().__next__()[4] for f in open_capture(capture("dns_udp.pcap"))] * 2
    frames += [rec[4] for raw in open_capture(capture("icmp6.pcap")) for rec in raw.records()]
    data = _handmade(frames[:4])
    path = tmp_path / "handmade.pcapng"
    path.write_bytes(data)
    got = ours(path)
    ref = tshark_frames(path)
    assert len(got) == len(ref) == 4
    for k, ((ts, wl, lt, ifc, body), (rts, rifc, rwl, rcap)) in enumerate(zip(got, ref,
                                                                               strict=True)):
        assert (wl, len(body), ifc, lt) == (rwl, rcap, rifc, 1), k
        if k < 3:
            assert ts == rts, k
    assert got[3][0] == got[2][0]
    assert got[1][0] == (1_700_000_001_250 + 100_000) * 1_000_000  # tsoffset 100 s
    assert [r[4] for r in got[:3]] == [frames[0], frames[1][:96], frames[2]]


def test_truncated_pcapng_gives_error_with_offset():
    """dhcp-trunc.pcapng ends inside its first Enhanced Packet Block (tshark: "cut short in
    the middle of a packet"): nothing is delivered, then the block's offset and reason."""
    r = open_capture(capture("dhcp-trunc.pcapng"))
    with pytest.raises(DecodeError) as e:
        list(r)
    assert e.value.kind == "truncated_block"
    with open(capture("dhcp.pcapng"), "rb") as fh:  # where the first EPB starts
        data = fh.read()
    shb = struct.unpack_from("<I", data, 4)[0]
    idb = struct.unpack_from("<I", data, shb + 4)[0]
    assert e.value.offset == shb + idb
    assert r.stats.errors == {"truncated_block": 1}


@pytest.mark.timeout(300)
def test_mutated_pcapng_never_crashes_or_hangs():
    """Random byte flips and cuts of real pcapng files: each read ends, either cleanly or with
    a DecodeError whose reason is one of the documented ones."""
    rng = random.Random(4)
    bases = [capture(n).read_bytes() for n in PCAPNG]
    kinds = set(REASONS.values()) | {"bad_byte_order_magic", "unsupported_version"}
    seen = set()
    clean = 0
    for _ in range(1500):
        b = bytearray(rng.choice(bases))
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        b = bytes(b[:rng.randint(4, len(b))])
        if b[:4] != b"\x0a\x0d\x0d\x0a":
            continue
        try:
            got = [rec[4] for raw in open_capture(b) for rec in raw.records()]
        except DecodeError as e:
            assert e.kind in kinds, e
            assert e.offset is not None and 0 <= e.offset <= len(b)
            seen.add(e.kind)
            continue
        # read to the end: the packets are those scapy's independent pcapng reader finds
        assert got == [data for data, _ in RawPcapNgReader(io.BytesIO(b))]
        clean += 1
    assert {"truncated_block", "bad_block_length"} <= seen
    assert clean > 0


@pytest.mark.parametrize("name", ["ok.pcap", "cooper-grill-dvwa.pcapng"])
def test_pipe_equals_file(name):
    """A capture read from a pipe (as `tcpdump -w - | flowsieve …`) equals the file."""
    path = capture(name)
    proc = subprocess.Popen(["cat", str(path)], stdout=subprocess.PIPE)
    try:
        got = ours(proc.stdout, batch_size=100)
    finally:
        proc.wait(timeout=10)
    assert got == ours(path)


def test_follow_a_growing_file(tmp_path):
    """A file written in pieces (cut inside record headers and packets) is followed until
    stopped, and every record arrives once, in order."""
    src = capture("ok.pcap").read_bytes()
    path = tmp_path / "growing.pcap"
    path.write_bytes(b"")
    stop = threading.Event()

    def writer():
        rng = random.Random(1)
        pos = 0
        with open(path, "ab") as fh:
            while pos < len(src):
                k = rng.randint(1, 40_000)
                fh.write(src[pos:pos + k])
                fh.flush()
                pos += k
                time.sleep(0.01)
        time.sleep(0.3)
        stop.set()

    t = threading.Thread(target=writer)
    t.start()
    got = ours(path, follow=True, stop=stop, batch_size=64)
    t.join()
    assert got == ours(capture("ok.pcap"))
    assert len(got) == 851


def test_large_file_reads_in_bounded_windows(tmp_path):
    """A file far larger than the window is read through windows: same records, and no window
    maps more than its size (the window never grows with the file)."""
    one = capture("ok.pcap").read_bytes()
    body = one[24:]
    path = tmp_path / "big.pcap"
    with open(path, "wb") as fh:
        fh.write(one[:24])
        for _ in range(40):
            fh.write(body)
    r = open_capture(path, window=1 << 16)
    n = 0
    biggest = 0
    for raw in r:
        n += len(raw)
        biggest = max(biggest, len(raw.buf))
    assert n == 851 * 40
    assert biggest <= (1 << 16) + os.sysconf("SC_PAGE_SIZE")
    assert path.stat().st_size > 300 * biggest


def test_stdin_decode_equals_file(tmp_path):
    """`flowsieve decode -` reads a pcap stream on stdin."""
    import sys
    path = capture("wikipedia.pcap")
    env = {**os.environ}
    cmd = [sys.executable, "-m", "api.cli", "decode", "--format", "csv", "--fields",
           "ts,src_ip,dst_ip,src_port,dst_port,protocol,wirelen"]
    with open(path, "rb") as fh:
        piped = subprocess.run([*cmd, "-"], stdin=fh, capture_output=True, text=True,
                               env=env, timeout=120)
    direct = subprocess.run([*cmd, str(path)], capture_output=True, text=True, env=env,
                            timeout=120)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == direct.stdout
    assert len(piped.stdout.splitlines()) == 1 + sum(
        1 for _ in dpkt.pcap.Reader(open(DATA / "pcap" / "wikipedia.pcap", "rb")))
