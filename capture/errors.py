"""One error family for bad input, with context (dpkt's UnpackError, goflow2's FlowError)."""

from __future__ import annotations


class DecodeError(ValueError):
    """Input that cannot be decoded: where (byte offset), in which layer, and why."""

    def __init__(self, reason: str, *, offset: int | None = None, layer: str = "",
                 source: str = "", exporter: str = "", template_id: int | None = None,
                 kind: str = ""):
        self.reason = reason
        self.kind = kind or layer  # short metric label, e.g. "truncated_record_data"
        self.offset = offset
        self.layer = layer
        self.source = source
        self.exporter = exporter
        self.template_id = template_id
        parts = [p for p in (source, layer) if p]
        where = ": ".join(parts)
        at = f" at byte {offset}" if offset is not None else ""
        tmpl = f" (exporter {exporter}, template {template_id})" if exporter else ""
        super().__init__(f"{where + ': ' if where else ''}{reason}{at}{tmpl}")
