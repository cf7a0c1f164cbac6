"""The samples and counters streams' batches: a ``SampleBatch`` is a packets ``TupleBatch`` (the
sampled headers, unpacked by the packet kernel) with the sample's own columns beside it; a
``CounterBatch`` holds counter samples. Both are ``Batch``es (capture/batch.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from capture.batch import TupleBatch, ip_arrow
from capture.fields import (
    IP,
    NULL_INT,
    SKETCH,
    TS,
    decoded_fields,
    fields,
    ip_text,
    key_field,
    mask_addresses,
)


@dataclass
class SampleBatch(TupleBatch):
    """Flow samples: the packets columns of their headers, and ``extra`` (the sample's integer
    columns by catalogue name; its addresses are in ``ips`` with ``ip_ok``)."""

    extra: dict[str, np.ndarray] = field(default_factory=dict)

    def column(self, name: str) -> np.ndarray:
        col = self.extra.get(name)
        return col if col is not None else super().column(name)

    def take(self, idx: np.ndarray) -> SampleBatch:
        t = super().take(idx)
        return SampleBatch(t.stream, t.ts_ns, t.ints, t.ips, t.strings, t.ip_ok,
                           {k: v[idx] for k, v in self.extra.items()})

    def rows(self) -> list[dict]:
        return table_rows(self, "samples")


@dataclass
class CounterBatch:
    """Counter samples: integer columns by catalogue name (-1 NULL), addresses with validity."""

    ts_ns: np.ndarray
    ints: dict[str, np.ndarray]
    ips: dict[str, np.ndarray]
    ip_ok: dict[str, np.ndarray]
    stream: str = "counters"

    def __len__(self) -> int:
        return len(self.ts_ns)

    @property
    def time(self) -> np.ndarray:
        return self.ts_ns // 1_000_000_000

    def column(self, name: str) -> np.ndarray:
        if name == "ts":
            return self.ts_ns
        if name == "time":
            return self.time
        if name in self.ips:
            return self.ips[name]
        if name.startswith(SKETCH):
            return self.column(name[1:])
        base, bits = key_field(name)
        if bits is not None:
            return mask_addresses(self.column(base), bits)
        return self.ints[name]

    def ip_valid(self, name: str = "agent") -> np.ndarray:
        return self.ip_ok[key_field(name)[0]]

    def arrow(self, name: str) -> pa.Array:
        if name.startswith(SKETCH):
            return self.arrow(name[1:])
        if key_field(name)[1] is not None or fields(self.stream)[name].kind == IP:
            return ip_arrow(self.column(name), self.ip_valid(name))
        if name == "ts":
            return pa.array(self.ts_ns // 1000, type=pa.timestamp("us", tz="UTC"))
        col = self.column(name)
        if name == "time":
            return pa.array(col, type=pa.int64())
        return pa.array(col, type=fields(self.stream)[name].arrow_type, mask=col < 0)

    def take(self, idx: np.ndarray) -> CounterBatch:
        return CounterBatch(self.ts_ns[idx], {k: v[idx] for k, v in self.ints.items()},
                            {k: v[idx] for k, v in self.ips.items()},
                            {k: v[idx] for k, v in self.ip_ok.items()})

    def rows(self) -> list[dict]:
        return table_rows(self, "counters")


def table_rows(batch, stream: str) -> list[dict]:
    """Rows as dicts of Python values (addresses as text, ``ts`` in ns, NULL as None): tests and
    tools."""
    out: list[dict] = [{} for _ in range(len(batch))]
    for name, f in decoded_fields(stream).items():
        if f.kind == TS:
            vals = [int(v) for v in batch.ts_ns]
        elif f.kind == IP:
            col, ok = batch.column(name), batch.ip_valid(name)
            vals = [ip_text(col[i].tobytes()) if ok[i] else None for i in range(len(batch))]
        elif f.kind in ("string", "bytes"):
            vals = batch.arrow(name).to_pylist()
        else:
            col = batch.column(name)
            vals = [None if v == NULL_INT or v < 0 else int(v) for v in col]
        for r, v in zip(out, vals, strict=True):
            r[name] = v
    return out
