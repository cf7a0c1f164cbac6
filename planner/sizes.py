"""Sizes of aggregate-tree nodes, ``sz(v)`` in seed 002: partial rows per period.

Measured sizes come from a sample of the tuples that passed the prefilter (the engine takes it,
collector/pipeline/sampling.py): for a node (keys, slots), the sampled tuples of its filter, per
window, go into an Apache DataSketches HLL keyed by (the node's fields, the query-bit pattern on its
slots) — the distinct partial rows the node would hold in the sample. A sample sees a fraction ``f``
of the tuples, and distinct counts do not scale by ``1/f``. ``distinct_estimate`` scales them by
Haas, Naughton, Seshadri and Stokes' hybrid (VLDB 1995): a chi-square test of how evenly
the sample's tuples fall on its groups picks, for low skew, the count ``D`` whose expected
distinct count in a sample of that size is the sample's (every group equally likely:
``D · (1 − (1 − 1/D)^n) = d``, solved by bisection), and for high skew Shlosser's estimator. On
Zipf-shaped traffic (a few heavy hosts, a long tail seen once) the first one is 3 to 10 times
low, which made a key with ip_len look a few thousand groups where a window holds 150,000 (and
the tree fold heavy hitters into it); Shlosser's is within 1.6 times (bench traces, 1/32
samples).

Without a sample, sizes are guessed from each field's typical cardinality, capped by the tuples
of the node's filter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import datasketches
import numpy as np

from capture.fields import IP, STRING, key_kind
from planner.aggtree import AggNode
from planner.slots import n_words, slot_mask

# typical distinct values per period where nothing was measured
CARDINALITY = {"protocol": 8, "ip_version": 2, "tcp_flags": 32, "dns_qr": 2, "dns_opcode": 4,
               "dns_rcode": 8, "icmp_type": 16, "icmp_code": 8, "more_fragments": 2,
               "dont_fragment": 2, "version": 3, "eth_type": 4, "iface": 4, "tos": 16,
               "ttl": 64, "dns_qdcount": 2, "dns_ancount": 8}
KIND_CARDINALITY = {IP: 20_000, STRING: 20_000}
DEFAULT_CARDINALITY = 2_000
DEFAULT_TUPLES = 1_000_000  # tuples per period assumed with no measurement
LG_K = 12  # HLL precision: about 1.6% relative error


def mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, vectorised."""
    x = x.astype(np.uint64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@dataclass
class TupleSample:
    """A uniform sample of one stream's tuples after the prefilter."""

    time: np.ndarray  # (n,) int64 epoch seconds
    hashes: dict[str, np.ndarray]  # field -> (n,) uint64 hash of its value (NULL included)
    Q: np.ndarray  # (n, words) uint64 query bits
    weight: np.ndarray  # (n,) float64: tuples each sampled one stands for (1 / probability)
    slots: frozenset[int] = frozenset()  # the query slots of the plan it was taken under

    def __len__(self) -> int:
        return len(self.time)


def distinct_in_population(d: float, n: float, N: float) -> float:
    """The number of equally likely groups whose expected distinct count in ``n`` draws is
    ``d``, at most ``N`` (the tuples sampled from)."""
    if d <= 0 or n <= 0:
        return 0.0
    N = max(N, d)
    if d >= n - 0.5:  # every draw distinct: the sample says nothing more
        return N

    def seen(D: float) -> float:
        return D * -np.expm1(n * np.log1p(-1.0 / D)) if D > 1 else 1.0
    lo, hi = d, N
    if seen(hi) <= d:
        return N
    for _ in range(60):
        mid = (lo + hi) / 2
        if seen(mid) < d:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def distinct_estimate(counts: np.ndarray, N: float, d: float | None = None) -> float:
    """Groups among ``N`` tuples from the tuple count of each group a uniform sample of them
    met (``d``: the sample's distinct count, if measured apart; default ``len(counts)``):
    Haas et al.'s hybrid of the equally-likely-groups estimate (``distinct_in_population``)
    for counts a chi-square test (97.5 %) finds even, and Shlosser's for skewed ones."""
    counts = np.asarray(counts, np.float64)
    n = float(counts.sum())
    d = float(len(counts)) if d is None else d
    if d <= 0 or n <= 0:
        return 0.0
    if len(counts) < 2 or n >= N:
        return max(min(d, N), 1.0)
    mean = n / len(counts)
    u = float(((counts - mean) ** 2).sum() / mean)
    k = len(counts) - 1  # Wilson-Hilferty: the chi-square quantile with k degrees of freedom
    if u <= k * (1 - 2 / (9 * k) + 1.959964 * np.sqrt(2 / (9 * k))) ** 3:
        return distinct_in_population(d, n, N)
    q = n / N
    f = np.bincount(counts.astype(np.int64))
    i = np.arange(len(f), dtype=np.float64)
    num = float(((1 - q) ** i * f).sum())
    den = float((i * q * (1 - q) ** (i - 1) * f).sum())
    return float(min(N, d + f[1] * num / den)) if den > 0 else N


def string_key(stream: str, key: str) -> bool:
    """Whether node key ``key`` (``~f``: the field a sketch counts) is a string field, on
    which the LFTA keeps no table."""
    try:
        return key_kind(stream, key.removeprefix("~")) == STRING
    except KeyError:  # not a catalogue field (a model's attribute)
        return False


@dataclass
class NodeSizes:
    """``sz`` of one (stream, period) folder's nodes: from a sample, or guessed."""

    stream: str
    period: int
    sample: TupleSample | None = None
    selectivity: dict[int, float] = field(default_factory=dict)  # slot -> share of tuples
    _cache: dict[AggNode, float] = field(default_factory=dict)
    # tuples per period, of the stream (key None) and reaching a filter (its slots): the tree
    # search asks for them on every edge it weighs, thousands of times per plan
    _tuples: dict[frozenset[int] | None, float] = field(default_factory=dict)

    def tuples(self) -> float:
        """Tuples per period (the root's size)."""
        got = self._tuples.get(None)
        if got is None:
            s = self.sample
            if s is None or not len(s):
                got = float(DEFAULT_TUPLES)
            else:
                windows = s.time // self.period
                per = np.bincount(windows - windows.min(), weights=s.weight)
                got = float(per[per > 0].mean())
            self._tuples[None] = got
        return got

    def tuples_of(self, v: AggNode) -> float:
        """Tuples per period that reach node v: those of its filter (its queries' slots)."""
        got = self._tuples.get(v.slots)
        if got is None:
            got = self._tuples[v.slots] = self._tuples_of(v.slots)
        return got

    def _tuples_of(self, slots: frozenset[int]) -> float:
        s = self.sample
        if s is None or not len(s) or not slots <= s.slots:
            share = sum(self.selectivity.get(x, 1.0) for x in slots) if slots else 1.0
            return self.tuples() * min(1.0, share)
        rows = self._q(slots).any(axis=1)
        if not rows.any():
            return 0.0
        windows = s.time // self.period
        per = np.bincount(windows - windows.min(), weights=s.weight * rows)
        seen = np.bincount(windows - windows.min(), weights=s.weight)
        return float(per[seen > 0].mean())

    def __call__(self, v: AggNode) -> float:
        if v.root:
            return self.tuples()
        got = self._cache.get(v)
        if got is None:
            got = self._measure(v) if self._sampled(v) else self._guess(v)
            if any(string_key(self.stream, k) for k in v.keys):
                # the LFTA keeps no table on a string key (collector/pipeline/lfta.py NodeTable):
                # every tuple of such a node is a row of its own
                got = max(got, self.tuples_of(v))
            self._cache[v] = got
        return got

    def _sampled(self, v: AggNode) -> bool:
        """Whether the sample can size v: it has v's fields (a query registered since the
        sample was taken may group by others)."""
        s = self.sample
        return (s is not None and len(s) > 0 and all(k in s.hashes for k in v.keys)
                and v.slots <= s.slots)

    def _q(self, slots) -> np.ndarray:
        """The sample's query bits restricted to ``slots`` (a slot beyond the sample's words
        matches nothing)."""
        Q = self.sample.Q
        mask = slot_mask(slots, max(Q.shape[1], n_words(max(slots, default=0) + 1)))
        return Q & mask[:Q.shape[1]]

    def _guess(self, v: AggNode) -> float:
        groups = 1.0
        for k in v.keys:
            groups *= CARDINALITY.get(k, KIND_CARDINALITY.get(key_kind(self.stream, k),
                                                              DEFAULT_CARDINALITY))
        return max(1.0, min(groups * (1 + len(v.slots) / 8), self.tuples_of(v)))

    def _measure(self, v: AggNode) -> float:
        s = self.sample
        q = self._q(v.slots)
        rows = np.flatnonzero(q.any(axis=1))
        if not len(rows):
            return 1.0
        h = np.full(len(rows), 0x9E3779B97F4A7C15, np.uint64)
        for k in sorted(v.keys):
            h = mix(h ^ s.hashes[k][rows])
        for w in range(q.shape[1]):
            h = mix(h ^ q[rows, w])
        windows = s.time[rows] // self.period
        weight = s.weight[rows]
        sizes = []
        for w in np.unique(windows):
            inw = windows == w
            groups, counts = np.unique(h[inw], return_counts=True)
            sketch = datasketches.hll_sketch(LG_K)
            for x in groups.view(np.int64).tolist():
                sketch.update(x)
            sizes.append(distinct_estimate(counts, float(weight[inw].sum()),
                                           sketch.get_estimate()))
        return max(1.0, float(np.mean(sizes)))
