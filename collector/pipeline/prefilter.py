"""The prefilter (Golab et al.): one numba pass per batch computes, per tuple, the bit vector B
of the plan's bits and the query mask Q: slot i is set iff (B & S_i) == S_i.

The compiled plan is plain arrays, so a rebuild swaps data, not code. More than 64 bits and more
than 64 query slots are held in several 64-bit words.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from capture.batch import Batch, ip_words
from capture.fields import IP, fields, prefix_mask, split128
from capture.jit import allocating, allocating_inline
from collector.pipeline.asc_runtime import AscRuntime
from planner.asc import ASC, qrb_words, qub_words
from planner.plan import Plan
from planner.slots import n_words, set_bit_rows, slot_mask

OPS = {"=": 0, "!=": 1, "<": 2, "<=": 3, ">": 4, ">=": 5, "in": 6, "between": 7, "prefix": 8,
       "mask": 9}


@dataclass
class CompiledPrefilter:
    """A plan's prefilter for one stream, as arrays for the kernel."""

    stream: str
    version: int
    int_cols: list[str]
    ip_cols: list[str]
    a_col: np.ndarray  # int32: row in the int or ip matrix
    a_op: np.ndarray  # int32
    a_neg: np.ndarray  # bool
    a_v: np.ndarray  # int64 (n_atoms, 2): constant(s); for IN: start and length in set_vals
    a_ip: np.ndarray  # uint64 (n_atoms, 4): value hi, lo, mask hi, lo
    set_vals: np.ndarray  # int64, sorted per IN atom
    p_start: np.ndarray  # int32 per local predicate: first atom
    p_len: np.ndarray
    b_start: np.ndarray  # int32 per bit: first entry in b_preds
    b_len: np.ndarray
    b_preds: np.ndarray  # int32 local predicate indices
    g_start: np.ndarray  # int64 per distinct signature: first entry of its bits in g_bits
    g_len: np.ndarray  # int64
    g_bits: np.ndarray  # int64 local bit ids
    g_mask: np.ndarray  # uint64 (signatures, q words): the slots with that signature
    pred_ids: list[int]  # plan predicate id of each local predicate
    n_slots: int
    ascs: list[ASC]
    asc_is_ip: np.ndarray  # bool per ASC
    asc_col: np.ndarray  # int32: row in the int or ip matrix
    asc_cstart: np.ndarray  # int32: first constant in c_int / c_hi, c_lo
    asc_clen: np.ndarray  # int32
    c_int: np.ndarray  # int64 constants of integer ASCs
    c_hi: np.ndarray  # uint64 high and low words of address constants
    c_lo: np.ndarray
    asc_qrb: np.ndarray  # uint64 (n_asc, max regions, q words)
    asc_qub: np.ndarray  # uint64 (n_asc, q words): the queries each ASC decides
    asc_tstart: np.ndarray  # int64 per ASC: first entry of its region table, -1 if none
    asc_tlen: np.ndarray  # int64: table length (values >= it are above every constant)
    r_table: np.ndarray  # int16 region of every value 0..len-1, for small integer domains
    asc_bstart: np.ndarray  # int64 per ASC: first entry of its /16 index in b_table, -1 if none
    b_table: np.ndarray  # int32 per address ASC: where each IPv4 /16's constants begin (65,537)

    def kernel_arrays(self) -> tuple:
        """The arrays ``prefilter_kernel`` reads, in its argument order."""
        return (self.a_col, self.a_op, self.a_neg, self.a_v, self.a_ip, self.set_vals,
                self.p_start, self.p_len, self.b_start, self.b_len, self.b_preds, self.g_start,
                self.g_len, self.g_bits, self.g_mask)

    def asc_arrays(self) -> tuple:
        """The arrays a region look-up needs, in the kernels' argument order."""
        return (self.asc_is_ip, self.asc_col, self.asc_cstart, self.asc_clen, self.c_int,
                self.c_hi, self.c_lo, self.asc_tstart, self.asc_tlen, self.r_table,
                self.asc_bstart, self.b_table)

    @property
    def q_words(self) -> int:
        return n_words(self.n_slots)


