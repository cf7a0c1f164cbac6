"""Spark's Python worker daemon for flowsieve's answer tasks (``spark.python.daemon.module``):
pyspark's own daemon, which forks a worker per task, started after importing what those tasks
run and loading their numba kernels from numba's cache. Every worker it forks has them already:
a fresh worker spent about 1.5 s importing them (numba, the LFTA's kernels, pydantic's
configuration) and loading the kernels before its first batch, in every task of a short job."""

from __future__ import annotations


def preload() -> None:
    """Import the answer tasks' modules and run their numba kernels once on tiny inputs."""
    import numpy as np
    import pyarrow as pa

    from collector.spark import answers, derive  # noqa: F401 - imported for the workers
    from collector.spark.grouping import group_ids, key_words, reduce_column
    gid, first = group_ids(key_words([np.zeros(2, np.int64)], 2))
    reduce_column(pa.array([1, 2], pa.int64()), gid, len(first), "sum")


if __name__ == "__main__":
    import contextlib

    with contextlib.suppress(Exception):  # a worker then imports what it needs itself
        preload()
    from pyspark.daemon import manager
    manager()
