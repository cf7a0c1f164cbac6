"""Adaptivity that pays for itself (collector/pipeline/residual.py): the value cache and
A-Greedy's profiling measure what they save against what they cost and turn themselves down,
and back up when the stream changes; the order A-Greedy learned survives plan rebuilds."""

from __future__ import annotations

import dataclasses
import functools
import tempfile

import numpy as np
import pyarrow as pa

from capture.batch import TupleBatch
from capture.pcap import open_capture
from capture.unpack import unpack
from collector.config import ResidualConfig
from collector.pipeline import compiled_plan
from collector.pipeline.compiled_prefilter import compile_prefilter
from collector.pipeline.engine import Engine
from collector.pipeline.prefilter import run_prefilter
from collector.pipeline.residual import Residual, ValueCache
from collector.pipeline.spool import Spool
from planner.plan import build_plan
from planner.query import parse_queries
from tests.helpers import capture

NAMES = ("var-services-std-ports.pcap", "wikipedia.pcap", "ok.pcap")


def dns_batches(n: int, rows: int = 4096) -> list:
    """Batches of the DNS packets of the test captures (their real names), each a random mix
    of them as a busy link's batch is."""
    tbs = []
    for name in NAMES:
        for raw in open_capture(capture(name), batch_size=1 << 20):
            tb = unpack(raw)
            tbs.append(tb.take(np.flatnonzero(tb.strings["dns_qname"].is_valid().to_numpy(
                zero_copy_only=False))))
    ips = set.intersection(*(set(t.ips) for t in tbs))
    strings = set.intersection(*(set(t.strings) for t in tbs))
    oks = set.intersection(*(set(t.ip_ok) for t in tbs))
    every = TupleBatch(tbs[0].stream, np.concatenate([t.ts_ns for t in tbs]),
                       np.concatenate([t.ints for t in tbs], axis=1),
                       {k: np.concatenate([t.ips[k] for t in tbs]) for k in ips},
                       {k: pa.concat_arrays([t.strings[k] for t in tbs]) for k in strings},
                       {k: np.concatenate([t.ip_ok[k] for t in tbs]) for k in oks})
    rng = np.random.default_rng(5)
    return [every.take(rng.integers(0, len(every), rows)) for _ in range(n)]


def flooded(tb, seed: int):
    """The batch with each name replaced by a fresh ten-letter label under victim.org or
    victim.com (a random-subdomain flood)."""
    rng = np.random.default_rng(seed)
    labels = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 10)) for _ in range(len(tb))]
    names = [f"{x}.victim.{'org' if i % 2 else 'com'}" for i, x in enumerate(labels)]
    return dataclasses.replace(tb, strings={**tb.strings, "dns_qname": pa.array(names)})


class Clock:
    """A clock the predicates move (what they cost), a tenth of a microsecond a reading (the
    cache's own work): the cache's decisions do not depend on the machine's load."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-7
        return self.now


def test_the_value_cache_turns_itself_off_where_it_does_not_pay_and_on_again():
    """Values that never repeat give no hits: after ``decide`` values the cache is off for
    that predicate (its look-ups only cost). Off, it is tried again after ``probe`` times its
    last trial; on values that repeat, under a predicate that costs far more than a look-up,
    the trial pays and it stays on. A predicate that comes to cost twice as much per value is
    tried at once. Outcomes never change."""
    clock = Clock()
    cache = ValueCache(1 << 16, decide=64, probe=4, clock=clock)
    calls: list[str] = []

    def slow(v: str) -> bool:  # a user predicate that resolves something
        calls.append(v)
        clock.now += 20e-6
        return v.endswith("7")

    pred = ("call", "slow")
    unique = [[f"u{i}-{j}" for j in range(32)] for i in range(3)]
    for values in unique:
        assert cache.evaluate(pred, values, slow) == [v.endswith("7") for v in values]
    assert cache.state() == {"slow()": False} and cache.hits == 0
    # off: every value computed, nothing looked up, until the trial after 4 × 64 values
    repeat = [f"r{j}" for j in range(16)]
    rounds = 0
    while not cache.state()["slow()"]:
        calls.clear()
        assert cache.evaluate(pred, repeat, slow) == [v.endswith("7") for v in repeat]
        assert len(calls) == len(repeat)
        rounds += 1
    # its trial took the first two calls' 64 values; the third call ran off
    assert rounds == (4 * 64 - 32) // len(repeat)
    for _ in range(8):  # the trial: hits on the repeated values pay for the look-ups
        calls.clear()
        assert cache.evaluate(pred, repeat, slow) == [v.endswith("7") for v in repeat]
    assert calls == [] and cache.state()["slow()"] and cache.saved_s > cache.spent_s

    # a cheap predicate on unique values turns off; once it costs more, it is tried at once
    delay = [0.0]

    def varies(v: str) -> bool:
        clock.now += delay[0]
        return "x" in v
    pred = ("call", "varies")
    k = 0
    while cache.state().get("varies()", True):
        cache.evaluate(pred, [f"v{k}-{j}" for j in range(64)], varies)
        k += 1
    delay[0] = 200e-6
    cache.evaluate(pred, [f"w{j}" for j in range(64)], varies)
    assert cache.state()["varies()"]


def test_profiling_turns_down_once_the_order_holds_and_up_when_the_stream_changes():
    """On the captures' DNS names a regexp for a ten-letter label drops every name and
    A-Greedy runs it first; once the order holds, one batch in FLOOR is profiled. A
    random-subdomain flood under .org and .com makes the label regexp pass everything: its drop
    rate moves, profiling is back on every batch, the old profile is dropped, and the regexp
    for .com (which drops half the flood) runs first. Every query bit equals the fixed
    order's throughout."""
    sql = ("SELECT ts FROM packets WHERE regexp(dns_qname, '[.]com$') AND "
           "regexp(dns_qname, '^[a-z]{10}[.]');")
    plan = build_plan(parse_queries(sql))
    cp = compile_prefilter(plan, "packets")
    fixed = Residual(plan, "packets", "cost")
    res = Residual(plan, "packets", timed=False, cache=ValueCache(1 << 16))
    text = {pid: plan.predicates[pid].predicate.text for pid in res.ids}

    def run(batches):
        for tb in batches:
            _, Q1 = run_prefilter(cp, tb)
            Q2 = Q1.copy()
            fixed.apply(tb, Q1)
            res.apply(tb, Q2)
            assert np.array_equal(Q1, Q2)

    assert [text[p] for p in res.order()][0] == "regexp(dns_qname, '[.]com$')"
    names = dns_batches(24)
    run(names)
    assert [text[p] for p in res.order()][0] == "regexp(dns_qname, '^[a-z]{10}[.]')"
    assert res.every == Residual.FLOOR and res.drifts == 0
    run([flooded(tb, k) for k, tb in enumerate(names)])
    assert res.drifts >= 1
    assert [text[p] for p in res.order()][0] == "regexp(dns_qname, '[.]com$')"


