"""The fast lane (``make test-fast``: every test not marked slow) starts no JVM and no daemon: run
in a pytest of its own with ``JAVA_HOME`` pointing nowhere and a ``java`` that refuses to start
first on ``PATH``, it passes. A full run leaves the fast tests to this one (tests/lanes.py), so they
run once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tests.lanes import IN_LANE, without_java

pytestmark = pytest.mark.slow


def test_the_fast_lane_passes_without_java(tmp_path):
    env = {**without_java(dict(os.environ), tmp_path / "bin"), IN_LANE: "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not slow",
                           "-p", "no:cacheprovider", "--durations=5"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    tail = "\n".join(proc.stdout.splitlines()[-60:])
    print(tail)  # noqa: T201 (the lane's own summary, shown with -rA or on failure)
    assert proc.returncode == 0, f"the fast lane failed:\n{tail}\n{proc.stderr[-2000:]}"
    assert " passed" in proc.stdout.splitlines()[-1]
