"""A full disk (issue 48): the var folder on a small tmpfs the test mounts (root) and fills.

The spool: a ``drop`` writer's file is not written (DiskFull, nothing half-written left), a
blocking one waits and writes once there is room, and gives up only when stopped. The daemon:
a followed capture (a durable source, policy block) keeps being written while its var folder is
full — the source waits, readiness says why (503), liveness stays 200, no route answers 500 —
and once the filler is removed everything resumes by itself: every window of the capture is
answered exactly. Then a person removes the spool's folder: it is made again, and every window
after is answered exactly too (those whose unread files went with it may fall short, never
over)."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest

from collector.pipeline.spool import DiskFull, Spool, punctuation
from tests.helpers import need
from tests.processes import (
    PERIOD,
    Feeder,
    answers,
    daemon_config,
    metric,
    no_server_errors,
    start_daemon,
    stop_and_drain,
    stop_daemon,
    wait_for,
    wait_until,
)
from tests.windows import QUERIES, answered, truth


@pytest.fixture
def tmpfs(tmp_path):
    """A folder on a tmpfs of its own, and a function that fills it (returns the filler)."""
    need(os.geteuid() == 0, "mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()

    def mount(size: str) -> Path:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                       check=True)
        return mnt
    yield mount
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(folder: Path) -> Path:
    """Write a file until its file system has no byte left."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for chunk in (1 << 20, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def test_a_full_disk_drops_or_waits_by_policy(tmpfs):
    root = tmpfs("1m")
    row = punctuation("packets", 1_700_000_040, 1, "probe")
    spool = Spool(root / "spool", policy="drop")
    assert spool.write("packets", "5", row) is not None  # room for the first
    filler = fill(root)
    with pytest.raises(DiskFull):
        spool.write("packets", "5", row)
    assert spool.full_since is not None and spool.disk_full == 1
    assert not [n for n in os.listdir(root / "spool" / "packets" / "5") if n.endswith(".tmp")]
    # block: waits (counted) until there is room, then writes the whole file
    waited, out = [], []
    writer = threading.Thread(target=lambda: out.append(
        spool.write("packets", "5", row, "block", waiting=waited.append)))
    writer.start()
    wait_until(lambda: sum(waited) >= 2, "the writer waiting")
    assert writer.is_alive() and not out
    filler.unlink()
    writer.join(30)
    assert out and pq.read_table(out[0]).num_rows == 1
    assert spool.full_since is None
    # stopped while it waits: DiskFull, nothing written
    fill(root)
    stop = threading.Event()
    errors = []

    def blocked():
        try:
            spool.write("packets", "5", row, "block", stop)
        except DiskFull as e:
            errors.append(e)
    writer = threading.Thread(target=blocked)
    writer.start()
    wait_until(lambda: spool.disk_full >= 3, "the writer waiting")
    stop.set()
    writer.join(30)
    assert errors


@pytest.mark.slow
def test_daemon_waits_out_a_full_disk_and_loses_nothing(tmp_path, tmpfs):
    var = tmpfs("96m")
    cfg, port = daemon_config(tmp_path, [
        f"{{type: pcap, name: traffic, path: {tmp_path / 'traffic.pcap'}, follow: true, "
        "restamp: false}"], QUERIES)
    cfg.write_text(cfg.read_text().replace(f"var_dir: {tmp_path / 'var'}", f"var_dir: {var}")
                   .replace("trigger_s: 1,", "trigger_s: 1, "
                            "restart_backoff_s: 1,"))
    results = var / "results"
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    log = open(tmp_path / "daemon.log", "a")  # noqa: SIM115 - closed in finally
    feeder = Feeder(tmp_path / "traffic.pcap", per_tick=20)
    proc = start_daemon(cfg, log)
    codes: list[int] = []

    def get(path: str) -> httpx.Response:
        r = client.get(path)
        codes.append(r.status_code)
        return r
    try:
        feeder.start()
        wait_for(lambda: get("/readyz").status_code == 200, 240, "ready")
        wait_for(lambda: len(answered(results)["all5s"]) >= 1, 120, "a window answered")
        filler = fill(var)
        wait_for(lambda: metric(get("/metrics").text, "flowsieve_spool_disk_full") == 1, 60,
                 "the spool's disk full")
        r = get("/readyz")
        assert r.status_code == 503 and "file system is full" in r.text, r.text
        deadline = time.monotonic() + 3 * PERIOD  # full for three windows
        while time.monotonic() < deadline:
            for path in ("/readyz", "/healthz", "/metrics", "/queries", "/prefilter",
                         "/queries/all5s/results"):
                get(path)
            assert get("/healthz").status_code == 200
            time.sleep(0.5)
        assert proc.poll() is None
        filler.unlink()  # room again: everything resumes by itself
        wait_for(lambda: metric(get("/metrics").text, "flowsieve_spool_disk_full") == 0, 60,
                 "room seen")
        wait_for(lambda: get("/readyz").status_code == 200, 240, "ready again")
        # Spark catches up with what waited (the windows of the full disk answered), then a
        # person removes the spool's folder: it comes back, and so do the answers (the files
        # Spark had not read yet are gone with it: their windows may fall short)
        back = time.time()
        wait_for(lambda: (answers(client, "all5s")[1] or 0) >= (int(back) // PERIOD) * PERIOD,
                 240, "the full disk's windows answered")
        done_before = answers(client, "all5s")[1]
        removed = time.time()
        shutil.rmtree(var / "spool" / "packets")
        wait_for(lambda: (var / "spool" / "packets" / str(PERIOD)).is_dir(), 60,
                 "the spool folder again")
        time.sleep(3 * PERIOD)
        wait_for(lambda: get("/readyz").status_code == 200, 240, "ready after the removal")
        stop_and_drain(feeder, client, "all5s")
        stop_daemon(proc)
    finally:
        feeder.stop.set()
        client.close()
        stop_daemon(proc)
        log.close()
    assert 500 not in codes and set(codes) <= {200, 503}, sorted(set(codes))
    no_server_errors(tmp_path / "daemon.log")
    # exact everywhere but the windows whose rows the removal took: those never exceed
    want, got = truth(tmp_path / "traffic.pcap"), answered(results)
    hit = range(int(done_before) // PERIOD, int(removed) // PERIOD + 2)
    for name in got:
        for t, rows in got[name].items():
            if t not in hit:
                assert rows == want[name].get(t, set()), (name, t)
    for t in hit:  # short, never over
        if t in got["all5s"] and t in want["all5s"]:
            [(n, b)], [(wn, wb)] = got["all5s"][t], want["all5s"][t]
            assert n <= wn and b <= wb, t
    assert set(want["all5s"]) - set(got["all5s"]) <= set(hit)  # nothing else lost
