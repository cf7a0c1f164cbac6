"""Shared fixtures: test data locations, the strict-mode rule, one Spark session."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
SHARED = ROOT.parent / "shared" / "data"
STRICT = os.environ.get("FLOWSIEVE_STRICT") == "1"

# CI draws the same examples on every run (a new failing example would fail an unrelated
# submission) and times none of them (a busy machine gives the same verdict); a developer's
# `make test` keeps exploring and prints a blob to reproduce a failure.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True,
                          deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") or STRICT else "dev")

# under FLOWSIEVE_STRICT=1 every skip, by whatever path, fails (tests/strict.py)
pytest_plugins = ["tests.strict"]


def need(condition: bool, reason: str) -> None:
    """Skip with a visible reason, except under FLOWSIEVE_STRICT=1 where nothing may skip."""
    if condition:
        return
    if STRICT:
        pytest.fail(f"FLOWSIEVE_STRICT=1 and {reason}")
    pytest.skip(reason)


def need_tool(name: str) -> str:
    path = shutil.which(name)
    need(path is not None, f"{name} is not installed (apt-get install -y {name})")
    return path


def capture(name: str) -> Path:
    """A capture from tests/data (permissive licences) or ../shared/data (GPL samples)."""
    local = DATA / "pcap" / name
    if local.exists():
        return local
    shared = SHARED / "pcap" / name
    need(shared.exists(), f"{shared} is absent (GPL sample, not copied into the repository)")
    return shared


def flow_data(rel: str) -> Path:
    """A NetFlow/IPFIX sample from tests/data/netflow or ../shared/data/netflow (AGPL/GPL)."""
    local = DATA / "netflow" / rel
    if local.exists():
        return local
    shared = SHARED / "netflow" / rel
    need(shared.exists(), f"{shared} is absent (AGPL/GPL sample, not copied into the "
         "repository)")
    return shared


def samples(kind: str, pattern: str, exclude: frozenset[str] | set[str] = frozenset()):
    """Parameters for every sample file of ``kind`` (pcap, netflow) in tests/data and in
    ../shared/data. When ../shared/data is absent its (GPL) samples are one visibly skipped
    parameter, never a silently shorter list (and under FLOWSIEVE_STRICT=1 a failure)."""
    names = {p.name for p in (DATA / kind).glob(pattern)}
    if (SHARED / kind).is_dir():
        names |= {p.name for p in (SHARED / kind).glob(pattern)}
        return sorted(names - set(exclude))
    missing = pytest.param(None, id="shared-absent", marks=pytest.mark.skip(
        reason=f"{SHARED / kind} is absent: its GPL/AGPL samples are not tested"))
    return [*sorted(names - set(exclude)), missing]


@pytest.fixture(scope="session")
def spark(tmp_path_factory):
    """The one in-process Spark session of the test run."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    need(shutil.which("java") is not None, "Java 17 is not installed")
    from collector.spark.job import build_session
    warehouse = tmp_path_factory.mktemp("spark-warehouse")
    session = build_session("local[2]", driver_memory="1g", shuffle_partitions=2,
                            extra={"spark.sql.warehouse.dir": str(warehouse)},
                            app_name="flowsieve-tests")
    yield session
    session.stop()
