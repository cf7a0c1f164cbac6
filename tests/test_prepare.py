"""``compile_kernels`` (api/prepare.py) compiles every kernel the product reaches, with every
signature: in a fresh numba cache (``NUMBA_CACHE_DIR``) it compiles them all, a second call
loads them all, and then realistic workloads in fresh processes (tests/kernel_workloads.py:
``decode`` of every stream of the test captures, ``replay``'s engines with broad query sets and
their answer tasks, the daemon's sources and engines) add no overload to the cache's indexes:
they compile nothing. No JVM starts.

The one signature that depends on the queries by design, the LFTA's merge kernel of a key
layout (``lfta_kernels.specialize``: its key fields and words compiled in as tuple lengths,
compiled on first use in the background while the generic kernel merges), is compiled for the
default queries' layout only; the workloads merge with the generic kernel."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

# a minute of compiling by design (no JVM): slow, beside the daemon tests
pytestmark = pytest.mark.slow

# a key layout's own merge kernel (its tuples' lengths are the layout)
LAYOUT_KERNELS = {"lfta_kernels._merge_tuples_of", "lfta_kernels._merge_tuples"}


def cached(cache: Path) -> set[tuple[str, str]]:
    """(kernel, signature) of every overload numba's cache indexes (``*.nbi``: the numba
    version pickled, then the source stamp and a dict keyed by (signature, target, hashes))."""
    out = set()
    for index in cache.rglob("*.nbi"):
        with open(index, "rb") as f:
            pickle.load(f)  # numba's version
            _, overloads = pickle.loads(f.read())
        kernel = index.name.split("-")[0]
        out |= {(kernel, str(key[0])) for key in overloads}
    return out


def layout_kernel(overload: tuple[str, str]) -> bool:
    kernel, sig = overload
    return kernel in LAYOUT_KERNELS and "UniTuple" in sig


def run(cache: Path, *args: str, timeout: float = 600) -> str:
    """A fresh Python process with numba's cache at ``cache``; its standard output."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


COMPILE = ("-c", "import json\nfrom api.prepare import compile_kernels\n"
                 "print(json.dumps(compile_kernels()))")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """A numba cache filled by ``compile_kernels`` in a fresh process (its summary beside)."""
    cache = tmp_path_factory.mktemp("numba-cache")
    summary = json.loads(run(cache, *COMPILE).splitlines()[-1])
    (cache.parent / f"{cache.name}-summary.json").write_text(json.dumps(summary))
    return cache


def summary_of(cache: Path) -> dict:
    return json.loads((cache.parent / f"{cache.name}-summary.json").read_text())


def test_a_fresh_cache_is_filled_and_a_second_call_loads_it(prepared):
    """The summary of a cold call: every overload compiled, one per cached signature, none
    loaded; a second call in a fresh process compiles nothing (the cache unchanged) and loads
    every kernel it runs."""
    cold = summary_of(prepared)
    assert cold["compiled"] == cold["overloads"] and cold["loaded"] == 0
    assert 30 <= cold["kernels"] <= cold["overloads"]
    have = cached(prepared)
    assert len(have) == cold["overloads"], "an overload compiled was not cached"
    kernels = {k for k, _ in have}
    for kernel in ("pcap.index_records", "pcapng.index_blocks", "unpack.unpack_packets",
                   "live.copy_block", "kernel.decode_kernel", "kernel.decode_sflow",
                   "mmdb.walk", "lpm.lookup_values_pair", "prefilter.prefilter_kernel",
                   "asc_runtime.asc_kernel", "lfta_kernels.merge_dense", "slots.slot_counts",
                   "grouping.group_ids", "grouping.group_reduce"):
        assert kernel in kernels, kernel
    assert any(layout_kernel(o) for o in have), "the default queries' key layout"
    assert cold["seconds"] > 0 and sum(cold["steps"].values()) <= cold["seconds"]
    warm = json.loads(run(prepared, *COMPILE).splitlines()[-1])
    assert warm["compiled"] == 0 and warm["loaded"] == warm["overloads"] > 20
    assert cached(prepared) == have


@pytest.mark.parametrize("workload", ["decode", "engines"])
def test_a_workload_compiles_nothing_new(prepared, workload, tmp_path):
    """A workload in a fresh process adds no overload to the cache: what it compiled is a
    gap of ``compile_kernels``."""
    before = cached(prepared)
    run(prepared, "-m", "tests.kernel_workloads", workload, str(tmp_path))
    new = cached(prepared) - before
    assert not new, f"compile_kernels misses {sorted(new)}"
