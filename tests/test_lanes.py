"""The fast lane (``make test-fast``: every test not marked slow) starts no JVM and no daemon: run
in a pytest of its own with ``JAVA_HOME`` pointing nowhere and a ``java`` that refuses to start
first on ``PATH``, it passes. A full run leaves the fast tests to this one (tests/lanes.py), so they
run once, beside the slow ones."""

from __future__ import annotations

import pytest

from tests.helpers import ROOT
from tests.lanes import FAST_LANE, start_fast_lane

pytestmark = pytest.mark.slow


def test_the_fast_lane_passes_without_java(request):
    """Its pytest started at collection beside the slow tests (tests/lanes.py), or here when
    this test runs alone."""
    proc, out = request.config.stash.get(FAST_LANE, None) or start_fast_lane(ROOT)
    try:
        proc.wait(timeout=1200)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = out.read_text(errors="replace").splitlines()
    tail = "\n".join(lines[-60:])
    print(tail)  # noqa: T201 (the lane's own summary, shown with -rA or on failure)
    assert proc.returncode == 0, f"the fast lane failed:\n{tail}"
    assert lines and " passed" in lines[-1]
