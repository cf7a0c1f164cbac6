"""The stable command line: decode against tshark, plan JSON, one-line errors."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys

from collector.cli import main
from collector.config import data_file
from tests.conftest import ROOT, capture, need_tool


def run(*args):
    return subprocess.run([sys.executable, "-m", "collector.cli", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)


def test_decode_csv_equals_tshark():
    """Addresses, ports, TTL and DNS question name of every packet, as tshark prints them."""
    tshark = need_tool("tshark")
    path = capture("wikipedia.pcap")
    out = run("decode", str(path), "--fields", "src_ip,dst_ip,src_port,dst_port,ttl,dns_qname")
    assert out.returncode == 0, out.stderr
    ours = list(csv.reader(io.StringIO(out.stdout)))
    assert ours[0] == ["src_ip", "dst_ip", "src_port", "dst_port", "ttl", "dns_qname"]
    ts = subprocess.run(
        [tshark, "-n", "-r", str(path), "-T", "fields", "-E", "separator=,", "-E", "occurrence=f",
         "-e", "ip.src", "-e", "ipv6.src", "-e", "ip.dst", "-e", "ipv6.dst", "-e", "tcp.srcport",
         "-e", "udp.srcport", "-e", "tcp.dstport", "-e", "udp.dstport", "-e", "ip.ttl",
         "-e", "ipv6.hlim", "-e", "dns.qry.name"],
        capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(ts) == len(ours) - 1
    for k, (mine, line) in enumerate(zip(ours[1:], ts, strict=True)):
        f = line.split(",")
        want = [f[0] or f[1], f[2] or f[3], f[4] or f[5], f[6] or f[7], f[8] or f[9],
                f[10].lower() if mine[2] in ("53", "5353") or mine[3] in ("53", "5353") else ""]
        assert mine == want, f"packet {k + 1}"


def test_decode_json_and_stdin():
    path = capture("dns_udp.pcap")
    out = subprocess.run(
        [sys.executable, "-m", "collector.cli", "decode", "-", "--fields",
         "ts,dns_qr,dns_qname,vlan", "--format", "json"],
        stdin=open(path, "rb"), capture_output=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.decode().splitlines()]
    assert [r["dns_qr"] for r in rows] == [0, 1]
    assert rows[0]["dns_qname"] == "www.tcpdump.org" and rows[0]["vlan"] is None
    assert rows[0]["ts"] == 1591780794.740079


def test_plan_json_contract():
    out = run("plan", "--queries", data_file("example.sql"), "--format", "json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert [q["name"] for q in doc["queries"]] == ["udp_bw", "dns_req", "dns_resp"]
    assert [b["predicates"] for b in doc["bits"]] == [[0], [1, 2], [3, 4]]
    assert doc["queries"][1]["signature"] == [0, 1]


def test_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.sql"
    bad.write_text("SELECT ts FROM packets;\n-- name: x\nSELECT ts FROM packets\nWHERE nope = 1")
    assert main(["plan", "--queries", str(bad)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {bad}: query x: line 4, column 7: unknown field 'nope' in stream "
                   "packets"]
    assert main(["decode", str(capture("partial_first_header.pcap"))]) == 1
    captured = capsys.readouterr()
    assert captured.err.strip().endswith("truncated record header (file ends inside a 16-byte "
                                         "record header) at byte 24")
    assert captured.out.splitlines()[0].startswith("ts,time,")
    assert main(["decode", str(capture("dns_udp.pcap")), "--fields", "nope"]) == 1
    assert "unknown packets field 'nope'" in capsys.readouterr().err
    assert main(["replay", "/nonexistent.pcap", "--queries", str(bad)]) == 1
    assert main(["decode", str(capture("dns_udp.pcap")), "--stream", "flows", "--fields",
                 "wirelen"]) == 1
    assert "unknown flows field 'wirelen'" in capsys.readouterr().err
    # a capture without export datagrams has no flow records: a header and nothing else
    assert main(["decode", str(capture("dns_udp.pcap")), "--stream", "flows"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("exporter,observation_domain,")
