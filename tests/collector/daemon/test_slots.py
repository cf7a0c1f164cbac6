"""A deleted query's slot comes back only when nothing can refer to it (issue 13): every engine
runs a plan without it, Spark has read every spool file written until then, and the windows
those files could add to are closed. No timer."""

from __future__ import annotations

import threading
import time

import pytest

from collector.config import SourceConfig, load_settings
from collector.daemon.service import Collector
from collector.pipeline.spool import list_files
from tests.pipelines import spread

Q = "SELECT time/5 AS t, src_ip, count(*) AS n FROM packets GROUP BY time/5, src_ip"


class SparkStub:
    """What release_slots asks of the Spark job: its folders and how far each is answered
    for good (the rest of SparkJob is not needed here)."""

    def __init__(self):
        self.queries = {("packets", "5"): None}
        self.complete_before: dict = {}

    def ensure(self, folders) -> None:
        pass

    def drain(self, deadline: float) -> bool:
        return True

    def stop(self, deadline: float | None = None, abandon_s: float = 5.0) -> None:
        pass


def test_a_slot_is_released_when_no_file_or_window_can_refer_to_it(tmp_path):
    path, _ = spread(tmp_path, "ok.pcap", 0.05)
    src = SourceConfig(type="pcap", name="file", path=str(path), loop=False, restamp=False)
    c = Collector(load_settings(var_dir=tmp_path / "var", initial_queries=None, sources=[src]))
    c.start(with_sources=False, with_spark=False)
    try:
        c.job = SparkStub()
        for name in ("a", "b"):
            c.register(name, Q)
        engine, source = c.engines[0], c.sources[0]
        for raw in source.batches(threading.Event()):
            engine.process(raw, "file", source.position())
        slot_b = c.query("b")[1]
        assert c.delete("b")
        assert c.release_slots() == []  # the engine still runs the plan with b
        engine.take_plan()  # its next batch (or the daemon's clock) switches and flushes
        engine.commit(force=True)  # a durable (loop-free) source publishes what it holds
        assert c.release_slots() == []  # marks the spool: files up to here may hold b's rows
        files = [f for d in c.settings.spool_dir.glob("*/*") for f in list_files(d)]
        assert files
        c.register("c", Q)
        assert c.query("c")[1] != slot_b  # held: unread files may hold its partials
        for f in files:  # Spark reads them
            f.unlink()
        assert c.release_slots() == []  # but the windows they add to are still open
        c.job.complete_before[("packets", "5")] = engine.max_time + 1.0
        assert c.release_slots() == [slot_b]
        c.register("d", Q)
        assert c.query("d")[1] == slot_b
    finally:
        c.job = None
        c.stop()


def test_probes_sharing_the_spool_hold_slots_too(tmp_path):
    """A capture probe (``role: capture``) takes the control plane's queries and slots from the
    shared spool and refuses registrations; the control plane releases a deleted query's slot
    only after the probe says it runs a plan without it and Spark has read the probe's files
    written until then."""
    import pytest

    from collector.daemon.cluster import ProbeOnly
    path, _ = spread(tmp_path, "ok.pcap", 0.05)
    spool = tmp_path / "shared"
    control = Collector(load_settings(var_dir=tmp_path / "control", initial_queries=None,
                                      sources=[], spool={"path": spool}))
    src = SourceConfig(type="pcap", name="file", path=str(path), loop=False, restamp=False)
    probe = Collector(load_settings(var_dir=tmp_path / "probe", initial_queries=None,
                                    sources=[src], spool={"path": spool}, role="capture",
                                    probe="edge"))
    control.start(with_sources=False, with_spark=False)
    probe.start(with_sources=False, with_spark=False)
    try:
        control.job = SparkStub()
        for name in ("a", "b"):
            control.register(name, Q)
        assert probe.registry.refresh()
        probe.rebuild()
        assert [(q.name, s) for q, s in probe.queries()] == \
            [(q.name, s) for q, s in control.queries()]
        assert probe.plan.version == control.plan.version
        with pytest.raises(ProbeOnly, match="capture probe"):
            probe.register("x", Q)
        engine, source = probe.engines[0], probe.sources[0]
        for raw in source.batches(threading.Event()):
            engine.process(raw, "file", source.position())
        engine.take_plan()
        probe._publish_status()
        slot_b = control.query("b")[1]
        assert control.delete("b")
        assert control.release_slots() == []  # the probe still runs the plan with b
        assert probe.registry.refresh()
        probe.rebuild()
        engine.take_plan()  # switching flushes the old plan's partials
        engine.commit(force=True)
        assert control.release_slots() == []  # its status is older than its switch
        probe._publish_status()
        assert control.release_slots() == []  # marks the probe's files up to here
        files = [f for d in spool.glob("*/*") for f in list_files(d)]
        assert files and all(".edge." in f.name for f in files)
        assert control.release_slots() == []  # Spark has not read them
        for f in files:
            f.unlink()
        control.job.complete_before[("packets", "5")] = engine.max_time + 1.0
        assert control.release_slots() == [slot_b]
    finally:
        control.job = None
        control.stop()
        probe.stop()


