"""A batch with its enrichment columns beside it: any ``Batch`` (capture/batch.py) of any stream,
with the fields ``Enrichment.apply`` computed. Every stage reads it through the Batch interface."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from capture.fields import CODE, NULL_INT, SKETCH, code_texts, fields


class EnrichedBatch:
    """``base`` and enrichment columns by catalogue name (integers; -1 NULL)."""

    def __init__(self, base, cols: dict[str, np.ndarray], source=None):
        # source: the Enrichment that computed them (the texts of its text codes)
        self.base, self.cols, self.stream, self.source = base, cols, base.stream, source

    def __len__(self) -> int:
        return len(self.base)

    def __getattr__(self, name: str):  # ts_ns, caplen … of the batch underneath
        return getattr(self.base, name)

    @property
    def time(self) -> np.ndarray:
        return self.base.time

    def column(self, name: str) -> np.ndarray:
        col = self.cols.get(name.lstrip(SKETCH))
        return col if col is not None else self.base.column(name)

    def ip_valid(self, name: str = "src_ip") -> np.ndarray:
        return self.base.ip_valid(name)

    def arrow(self, name: str) -> pa.Array:
        base = name.lstrip(SKETCH)
        col = self.cols.get(base)
        if col is None:
            return self.base.arrow(name)
        f = fields(self.stream)[base]
        if f.kind == CODE:
            return code_texts(col) if f.codec == "letters" else self.source.text_array(col)
        return pa.array(col, type=f.arrow_type, mask=col < 0)

    def take(self, idx: np.ndarray) -> EnrichedBatch:
        return EnrichedBatch(self.base.take(idx), {k: v[idx] for k, v in self.cols.items()},
                             self.source)

    def rows(self) -> list[dict]:
        """Rows as dicts (tests and tools): the batch's, and the enrichment fields (codes as
        text)."""
        out = self.base.rows()
        for name in self.cols:
            vals = self.arrow(name).to_pylist()
            for r, v in zip(out, vals, strict=True):
                r[name] = v if v is None or isinstance(v, str) or v != NULL_INT else None
        return out
