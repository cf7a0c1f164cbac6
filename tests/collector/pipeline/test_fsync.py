"""Every durable file and its directory are on disk before the step that depends on them
(capture/disk.py). SIGKILL keeps the page cache, so a kill test cannot see a missing fsync: these
tests wrap ``os.fsync`` and ``os.replace`` and check their order, by inode, as a durable source
commits (spool files held, its snapshot, the state file, publishing), as an answer part is
renamed into place, and as the small state files (NetFlow templates) are replaced; the two
SQLite stores commit with ``synchronous = FULL``."""

from __future__ import annotations

import os
import stat
import threading

import pyarrow as pa

from capture.netflow.templates import TemplateStore
from collector.config import Settings
from collector.daemon.alerts.store import AlertStore
from collector.daemon.registry import Registry
from collector.daemon.sources import PcapFileSource
from collector.pipeline.durability import Checkpoint
from collector.pipeline.engine import Engine
from collector.pipeline.spool import Spool
from collector.spark.write import PartWriter
from planner.plan import build_plan
from planner.query import parse_queries
from tests.pipelines import spread

QUERIES = """
SELECT time/5 AS t, src_ip, count(*) AS n, sum(wirelen) AS b FROM packets GROUP BY time/5, src_ip;
SELECT ts, src_ip, dst_port FROM packets WHERE protocol = 17
"""


class Disk:
    """What reached the disk, in order: ``("fsync", inode, is_dir)`` and
    ``("replace", inode, source path, target path)``."""

    def __init__(self, monkeypatch):
        self.events: list[tuple] = []
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(fd):
            st = os.fstat(fd)
            self.events.append(("fsync", st.st_ino, stat.S_ISDIR(st.st_mode)))
            return real_fsync(fd)

        def replace(src, dst, **kw):
            ino = os.stat(src).st_ino
            real_replace(src, dst, **kw)
            self.events.append(("replace", ino, str(src), str(dst)))
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)

    def synced_before(self, ino: int, at: int) -> bool:
        return any(e[0] == "fsync" and e[1] == ino for e in self.events[:at])

    def dir_synced(self, path: str, after: int, before: int | None = None) -> bool:
        ino = os.stat(os.path.dirname(path)).st_ino
        return any(e[0] == "fsync" and e[2] and e[1] == ino
                   for e in self.events[after + 1:before])

    def replaces(self) -> list[tuple[int, tuple]]:
        return [(i, e) for i, e in enumerate(self.events) if e[0] == "replace"]


def test_a_durable_source_syncs_before_each_step(tmp_path, monkeypatch):
    path, _ = spread(tmp_path, "ok.pcap", 0.05)
    plan = build_plan(parse_queries(QUERIES), **Settings(initial_queries=None).plan_options())
    spool = Spool(tmp_path / "spool", max_bytes=1 << 30)
    cp = Checkpoint(tmp_path / "state" / "file.json", spool, "probe-file")
    src = PcapFileSource(str(path), "file", loop=False, batch_size=64)
    engine = Engine(spool, "packets", probe="probe", watermark_delay_s=1, checkpoint=cp,
                    commit_s=0.0, lfta=Settings().lfta.model_copy(update={"capacity": 64}))
    engine.set_plan(plan)
    disk = Disk(monkeypatch)
    for raw in src.batches(threading.Event()):
        engine.process(raw, "file", src.position())
    engine.finish()
    kinds = {"state": 0, "held": 0, "publish": 0, "mark": 0}
    for i, (_, ino, s, d) in disk.replaces():
        # every file renamed was fsynced first (its bytes on disk before any name points at it)
        assert disk.synced_before(ino, i), (s, d)
        if d.endswith("file.json"):  # a commit: what it lists is named on disk already
            kinds["state"] += 1
            assert disk.dir_synced(d, i), "the state file's directory"
            nxt = next((j for j, (_, _, s2, d2) in disk.replaces() if j > i), None)
            for j, (_, _, s2, d2) in disk.replaces():
                if j < i and d2.endswith((".held", ".snap")):
                    # named on disk after its rename, before this commit listed it
                    assert disk.dir_synced(d2, j, i), d2
                if j > i and s2.endswith(".held") and (nxt is None or j <= nxt):
                    kinds["publish"] += 1  # published only once the state is on disk
        elif d.endswith((".held", ".snap")):
            kinds["held"] += 1
        elif os.path.basename(d).startswith("_seq."):
            kinds["mark"] += 1
            assert disk.dir_synced(d, i), "the sequence mark's directory"
        elif s.endswith(".held"):
            pass  # a publish, checked above
        else:  # a file straight into the spool (none for a durable source)
            assert disk.dir_synced(d, i), d
    assert kinds["state"] >= 5 and kinds["held"] >= 5 and kinds["publish"] >= 5, kinds
    # the sequence marks: one durable write per folder, not one per file
    assert kinds["mark"] == len([p for p in (tmp_path / "spool").glob("packets/*")
                                 if p.is_dir()]), kinds


def test_a_spool_file_and_its_mark_are_synced(tmp_path, monkeypatch):
    disk = Disk(monkeypatch)
    spool = Spool(tmp_path / "spool")
    from collector.pipeline.spool import punctuation
    for i in range(3):
        spool.write("packets", "60", punctuation("packets", 1_700_000_040 + 60 * i, 1, "p"))
    files = [(i, e) for i, e in disk.replaces() if e[3].endswith(".parquet")]
    assert len(files) == 3
    for i, (_, ino, _, d) in files:
        assert disk.synced_before(ino, i) and disk.dir_synced(d, i), d


def test_an_answer_part_is_synced_before_and_after_its_rename(tmp_path, monkeypatch):
    disk = Disk(monkeypatch)
    schema = pa.schema([("t", pa.int64()), ("n", pa.int64())])
    w = PartWriter(tmp_path / "results", "q1", "part-run-00000001.parquet", schema)
    w.write(pa.table({"t": [1, 2], "n": [3, 4]}, schema=schema))
    final = w.close()
    [(i, (_, ino, _, d))] = disk.replaces()
    assert d == str(final) and disk.synced_before(ino, i) and disk.dir_synced(d, i)


def test_templates_are_synced(tmp_path, monkeypatch):
    disk = Disk(monkeypatch)
    TemplateStore().save(tmp_path / "templates.json")
    [(i, (_, ino, _, d))] = disk.replaces()
    assert disk.synced_before(ino, i) and disk.dir_synced(d, i)


def test_the_sqlite_stores_commit_fully(tmp_path):
    reg = Registry(tmp_path / "registry.db")
    store = AlertStore(tmp_path / "registry.db")
    assert reg._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2
