"""The benchmark traces' pcaps say what their generator's arrays say (dpkt decodes them, scapy
reads the wire lengths): the Spark benchmark's truth is computed from the arrays, so they must
describe the file exactly."""

from __future__ import annotations

import numpy as np
import pytest
from scapy.utils import RawPcapReader

from bench.traces import DNS_NAMES, trace
from capture.fields import ip_text
from tests.reference import packets


@pytest.mark.parametrize("kind", ["backbone", "uniform"])
def test_trace_arrays_equal_dpkt(kind, tmp_path):
    path, p = trace(kind, 20_000, tmp_path)
    ref = packets(path)
    assert len(ref) == len(p["ts_us"]) == 20_000
    time = p["ts_us"] // 1_000_000
    assert [r["time"] for r in ref] == time.tolist()
    assert (np.diff(p["ts_us"]) >= 0).all()
    assert [meta.wirelen for _, meta in RawPcapReader(str(path))] == p["wirelen"].tolist()
    for k in ("protocol", "src_port", "dst_port", "ip_version"):
        col = {"protocol": "proto", "src_port": "sport", "dst_port": "dport",
               "ip_version": "ipv"}[k]
        want = p[col].tolist()
        got = [r[k] for r in ref]
        if k in ("src_port", "dst_port"):  # ICMP has no ports
            want = [None if pr in (1, 58) else v for v, pr in zip(want, p["proto"], strict=True)]
        assert got == want, k
    assert [r["src_ip"] for r in ref] == [ip_text(bytes(a)) for a in p["src"]]
    assert [r["dst_ip"] for r in ref] == [ip_text(bytes(a)) for a in p["dst"]]
    assert [r["tcp_flags"] for r in ref] == [int(f) if pr == 6 else None
                                             for f, pr in zip(p["flags"], p["proto"],
                                                              strict=True)]
    dns = p["qname"] >= 0
    assert dns.sum() > 100
    assert [r["dns_qname"] for r, d in zip(ref, dns, strict=True) if d] == \
        [DNS_NAMES[i] for i in p["qname"][dns]]
    # every packet: only the DNS flows' packets carry a DNS header (no random port is 53 or
    # mDNS's 5353, which decoders read as DNS)
    assert [r["dns_qr"] for r in ref] == [int(q) if d else None
                                          for q, d in zip(p["dns_qr"], dns, strict=True)]
    span = (time.max() - time.min()) // 60
    assert span >= 4  # five one-minute windows at least
