"""Node keys packed into the spool's binary ``key`` and back, on real captures against dpkt:
every tuple's fields (addresses, ports, the DNS name, NULLs) survive the spool, and the driver's
derivation gives each query exactly its tuples."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

from capture.fields import ip_text
from capture.pcap import open_capture
from capture.unpack import unpack
from collector.config import LftaConfig
from collector.keys import KeyLayout
from collector.pipeline.lfta import NodeTable
from collector.spark.derive import Folder, fan_out
from planner.query import parse_queries
from planner.slots import slot_mask
from tests.helpers import capture
from tests.reference import packets

KEYS = ("dst_port", "src_ip", "dns_qname", "protocol")


def _text(v):
    return ip_text(v) if isinstance(v, bytes) else v


@pytest.mark.parametrize("name", ["dns_udp.pcap", "wikipedia.pcap", "icmp6.pcap"])
def test_keys_round_trip_equal_dpkt(name):
    """Per-tuple rows (a string key: no LFTA table) decoded from the binary keys equal dpkt's
    fields of every packet, NULLs included, with the pattern words as written."""
    path = capture(name)
    layout = KeyLayout("packets", KEYS, 2)
    assert layout.label == "dns_qname,dst_port,protocol,src_ip#2"
    assert KeyLayout.parse("packets", layout.label).keys == layout.keys
    got = []
    for raw in open_capture(path, batch_size=50):
        tb = unpack(raw)
        rows = np.arange(len(tb))
        words = np.hstack([layout.field_words_of(tb, rows),
                           np.tile(np.array([5, -7], np.int64), (len(tb), 1))])
        cols, pattern = layout.decode(layout.encode(words, layout.strings_of(tb, rows)))
        assert (pattern.view(np.int64) == [5, -7]).all()
        got += list(zip(*[[_text(v) for v in cols[k].to_pylist()] for k in layout.keys],
                        strict=True))
    want = [tuple(p[k] for k in layout.keys) for p in packets(path)]
    assert got == want


def test_query_partials_give_each_query_its_tuples():
    """One node shared by two queries of different keys: each query's rows (decoded, split by
    its slot) count exactly the packets dpkt says match it."""
    path = capture("dns_udp.pcap")
    qs = parse_queries("""
        SELECT time/60 AS t, src_ip, count(*) AS n FROM packets WHERE protocol = 17
          GROUP BY time/60, src_ip;
        SELECT time/60 AS t, src_ip, dns_qname, count(*) AS n FROM packets WHERE dst_port = 53
          GROUP BY time/60, src_ip, dns_qname""")
    node = NodeTable("packets", 60, ("src_ip", "dns_qname"), [3, 70], 2, LftaConfig())
    assert node.table is None  # a string key: one row per tuple
    ref = packets(path)
    spooled = []
    for raw in open_capture(path, batch_size=64):
        tb = unpack(raw)
        Q = np.zeros((len(tb), 2), np.uint64)
        Q[tb.column("protocol") == 17] |= slot_mask([3], 2)
        Q[tb.column("dst_port") == 53] |= slot_mask([70], 2)
        spooled += node.add(tb, Q, 0, 1, "probe")
    table = pa.concat_tables(spooled)
    folder = Folder("packets", "60", ((3, qs[0]), (70, qs[1])))
    fanned = pa.Table.from_batches(list(fan_out(folder, iter(table.select(
        folder.columns).to_batches()))))
    assert folder.keys == ["src_ip", "dns_qname"]
    assert fanned.column_names[:5] == ["g", "q", "window_start", "k0", "k1"]
    assert "sum_wirelen" not in fanned.column_names  # count(*) reads no measure
    udp = Counter(p["src_ip"] for p in ref if p["protocol"] == 17)
    dns = Counter((p["src_ip"], p["dns_qname"]) for p in ref if p["dst_port"] == 53)
    got: dict[int, Counter] = {3: Counter(), 70: Counter()}
    for r in fanned.to_pylist():  # each row counts its tuples for its query's keys
        key = ip_text(r["k0"]) if r["q"] == 3 else (ip_text(r["k0"]), r["k1"])
        got[r["q"]][key] += r["cnt"]
    assert got[3] == udp
    assert got[70] == dns


def test_a_spread_answer_s_key_hash_depends_on_the_values_alone():
    """``derive.key_hash`` (which task of a spread answer a row goes to): a row's hash is the
    same whatever batch, order or slice holds it (the rows of one group, fanned out by
    different tasks, meet), NULL as an empty value; different keys mostly differ."""
    from collector.spark.derive import key_hash
    names = ["www.example.com", "", None, "a", "b", "ü.example", "www.example.com"]
    ips = [bytes(range(i, i + 16)) for i in range(len(names))]
    ports = [53, 80, None, 443, 53, 8080, 53]
    cols = [pa.array(names), pa.array(ips, pa.binary()), pa.array(ports, pa.int32())]
    h = key_hash(cols, len(names))
    order = [6, 3, 0, 5, 2, 1, 4]
    shuffled = [c.take(pa.array(order)) for c in cols]
    assert key_hash(shuffled, len(order)).tolist() == h[order].tolist()
    sliced = [pa.concat_arrays([pa.array(["x"] * 3), cols[0]]).slice(3),
              pa.concat_arrays([pa.array([b"y" * 16] * 3), cols[1]]).slice(3), cols[2]]
    assert key_hash(sliced, len(names)).tolist() == h.tolist()
    wide = [pa.array(names, pa.large_string()), cols[1].cast(pa.large_binary()), cols[2]]
    assert key_hash(wide, len(names)).tolist() == h.tolist()
    # an address hashes alike in a batch of addresses only and in one with a NULL
    with_null = pa.array([*ips, None], pa.binary())
    assert key_hash([with_null], len(ips) + 1)[:-1].tolist() == \
        key_hash([cols[1]], len(ips)).tolist()
    assert len(set(h[:6].tolist())) == 6  # six distinct keys
    assert key_hash([pa.array([None], pa.string())], 1)[0] == \
        key_hash([pa.array([""])], 1)[0]
