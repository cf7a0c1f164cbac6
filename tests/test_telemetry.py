"""The telemetry applications (bench/telemetry/apps.sql) through ``replay`` on a generated
backbone-shaped capture with attacks injected at known hosts and windows: every answer equals
the pandas truth computed from the generator's own arrays, and each application reports the
injected attacks and nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.telemetry.attacks import COLUMNS, capture, expected_keys, frame, truth
from collector.replay import replay
from collector.results import rows_of
from planner.query import parse_queries
from tests.reference import packets

pytestmark = pytest.mark.slow
APPS = Path(__file__).parent.parent / "bench" / "telemetry" / "apps.sql"


def test_capture_says_what_the_arrays_say(tmp_path):
    """dpkt reads in the pcap the fields the truth takes from the arrays."""
    path, p, _ = capture(30_000, tmp_path, seed=7)
    df, ref = frame(p), packets(path)
    assert len(ref) == len(df)
    for col, field in [("src", "src_ip"), ("dst", "dst_ip"), ("dport", "dst_port"),
                       ("ip_len", "ip_len")]:
        assert [r[field] for r in ref] == [None if v == -1 else v for v in df[col]], field
    assert [r["tcp_flags"] for r in ref] == [None if f < 0 else f for f in df["tcp_flags"]]
    dns = [(r["dns_an_type"], r["dns_an_ttl"], r["dns_an_name"]) for r in ref]
    want = [(t, ttl, n) if n is not None else (None, None, None)
            for t, ttl, n in zip(df["an_type"], df["an_ttl"], df["an_name"], strict=True)]
    assert dns == want and sum(t == 16 for t, _, _ in dns) > 100


def test_applications_find_the_attacks(spark, tmp_path):
    path, p, want = capture(200_000, tmp_path)
    res = replay(path, parse_queries(APPS.read_text()), tmp_path / "work", spark)
    assert res.error is None
    got = {q.name: rows_of(q, t) for q, t in res.answers}
    right, attacks = truth(frame(p)), expected_keys(want)
    assert set(got) == set(COLUMNS) == set(attacks)
    for app, (keys, values) in COLUMNS.items():
        rows = {tuple(r[k] for k in keys): tuple(r[v] for v in values) for r in got[app]}
        assert rows == right[app], app
        assert set(rows) == attacks[app], app
