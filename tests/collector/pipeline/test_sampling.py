"""The tuple sample the planner sizes aggregate-tree nodes from (collector/pipeline/sampling.py)."""

from __future__ import annotations

import numpy as np

from capture.pcap import open_capture
from capture.unpack import unpack
from collector.pipeline.sampling import TupleSampler
from tests.helpers import capture


def test_a_sample_drawn_among_rows_is_the_sample_of_those_rows_taken():
    """Drawn among the rows that passed (``among``), without taking them out of the batch
    first, the sample is the same: the same rows, times, key hashes, query bits and
    weights as when the batch's passed rows are taken and sampled, seed for seed."""
    tb = unpack(next(iter(open_capture(capture("ok.pcap")))), ["src_ip", "dst_port", "protocol"])
    rng = np.random.default_rng(7)
    Q = rng.integers(0, 4, (len(tb), 1)).astype(np.uint64)  # a quarter of the rows: no bit
    passed = np.flatnonzero(Q.any(axis=1))
    keys, slots = ["src_ip", "dst_port"], [0, 1]
    taken, among = TupleSampler(rows=64, probability=0.3), TupleSampler(rows=64,
                                                                         probability=0.3)
    taken.observe("packets", tb.take(passed), Q[passed], keys, slots)
    among.observe("packets", tb, Q, keys, slots, among=passed)
    a, b = taken.sample("packets"), among.sample("packets")
    assert 0 < len(a.time) < len(passed)
    assert a.time.tolist() == b.time.tolist()
    assert a.Q.tolist() == b.Q.tolist() and a.Q.any(axis=1).all()
    assert a.weight.tolist() == b.weight.tolist()
    assert {k: v.tolist() for k, v in a.hashes.items()} == \
        {k: v.tolist() for k, v in b.hashes.items()}
