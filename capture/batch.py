"""The batch every stage passes: catalogue columns keyed by field name.

``TupleBatch`` holds the packets stream's (and the samples stream's) columns as the unpack
kernels write them; ``capture/netflow/batch.py``'s ``FlowBatch`` holds flow records. Both are a
``Batch``: the prefilter, the residual predicates, the LFTA and the sampler read either through
this interface only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import pyarrow as pa

from capture.fields import (
    BYTES,
    ENRICHED_NAMES,
    IP,
    NULL_INT,
    PACKET_INT_INDEX,
    SKETCH,
    STRING,
    TS,
    fields,
    key_field,
    mask_addresses,
)
from capture.jit import kernel

C_IPV = PACKET_INT_INDEX["ip_version"]
_IP_FIELDS = tuple(f.name for f in fields("packets").values() if f.kind == IP)


class Batch(Protocol):
    """What a stage reads of a batch, whichever stream it is of."""

    stream: str

    def __len__(self) -> int: ...

    @property
    def time(self) -> np.ndarray:
        """Event time in seconds, per row."""

    def column(self, name: str) -> np.ndarray:
        """A numpy column: integers with -1 for NULL, addresses as (n, 16) uint8."""

    def ip_valid(self, name: str = "src_ip") -> np.ndarray:
        """Which rows carry address field ``name``."""

    def arrow(self, name: str) -> pa.Array:
        """One column as Arrow, with NULLs."""

    def take(self, idx: np.ndarray) -> Batch:
        """The rows at ``idx`` (an index array or boolean mask)."""


@dataclass
class TupleBatch:
    """Columns of one batch, keyed by catalogue field name (NULL = -1 for integers)."""

    stream: str
    ts_ns: np.ndarray
    ints: np.ndarray  # (len(PACKET_INT_FIELDS), n) int32
    ips: dict[str, np.ndarray]  # name -> (n, 16) uint8
    strings: dict[str, pa.Array] = field(default_factory=dict)
    ip_ok: dict[str, np.ndarray] = field(default_factory=dict)  # validity beside ip_version's

    def __len__(self) -> int:
        return len(self.ts_ns)

    @property
    def time(self) -> np.ndarray:
        return self.ts_ns // 1_000_000_000

    def column(self, name: str) -> np.ndarray:
        """A numpy column (integers: -1 is NULL; IPs: (n, 16) uint8)."""
        if name == "ts":
            return self.ts_ns
        if name == "time":
            return self.time
        if name in self.ips:
            return self.ips[name]
        if name.startswith(SKETCH):  # a sketch key reads its field
            return self.column(name[1:])
        base, bits = key_field(name)
        if bits is not None:  # an address prefix key (src_ip/24)
            return mask_addresses(self.column(base), bits)
        if name in ENRICHED_NAMES:  # not enriched (capture/enrich/)
            return np.full(len(self), NULL_INT, np.int64)
        if name in _IP_FIELDS:  # not unpacked for this plan
            return np.zeros((len(self), 16), np.uint8)
        return self.ints[PACKET_INT_INDEX[name]]

    def ip_valid(self, name: str = "src_ip") -> np.ndarray:
        """Which packets carry address field ``name`` (an IP packet carries its source and
        destination; a DNS answer its address)."""
        base = key_field(name)[0]
        if base in self.ip_ok:
            return self.ip_ok[base]
        if base in _IP_FIELDS and base not in ("src_ip", "dst_ip"):
            return np.zeros(len(self), np.bool_)  # not unpacked for this plan
        return self.ints[C_IPV] >= 0

    def arrow(self, name: str) -> pa.Array:
        """One column as Arrow, with NULLs."""
        if name.startswith(SKETCH):
            return self.arrow(name[1:])
        if key_field(name)[1] is not None:
            return ip_arrow(self.column(name), self.ip_valid(name))
        f = fields(self.stream)[name]
        if name in ENRICHED_NAMES:
            return pa.nulls(len(self), f.arrow_type)
        if f.kind in (STRING, BYTES):  # not unpacked for this plan: NULL
            return self.strings.get(name, pa.nulls(len(self), f.arrow_type))
        if f.kind == TS:
            return pa.array(self.ts_ns // 1000, type=pa.timestamp("us", tz="UTC"))
        if f.kind == IP:
            if name not in self.ips:
                return pa.nulls(len(self), pa.binary())
            return ip_arrow(self.ips[name], self.ip_valid(name))
        col = self.column(name)
        if name == "time":
            return pa.array(col, type=pa.int64())
        return pa.array(col, type=f.arrow_type, mask=col < 0)

    def take(self, idx: np.ndarray) -> TupleBatch:
        """The rows at ``idx`` (an index array or boolean mask)."""
        return TupleBatch(self.stream, self.ts_ns[idx], self.ints[:, idx],
                          {k: v[idx] for k, v in self.ips.items()},
                          {k: v.filter(pa.array(idx)) if np.asarray(idx).dtype == bool
                           else v.take(pa.array(idx)) for k, v in self.strings.items()},
                          {k: v[idx] for k, v in self.ip_ok.items()})


def validity_buffer(valid: np.ndarray):
    return None if valid.all() else pa.array(valid).buffers()[1]


def ip_arrow(col: np.ndarray, valid: np.ndarray) -> pa.Array:
    """(n, 16) bytes as an Arrow binary array without a Python loop."""
    n = len(col)
    offsets = np.arange(0, 16 * (n + 1), 16, dtype=np.int32)
    return pa.Array.from_buffers(
        pa.binary(), n, [validity_buffer(valid), pa.py_buffer(offsets.tobytes()),
                         pa.py_buffer(np.ascontiguousarray(col).tobytes())],
        null_count=int((~valid).sum()))


@kernel
def address_words(col, ok, out):
    """Addresses (n, 16 bytes) as ``out`` rows (validity, high half, low half), big-endian
    halves as int64; zero words for a tuple without the address (a third of the time of
    numpy's byte-swapping cast)."""
    for i in range(col.shape[0]):
        hi = np.uint64(0)
        lo = np.uint64(0)
        if ok[i]:
            for b in range(8):
                hi = (hi << np.uint64(8)) | np.uint64(col[i, b])
                lo = (lo << np.uint64(8)) | np.uint64(col[i, 8 + b])
        out[i, 0] = 1 if ok[i] else 0
        out[i, 1] = np.int64(hi)
        out[i, 2] = np.int64(lo)


def ip_words(col: np.ndarray, ok: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(n, 16) address bytes as big-endian (hi, lo) uint64 words (zero where ``ok`` is
    False), by ``address_words``."""
    n = len(col)
    out = np.empty((n, 3), np.int64)
    address_words(np.ascontiguousarray(col), np.ones(n, np.bool_) if ok is None else ok, out)
    return (np.ascontiguousarray(out[:, 1]).view(np.uint64),
            np.ascontiguousarray(out[:, 2]).view(np.uint64))
