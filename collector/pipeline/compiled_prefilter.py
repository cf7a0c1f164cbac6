"""A plan's prefilter for one stream as the plain arrays the kernels read (prefilter.py runs
them; asc_runtime.py reorders their ASCs): atoms, predicates, bits, signatures and the ASCs'
constants. A rebuild makes new arrays, never new code.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from capture.fields import IP, fields, prefix_mask, split128
from planner.asc import ASC, qrb_words, qub_words
from planner.plan import Plan
from planner.slots import n_words, slot_mask

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
