"""The peers benchmark's harness (bench/peers): every tool, run as bench/peers/tools.py runs it,
counts each of the 50 peer queries' packets exactly as numpy counts them from the trace
generator's arrays, so a figure in bench/README.md compares tools that did the same work."""

from __future__ import annotations

import json
import shutil

import pytest

from bench.peers import queries as peer_queries
from bench.peers.tools import (
    BINARIES,
    DEBIAN,
    RUNNERS,
    ToolError,
    _io_stat_counts,
    _nfdump_packets,
)
from bench.spark_queries import columns, truth
from bench.traces import trace
from planner.query import parse_queries
from tests.helpers import need


def test_query_file_holds_every_form_of_the_shared_filters():
    qs = peer_queries.load()
    assert len(qs) == 50
    assert all(set(q) == set(peer_queries.FORMS) for q in qs)
    parsed = parse_queries(peer_queries.sql())
    assert [q.name for q in parsed] == [peer_queries.name(i) for i in range(50)]
    need(peer_queries.SHARED.exists(), f"{peer_queries.SHARED} is absent")
    # bench/peers/queries.json is the shared file with two forms added, nothing changed
    assert peer_queries.with_forms(json.loads(peer_queries.SHARED.read_text())) == qs


def test_output_parsers_read_the_tools_formats():
    row = ("|   0.0 <> 290.8 |   5349 | 400966 |  20431 | 9261446 |  23904 | 10377746 |")
    assert _io_stat_counts(f"header\n{row}\n", 3) == [5349, 20431, 23904]
    assert _io_stat_counts("|  0.0 <> 1.0 |   7 |  420 |\n", 1) == [7]
    with pytest.raises(ToolError, match="cells"):
        _io_stat_counts(f"{row}\n", 2)
    with pytest.raises(ToolError, match="no io,stat"):
        _io_stat_counts("nothing\n", 1)
    assert _nfdump_packets("a,b\nSummary\nflows,bytes,packets,avg_bps\n12,3400,56,7\n") == 56
    with pytest.raises(ToolError, match="summary"):
        _nfdump_packets("no summary here\n")


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    path, p = trace("uniform", 20_000, tmp_path_factory.mktemp("peers"))
    cols = columns(p)
    want = [sum(r["pkts"] for r in truth(q, p, cols))
            for q in parse_queries(peer_queries.sql())]
    assert sum(want) > 10_000 and sum(1 for w in want if w) > 40  # the queries select
    return path, want


@pytest.mark.slow
@pytest.mark.parametrize("tool", sorted(RUNNERS))
def test_tool_counts_equal_the_truth(tool, small_trace):
    for binary in BINARIES[tool]:
        need(shutil.which(binary) is not None,
             f"{binary} is not installed (apt-get install -y {DEBIAN[tool]})")
    path, want = small_trace
    run = RUNNERS[tool](path, peer_queries.load())
    assert run.counts == want
    assert run.wall_s > run.fixed_s >= 0
    if tool == "pmacctd":
        assert run.detail["daemons"] == 2  # 50 plugins: two daemons of 25 (32 at most)
