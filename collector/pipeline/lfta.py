"""LFTA partial aggregation (Gigascope's low-level aggregation, prefilter paper §3.1): tuples are
merged into small hash tables before anything reaches the spool, so Spark (the HFTA) sees one
partial row per (window, group, query-bit pattern) and flush instead of one row per tuple.

A ``PartialTable`` is one numba open-addressing hash table (linear probing, power-of-two
capacity) keyed by a row of int64 key words: the window start, the node's group-key columns (an
address takes three words: validity and two 64-bit halves) and the query-bit pattern. It holds
``cnt`` and per measure ``sum``, ``min`` and ``max``. Tuples and partial rows go through the same
merge, so a partial is always mergeable with another (as the HFTA merges the partials of several
capture daemons). The table is flushed:

- ``full``: at ``max_load`` of its capacity (the caller gets what was flushed and goes on);
- ``window``: when the watermark closes windows (only the closed windows' rows leave);
- ``age``: when its oldest row is older than ``max_age_s`` (rows never wait forever);
- ``shutdown``: at the end of input.

When OM switches a node to another plan (planner/charts.py), the old table retires: it takes no
more tuples and leaves as its windows close, so a switch sends no row early.

Nothing accepted is lost or counted twice: the rows flushed over a table's life, merged, equal
the aggregate of every tuple added (tests check this against a Python dictionary aggregator).

The hash tables' kernels are in ``lfta_kernels.py``; this module holds the tables and the nodes
that own them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from capture.batch import address_words
from capture.fields import IP, SKETCH, STRING, fields, measures
from collector.config import LftaConfig
from collector.keys import KeyLayout
from collector.pipeline.lfta_kernels import (
    DENSE_MAX_BYTES,
    DENSE_MAX_SLOTS,
    I64_MAX,
    I64_MIN,
    merge_dense,
    merge_rows,
    merge_tuples,
)
from collector.pipeline.spool import TS_US, aggregate_schema
from planner.charts import Chart, LftaPlan, Scheduler, fit_groups
from planner.sizes import mix
from planner.slots import slot_mask

log = logging.getLogger("flowsieve.lfta")

FLUSH_REASONS = ("full", "window", "age", "shutdown")


class BatchColumns:
    """A batch's key and measure columns as ``merge_tuples`` reads them, made once per batch
    for every node that reads them: integer fields as rows of int64, addresses as (validity,
    high half, low half) int64 words (zero when the packet has no such address), the window
    clock in seconds. The engine has ``need`` make the rows of every node of the batch in one
    go (a node asking for one more adds it)."""

    def __init__(self, tb):
        self.tb = tb
        self.time = tb.time
        self._ints: dict[str, int] = {}
        self._ips: dict[str, int] = {}
        self.ints = np.zeros((0, len(tb)), np.int64)
        self.ips = np.zeros((0, len(tb), 3), np.int64)

    def need(self, ints, ips) -> None:
        """Make the rows of integer fields ``ints`` and address fields ``ips`` not made yet."""
        tb, n = self.tb, len(self.tb)
        new = [f for f in dict.fromkeys(ints) if f not in self._ints]
        if new:
            add = np.empty((len(new), n), np.int64)
            for r, f in enumerate(new):
                add[r] = tb.column(f)
                self._ints[f] = len(self._ints)
            self.ints = np.concatenate([self.ints, add]) if len(self.ints) else add
        new = [f for f in dict.fromkeys(ips) if f not in self._ips]
        if new:
            add = np.empty((len(new), n, 3), np.int64)
            for r, f in enumerate(new):
                address_words(np.ascontiguousarray(tb.column(f)), tb.ip_valid(f), add[r])
                self._ips[f] = len(self._ips)
            self.ips = np.concatenate([self.ips, add]) if len(self.ips) else add

    def rows(self, names, kinds) -> np.ndarray:
        """Where each key field's row is (in ``ints`` or ``ips`` by its kind)."""
        return np.array([self._ips[f] if kind == IP else self._ints[f]
                         for f, kind in zip(names, kinds, strict=True)], np.int64)

    def index(self, f: str) -> int:
        return self._ints[f]


