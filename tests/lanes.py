"""The fast lane holds by construction: a test that starts a JVM or a daemon is ``slow``
whether or not its author said so, and a test left in the fast lane cannot start one.

- At collection, a test is marked slow when its fixtures include ``spark`` or ``big_window``,
  or when its code (nested functions included) calls a launcher: ``api.replay.replay``, or a
  helper of ``tests/processes.py`` that starts ``flowsieve run``/``replay`` or the daemon.
- While a fast test runs, ``JAVA_HOME`` points nowhere and the ``java`` first on ``PATH``
  refuses to start, naming the rule: a JVM it starts anyway fails the test.
- The whole suite in one process runs the fast lane once, as the slow test
  ``tests/test_lanes.py``, in a pytest of its own with the same rule (so a run of everything
  proves it), and keeps the fast tests out of its own session: they are not run twice. That
  pytest starts as soon as the session is collected and runs beside the slow tests (which
  mostly wait: for a JVM, a window to close), and the lane test waits for its verdict. On
  xdist's workers (``make test``) the fast tests run in the session itself, each under the
  rule, between and after the long slow files; the lane test is left out.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest

SPARK_FIXTURES = {"spark", "big_window"}
NOWHERE = "/nonexistent/java-home"
LANE_TEST = "tests/test_lanes.py"
IN_LANE = "FLOWSIEVE_FAST_LANE"  # set in the fast lane's own pytest


def _launchers() -> set:
    from api.replay import replay
    from tests import processes
    return {replay, processes.cli_spark, processes.start_daemon}


def _names(code: types.CodeType):
    yield from code.co_names
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _names(c)


def starts_jvm(item, launchers: set) -> bool:
    if SPARK_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    fn = getattr(item, "function", None)
    if fn is None:
        return False
    space = fn.__globals__
    return any(space.get(n) in launchers for n in _names(fn.__code__)
               if isinstance(space.get(n), types.FunctionType))


def pytest_collection_modifyitems(config, items):
    launchers = _launchers()
    for item in items:
        if starts_jvm(item, launchers) and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
    # a run that includes the lane test leaves the fast tests to it; on xdist's workers the
    # fast tests run in the session instead, under the same rule (they fill the workers' gaps
    # between the long slow files), and the lane test, which would only repeat them, does not
    selected = {i.nodeid.split("::")[0] for i in items}
    if LANE_TEST in selected and not os.environ.get(IN_LANE) and \
            config.getoption("markexpr") in WHOLE_RUN:
        if hasattr(config, "workerinput"):
            keep = [i for i in items if i.nodeid.split("::")[0] != LANE_TEST]
        else:  # one process: the lane runs beside it, in a pytest of its own
            keep = [i for i in items if i.get_closest_marker("slow")]
            config.stash[FAST_LANE] = start_fast_lane(Path(config.rootpath))
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep
    # the longest files first: xdist hands the workers files in this order, and a long one
    # given last would run on alone
    rank = {name: i for i, name in enumerate(LONGEST)}
    items.sort(key=lambda i: rank.get(i.nodeid.split("::")[0], len(rank)))


# the mark expressions of a run of every test but those a lane of their own runs: no
# expression, or make test's (the long lane is make test-long's)
WHOLE_RUN = ("", "not long")
# the slow files that take longest (make test's --durations), longest first; the long lane's
# hot swap (5 min) before its cluster and crash chains: given last, it ran on alone for 100 s
LONGEST = ("tests/test_hot_swap.py",
           "tests/test_kill.py", "tests/test_prepare.py", "tests/test_disk_full.py",
           "tests/test_dependencies.py", "tests/test_cluster.py", "tests/test_alerts_daemon.py",
           "tests/collector/spark/test_answer_path.py", "tests/test_lanes.py",
           "tests/test_long_run.py", "tests/test_sflow_daemon.py")


FAST_LANE = pytest.StashKey()


def start_fast_lane(root: Path) -> tuple[subprocess.Popen, Path]:
    """The fast lane in a pytest of its own, without Java, its output in a file."""
    folder = Path(tempfile.mkdtemp(prefix="flowsieve-fast-lane-"))
    env = {**without_java(dict(os.environ), folder / "bin"), IN_LANE: "1"}
    out = folder / "lane.log"
    with open(out, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-m", "not slow",
                                 "-p", "no:cacheprovider", "--durations=5"], cwd=root, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
    return proc, out


REFUSAL = ("#!/bin/sh\necho 'a test of the fast lane started a JVM: mark it slow "
           "(tests/lanes.py)' >&2\nexit 1\n")


def without_java(env: dict, stub_dir: Path) -> dict:
    """``env`` with ``JAVA_HOME`` pointing nowhere and a refusing ``java`` first on PATH."""
    stub = stub_dir / "java"
    if not stub.exists():
        stub_dir.mkdir(parents=True, exist_ok=True)
        stub.write_text(REFUSAL)
        stub.chmod(0o755)
    return {**env, "JAVA_HOME": NOWHERE,
            "PATH": os.pathsep.join([str(stub_dir), env.get("PATH", "")])}


@pytest.fixture(scope="session")
def _java_stub(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("no-java")


@pytest.fixture(autouse=True)
def _no_jvm_in_the_fast_lane(request, monkeypatch):
    if request.node.get_closest_marker("slow"):
        return
    env = without_java(dict(os.environ), request.getfixturevalue("_java_stub"))
    monkeypatch.setenv("JAVA_HOME", env["JAVA_HOME"])
    monkeypatch.setenv("PATH", env["PATH"])
