"""When memory truly runs out, the one line says so and names the setting to raise (issue 41):
a Spark JVM that dies of an OutOfMemoryError, a Python worker that hits its memory limit, a
Python worker the kernel kills. Each failure is real, never an error text made up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from collector.config import data_file
from collector.spark.session import failure_reason
from tests.collector.test_cli import _one_error_line
from tests.conftest import ROOT, capture

pytestmark = pytest.mark.slow

# a JVM of 512 MiB asked for a string of 600 MB in a task (not a constant the optimizer would
# fold on the driver's thread): Spark's handler ends the JVM
OOM = r"""
import sys
from collector.spark.session import build_session, failure_reason, jvm_exit_code
spark = build_session("local[1]", "512m", 1, jvm_log=sys.argv[1])
try:
    spark.range(1).selectExpr("length(repeat('x', CAST(id + 600000000 AS INT)))").collect()
except Exception as e:
    reason = failure_reason(e, sys.argv[1])
    print(type(e).__name__, jvm_exit_code(), reason, sep="|")
"""


def test_a_jvm_that_dies_of_an_out_of_memory_error(tmp_path):
    log = tmp_path / "jvm.log"
    out = subprocess.run([sys.executable, "-c", OOM, str(log)], capture_output=True,
                         text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    error, code, reason = out.stdout.strip().splitlines()[-1].split("|")
    assert error == "ConnectionRefusedError"  # all that Py4J says
    assert code == "52"  # Spark's exit code for an OutOfMemoryError
    assert "OutOfMemoryError" in log.read_text()
    assert "ran out of memory" in reason and "spark.driver_memory" in reason
    assert "Connection refused" not in reason


def test_a_python_worker_killed_is_named(spark):
    """A Spark Python worker killed (SIGKILL, as the kernel's OOM killer kills) in a task."""
    def die(batches):
        os.kill(os.getpid(), signal.SIGKILL)
        yield from batches
    with pytest.raises(Exception) as e:  # noqa: B017 - whatever PySpark raises
        spark.range(10).mapInArrow(die, "id long").collect()
    reason = failure_reason(e.value)
    assert "Python worker was killed" in reason and "spark.executor.pyspark.memory" in reason


def test_replay_whose_python_workers_run_out_of_memory(tmp_path):
    """``replay`` whose answer tasks' Python workers are limited below what they need: one
    line naming the setting."""
    out = subprocess.run(
        [sys.executable, "-m", "api.cli", "replay", str(capture("ok.pcap")), "--queries",
         data_file("example.sql")], capture_output=True, text=True, cwd=ROOT, timeout=600,
        env={**os.environ, "FLOWSIEVE_SPARK__EXTRA": json.dumps(
            {"spark.executor.pyspark.memory": "64m"})})
    line = _one_error_line(out, "Spark failed: a Spark Python worker",
                           "spark.executor.pyspark.memory")
    assert "Connection refused" not in line
