"""``replay`` reads and unpacks a capture's next batches on a thread of its own while the engine
runs the current one (api.replay.ahead, Engine.prepare): the same batches in the same
order, a decode error where the file has it, a reader that stops with its consumer, and tuples
unpacked for a plan that no longer runs unpacked again."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pyarrow.parquet as pq
import pytest

from api.replay import ahead
from capture.errors import DecodeError
from capture.pcap import open_capture
from capture.unpack import unpack
from collector.metrics import Metrics
from collector.pipeline.engine import Engine
from collector.pipeline.spool import Spool
from planner.plan import build_plan
from planner.query import parse_queries
from tests.helpers import capture


def _batches(path, size=7):
    return list(open_capture(path, size))


def test_batches_come_in_order_with_what_the_reader_made_of_them():
    path = capture("wikipedia.pcap")
    want = _batches(path)
    got = list(ahead(open_capture(path, 7), lambda raw: unpack(raw, ["src_ip", "dst_port"])))
    assert len(got) == len(want) > 3
    for (raw, tb), ref in zip(got, want, strict=True):
        assert np.array_equal(raw.ts_ns, ref.ts_ns) and np.array_equal(raw.offset, ref.offset)
        inline = unpack(ref, ["src_ip", "dst_port"])
        assert np.array_equal(tb.ints, inline.ints)
        assert np.array_equal(tb.ips["src_ip"], inline.ips["src_ip"])


def test_a_decode_error_comes_after_the_batches_before_it(tmp_path):
    """A capture cut inside a record: the batches before the cut, then the reader's error."""
    data = capture("wikipedia.pcap").read_bytes()
    cut = tmp_path / "cut.pcap"
    cut.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(DecodeError) as inline:
        want = []
        for raw in open_capture(cut, 7):
            want.append(raw.ts_ns.copy())
    got = []
    with pytest.raises(DecodeError) as read_ahead:
        for raw, _ in ahead(open_capture(cut, 7), lambda raw: None):
            got.append(raw.ts_ns.copy())
    assert len(got) == len(want) > 3
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    assert str(read_ahead.value) == str(inline.value)
    assert "truncated record data" in str(read_ahead.value)


def test_a_consumer_that_stops_stops_the_reader():
    before = {t.ident for t in threading.enumerate()}
    items = ahead(itertools.count(), lambda x: x * x, depth=2)
    assert [next(items) for _ in range(3)] == [(0, 0), (1, 1), (2, 4)]
    items.close()  # the reader is blocked on a full queue: it must notice and end
    assert {t.ident for t in threading.enumerate()} == before


QUERIES = """
-- name: by_proto
SELECT time/60 AS t, protocol, count(*) AS n, sum(wirelen) AS b FROM packets
GROUP BY time/60, protocol;
"""
OTHER = """
-- name: by_src
SELECT time/60 AS t, src_ip, dst_port, count(*) AS n FROM packets WHERE protocol = 6
GROUP BY time/60, src_ip, dst_port;
"""


def _spooled(root) -> list[dict]:
    rows = []
    for f in sorted(root.rglob("*.parquet")):
        rows += pq.read_table(f).to_pylist()
    return sorted(rows, key=repr)


def test_tuples_unpacked_for_another_plan_are_unpacked_again(tmp_path):
    """A plan taken between ``prepare`` and ``process`` (a rebuild) needs fields the reader did
    not unpack: the engine unpacks the batch again, and spools what the inline path spools."""
    path = capture("wikipedia.pcap")
    first, then = build_plan(parse_queries(QUERIES)), build_plan(parse_queries(OTHER))
    assert set(first.unpacking("packets").extract) != set(then.unpacking("packets").extract)
    out = {}
    for how in ("ahead", "inline"):
        e = Engine(Spool(tmp_path / how), "packets", Metrics(), watermark_delay_s=0)
        e.set_plan(first)
        e.process(_batches(path, 50)[0])  # the first plan runs
        for raw in _batches(path, 50)[1:]:
            prepared = e.prepare(raw) if how == "ahead" else None
            e.set_plan(then)
            e.process(raw, prepared=prepared)
        e.finish()
        out[how] = _spooled(tmp_path / how)
    assert out["ahead"] and out["ahead"] == out["inline"]
    assert any(r["node"].startswith("dst_port,src_ip") and r["cnt"] for r in out["ahead"])


def test_the_reader_unpacks_for_a_plan_set_but_not_yet_taken(tmp_path, monkeypatch):
    """``replay``'s reader prepares the first batches before the engine has processed one (its
    plan is set, not yet taken): they are unpacked for that plan, and used."""
    path = capture("wikipedia.pcap")
    plan = build_plan(parse_queries(OTHER))
    e = Engine(Spool(tmp_path / "s"), "packets", Metrics(), watermark_delay_s=0)
    assert e.prepare(_batches(path)[0]) is None  # no plan yet: nothing to unpack for
    e.set_plan(plan)
    prepared = [e.prepare(raw) for raw in _batches(path)]
    assert all(p is not None and p.fields == plan.unpacking("packets").extract for p in prepared)
    used = []
    real = Engine.process_tuples

    def spy(self, c, tb):
        used.append(tb)
        return real(self, c, tb)
    monkeypatch.setattr(Engine, "process_tuples", spy)
    for raw, p in zip(_batches(path), prepared, strict=True):
        e.process(raw, prepared=p)
    assert [id(t) for t in used] == [id(p.tuples) for p in prepared]


def test_an_engine_that_fails_leaves_no_reader_behind(tmp_path, monkeypatch):
    """``replay``'s engine raising mid-capture: the error comes out of ``replay`` and the
    reading thread is gone with it (not left holding batches until the traceback is freed)."""
    from api.replay import replay
    from collector.config import Settings

    calls = []

    def failing(self, raw, source="", position=None, prepared=None):
        calls.append(len(raw))
        if len(calls) == 3:
            raise RuntimeError("the engine broke")
    monkeypatch.setattr(Engine, "process", failing)
    settings = Settings(initial_queries=None, batch_size=16, planner={"measure_tuples": 0},
                        spool={"format": "arrow"}, replay_workers=1)
    with pytest.raises(RuntimeError, match="the engine broke"):
        replay(capture("wikipedia.pcap"), parse_queries(QUERIES), tmp_path, None,
               settings=settings)
    assert len(calls) == 3
    assert not [t for t in threading.enumerate() if t.name == "replay-reader"]
