"""Prefix tables for ``in_table(src_ip, 'name')`` (issue 15): membership equals Python's
ipaddress module on the addresses dpkt reads from real captures (IPv4 and IPv6, prefixes of
every length); a bad file is an error with its line; a query naming a table the configuration
lacks is refused with the table name's position; a changed file is read again; the prefilter
never takes a table predicate (it is residual); and replay answers a table query as dpkt's
count says."""

from __future__ import annotations

import ipaddress
import random

import numpy as np
import pytest

from capture.pcap import open_capture
from capture.unpack import unpack
from collector.config import Settings
from collector.pipeline import prefix_tables as tables
from collector.pipeline.residual import eval_predicate
from planner.ir import QueryError
from planner.plan import build_plan
from planner.query import parse_single
from tests.helpers import capture
from tests.reference import packets

FILES = ("ok.pcap", "wikipedia.pcap", "icmp6.pcap", "ipv6-fragmented-dns.pcap")


def table_file(path, rnd: random.Random) -> list:
    """Prefixes around the captures' own addresses (every length) and random ones."""
    seen = sorted({p[f] for name in FILES for p in packets(capture(name))
                   for f in ("src_ip", "dst_ip") if p[f]})
    nets = []
    for a in seen:
        addr = ipaddress.ip_address(a)
        if rnd.random() < 0.4:
            bits = addr.max_prefixlen
            nets.append(ipaddress.ip_network((addr, rnd.randint(bits // 2, bits)), strict=False))
    nets += [ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("2001:db8::/32")]
    lines = ["# customers", ""] + [f"{n}   # one of them" if i % 3 == 0 else str(n)
                                   for i, n in enumerate(nets)]
    path.write_text("\n".join(lines) + "\n")
    return nets


def test_membership_equals_ipaddress(tmp_path):
    nets = table_file(tmp_path / "t.txt", random.Random(4))
    tables.configure({"t": tmp_path / "t.txt"})
    for field in ("src_ip", "dst_ip"):
        q = parse_single(f"SELECT ts FROM packets WHERE in_table({field}, 't')", "q")
        (p,) = q.predicates
        hits = total = 0
        for name in FILES:
            refs = packets(capture(name))
            got = []
            for raw in open_capture(capture(name), batch_size=64):
                tb = unpack(raw)
                got.extend(eval_predicate(p, tb, np.arange(len(tb))).tolist())
            want = [r[field] is not None and
                    any(ipaddress.ip_address(r[field]) in n for n in nets) for r in refs]
            assert got == want, (name, field)
            hits += sum(want)
            total += len(want)
        assert 0 < hits < total  # some in, some out
    neg = parse_single("SELECT ts FROM packets WHERE NOT in_table(src_ip, 't')", "q")
    tb = unpack(next(iter(open_capture(capture("ok.pcap"), batch_size=1 << 20))))
    rows = np.arange(len(tb))
    have = tb.ip_valid("src_ip")
    assert np.array_equal(eval_predicate(neg.predicates[0], tb, rows),
                          ~eval_predicate(parse_single(
                              "SELECT ts FROM packets WHERE in_table(src_ip, 't')", "q")
                              .predicates[0], tb, rows) & have)


def test_bad_tables_and_unknown_names(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("10.0.0.0/8\n# fine\n10.1.2.3/33\n")
    with pytest.raises(ValueError, match=r"bad.txt line 3"):
        tables.configure({"bad": bad})
    tables.configure({})
    q = parse_single("SELECT ts FROM packets\nWHERE protocol = 6 AND in_table(dst_ip, 'nope')",
                     "q")
    with pytest.raises(QueryError) as e:
        tables.check(q)
    assert (e.value.line, e.value.col) == (2, 41) and "no prefix table 'nope'" in str(e.value)
    with pytest.raises(QueryError, match="in_table\\(\\) needs an address field"):
        parse_single("SELECT ts FROM packets WHERE in_table(dst_port, 'x')", "q")
    # a table the configuration lost holds nothing (said once), never an exception
    assert not tables.lookup("nope", np.zeros(2, np.uint64), np.zeros(2, np.uint64)).any()


def test_a_changed_file_is_read_again_and_the_prefilter_leaves_tables_alone(tmp_path):
    import os
    f = tmp_path / "t.txt"
    f.write_text("192.168.0.0/16\n")
    tables.configure({"t": f})
    assert tables.get("t").size == 1
    f.write_text("192.168.0.0/16\n172.16.0.0/12\n")
    os.utime(f, ns=(1, 1))  # a new stamp even within the clock's resolution
    assert tables.get("t").size == 2
    plan = build_plan([parse_single("SELECT ts FROM packets WHERE protocol = 17 AND "
                                    "in_table(src_ip, 't')", "q")], cheap_cost=1000)
    info = {i.predicate.text: i for i in plan.predicates}
    assert not info["in_table(src_ip, 't')"].cheap and info["protocol = 17"].cheap
    assert plan.queries[0].residual == [info["in_table(src_ip, 't')"].id]


def test_replay_answers_a_table_query(tmp_path, spark):
    """ok.pcap's packets per minute from the sources of a table, as dpkt counts them."""
    from api.replay import replay
    from tests.reference import rows_of
    refs = packets(capture("ok.pcap"))
    srcs = sorted({r["src_ip"] for r in refs if r["src_ip"]})
    inside = srcs[::2]
    (tmp_path / "t.txt").write_text("".join(f"{a}\n" for a in inside))
    q = parse_single("SELECT time/60 AS t, count(*) AS n FROM packets WHERE "
                     "in_table(src_ip, 'some') GROUP BY time/60", "some_sources")
    res = replay(capture("ok.pcap"), [q], tmp_path / "work", spark,
                 settings=Settings(initial_queries=None, tables={"some": tmp_path / "t.txt"}))
    assert res.error is None
    got = {r["t"]: r["n"] for r in rows_of(*res.answers[0])}
    want: dict[int, int] = {}
    for r in refs:
        if r["src_ip"] in inside:
            want[r["time"] // 60] = want.get(r["time"] // 60, 0) + 1
    assert got == want and sum(want.values()) > 0
