"""The crash points themselves (collector/crashpoints.py): a point named in
``FLOWSIEVE_CRASH`` kills the process at its n-th hit, counted across processes in
``FLOWSIEVE_CRASH_DIR``; the Spark JVM's steps are recognised by the names Spark 4 gives its
checkpoint files (as an inotify trace of a real run showed them); a bad setting is one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from collector import crashpoints
from tests.helpers import ROOT
from tests.processes import cli, one_error_line, wait_until

HIT = "from collector.crashpoints import reached; reached('spool.write'); print('alive')"


def test_the_nth_hit_across_processes_kills_that_process(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLOWSIEVE_CRASH": "spool.write:3",
           "FLOWSIEVE_CRASH_DIR": str(tmp_path)}
    codes = [subprocess.run([sys.executable, "-c", HIT], env=env, capture_output=True,
                            text=True, timeout=60).returncode for _ in range(4)]
    assert codes == [0, 0, -9, 0]  # the third process to reach it died there, by SIGKILL
    assert (tmp_path / "spool.write.hits").stat().st_size == 4


def test_other_points_and_no_setting_do_nothing(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLOWSIEVE_CRASH": "spool.rename:1"}
    out = subprocess.run([sys.executable, "-c", HIT], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout == "alive\n"
    env.pop("FLOWSIEVE_CRASH")
    assert subprocess.run([sys.executable, "-c", HIT], env=env, timeout=60).returncode == 0


@pytest.mark.parametrize("value", ["spool.write", "spool.write:0", "nowhere:1", "spool.write:1:x"])
def test_a_bad_setting_is_refused(value):
    with pytest.raises(ValueError, match="FLOWSIEVE_CRASH"):
        crashpoints.configure(value)
    crashpoints.configure("")


def test_run_refuses_a_bad_setting_in_one_line(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"var_dir: {tmp_path / 'var'}\napi: {{host: 127.0.0.1, port: 0}}\n")
    out = cli("run", "--config", str(cfg), env={**os.environ, "FLOWSIEVE_CRASH": "nowhere:1"})
    one_error_line(out, "FLOWSIEVE_CRASH='nowhere:1'", "spool.write")


# the files a Spark 4.3 streaming query writes in its checkpoint (an inotify trace of a run)
SPARK_FILES = {
    ("offsets", ".0.11e3be5a-bd24-451c-ba1a-94163480afd7.tmp"): "spark.offsets",
    ("sources/0", ".1.687dc674-c25d-411d-a02c-46b6cb38b915.tmp"): "spark.sources",
    ("commits", ".0.0dabc3ec-7214-40e9-9d8f-cfb49565cb4d.tmp"): "spark.commits",
    ("state/0/1", ".1.changelog.8ffae01d-ebca-4230-9391-cb5cebf2ed1b.TID2.tmp"): "spark.state",
    ("state/1/0", ".2.changelog.4af4efb5-9fcf-4af2-b487-f2a877c919a8.TID9.tmp"): "spark.state",
    ("state/0/0/_metadata", ".schema.f6f1dc2c-6952-4dbe-8137-659e61579838.tmp"): None,
    ("state/0/_metadata", ".metadata.e25f5c13-6601-4fc6-862f-bc520723d5a7.tmp"): None,
    ("", ".metadata.a6dab962-f58c-4ca1-8173-ae86d50a31b6.tmp"): None,
    ("offsets", "0"): None,  # the entry renamed into place
    ("commits", "..0.0dabc3ec-7214-40e9-9d8f-cfb49565cb4d.tmp.crc"): None,
}


def test_the_jvm_steps_are_known_by_their_files():
    from pathlib import Path
    for (folder, name), point in SPARK_FILES.items():
        got = [p for p in crashpoints.JVM_POINTS
               if crashpoints._jvm_step(p, Path(folder), name)]
        assert got == ([point] if point else []), (folder, name, got)


def test_the_checkpoint_watch_reaches_the_nth_file(tmp_path, monkeypatch):
    """Folders made after the watch started, and a file made in a folder before the watch
    reached it (Spark makes a partition's state folder and its file at once), all count."""
    hits = []
    monkeypatch.setattr(crashpoints, "crash", lambda jvm_only, point: hits.append(point))
    monkeypatch.delenv("FLOWSIEVE_CRASH_DIR", raising=False)
    crashpoints.configure("spark.state:3")
    try:
        root = tmp_path / "checkpoints"
        # what an earlier process left (a crash's temporary file) is no step of this one
        (root / "packets" / "5" / "state" / "0" / "0").mkdir(parents=True)
        (root / "packets" / "5" / "state" / "0" / "0" / ".9.changelog.z.TID9.tmp").touch()
        crashpoints.watch_checkpoints(root)
        part = root / "packets" / "10" / "state" / "0" / "0"
        part.mkdir(parents=True)
        (part / ".1.changelog.a.TID1.tmp").touch()
        (part.parent / "_metadata").mkdir()
        (part.parent / "_metadata" / ".schema.b.tmp").touch()  # not a step
        other = root / "packets" / "10" / "state" / "0" / "1"
        other.mkdir()
        (other / ".1.changelog.c.TID2.tmp").touch()
        wait_until(lambda: crashpoints._hits >= 2, "two state files seen")
        assert not hits
        (part / ".2.changelog.d.TID3.tmp").touch()
        wait_until(lambda: hits, "the third")
        assert hits == ["spark.state"] and crashpoints._hits == 3
    finally:
        crashpoints.configure("")
