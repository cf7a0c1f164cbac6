"""The LFTA's numba kernels (collector/pipeline/lfta.py drives them): an open-addressing hash
table keyed by rows of int64 words (linear probing, power-of-two capacity), merged with partial
rows (``merge_rows``), with a batch's tuples straight from its columns (``merge_tuples``, and a
key layout's own compiled variant, ``specialize``), or through a directly indexed array first
for nodes keyed on small codes (``merge_dense``).

The merge loops are ``capture/jit.py``'s ``kernel`` (no numba runtime); a thin ``allocating``
function in front of each makes its scratch arrays.
"""

from __future__ import annotations

import logging
import threading

import numba as nb
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from capture.jit import allocating, kernel, kernel_inline

log = logging.getLogger("flowsieve.lfta")

I64_MAX = np.iinfo(np.int64).max
I64_MIN = np.iinfo(np.int64).min


# odd 64-bit constants (splitmix64's, murmur3's, xxhash's and wyhash's): a key's words are
# multiplied by them independently, so the hash of a key of several words costs one
# multiplication's latency and a finaliser, not a chain of one mix per word
_WORD_MULT = np.array([
    0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93,
    0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x27D4EB2F165667C5, 0x94D049BB133111EB,
    0xBF58476D1CE4E5B9, 0x2545F4914F6CDD1D, 0x9FB21C651E98DF25, 0xA0761D6478BD642F,
    0xE7037ED1A0B428DB, 0x8EBC6AF09C88C6E3, 0x589965CC75374CC3, 0x1D8E4E27C47D124F],
    np.uint64)


@kernel_inline
def hash_key(keys, i, width):
    """A 64-bit hash of row ``i``'s first ``width`` key words (all of them; a compile-time
    constant where the caller knows it, ``merge_tuples``): the sum of each word times its own odd
    constant, through splitmix64's finaliser (which brings the high bits to the low ones the
    slot is taken from). About half the cost per tuple of mixing word by word, which is a
    chain of two multiplications per word."""
    h = np.uint64(0)
    for k in range(width):
        h += np.uint64(keys[i, k]) * _WORD_MULT[k & 15]
    h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


@kernel_inline
def _slot(t_keys, t_used, keys, r, h, width):
    """Where key row ``r`` of ``keys`` (its hash ``h``, its ``width`` words) lives in the
    table: (slot, True) when it is held, (the free slot its probe reached, False) when it is
    not."""
    mask = np.uint64(t_keys.shape[0] - 1)
    slot = np.int64(h & mask)
    while True:
        if not t_used[slot]:
            return slot, False
        same = True
        for k in range(width):
            if t_keys[slot, k] != keys[r, k]:
                same = False
                break
        if same:
            return slot, True
        slot = np.int64((np.uint64(slot) + np.uint64(1)) & mask)


