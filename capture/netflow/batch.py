"""The flows stream's batches: export datagrams in (``Datagrams``), flow records out
(``FlowBatch``: catalogue columns, the same interface as the packets stream's TupleBatch)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from capture.batch import ip_arrow
from capture.fields import (
    ENRICHED_NAMES,
    IP,
    NULL_INT,
    SKETCH,
    TS,
    fields,
    ip_bytes,
    ip_text,
    key_field,
    mask_addresses,
)
from capture.netflow.elements import C_TIME, FLOW_INT_FIELDS, FLOW_INT_INDEX, FLOW_IP_FIELDS, F


@dataclass
class Datagrams:
    """Export datagrams of one batch: payload bytes in place, exporter address, arrival time."""

    buf: np.ndarray  # uint8
    offset: np.ndarray  # int64
    length: np.ndarray  # int32
    exporter: np.ndarray  # (n, 16) uint8, IPv4 as IPv4-mapped
    ts_ns: np.ndarray  # int64 arrival (capture) time
    flags: np.ndarray | None = None  # uint8 per datagram (REPLAY)

    def __len__(self) -> int:
        return len(self.offset)

    @classmethod
    def from_payloads(cls, payloads: list[bytes], exporter: str = "127.0.0.1",
                      ts_ns: int | None = None) -> Datagrams:
        """Datagrams from raw payloads (files of export bytes, tests)."""
        n = len(payloads)
        lengths = np.array([len(p) for p in payloads], dtype=np.int32)
        offset = np.zeros(n, np.int64)
        if n:
            offset[1:] = np.cumsum(lengths[:-1])
        buf = np.frombuffer(b"".join(payloads), dtype=np.uint8).copy() if n else \
            np.zeros(0, np.uint8)
        exp = np.tile(np.frombuffer(ip_bytes(exporter), np.uint8), (n, 1))
        ts = np.full(n, time.time_ns() if ts_ns is None else ts_ns, np.int64)
        return cls(buf, offset, lengths, exp, ts)


@dataclass
class FlowBatch:
    """Flow records of one batch, keyed by catalogue field name (NULL = -1 for integers; times
    in ns). Same interface as the packets stream's TupleBatch."""

    ints: np.ndarray  # (len(FLOW_INT_FIELDS), n) int64
    ips: np.ndarray  # (4, n, 16) uint8: exporter, src_ip, dst_ip, next_hop
    ipset: np.ndarray  # (4, n) bool
    stream: str = "flows"
    strings: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return self.ints.shape[1]

    @property
    def time(self) -> np.ndarray:
        return self.ints[C_TIME]

    def column(self, name: str) -> np.ndarray:
        if name in FLOW_IP_FIELDS:
            return self.ips[FLOW_IP_FIELDS.index(name)]
        if name.startswith(SKETCH):  # a sketch key reads its field
            return self.column(name[1:])
        base, bits = key_field(name)
        if bits is not None:  # an address prefix key (src_ip/24)
            return mask_addresses(self.column(base), bits)
        if name in ENRICHED_NAMES:  # not enriched (capture/enrich/)
            return np.full(len(self), NULL_INT, np.int64)
        return self.ints[FLOW_INT_INDEX[name]]

    def ip_valid(self, name: str = "src_ip") -> np.ndarray:
        """Which records carry address field ``name`` (or the prefix key of it)."""
        return self.ipset[FLOW_IP_FIELDS.index(key_field(name)[0])]

    def arrow(self, name: str) -> pa.Array:
        if name.startswith(SKETCH):
            return self.arrow(name[1:])
        if key_field(name)[1] is not None:
            return ip_arrow(self.column(name), self.ip_valid(name))
        if name in ENRICHED_NAMES:
            return pa.nulls(len(self), fields("flows")[name].arrow_type)
        f = F[name]
        if f.kind == IP:
            k = FLOW_IP_FIELDS.index(name)
            return ip_arrow(self.ips[k], self.ipset[k])
        col = self.ints[FLOW_INT_INDEX[name]]
        if f.kind == TS:
            return pa.array(col // 1000, type=pa.timestamp("us", tz="UTC"), mask=col < 0)
        return pa.array(col, type=f.arrow_type, mask=col < 0)

    def take(self, idx: np.ndarray) -> FlowBatch:
        return FlowBatch(self.ints[:, idx], self.ips[:, idx], self.ipset[:, idx])

    @classmethod
    def concat(cls, batches: list[FlowBatch]) -> FlowBatch:
        if not batches:
            return empty_flows(0)
        return cls(np.concatenate([b.ints for b in batches], axis=1),
                   np.concatenate([b.ips for b in batches], axis=1),
                   np.concatenate([b.ipset for b in batches], axis=1))

    def rows(self) -> list[dict]:
        """Records as dicts of Python values (addresses as text, times in ns): tests, tools."""
        out = []
        for i in range(len(self)):
            r = {}
            for name in F:
                if name in FLOW_IP_FIELDS:
                    k = FLOW_IP_FIELDS.index(name)
                    r[name] = ip_text(self.ips[k, i].tobytes()) if self.ipset[k, i] \
                        else None
                else:
                    v = int(self.ints[FLOW_INT_INDEX[name], i])
                    r[name] = None if v < 0 else v
            out.append(r)
        return out


def empty_flows(n: int) -> FlowBatch:
    return FlowBatch(np.full((len(FLOW_INT_FIELDS), n), NULL_INT, np.int64),
                     np.zeros((4, n, 16), np.uint8), np.zeros((4, n), np.bool_))