def region_table(constants: list[int], length: int) -> np.ndarray:
    """``ASC.region_of(v)`` for every v in [0, length), at once: 2i + 1 for the constant c_i,
    2i for the gap below it."""
    c = np.asarray(constants, np.int64)
    v = np.arange(length, dtype=np.int64)
    i = np.searchsorted(c, v, side="left")
    hit = c[np.minimum(i, len(c) - 1)] == v if len(c) else np.zeros(length, bool)
    return (2 * i + hit).astype(np.int16)


def v4_buckets(constants: list[int]) -> np.ndarray:
    """Where the constants (sorted 128-bit addresses) of each IPv4 /16 begin: entry k is the
    number of constants below ::ffff:(k << 16), for k in 0…65,536. An IPv4 address of /16 k
    lies between entries k and k + 1 of them (``_regions`` searches only those)."""
    base = 0xFFFF << 32
    c = np.array([x - base if base <= x < base + (1 << 32) else (-1 if x < base else 1 << 32)
                  for x in constants], np.int64)
    return np.searchsorted(c, np.arange(65_537, dtype=np.int64) << 16).astype(np.int32)


def signature_masks(by_signature: dict[tuple[int, ...], list[int]], words: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each distinct signature (its local bits, fewest first) and the mask of its slots:
    (g_start, g_len, g_bits, g_mask)."""
    sigs = sorted(by_signature, key=lambda g: (len(g), g))
    g_len = np.array([len(g) for g in sigs], np.int64)
    g_start = np.concatenate([[0], np.cumsum(g_len)[:-1]]).astype(np.int64)
    g_bits = np.array([b for g in sigs for b in g], np.int64)
    g_mask = np.array([slot_mask(by_signature[g], words) for g in sigs],
                      np.uint64).reshape(len(sigs), words)
    return g_start, g_len, g_bits, g_mask


def compile_prefilter(plan: Plan, stream: str) -> CompiledPrefilter:
    """Turn a plan's bits and signatures for ``stream`` into kernel arrays."""
    cat = fields(stream)
    bit_ids = [i for i, b in enumerate(plan.bits)
               if plan.predicates[b[0]].predicate.stream == stream]
    local_bit = {b: k for k, b in enumerate(bit_ids)}
    pred_ids = sorted({p for b in bit_ids for p in plan.bits[b]})
    local_pred = {p: k for k, p in enumerate(pred_ids)}
    int_cols: list[str] = []
    ip_cols: list[str] = []
    a_col, a_op, a_neg, a_v, a_ip, set_vals, p_start, p_len = [], [], [], [], [], [], [], []
    for pid in pred_ids:
        atoms = plan.predicates[pid].predicate.atoms
        p_start.append(len(a_col))
        p_len.append(len(atoms))
        for a in atoms:
            kind = cat[a.field].kind
            cols = ip_cols if kind == IP else int_cols
            if a.field not in cols:
                cols.append(a.field)
            a_col.append(cols.index(a.field))
            a_op.append(OPS[a.op])
            a_neg.append(a.negated)
            if a.op == "prefix":
                value, length = a.values
                a_ip.append((*split128(value), *split128(prefix_mask(length))))
                a_v.append((0, 0))
            elif a.op == "in":
                a_v.append((len(set_vals), len(a.values)))
                set_vals.extend(a.values)
                a_ip.append((0, 0, 0, 0))
            else:
                a_v.append((a.values[0], a.values[1] if len(a.values) > 1 else 0))
                a_ip.append((0, 0, 0, 0))
    b_start, b_len, b_preds = [], [], []
    for b in bit_ids:
        b_start.append(len(b_preds))
        b_len.append(len(plan.bits[b]))
        b_preds.extend(local_pred[p] for p in plan.bits[b])
    ascs = plan.stream_ascs(stream)
    asc_is_ip, asc_col, asc_cstart, asc_clen, c_int, c_hi, c_lo = [], [], [], [], [], [], []
    for a in ascs:
        is_ip = a.kind == "ip"
        cols = ip_cols if is_ip else int_cols
        if a.attribute not in cols:
            cols.append(a.attribute)
        asc_is_ip.append(is_ip)
        asc_col.append(cols.index(a.attribute))
        asc_cstart.append(len(c_int))
        asc_clen.append(len(a.constants))
        for c in a.constants:
            c_int.append(0 if is_ip else c)
            hi, lo = split128(c) if is_ip else (0, 0)
            c_hi.append(hi)
            c_lo.append(lo)
    # integer ASCs whose constants are below 2^16 (ports, TTL, protocol, VLAN) get a table
    # value -> region: one load instead of a binary search
    asc_tstart, asc_tlen, tables = [], [], []
    size = 0
    for a in ascs:
        top = max(a.constants) if a.constants else 0
        if a.kind == "int" and 0 <= top < (1 << 16) and a.constants[0] >= 0:
            length = top + 2
            asc_tstart.append(size)
            asc_tlen.append(length)
            tables.append(region_table(a.constants, length))
            size += length
        else:
            asc_tstart.append(-1)
            asc_tlen.append(0)
    r_table = np.concatenate(tables) if tables else np.zeros(0, np.int16)
    asc_bstart, buckets = [], []
    for a in ascs:
        asc_bstart.append(65_537 * len(buckets) if a.kind == "ip" else -1)
        if a.kind == "ip":
            buckets.append(v4_buckets(a.constants))
    b_table = np.concatenate(buckets) if buckets else np.zeros(0, np.int32)
    n_slots = max([qp.slot for qp in plan.queries] + [-1]) + 1
    by_signature: dict[tuple[int, ...], list[int]] = {}  # a signature's slots
    for qp in plan.queries:
        if qp.query.stream == stream:
            sig = tuple(sorted({local_bit[b] for b in qp.signature}))
            by_signature.setdefault(sig, []).append(qp.slot)
    g_start, g_len, g_bits, g_mask = signature_masks(by_signature, n_words(n_slots))
    return CompiledPrefilter(
        stream, plan.version, int_cols, ip_cols,
        np.array(a_col, np.int32), np.array(a_op, np.int32), np.array(a_neg, np.bool_),
        np.array(a_v, np.int64).reshape(-1, 2), np.array(a_ip, np.uint64).reshape(-1, 4),
        np.array(set_vals, np.int64), np.array(p_start, np.int32), np.array(p_len, np.int32),
        np.array(b_start, np.int32), np.array(b_len, np.int32), np.array(b_preds, np.int32),
        g_start, g_len, g_bits, g_mask,
        pred_ids, n_slots, ascs,
        np.array(asc_is_ip, np.bool_),
        np.array(asc_col, np.int32), np.array(asc_cstart, np.int32),
        np.array(asc_clen, np.int32), np.array(c_int, np.int64), np.array(c_hi, np.uint64),
        np.array(c_lo, np.uint64), qrb_words(ascs, n_words(n_slots)),
        qub_words(ascs, n_words(n_slots)), np.array(asc_tstart, np.int64),
        np.array(asc_tlen, np.int64), r_table, np.array(asc_bstart, np.int64), b_table)


@allocating_inline
def in_sorted(set_vals, start, count, x) -> bool:
    """x among set_vals[start:start + count] (sorted), by binary search."""
    lo = start
    hi = start + count
    while lo < hi:
        mid = (lo + hi) // 2
        if set_vals[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo < start + count and set_vals[lo] == x


# rows of a batch the prefilter kernel evaluates at a time: a chunk's predicate, bit and mask
# rows stay in the core's cache between the passes over them (a whole batch of 65,536 rows
# streamed the 50-query set's 47 rows of predicates and bits from memory on every pass)
CHUNK = 8192


@allocating
def _eval_atom_column(out, m, lo, a, ints, ip_hi, ip_lo, ip_ok, a_col, a_op, a_neg, a_v, a_ip,
                      set_vals, tmp):
    """out[i] |= atom a on tuple lo + i, for i < m: the operator is chosen once and the loop
    over tuples is branch-free (NULL is false, negated or not), over a contiguous slice of
    the column (so that it vectorizes); an IN of few constants is one pass per constant
    (``tmp``: scratch of m entries)."""
    op = a_op[a]
    c = a_col[a]
    neg = a_neg[a]
    if op == 8:
        vh, vl, mh, ml = a_ip[a, 0], a_ip[a, 1], a_ip[a, 2], a_ip[a, 3]
        hi_ = ip_hi[c, lo:lo + m]
        lo_ = ip_lo[c, lo:lo + m]
        ok_ = ip_ok[c, lo:lo + m]
        for i in range(m):
            hit = ((hi_[i] & mh) == vh) & ((lo_[i] & ml) == vl)
            out[i] |= (hit ^ neg) & ok_[i]
        return
    x_ = ints[c, lo:lo + m]
    v0 = a_v[a, 0]
    v1 = a_v[a, 1]
    if op == 0:
        for i in range(m):
            out[i] |= x_[i] == v0
    elif op == 1:
        for i in range(m):
            out[i] |= (x_[i] != v0) & (x_[i] >= 0)
    elif op == 2:
        for i in range(m):
            out[i] |= (x_[i] < v0) & (x_[i] >= 0)
    elif op == 3:
        for i in range(m):
            out[i] |= (x_[i] <= v0) & (x_[i] >= 0)
    elif op == 4:
        for i in range(m):
            out[i] |= x_[i] > v0
    elif op == 5:
        for i in range(m):
            out[i] |= x_[i] >= v0
    elif op == 7:
        for i in range(m):
            x = x_[i]
            out[i] |= (((x >= v0) & (x <= v1)) ^ neg) & (x >= 0)
    elif op == 9:  # bit test: (x & v0) == v1
        for i in range(m):
            x = x_[i]
            out[i] |= (((x & v0) == v1) ^ neg) & (x >= 0)
    else:  # IN: v0 = first constant, v1 = count
        hit = tmp[:m]
        if v1 <= 16:
            for i in range(m):
                hit[i] = False
            for k in range(v0, v0 + v1):
                v = set_vals[k]
                for i in range(m):
                    hit[i] |= x_[i] == v
        else:
            for i in range(m):
                hit[i] = in_sorted(set_vals, v0, v1, x_[i])
        for i in range(m):
            out[i] |= (hit[i] ^ neg) & (x_[i] >= 0)


@allocating
def prefilter_kernel(ints, ip_hi, ip_lo, ip_ok, a_col, a_op, a_neg, a_v, a_ip, set_vals,
                     p_start, p_len, b_start, b_len, b_preds, g_start, g_len, g_bits, g_mask,
                     B, Q):
    """Fill Q (n, slot words) and, when B has n rows, B (n, bit words); return the number of
    tuples with Q != 0.

    Column at a time, a chunk of rows (``CHUNK``) at a time: each predicate once over the
    chunk (an OR of its atoms), each composite bit the AND of its predicates (a one-predicate
    bit is its predicate's column), and the slots of signature g (``g_mask[g]``) where the
    bits of g are all set, i.e. (B & S_s) == S_s for each such slot s. The queries sharing a
    signature (most often one bit, or none) are set in one pass. Branch-free inner loops: a
    row-at-a-time loop with early exits spent ~13x more per tuple on the 50-query set
    (bench/bench_planner.py); packing B costs as much again, so it is optional. Copies and
    fills are loops too: numba's slice assignment took as long as the rest of the kernel.
    The backbone bench's 50 queries, per batch of 65,536: 1.55 ms before chunks, slices
    and shared signatures, 0.5 ms after."""
    n = Q.shape[0]
    words = Q.shape[1]
    size = max(min(CHUNK, n), 1)
    n_pred = p_start.shape[0]
    n_bits = b_start.shape[0]
    n_comp = 0
    for b in range(n_bits):
        n_comp += b_len[b] > 1
    M = np.empty((n_pred + n_comp, size), dtype=np.bool_)
    tmp = np.empty(size, dtype=np.bool_)
    word = np.empty(size, dtype=np.uint64)
    any_q = np.empty(size, dtype=np.bool_)
    bit_row = np.empty(n_bits, dtype=np.int64)
    kept = 0
    for lo in range(0, n, size):
        m = min(size, n - lo)
        for p in range(n_pred):
            row = M[p]
            for i in range(m):
                row[i] = False
            for a in range(p_start[p], p_start[p] + p_len[p]):
                _eval_atom_column(row, m, lo, a, ints, ip_hi, ip_lo, ip_ok, a_col, a_op,
                                  a_neg, a_v, a_ip, set_vals, tmp)
        c = n_pred
        for b in range(n_bits):
            if b_len[b] == 1:
                bit_row[b] = b_preds[b_start[b]]
                continue
            row = M[c]
            first = M[b_preds[b_start[b]]]
            for i in range(m):
                row[i] = first[i]
            for k in range(b_start[b] + 1, b_start[b] + b_len[b]):
                other = M[b_preds[k]]
                for i in range(m):
                    row[i] &= other[i]
            bit_row[b] = c
            c += 1
        if B.shape[0] == n:
            for b in range(n_bits):
                set_bit_rows(B[lo:lo + m], b, M[bit_row[b], :m])
        out = word[:m]
        seen = any_q[:m]
        for i in range(m):
            seen[i] = False
        for w in range(words):
            for i in range(m):
                out[i] = 0
            for g in range(g_start.shape[0]):
                mask = g_mask[g, w]
                if mask == 0:
                    continue
                if g_len[g] == 0:  # no bit: every tuple
                    for i in range(m):
                        out[i] |= mask
                    continue
                acc = M[bit_row[g_bits[g_start[g]]]]
                if g_len[g] > 1:  # the AND of its bits
                    for i in range(m):
                        tmp[i] = acc[i]
                    for k in range(g_start[g] + 1, g_start[g] + g_len[g]):
                        row = M[bit_row[g_bits[k]]]
                        for i in range(m):
                            tmp[i] &= row[i]
                    acc = tmp
                for i in range(m):
                    out[i] |= mask * np.uint64(acc[i])
            for i in range(m):
                Q[lo + i, w] = out[i]
                seen[i] |= out[i] != 0
        for i in range(m):
            kept += seen[i]
    return kept


def kernel_inputs(cp: CompiledPrefilter, tb: Batch
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The columns the kernels read: (ints, ip_hi, ip_lo, ip_ok) for the plan's fields; ``ip_ok[k]``
    says which tuples carry address field ``k`` (a flow record may lack its next hop)."""
    n = len(tb)
    ints = np.empty((len(cp.int_cols), n), dtype=np.int64)
    for k, name in enumerate(cp.int_cols):
        ints[k] = tb.column(name)
    ip_hi = np.empty((len(cp.ip_cols), n), dtype=np.uint64)
    ip_lo = np.empty((len(cp.ip_cols), n), dtype=np.uint64)
    ip_ok = np.empty((len(cp.ip_cols), n), dtype=np.bool_)  # each address field its own
    for k, name in enumerate(cp.ip_cols):
        ip_hi[k], ip_lo[k] = ip_words(tb.column(name))
        ip_ok[k] = tb.ip_valid(name)
    return ints, ip_hi, ip_lo, ip_ok


def run_prefilter(cp: CompiledPrefilter, tb: Batch, asc: AscRuntime | None = None,
                  want_b: bool = False) -> tuple[np.ndarray | None, np.ndarray]:
    """Q for every tuple of a batch (and B with ``want_b``): bits and signatures, then the
    ASCs (in the runtime's adaptive sequence, or in plan order)."""
    n = len(tb)
    ints, ip_hi, ip_lo, ip_ok = kernel_inputs(cp, tb)
    B = np.zeros((n if want_b else 0, n_words(len(cp.b_start))), dtype=np.uint64)
    Q = np.zeros((n, cp.q_words), dtype=np.uint64)
    prefilter_kernel(ints, ip_hi, ip_lo, ip_ok, *cp.kernel_arrays(), B, Q)
    if cp.ascs:
        if asc is None:
            asc = AscRuntime(cp, strategy="fixed")
        asc.run(ints, ip_hi, ip_lo, ip_ok, Q)
    return (B if want_b else None), Q
