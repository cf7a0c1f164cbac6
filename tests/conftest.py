"""Shared fixtures: test data locations, the strict-mode rule, one Spark session."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
SHARED = ROOT.parent / "shared" / "data"
STRICT = os.environ.get("FLOWSIEVE_STRICT") == "1"


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