@intrinsic
def prefetch_row(typingctx, table, row):
    """Ask the CPU for row ``row`` of a 2-D table (LLVM's prefetch, for writing): a merge
    computes the home slots of a run of tuples first, so their cache misses overlap."""
    def codegen(context, builder, signature, args):
        ty = signature.args[0]
        arr = context.make_array(ty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, ty, arr,
                                       [args[1]] + [context.get_constant(types.intp, 0)]
                                       * (ty.ndim - 1))
        i32 = ir.IntType(32)
        ptr = builder.bitcast(ptr, cgutils.voidptr_t)  # one declaration for every table
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32]),
            "llvm.prefetch.p0")
        builder.call(fn, [ptr, ir.Constant(i32, 1), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return types.void(table, row), codegen


@kernel_inline
def _put(t_cnt, t_sum, t_min, t_max, slot, held, cnt, sums, mins, maxs, i, at):
    """Merge count ``cnt`` and row ``i`` of sums, mins and maxs (the table's measure ``m`` in
    their column ``at[m]``) into ``slot`` (``held``: it holds a row already; else it starts
    one). A negative measure is a tuple's NULL (the ip_len of a frame without IP): it adds
    nothing to the sum and the min skips it (``I64_MAX``, read back as NULL); a max of NULLs
    only stays -1 (NULL). Partial rows carry these sentinels already. (The probe and the
    update are two small functions: numba made one function of both, with its dozen array
    arguments, five times slower per tuple.)"""
    if held:
        t_cnt[slot] += cnt
        for m in range(at.shape[0]):
            c = at[m]
            t_sum[slot, m] += max(sums[i, c], 0)
            if 0 <= mins[i, c] < t_min[slot, m]:
                t_min[slot, m] = mins[i, c]
            if maxs[i, c] > t_max[slot, m]:
                t_max[slot, m] = maxs[i, c]
    else:
        t_cnt[slot] = cnt
        for m in range(at.shape[0]):
            c = at[m]
            t_sum[slot, m] = max(sums[i, c], 0)
            t_min[slot, m] = mins[i, c] if mins[i, c] >= 0 else I64_MAX
            t_max[slot, m] = maxs[i, c]


@kernel_inline
def _claim(t_keys, t_used, slot, keys, r, width):
    """Start a row for key row ``r`` (``width`` words) in the free ``slot``."""
    t_used[slot] = True
    for k in range(width):
        t_keys[slot, k] = keys[r, k]


@allocating
def merge_rows(t_keys, t_used, t_cnt, t_sum, t_min, t_max, n_used, limit, keys, cnt, sums,
               mins, maxs, start):
    """Merge rows ``start…`` of (keys, cnt, sums, mins, maxs) into the table; stop before a row
    that would make the table hold more than ``limit`` entries. Returns (next row, entries)."""
    return _merge_rows(t_keys, t_used, t_cnt, t_sum, t_min, t_max, n_used, limit, keys, cnt,
                       sums, mins, maxs, start, np.arange(sums.shape[1]))


@kernel
def _merge_rows(t_keys, t_used, t_cnt, t_sum, t_min, t_max, n_used, limit, keys, cnt, sums,
                mins, maxs, start, at):
    w = keys.shape[1]
    for i in range(start, keys.shape[0]):
        slot, held = _slot(t_keys, t_used, keys, i, hash_key(keys, i, w), w)
        if not held:
            if n_used >= limit:
                return i, n_used
            _claim(t_keys, t_used, slot, keys, i, w)
            n_used += 1
        _put(t_cnt, t_sum, t_min, t_max, slot, held, cnt[i], sums, mins, maxs, i, at)
    return keys.shape[0], n_used


@kernel_inline
def _node_tuples(Q, mask, start, sel):
    """The tuples ``start…`` whose query bits meet ``mask``, the first ``m`` of ``sel`` (listed
    without a branch: most nodes take a minority of a batch, and a test per tuple
    mispredicted); returns ``m``."""
    m = 0
    if Q.shape[1] == 1:  # one mask word: a flat loop (half the time of the general one)
        q = Q.reshape(-1)
        m0 = mask[0]
        for i in range(start, q.shape[0]):
            sel[m] = i
            m += (q[i] & m0) != 0
        return m
    for i in range(start, Q.shape[0]):
        hit = np.uint64(0)
        for w in range(Q.shape[1]):
            hit |= Q[i, w] & mask[w]
        sel[m] = i
        m += hit != 0
    return m


# a node keyed only on small codes gets a directly indexed array (DenseFront) of at most this
# many bytes, when it serves at most this many slots (a row per query-bit pattern)
DENSE_MAX_BYTES = 16 << 20
DENSE_MAX_SLOTS = 12
RUN = 32  # tuples whose keys and home slots merge_tuples makes before it probes them


def merge_tuples(t_keys, t_used, t_cnt, t_sum, t_min, t_max, n_used, limit, Q, mask, time,
                 period, ints, ips, kinds, idx, meas_idx, start):
    """Merge a batch's tuples ``start…`` into the table as partials of one, building each
    tuple's key on the fly (``NodeTable``'s layout: window start, the key fields in order —
    ``kinds[k]`` 0: row ``idx[k]`` of ``ints``, 1: the three words of address ``idx[k]`` of
    ``ips`` (validity and two big-endian halves, ``BatchColumns``) — then the query-bit
    pattern ``Q[i] & mask``); its measures are rows ``meas_idx`` of ``ints``. Tuples whose
    pattern is empty are not the node's. Stops before a tuple that would make the table hold
    more than ``limit`` entries. Returns (next tuple, entries, tuples merged, earliest window
    start merged).

    The node's tuples are listed first without a branch (most nodes take a minority of a
    batch: a test per tuple mispredicted); then, a run of ``RUN`` tuples at a time, their
    keys and hashes are made and their home slots prefetched before any is probed
    (bench/README.md: 25 % less time a merge on the backbone's 50 queries).

    A key layout's own kernel (``specialize``) merges in about half the time of the generic
    one; until it is ready, the generic one merges."""
    key = (len(kinds), t_keys.shape[1])
    fields_ = tuple(int(k) for k in kinds) + (0,)  # one more: an empty tuple has no type
    rows = tuple(int(k) for k in idx) + (0,)
    if key in _SPECIALIZED:
        return _merge_tuples_of(t_keys, t_used, t_cnt, t_sum, t_min, t_max, n_used, limit, Q,
                                mask, time, period, ints, ips, fields_, rows,
                                (0,) * t_keys.shape[1], meas_idx, start)
    args = (t_keys, t_used, t_cnt, t_sum, t_min, t_max, n_used, limit, Q, mask, time, period,
            ints, ips)
    if SPECIALIZE:
        specialize(key, (*args, fields_, rows, (0,) * t_keys.shape[1], meas_idx, start))
    return _merge_tuples_of(*args, np.array(fields_, np.int64), np.array(rows, np.int64),
                            np.empty(t_keys.shape[1], np.int64), meas_idx, start)


# key layouts (key fields, key words) whose merge_tuples kernel is compiled, and those being
# compiled; the compiling thread
_SPECIALIZED: set[tuple[int, int]] = set()
_SPECIALIZING: dict[tuple[int, int], threading.Thread] = {}
_SPECIALIZE_LOCK = threading.Lock()
# False: merge_tuples compiles no layout's own kernel (``flowsieve prepare``'s warm-up queries:
# their aggregate trees' layouts are theirs, not the user's, and take 1-2.5 s each)
SPECIALIZE = True


def specialize(key: tuple[int, int], args: tuple) -> threading.Thread:
    """Compile ``merge_tuples``' kernel for one key layout (``key``: its fields, its words), on
    a thread of its own, for calls like ``args``. The layout's field kinds and rows and its
    words are passed as tuples, whose lengths numba compiles in: the key's loops unroll (the
    telemetry bench's nodes: 14-18 ns a tuple against 27-35). A plan's layouts are few, and
    numba's cache keeps each compiled (about a second the first time, a few milliseconds
    loaded): compiling where the tuples are merged would stop the capture for that long at a
    plan change, which swaps data, not code (DESIGN, prefilter). Returns the thread."""
    with _SPECIALIZE_LOCK:
        t = _SPECIALIZING.get(key)
        if t is not None:
            return t
        sig = tuple(nb.typeof(a) for a in args)

        def run() -> None:
            try:
                _merge_tuples_of.compile(sig)
            except Exception:  # noqa: BLE001 - the generic kernel goes on merging
                log.exception("could not compile the LFTA merge for key layout %s", key)
                return
            _SPECIALIZED.add(key)
        t = _SPECIALIZING[key] = threading.Thread(target=run, daemon=True,
                                                  name=f"lfta-specialize-{key[0]}-{key[1]}")
        t.start()
        return t


def wait_specialized() -> list[tuple[int, int]]:
    """Wait for the key layouts' kernels being compiled (``specialize``'s threads are daemon
    threads: a process that ends first loses them, cache included); the layouts ready."""
    with _SPECIALIZE_LOCK:
        threads = list(_SPECIALIZING.values())
    for t in threads:
        t.join()
    return sorted(_SPECIALIZED)


@allocating
def _merge_tuples_of(t_keys, t_used, t_cnt, t_sum, t_min, t_max, n_used, limit, Q, mask, time,
                     period, ints, ips, kinds, idx, width, meas_idx, start):
    return _merge_tuples(t_keys, t_used, t_cnt, t_sum, t_min, t_max, n_used, limit, Q, mask,
                         time, period, ints, ips, kinds, idx, width, meas_idx, start,
                         np.empty(Q.shape[0] - start, np.int64),
                         np.empty((RUN, t_keys.shape[1]), np.int64), np.empty(RUN, np.uint64))


@kernel
def _merge_tuples(t_keys, t_used, t_cnt, t_sum, t_min, t_max, n_used, limit, Q, mask, time,
                  period, ints, ips, kinds, idx, width, meas_idx, start, sel, keys, hashes):
    """``merge_tuples``: ``kinds`` and ``idx`` end in one unused entry; ``width`` is as long as
    a key row (its words: the window start, the fields', the pattern's). Tuples make it a
    layout's own kernel, arrays the generic one."""
    n_fields = len(kinds) - 1
    n_words = len(width)
    n = Q.shape[0]
    m = _node_tuples(Q, mask, start, sel)
    meas_t = ints.T  # (tuples, fields): each tuple its own sum, min and max
    home = np.uint64(t_keys.shape[0] - 1)
    merged = 0
    first = I64_MAX
    ws, end = I64_MAX, I64_MIN  # the window of the tuple before: a division saved a tuple
    for j0 in range(0, m, RUN):
        run = min(RUN, m - j0)
        for r in range(run):
            i = sel[j0 + r]
            if not ws <= time[i] < end:
                ws = (time[i] // period) * period
                end = ws + period
            keys[r, 0] = ws
            c = 1
            for k in range(n_fields):
                if kinds[k] == 0:
                    keys[r, c] = ints[idx[k], i]
                    c += 1
                else:
                    keys[r, c] = ips[idx[k], i, 0]
                    keys[r, c + 1] = ips[idx[k], i, 1]
                    keys[r, c + 2] = ips[idx[k], i, 2]
                    c += 3
            for w in range(n_words - c):
                keys[r, c + w] = np.int64(Q[i, w] & mask[w])
            hashes[r] = hash_key(keys, r, n_words)
            slot = np.int64(hashes[r] & home)
            prefetch_row(t_keys, slot)
            prefetch_row(t_used, slot)
            prefetch_row(t_cnt, slot)
            prefetch_row(t_sum, slot)
            prefetch_row(t_min, slot)
            prefetch_row(t_max, slot)
        for r in range(run):
            i = sel[j0 + r]
            slot, held = _slot(t_keys, t_used, keys, r, hashes[r], n_words)
            if not held:
                if n_used >= limit:
                    return i, n_used, merged, first
                _claim(t_keys, t_used, slot, keys, r, n_words)
                n_used += 1
            _put(t_cnt, t_sum, t_min, t_max, slot, held, 1, meas_t, meas_t, meas_t, i, meas_idx)
            merged += 1
            first = min(first, keys[r, 0])
    return n, n_used, merged, first


@kernel
def _drain_dense(t_keys, t_used, t_cnt, t_sum, t_min, t_max, n_used, ws, radix, pat_w,
                 pat_b, d_cnt, d_sum, d_min, d_max, touched, n_touched, key, at):
    """Merge the ``n_touched`` rows of the direct-indexed array (window ``ws``) into the hash
    table, emptying the array; the caller has kept room for them. Returns the entries.
    ``key``: a row of scratch, ``at``: the measure columns in order."""
    nk = radix.shape[0]
    kw = key.shape[1]
    for t in range(n_touched):
        code = touched[t]
        pid = code & ((np.int64(1) << pat_w.shape[0]) - 1)
        rest = code >> pat_w.shape[0]
        key[0, 0] = ws
        for k in range(nk - 1, -1, -1):
            key[0, 1 + k] = rest % radix[k]
            rest //= radix[k]
        for w in range(t_keys.shape[1] - 1 - nk):
            key[0, 1 + nk + w] = 0
        for b in range(pat_w.shape[0]):  # the first pattern bit is the highest
            if (pid >> (pat_w.shape[0] - 1 - b)) & 1:
                c = 1 + nk + pat_w[b]
                key[0, c] = np.int64(np.uint64(key[0, c]) | (np.uint64(1) << np.uint64(pat_b[b])))
        slot, held = _slot(t_keys, t_used, key, 0, hash_key(key, 0, kw), kw)
        if not held:
            _claim(t_keys, t_used, slot, key, 0, kw)
            n_used += 1
        _put(t_cnt, t_sum, t_min, t_max, slot, held, d_cnt[code], d_sum, d_min, d_max, code,
             at)
        d_cnt[code] = 0
    return n_used


@allocating
def merge_dense(t_keys, t_used, t_cnt, t_sum, t_min, t_max, n_used, limit, Q, mask, time,
                period, ints, idx, meas_idx, start, radix, pat_w, pat_b, d_cnt, d_sum, d_min,
                d_max, touched):
    """``merge_tuples`` for a node keyed on small integer codes only (``DenseFront``): a
    tuple's row in a directly indexed array is its key fields in mixed radix ``radix``, then
    its query-bit pattern (bit ``pat_b[b]`` of pattern word ``pat_w[b]``, the first highest),
    so it merges without a hash, a probe or a key compare. The array holds one window at a
    time and is merged into the hash table when the window changes, before the table could
    pass ``limit`` and at the end: between calls the table holds everything, as with
    ``merge_tuples``, whose results and stopping rule this keeps. A tuple whose key field is
    NULL or outside its radix merges into the hash table directly. (Backbone bench, 50
    queries: the protocol, ip_version and dst_port nodes' 10.8M tuples took 14 ns each, 20
    through the hash table.)"""
    n = Q.shape[0] - start
    return _merge_dense(t_keys, t_used, t_cnt, t_sum, t_min, t_max, n_used, limit, Q, mask,
                        time, period, ints, idx, meas_idx, start, radix, pat_w, pat_b, d_cnt,
                        d_sum, d_min, d_max, touched, np.empty(n, np.int64),
                        np.zeros(n, np.int64), np.empty((1, t_keys.shape[1]), np.int64),
                        np.arange(d_sum.shape[1]))


@kernel
def _merge_dense(t_keys, t_used, t_cnt, t_sum, t_min, t_max, n_used, limit, Q, mask, time,
                 period, ints, idx, meas_idx, start, radix, pat_w, pat_b, d_cnt, d_sum, d_min,
                 d_max, touched, sel, codes, key, at):
    words = Q.shape[1]
    n = Q.shape[0]
    nk = idx.shape[0]
    nb_ = pat_w.shape[0]
    nm = meas_idx.shape[0]
    kw = key.shape[1]
    meas_t = ints.T  # (tuples, fields), as merge_tuples reads the measures
    m = _node_tuples(Q, mask, start, sel)
    # column at a time over the node's tuples: each one's row (-1: a key outside its radix)
    for k in range(nk):
        r = radix[k]
        col = ints[idx[k]]
        for j in range(m):
            v = col[sel[j]]
            c = codes[j] * r + v
            codes[j] = c if (v >= 0) & (v < r) & (codes[j] >= 0) else -1
    for b in range(nb_):
        w = pat_w[b]
        sh = np.uint64(pat_b[b])
        for j in range(m):
            c = codes[j]
            bit = np.int64((Q[sel[j], w] >> sh) & np.uint64(1))
            codes[j] = (c << 1) | bit if c >= 0 else -1
    # np.int64, not literals: numba compiled _drain_dense once per literal argument it met
    # while typing (three times, 3 s)
    n_t = np.int64(0)
    ws_d = np.int64(I64_MIN)  # the window the array holds
    merged = 0
    first = I64_MAX
    ws, end = I64_MAX, I64_MIN
    for j in range(m):
        i = sel[j]
        if not ws <= time[i] < end:
            ws = (time[i] // period) * period
            end = ws + period
        code = codes[j]
        small = code >= 0
        if small:
            if ws != ws_d and n_t:
                n_used = _drain_dense(t_keys, t_used, t_cnt, t_sum, t_min, t_max, n_used, ws_d,
                                      radix, pat_w, pat_b, d_cnt, d_sum, d_min, d_max, touched,
                                      n_t, key, at)
                n_t = np.int64(0)
            ws_d = ws
            if d_cnt[code] == 0 and n_used + n_t >= limit:
                small = False  # no room for a new row unless it is in the table: probe it
        if small:
            # _put's rule, written out on the measure rows: through _put and the batch's
            # transposed columns this loop took 3x as long (0.45 s against 0.14 s)
            if d_cnt[code] == 0:
                touched[n_t] = code
                n_t += 1
                for q in range(nm):
                    d_sum[code, q] = 0
                    d_min[code, q] = I64_MAX
                    d_max[code, q] = I64_MIN
            d_cnt[code] += 1
            for q in range(nm):
                x = ints[meas_idx[q], i]
                d_sum[code, q] += max(x, 0)
                if 0 <= x < d_min[code, q]:
                    d_min[code, q] = x
                if x > d_max[code, q]:
                    d_max[code, q] = x
        else:
            if n_t and n_used + n_t >= limit:
                n_used = _drain_dense(t_keys, t_used, t_cnt, t_sum, t_min, t_max, n_used, ws_d,
                                      radix, pat_w, pat_b, d_cnt, d_sum, d_min, d_max, touched,
                                      n_t, key, at)
                n_t = np.int64(0)
            key[0, 0] = ws
            for k in range(nk):
                key[0, 1 + k] = ints[idx[k], i]
            for w in range(words):
                key[0, 1 + nk + w] = np.int64(Q[i, w] & mask[w])
            slot, held = _slot(t_keys, t_used, key, 0, hash_key(key, 0, kw), kw)
            if not held:
                if n_used >= limit:
                    return i, n_used, merged, first
                _claim(t_keys, t_used, slot, key, 0, kw)
                n_used += 1
            _put(t_cnt, t_sum, t_min, t_max, slot, held, 1, meas_t, meas_t, meas_t, i, meas_idx)
        merged += 1
        first = min(first, ws)
    if n_t:
        n_used = _drain_dense(t_keys, t_used, t_cnt, t_sum, t_min, t_max, n_used, ws_d, radix,
                              pat_w, pat_b, d_cnt, d_sum, d_min, d_max, touched, n_t, key, at)
    return n, n_used, merged, first