def measure_arrays(meas: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tuples' measures as the sums, mins and maxs of partials of one (``_put``'s rule for
    a NULL measure: 0 in the sum, ``I64_MAX`` as the min, -1 as the max); only a measure
    column holding NULLs is copied."""
    sums, mins = meas, meas  # (tuples, measures)
    for m in np.flatnonzero((meas < 0).any(axis=0)):
        if sums is meas:
            sums, mins = meas.copy(), meas.copy()
        null = meas[:, m] < 0
        sums[null, m], mins[null, m] = 0, I64_MAX
    return sums, mins, meas


def sketch_rows(p: Partials, strings: pa.Array | None, table: KeyLayout, spool: KeyLayout,
                lg_k: int) -> tuple[Partials, pa.Array | None, pa.Array]:
    """Rows keyed on the table's layout (one per value of the sketched field) merged into rows
    of the spool's layout, each with a HyperLogLog sketch (Apache DataSketches, HLL_8,
    ``lg_k``) of the values it merged: a value's sketch update is its integer, its address's
    64-bit hash, or its string; NULL is not counted."""
    import datasketches as ds

    field = spool.sketch[len(SKETCH):]
    at = table.offsets()
    words = p.keys[:, 1:]
    q = words[:, table.field_words:]
    parts = [p.keys[:, :1]]
    for name in spool.keys:
        c, w = at[name]
        parts.append(words[:, c:c + w])
    if spool.string is not None:  # a string key beside the sketch: grouped by its value
        parts.append(pc.dictionary_encode(pc.fill_null(strings, "\x00null")).indices
                     .to_numpy(zero_copy_only=False).astype(np.int64).reshape(-1, 1))
    parts.append(q)
    group = np.concatenate(parts, axis=1)
    uniq, first, inv = np.unique(group, axis=0, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    g = len(uniq)
    cnt = np.zeros(g, np.int64)
    np.add.at(cnt, inv, p.cnt)
    sums = np.zeros((g, p.sums.shape[1]), np.int64)
    np.add.at(sums, inv, p.sums)
    mins = np.full((g, p.sums.shape[1]), I64_MAX, np.int64)
    np.minimum.at(mins, inv, p.mins)
    maxs = np.full((g, p.sums.shape[1]), I64_MIN, np.int64)
    np.maximum.at(maxs, inv, p.maxs)
    c, w = at[field]
    kind = table.kinds[table.keys.index(field)]
    if kind == IP:
        valid = words[:, c] != 0
        vals = mix(mix(words[:, c + 1].view(np.uint64)) ^
                   words[:, c + 2].view(np.uint64)).view(np.int64)
    elif kind == STRING:
        s = strings  # the table's string key is the sketched field
        valid = s.is_valid().to_numpy(zero_copy_only=False)
        vals = np.array(s.to_pylist(), dtype=object)
    else:
        valid = words[:, c] >= 0
        vals = words[:, c]
    order = np.argsort(inv, kind="stable")
    order = order[valid[order]]
    bounds = np.searchsorted(inv[order], np.arange(g + 1))
    values = vals[order].tolist()
    blobs = []
    for k in range(g):
        sk = ds.hll_sketch(lg_k, ds.tgt_hll_type.HLL_8)
        for v in values[bounds[k]:bounds[k + 1]]:
            sk.update(v)
        blobs.append(sk.serialize_compact())
    keys = np.concatenate([uniq[:, :1 + spool.field_words], uniq[:, -q.shape[1]:]], axis=1) \
        if q.shape[1] else uniq[:, :1 + spool.field_words]
    out_strings = strings.take(pa.array(first)) if spool.string is not None else None
    return Partials(keys, cnt, sums, mins, maxs), out_strings, pa.array(blobs, pa.binary())


@dataclass
class Partials:
    """Partial aggregate rows: key words, count, and per measure sum, min and max."""

    keys: np.ndarray  # (n, key words) int64; column 0 is the window start
    cnt: np.ndarray  # (n,) int64
    sums: np.ndarray  # (n, measures) int64
    mins: np.ndarray
    maxs: np.ndarray

    def __len__(self) -> int:
        return len(self.cnt)

    @classmethod
    def of_tuples(cls, keys: np.ndarray, meas: np.ndarray) -> Partials:
        """Each tuple as a partial of one (cnt 1, sum = min = max = the measure)."""
        return cls(keys, np.ones(len(keys), np.int64), *measure_arrays(meas))

    @classmethod
    def empty(cls, key_words: int, n_measures: int) -> Partials:
        z = np.zeros((0, n_measures), np.int64)
        return cls(np.zeros((0, key_words), np.int64), np.zeros(0, np.int64), z, z, z)

    def take(self, idx: np.ndarray) -> Partials:
        return Partials(self.keys[idx], self.cnt[idx], self.sums[idx], self.mins[idx],
                        self.maxs[idx])


@dataclass
class LftaStats:
    """Counters of one table (the collector exports them as metrics)."""

    rows_in: int = 0  # tuples or partial rows merged in
    rows_out: int = 0  # partial rows flushed
    flushes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FLUSH_REASONS, 0))
    evicted: int = 0  # rows flushed because the table was full

    def copy(self) -> LftaStats:
        return LftaStats(self.rows_in, self.rows_out, dict(self.flushes), self.evicted)


class DenseFront:
    """The directly indexed array in front of a node's hash tables (``merge_dense``), for a node
    keyed only on small integer codes (the catalogue's ``values``) with a few slots: a row per
    (key values, query-bit pattern) of one window. It is scratch memory of one batch's merge
    (the hash table holds every row between batches), allocated on first use, at most
    ``DENSE_MAX_BYTES``; the rows it touched are emptied after each merge."""

    def __init__(self, radix: list[int], mask: np.ndarray, n_measures: int):
        self.radix = np.array(radix, np.int64)
        bits = [(w, b) for w in range(len(mask)) for b in range(64)
                if int(mask[w]) >> b & 1]
        self.pat_w = np.array([w for w, _ in bits], np.int64)
        self.pat_b = np.array([b for _, b in bits], np.int64)
        self.size = int(np.prod(radix, dtype=np.int64)) << len(bits)
        self.n_measures = n_measures
        self._arrays: tuple[np.ndarray, ...] | None = None

    @classmethod
    def for_node(cls, stream: str, keys, mask: np.ndarray, n_measures: int
                 ) -> DenseFront | None:
        """The front of a node keyed on ``keys`` with slot ``mask``, or None when a key is not
        a small code or the array would pass ``DENSE_MAX_BYTES``."""
        cat = fields(stream)
        radix = [cat[k].values if k in cat else 0 for k in keys]
        if not all(radix) or sum(int(w).bit_count() for w in mask) > DENSE_MAX_SLOTS:
            return None
        front = cls(radix, mask, n_measures)
        return front if front.size * 8 * (2 + 3 * n_measures) <= DENSE_MAX_BYTES else None

    def arrays(self) -> tuple[np.ndarray, ...]:
        """(radix, pattern words, pattern bits, counts, sums, mins, maxs, touched rows)."""
        if self._arrays is None:
            n, m = self.size, self.n_measures
            self._arrays = (np.zeros(n, np.int64), np.empty((n, m), np.int64),
                            np.empty((n, m), np.int64), np.empty((n, m), np.int64),
                            np.empty(n, np.int64))
        return (self.radix, self.pat_w, self.pat_b, *self._arrays)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._arrays or ())


class PartialTable:
    """One LFTA hash table (see the module docstring). ``capacity`` is rounded up to a power of
    two; memory is about ``capacity × 8 × (key words + 1 + 3 × measures)`` bytes."""

    def __init__(self, key_words: int, n_measures: int, capacity: int = 1 << 16,
                 max_load: float = 0.5, max_age_s: float = 60.0):
        if key_words < 1:
            raise ValueError("an LFTA key has at least the window start")
        if not 0 < max_load <= 0.9:
            raise ValueError("max_load is in (0, 0.9]: open addressing needs free slots")
        cap = 1 << max(4, int(capacity - 1).bit_length())
        self.key_words, self.n_measures = key_words, n_measures
        self.capacity, self.limit = cap, max(1, int(cap * max_load))
        self.max_age_ns = int(max_age_s * 1e9)
        self.stats = LftaStats()
        self.reported = LftaStats()  # what the metrics have counted so far
        self._oldest_ns: int | None = None  # arrival time of the oldest unflushed row
        self._first_window: int | None = None  # the earliest window start held
        self._alloc()

    def _alloc(self) -> None:
        cap, m = self.capacity, self.n_measures
        self.t_keys = np.zeros((cap, self.key_words), np.int64)
        self.t_used = np.zeros(cap, np.bool_)
        self.t_cnt = np.zeros(cap, np.int64)
        self.t_sum = np.zeros((cap, m), np.int64)
        # a slot's measures are written when a row claims it (``_put``) and read only while
        # it is used: left unwritten, a large table's pages are mapped only as rows use them
        self.t_min = np.empty((cap, m), np.int64)
        self.t_max = np.empty((cap, m), np.int64)
        self.n_used = 0

    def _clear(self) -> None:
        """Empty the table in place (a flush): a claim writes its slot's key, count and
        measures, so only the used flags need clearing. A fresh table for every flush had
        each window's rows fault its pages in again (the backbone bench's 50 queries: the
        engine 0.66-0.68 -> 0.63-0.65 s warm)."""
        self.t_used[:] = False
        self.n_used = 0

    def __len__(self) -> int:
        return self.n_used

    def merge(self, rows: Partials, now_ns: int | None = None) -> list[Partials]:
        """Merge partial rows (or tuples, ``Partials.of_tuples``) into the table; returns what
        had to be flushed because the table filled up (each flush empties it)."""
        out: list[Partials] = []
        if not len(rows):
            return []
        if self._oldest_ns is None:
            self._oldest_ns = now_ns
        first = int(rows.keys[:, 0].min())
        self._first_window = first if self._first_window is None else \
            min(self._first_window, first)
        pos = 0
        while pos < len(rows):
            pos, self.n_used = merge_rows(
                self.t_keys, self.t_used, self.t_cnt, self.t_sum, self.t_min, self.t_max,
                self.n_used, self.limit, rows.keys, rows.cnt, rows.sums, rows.mins, rows.maxs,
                pos)
            if pos < len(rows):
                out.append(self._drain("full"))
                self._oldest_ns = now_ns
                self._first_window = int(rows.keys[pos:, 0].min())
        self.stats.rows_in += len(rows)
        return out

    def merge_batch(self, Q, mask, time, period, ints, ips, kinds, idx, meas_idx,
                    now_ns: int | None = None, dense: DenseFront | None = None
                    ) -> list[Partials]:
        """Merge a batch's tuples straight from its columns (``merge_tuples``, or
        ``merge_dense`` through ``dense``); returns what had to be flushed because the table
        filled up, as ``merge`` does."""
        out: list[Partials] = []
        pos, n = 0, Q.shape[0]
        while pos < n:
            table = (self.t_keys, self.t_used, self.t_cnt, self.t_sum, self.t_min, self.t_max,
                     self.n_used, self.limit, Q, mask, time, period)
            if dense is not None:
                pos, self.n_used, merged, first = merge_dense(
                    *table, ints, idx, meas_idx, pos, *dense.arrays())
            else:
                pos, self.n_used, merged, first = merge_tuples(
                    *table, ints, ips, kinds, idx, meas_idx, pos)
            if merged:
                if self._oldest_ns is None:
                    self._oldest_ns = now_ns
                self._first_window = first if self._first_window is None else \
                    min(self._first_window, first)
                self.stats.rows_in += merged
            if pos < n:
                out.append(self._drain("full"))
                self._oldest_ns = now_ns
        return out

    def flush_windows(self, before: int) -> Partials:
        """Flush the rows of windows that start before ``before`` (closed by the watermark);
        the rest stay. Nothing is scanned while no held window is that old (every batch
        asks)."""
        if not self.n_used or self._first_window is None or self._first_window >= before:
            return Partials.empty(self.key_words, self.n_measures)
        idx = np.flatnonzero(self.t_used)
        closed = self.t_keys[idx, 0] < before
        if not closed.any():
            return Partials.empty(self.key_words, self.n_measures)
        rows = self._rows(idx)
        self._clear()
        keep = rows.take(np.flatnonzero(~closed))
        if len(keep):
            merge_rows(self.t_keys, self.t_used, self.t_cnt, self.t_sum, self.t_min,
                       self.t_max, 0, self.limit, keep.keys, keep.cnt, keep.sums, keep.mins,
                       keep.maxs, 0)
            self.n_used = len(keep)
            self._first_window = int(keep.keys[:, 0].min())
        else:
            self._oldest_ns = self._first_window = None
        return self._count("window", rows.take(np.flatnonzero(closed)))

    def flush_if_old(self, now_ns: int) -> Partials | None:
        """Flush everything when the oldest row waited longer than ``max_age_s``."""
        if self._oldest_ns is None or now_ns - self._oldest_ns < self.max_age_ns:
            return None
        return self._drain("age")

    def flush_all(self) -> Partials:
        """Flush every row (end of input, shutdown, a plan change)."""
        return self._drain("shutdown")


    def snapshot(self) -> Partials:
        """A copy of every row held, the table unchanged (a durable source's checkpoint)."""
        return self._rows(np.flatnonzero(self.t_used))

    def _rows(self, idx: np.ndarray) -> Partials:
        return Partials(self.t_keys[idx], self.t_cnt[idx], self.t_sum[idx], self.t_min[idx],
                        self.t_max[idx])

    def _drain(self, reason: str) -> Partials:
        rows = self._rows(np.flatnonzero(self.t_used))
        self._clear()
        self._oldest_ns = self._first_window = None
        return self._count(reason, rows)

    def _count(self, reason: str, rows: Partials) -> Partials:
        if len(rows):
            self.stats.flushes[reason] += 1
            self.stats.rows_out += len(rows)
            if reason == "full":
                self.stats.evicted += len(rows)
        return rows

    @property
    def nbytes(self) -> int:
        """Memory of the table's arrays."""
        return sum(a.nbytes for a in (self.t_keys, self.t_used, self.t_cnt, self.t_sum,
                                      self.t_min, self.t_max))


# --------------------------------------------------------------------------- the engine's tables
class NodeTable:
    """One aggregate-tree node of a (stream, period) folder as the engine runs it: each tuple's
    key is its window start, the node's fields and its query-bit pattern restricted to the node's
    slots (collector/keys.py packs it for the spool). With an LFTA table the tuples merge into
    partials that leave when flushed; without one (the LFTA off, or a string key such as
    ``dns_qname``) every tuple goes to the spool as a partial of one."""

    def __init__(self, stream: str, period: int, keys, slots, q_words: int,
                 lfta: LftaConfig | None, chart: Chart | None = None,
                 history: int = 5, decay: float = 0.5, reads=None):
        self.stream, self.period = stream, period
        self.spool_layout = KeyLayout(stream, keys, q_words)  # what the spool's rows carry
        # what the table keys on: with a sketch key (~dst_ip), the sketched field too (its
        # rows merge per packed key into one sketch each when they leave, ``sketch_rows``)
        self.layout = self.spool_layout if self.spool_layout.sketch is None else \
            KeyLayout(stream, self.spool_layout.table_keys(), q_words)
        self.keys, self.slots = self.layout.keys, sorted(slots)
        self.name = f"{period}s/{','.join(sorted(keys)) or '-'}/" \
            f"{'.'.join(map(str, self.slots))}"
        self.mask = slot_mask(slots, q_words)
        # the measures its queries read (``reads``; default: all): the table holds and the
        # spool carries only these, the others' columns are NULL
        self.all_measures = [m.name for m in measures(stream)]
        self.measures = [m for m in self.all_measures if reads is None or m in reads]
        self.lfta = lfta
        self.table = None
        self.scheduler: Scheduler | None = None  # OM (planner/charts.py)
        if lfta is not None and lfta.enabled and self.layout.string is None:
            self.table = PartialTable(1 + self.layout.words, len(self.measures), lfta.capacity,
                                      lfta.max_load, lfta.max_age_s)
            if chart is not None:
                # the first window runs the configured table, OM's choice the next ones (the
                # plan's group counts come from a sample, which misses skewed traffic's tail)
                first = LftaPlan("table", self.table.capacity, "window")
                self.scheduler = Scheduler(chart, *chart.start(), history, decay,
                                           chart.plans.index(first)
                                           if first in chart.plans else None)
                self.table = self._table_for(chart.plans[self.scheduler.plan])
        self._round: int | None = None  # the window start of the round running (OM)
        self._round_ns = 0  # when it began (monotonic)
        self._round_evicted = 0  # the table's evicted rows when it began
        self._round_all = self._round_node = 0  # the stream's and the node's tuples in it
        self.retired: list[PartialTable] = []  # tables of earlier plans, until empty
        self.dense = DenseFront.for_node(stream, self.keys, self.mask, len(self.measures)) \
            if lfta is not None and lfta.enabled and self.layout.string is None else None
        self.schema = aggregate_schema(stream)
        self._kinds = np.array([int(kind == IP) for kind in self.layout.kinds], np.int8)
        # what its table reads of a batch (``BatchColumns``): integer keys and measures, and
        # address keys
        pairs = list(zip(self.keys, self.layout.kinds, strict=True))
        self.reads = ([k for k, kind in pairs if kind != IP] + self.measures,
                      [k for k, kind in pairs if kind == IP])

    def tables(self) -> list[PartialTable]:
        """The node's tables: the running plan's, and those of earlier plans still holding
        windows that have not closed."""
        return ([self.table] if self.table is not None else []) + self.retired

    def prune(self) -> None:
        """Forget retired tables that have flushed everything."""
        self.retired = [x for x in self.retired if len(x)]

    def _regroup(self) -> None:
        """After a round of a window-flushed table: the groups it met (rows it evicted in the
        round plus those it holds, the window just ended not being flushed yet) refit the
        chart's group population."""
        t, p = self.table, self.scheduler.chart.plans[self.scheduler.plan]
        if t is None or p.flush != "window" or not self._round_node:
            return
        rows = t.stats.evicted - self._round_evicted + len(t)
        groups = fit_groups(self._round_node, t.limit, rows)
        if groups is not None:
            self.scheduler.regroup(groups)

    def _table_for(self, p: LftaPlan) -> PartialTable | None:
        """A physical plan's table (None: pass-through)."""
        if p.kind == "passthrough":
            return None
        age = self.lfta.max_age_s
        if p.flush == "age":
            age = min(age, self.period * self.scheduler.chart.options.age_fraction)
        return PartialTable(1 + self.layout.words, len(self.measures), p.capacity,
                            self.lfta.max_load, age)

    def end_of_batch(self, latest: int, tuples: int, now_ns: int) -> bool:
        """OM's round accounting after a batch of ``tuples`` of the stream whose latest time
        is ``latest``, processed at ``now_ns`` (monotonic) (Algorithm 2): when the batch reached
        a later window, the round ends (rounds end at batch granularity) and the chart's plan
        for the next one is taken. The arrival rate is tuples per second of processing time:
        the load the node puts on Spark (a replayed file arrives faster than it was captured).
        Returns whether the plan switched (the old table then retires, see ``tables``)."""
        if self.scheduler is None:
            return False
        ws = (latest // self.period) * self.period
        if self._round is None:
            self._round, self._round_ns = ws, now_ns
        self._round_all += tuples
        if ws <= self._round:
            return False
        sel = self._round_node / self._round_all if self._round_all else 0.0
        lam = self._round_all / max((now_ns - self._round_ns) / 1e9, 1e-6)
        before = self.scheduler.plan
        self._regroup()
        plan = self.scheduler.end_round(sel, lam)
        self._round, self._round_ns, self._round_all, self._round_node = ws, now_ns, 0, 0
        self._round_evicted = self.table.stats.evicted if self.table is not None else 0
        if plan == before:
            return False
        if self.table is not None and len(self.table):
            self.retired.append(self.table)
        self.table = self._table_for(self.scheduler.chart.plans[plan])
        self._round_evicted = 0
        return True

    def rows_of(self, tb, Q: np.ndarray) -> tuple[Partials, pa.Array | None] | None:
        """The batch's tuples of this node as partials of one, with their string key (None
        when no tuple belongs to the node)."""
        q = Q & self.mask
        rows = np.flatnonzero(q.any(axis=1))
        if not len(rows):
            return None
        keys = np.empty((len(rows), 1 + self.layout.words), np.int64)
        keys[:, 0] = (tb.time[rows] // self.period) * self.period
        keys[:, 1:1 + self.layout.field_words] = self.layout.field_words_of(tb, rows)
        keys[:, 1 + self.layout.field_words:] = q[rows].view(np.int64)
        meas = np.empty((len(rows), len(self.measures)), np.int64)
        for m, name in enumerate(self.measures):
            meas[:, m] = tb.column(name)[rows]
        return Partials.of_tuples(keys, meas), self.layout.strings_of(tb, rows)

    def add(self, tb, Q: np.ndarray, now_ns: int, plan_version: int, probe: str,
            cols: BatchColumns | None = None) -> list[pa.Table]:
        """Take a batch's tuples; returns the spool rows due now (every tuple without a table,
        what a full table flushed with one). ``cols``: the batch's columns as other nodes of
        it already made them."""
        if self.table is not None:
            cols = cols or BatchColumns(tb)
            before = self.table.stats.rows_in
            out = [self.to_spool(p, plan_version, probe)
                   for p in self.table.merge_batch(Q, self.mask, cols.time, self.period,
                                                   *self.columns(cols), now_ns, self.dense)]
            self._round_node += self.table.stats.rows_in - before
            return out
        got = self.rows_of(tb, Q)
        if got is None:
            return []
        rows, strings = got
        self._round_node += len(rows)
        return [self.to_spool(rows, plan_version, probe, strings)]

    def need(self, cols: BatchColumns) -> None:
        """Have ``cols`` make the columns this node's table reads."""
        cols.need(*self.reads)

    def columns(self, cols: BatchColumns) -> tuple[np.ndarray, ...]:
        """What ``merge_tuples`` reads of the batch for this node: ``cols``' integer rows,
        address words, each key field's kind and row, and the rows of the measures."""
        self.need(cols)
        return (cols.ints, cols.ips, self._kinds, cols.rows(self.keys, self.layout.kinds),
                np.array([cols.index(m) for m in self.measures], np.int64))

    def to_spool(self, p: Partials, plan_version: int, probe: str,
                 strings: pa.Array | None = None) -> pa.Table:
        """Partial rows as a spool batch (DESIGN's spool schema)."""
        hll = None
        if self.spool_layout.sketch is not None and len(p):
            p, strings, hll = sketch_rows(p, strings, self.layout, self.spool_layout,
                                          self.lfta.hll_lg_k if self.lfta else 12)
        n = len(p)
        cols = [pa.array(p.keys[:, 0] * 1_000_000, TS_US),
                pa.array(np.full(n, plan_version, np.int32)),
                pa.repeat(pa.scalar(self.spool_layout.label, pa.string()), n),
                self.spool_layout.encode(p.keys[:, 1:], strings),
                pa.array(p.cnt)]
        at = {name: m for m, name in enumerate(self.measures)}
        for name in self.all_measures:
            if name in at:
                m = at[name]
                cols += [pa.array(p.sums[:, m]), pa.array(p.mins[:, m]),
                         pa.array(p.maxs[:, m])]
            else:
                cols += [pa.nulls(n, pa.int64())] * 3
        cols.append(hll if hll is not None else pa.nulls(n, pa.binary()))
        cols.append(pa.repeat(pa.scalar(probe, pa.string()), n))
        return pa.Table.from_arrays(cols, schema=self.schema)
