"""Exactly-once capture of a file source (collector/pipeline/durability.py): an engine and its
source abandoned at seeded points — between batches, inside a commit after its state file was
written, with spool files still held — and started again from the committed state leave a spool
whose answers equal dpkt's: nothing lost, nothing twice."""

from __future__ import annotations

import random
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from collector.config import Settings
from collector.daemon.results import project
from collector.daemon.sources import PcapFileSource
from collector.pipeline.durability import Checkpoint
from collector.pipeline.engine import Engine
from collector.pipeline.spool import Held, Spool, list_files
from collector.spark.derive import Folder, answer_locally
from planner.plan import build_plan
from planner.query import parse_queries
from tests.pipelines import spread
from tests.reference import packets, rows_of

QUERIES = """
SELECT time/5 AS t, src_ip, count(*) AS n, sum(wirelen) AS b FROM packets GROUP BY time/5, src_ip;
SELECT ts, src_ip, dst_port FROM packets WHERE protocol = 17
"""


class Killed(Exception):
    """The process dies here."""


def answers(spool_root, plan) -> dict:
    """What Spark would answer from every visible spool file (partials merge in any order)."""
    slots = tuple((qp.slot, qp.query) for qp in plan.queries)
    out = {}
    for folder in sorted(p for p in spool_root.glob("packets/*") if p.is_dir()):
        files = list_files(folder)
        if not files:
            continue
        table = pa.concat_tables([pq.read_table(f) for f in files])
        spec = Folder("packets", folder.name, tuple((s, q) for s, q in slots
                                                    if q.folder == folder.name))
        for name, rows in answer_locally(table, spec).items():
            q = next(q for _, q in slots if q.name == name)
            out[name] = Counter(tuple(sorted(r.items())) for r in rows_of(q, project(q, rows)))
    return out


def run(path, spool, plan, state, kill_after: int | None, batch_size: int) -> bool:
    """One life of the source: resume from the state, read, die after ``kill_after`` batches
    (None: read to the end and finish). True when it reached the end."""
    cp = Checkpoint(state, spool, "probe-file")
    src = PcapFileSource(str(path), "file", loop=False, batch_size=batch_size)
    assert src.resume(cp.recover()) is None
    engine = Engine(spool, "packets", probe="probe", watermark_delay_s=1, checkpoint=cp,
                    commit_s=0.0, lfta=Settings().lfta.model_copy(update={"capacity": 64}))
    engine.set_plan(plan)
    for i, raw in enumerate(src.batches(_never())):
        engine.process(raw, "file", src.position())
        if kill_after is not None and i + 1 >= kill_after:
            return False  # abandoned: what is held and in memory dies with it
    engine.finish()
    return True


def _never():
    import threading
    return threading.Event()


@pytest.mark.parametrize("seed", [1, 2])
def test_killed_and_restarted_source_answers_exactly_once(tmp_path, seed, monkeypatch):
    path, _ = spread(tmp_path, "ok.pcap", 0.05)  # 851 packets over 9 five-second windows
    plan = build_plan(parse_queries(QUERIES), **Settings(initial_queries=None).plan_options())
    rnd = random.Random(seed)
    spool = Spool(tmp_path / "spool", max_bytes=1 << 30)
    state = tmp_path / "state" / "file.json"
    lives, done = 0, False
    while not done:
        lives += 1
        if lives <= 6:
            kill = rnd.randrange(1, 6)
            if lives % 3 == 0:  # die inside a commit: state written, files not yet published
                real = Held.publish
                calls = {"n": 0}

                def dying(self, real=real, calls=calls):
                    calls["n"] += 1
                    if calls["n"] == 2:
                        raise Killed
                    real(self)
                monkeypatch.setattr(Held, "publish", dying)
                try:
                    done = run(path, spool, plan, state, kill, 32)
                except Killed:
                    done = False
                monkeypatch.setattr(Held, "publish", real)
                continue
            done = run(path, spool, plan, state, kill, 32)
        else:
            done = run(path, spool, plan, state, None, 32)
    assert lives >= 6  # at least five deaths before the end
    assert not spool.held_files("probe-file") or all(
        p.suffix == ".snap" for p in spool.held_files("probe-file"))
    whole = Spool(tmp_path / "whole", max_bytes=1 << 30)
    engine = Engine(whole, "packets", probe="probe", watermark_delay_s=1,
                    lfta=Settings().lfta.model_copy(update={"capacity": 64}))
    engine.set_plan(plan)
    for raw in PcapFileSource(str(path), "file", loop=False, batch_size=32).batches(_never()):
        engine.process(raw, "file")
    engine.finish()
    got, want = answers(tmp_path / "spool", plan), answers(tmp_path / "whole", plan)
    assert got == want
    # and the uninterrupted run is dpkt's
    pk = packets(path)
    q1 = Counter()
    for p in pk:
        q1[(int(p["time"]) // 5, p["src_ip"])] += 1
    assert {(dict(r)["t"], dict(r)["src_ip"]): dict(r)["n"] for r in want["q1"]} == dict(q1)
    assert sum(want["q2"].values()) == sum(1 for p in pk if p["protocol"] == 17)
