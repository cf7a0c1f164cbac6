"""The spool's bound: files counted as they are written, room seen again once Spark's commit
deletes files, the drop and block policies."""

from __future__ import annotations

import os

import pytest

from collector.pipeline.spool import SEQ_BLOCK, Spool, SpoolFull, list_files, punctuation


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_bound_drop_and_room_after_commit(tmp_path, fmt):
    row = punctuation("packets", 1_700_000_040, 1, "probe")
    probe = Spool(tmp_path / "probe", format=fmt)
    size = probe.write("packets", "60", row).stat().st_size
    spool = Spool(tmp_path / "spool", max_bytes=3 * size, policy="drop", format=fmt)
    written = [spool.write("packets", "60", row) for _ in range(5)]
    assert [p is not None for p in written] == [True, True, True, False, False]
    assert spool.size() == 3 * size
    folder = spool.folder("packets", "60")
    for f in list_files(folder)[:2]:  # Spark committed two files
        os.remove(f)
    assert spool.write("packets", "60", row) is not None
    assert spool.write("packets", "60", row) is not None
    assert spool.write("packets", "60", row) is None
    # dropped writes took no sequence number
    assert [int(f.name.split(".")[0]) for f in list_files(folder)] == [2, 3, 4]


def test_probes_share_a_spool_without_a_lock(tmp_path):
    """Two capture daemons writing one spool (shared storage): each numbers its own files, so
    neither overwrites the other's; each one's high-water mark and "holds up to" see its own
    files only (a slow probe never keeps another's slots from being released); a spool written
    before probes had names goes on from its sequence."""
    import pyarrow.parquet as pq
    folder = tmp_path / "spool" / "packets" / "60"
    folder.mkdir(parents=True)
    (folder / "_seq").write_text("6")  # the unnamed writer's mark, as an older version left it
    a, b = Spool(tmp_path / "spool", probe="edge-a"), Spool(tmp_path / "spool", probe="edge_b")
    for i in range(3):
        a.write("packets", "60", punctuation("packets", 1_700_000_040 + i, 1, "edge-a"))
        b.write("packets", "60", punctuation("packets", 1_700_000_040 + i, 1, "edge_b"))
    names = sorted(p.name for p in list_files(folder))
    assert names == [f"{s:016d}.{p}.parquet" for s in (7, 8, 9) for p in ("edge-a", "edge_b")]
    assert all(pq.read_table(folder / n).column("probe")[0].as_py() == n.split(".")[1]
               for n in names)
    mark = a.high_water()
    assert mark == {folder: 9} and b.high_water() == {folder: 9}
    for n in names:
        if "edge-a" in n:
            os.remove(folder / n)  # Spark read a's files
    assert not a.holds_up_to(mark)  # b's unread files are b's business
    assert b.holds_up_to(mark)
    # a restart numbers above every number reserved: the mark on disk is written a block
    # ahead (from 7, the first written), never per file
    again = Spool(tmp_path / "spool", probe="edge-a")
    assert again.write("packets", "60", punctuation("packets", 1, 1, "edge-a")).name == \
        f"{7 + SEQ_BLOCK:016d}.edge-a.parquet"
    with pytest.raises(ValueError, match="probe name"):
        Spool(tmp_path / "spool", probe="a.b")


def test_block_without_a_consumer_is_an_error(tmp_path):
    row = punctuation("packets", 1_700_000_040, 1, "probe")
    spool = Spool(tmp_path / "spool", max_bytes=1, policy="block", block_timeout_s=0)
    spool.write("packets", "60", row)  # the first write finds room
    with pytest.raises(SpoolFull, match="reached spool.max_bytes"):
        spool.write("packets", "60", row)


def test_a_followed_file_keeps_its_own_times(tmp_path):
    """`restamp` (on by default) shifts a looped capture to the current time; a followed file
    (tcpdump -w) is live already, so its packets keep the times written in it (scapy reads
    them), or a window could move as late as the daemon reads the file."""
    import shutil
    import threading

    from scapy.utils import RawPcapReader

    from collector.config import SourceConfig
    from collector.daemon.sources import make_source
    from tests.helpers import capture
    path = tmp_path / "live.pcap"
    shutil.copy(capture("ok.pcap"), path)
    cfg = SourceConfig(name="live", path=str(path), follow=True, loop=False)
    assert cfg.restamp  # the default
    src = make_source(cfg, 4096, lambda st: None, tmp_path)
    stop = threading.Event()
    got = []
    for raw in src.batches(stop):
        if raw is not None:
            got.extend(raw.ts_ns.tolist())
        if len(got) >= 851:
            stop.set()
    want = [meta.sec * 10**9 + meta.usec * 1000 for _, meta in RawPcapReader(str(path))]
    assert got == want