@pytest.mark.slow  # races rebuilds for seconds
def test_a_registered_query_never_looks_deleted_while_plans_are_rebuilt(tmp_path):
    """Spark's batch thread resolves the slots of the partials it merges while registrations
    rebuild the plan: a query registered throughout resolves to itself at every moment (a
    moment's None skips its partials of a whole Spark batch: windows missing from its
    answers). The switch interval is made tiny so the threads interleave often."""
    import sys

    c = Collector(load_settings(var_dir=tmp_path / "var", initial_queries=None, sources=[]))
    c.start(with_sources=False, with_spark=False)
    stop, misses, looks = threading.Event(), [], [0]
    try:
        c.job = SparkStub()
        c.register("stable", Q)
        slot = c.query("stable")[1]

        def spark_thread() -> None:
            while not stop.is_set():
                q = c.query_of_slot(slot)
                looks[0] += 1
                if q is None or q.name != "stable":
                    misses.append(q)
        t = threading.Thread(target=spark_thread, daemon=True)
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        try:
            t.start()
            for i in range(150):
                c.register(f"churn{i}", Q.replace("src_ip", "dst_ip"))
                assert c.delete(f"churn{i}")
        finally:
            stop.set()
            t.join(10)
            sys.setswitchinterval(interval)
    finally:
        c.stop()
    assert looks[0] > 0 and misses == []


def test_concurrent_registrations_share_plan_builds(tmp_path):
    """Registrations made while a plan is built wait for the next build, which serves them all
    (group commit): each returns once a plan holding its query is the engines', and 40 at once
    cost one build when they all wait for it. One at a time, each still builds its own."""
    from concurrent.futures import ThreadPoolExecutor
    c = Collector(load_settings(var_dir=tmp_path / "var", initial_queries=None, sources=[]))
    c.start(with_sources=False, with_spark=False)
    try:
        built = []
        build = c._rebuild

        def counted(options):  # the first build starts once all 40 wait for it
            built.append(1)
            deadline = time.monotonic() + 60
            while len(built) == 1 and c._changes < 40 and time.monotonic() < deadline:
                time.sleep(0.01)
            return build(options)
        c._rebuild = counted

        def register(i: int) -> None:
            q = c.register(f"q{i}", Q.replace("time/5", f"time/{i + 1}"))
            assert q.name in {x.query.name for x in c.plan.queries}  # live when it returns
        with ThreadPoolExecutor(40) as pool:
            list(pool.map(register, range(40)))
        assert {x.query.name for x in c.plan.queries} == {f"q{i}" for i in range(40)}
        assert len(built) == 1
        before = len(built)
        c.register("alone", Q)
        assert c.delete("q0")
        assert len(built) == before + 2
        assert "q0" not in {x.query.name for x in c.plan.queries}
    finally:
        c.stop()
