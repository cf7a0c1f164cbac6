"""The spool's bound: files counted as they are written, room seen again once Spark's commit
deletes files, the drop and block policies."""

from __future__ import annotations

import os

import pytest

from collector.spool import Spool, SpoolFull, list_files, punctuation


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
    from collector.sources import make_source
    from tests.conftest import capture
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