def test_the_learned_order_survives_registrations_of_unrelated_queries(monkeypatch):
    """The engine learns an order that is not the catalogue's; then 100 queries are
    registered one at a time (half with residual predicates of their own), each a new plan
    version compiled as the daemon does: after every rebuild the learned predicates run in the
    order learned (the order of the traffic before it), with their profile window, and new
    predicates follow them. Predicates cost
    their catalogue cost here, not their measured time: a clock's reading under a loaded
    machine could move the order between registrations, which is learning, not what is tested;
    and profiling runs at its probability throughout (``adapt`` off: whether it pays is
    measured by the clock too)."""
    monkeypatch.setattr(compiled_plan, "Residual", functools.partial(Residual, timed=False))
    learn = ("-- name: q\nSELECT time/60 AS t, count(*) AS n FROM packets WHERE "
             "dst_port = 53 AND regexp(dns_qname, '[a-z]') AND regexp(dns_qname, '^no-such-name$') "
             "GROUP BY time/60;\n")
    cfg = ResidualConfig(profile_probability=1.0, profile_window=20, profile_budget=1.0,
                         adapt=False)
    raws = [raw for name in NAMES for raw in open_capture(capture(name), batch_size=64)]
    with tempfile.TemporaryDirectory() as d:
        engine = Engine(Spool(d), "packets", residual=cfg)
        engine.set_plan(build_plan(parse_queries(learn), version=1))
        first = None
        for _ in range(6):
            for raw in raws:
                engine.process(raw, "t")
            first = engine.residual_state()
            if first["order"][0] == "regexp(dns_qname, '^no-such-name$')":
                break
        assert first["order"] == ["regexp(dns_qname, '^no-such-name$')",
                                  "regexp(dns_qname, '[a-z]')"]
        learned = first["order"]
        sql = learn
        for i in range(100):
            where = f"dst_port = {1000 + i}" if i % 2 else \
                f"protocol = 17 AND regexp(dns_qname, 'other{i}')"
            sql += (f"-- name: u{i}\nSELECT time/60 AS t, count(*) AS n FROM packets "
                    f"WHERE {where} GROUP BY time/60;\n")
            before = engine.residual_state()
            engine.set_plan(build_plan(parse_queries(sql), version=i + 2))
            engine.take_plan()
            after = engine.residual_state()
            assert after["order"][:len(before["order"])] == before["order"], i
            assert [t for t in after["order"] if t in learned] == learned
            assert after["profile_tuples"] == before["profile_tuples"]
            assert after["carried"] == len(before["order"])
            if i % 10 == 9:  # traffic between registrations: learning goes on (the new
                # queries' tuples may move the order, which the next rebuild then carries)
                for raw in raws[:8]:
                    engine.process(raw, "t")
                learned = [t for t in engine.residual_state()["order"] if t in learned]
        final = engine.residual_state()
        assert [t for t in final["order"] if t in learned] == learned
        assert len(final["order"]) == 2 + 50 and final["reorders"] >= first["reorders"]
