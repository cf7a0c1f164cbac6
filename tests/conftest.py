"""Shared fixtures: test data locations, the strict-mode rule, one Spark session."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests.helpers import BIG_WINDOW, STRICT, many_groups, need
from tests.processes import TEST_JVM

# CI draws the same examples on every run (a new failing example would fail an unrelated
# submission) and times none of them (a busy machine gives the same verdict); a developer's
# `make test` keeps exploring and prints a blob to reproduce a failure.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True,
                          deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") or STRICT else "dev")

# under FLOWSIEVE_STRICT=1 every skip, by whatever path, fails (tests/strict.py);
# a test that starts a JVM or a daemon is slow by construction (tests/lanes.py)
pytest_plugins = ["tests.strict", "tests.lanes"]

# tests/install/ makes fresh environments from a clean clone (minutes each): CI's install lane
# (`make test-install`, run by .ci/run after make test), never a part of make test
collect_ignore = [] if os.environ.get("FLOWSIEVE_INSTALL_LANE") else ["install"]


@pytest.fixture(scope="session")
def spark(tmp_path_factory):
    """The one in-process Spark session of the test run."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    need(shutil.which("java") is not None, "Java 17 is not installed")
    from collector.spark.session import build_session
    warehouse = tmp_path_factory.mktemp("spark-warehouse")
    session = build_session("local[2]", driver_memory="1g", shuffle_partitions=2,
                            extra={"spark.sql.warehouse.dir": str(warehouse),
                                   # a user's JVM option (test_merge's), and the test JVM's
                                   # C1 alone (tests/processes.py; 99 against 139 CPU s of
                                   # test_watermark.py and test_merge.py)
                                   "spark.driver.extraJavaOptions":
                                       f"-Dflowsieve.test=1 {TEST_JVM}"},
                            app_name="flowsieve-tests")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def big_window(tmp_path_factory) -> Path:
    """A capture whose one minute holds 4 million groups of (source, destination, source
    port): every packet its own."""
    path = tmp_path_factory.mktemp("big-window") / "groups.pcap"
    many_groups(path, BIG_WINDOW)
    return path


