"""One error family for capture, with context (dpkt's UnpackError, goflow2's FlowError).

Every error has ``kind``, the short metric label it is counted under (``truncated_block``,
``template_truncated``, ``bad_filter``), and ``reason``, the text a person reads; the message
adds where it happened: source, layer, byte offset, exporter and template id when known.
"""

from __future__ import annotations


class CaptureError(ValueError):
    """Base of the family: ``kind`` labels the metric, ``reason`` says why."""

    def __init__(self, reason: str, *, kind: str = "", offset: int | None = None,
                 layer: str = "", source: str = "", exporter: str = "",
                 template_id: int | None = None):
        self.reason = reason
        self.kind = kind or layer or type(self).__name__
        self.offset = offset
        self.layer = layer
        self.source = source
        self.exporter = exporter
        self.template_id = template_id
        where = ": ".join(p for p in (source, layer) if p)
        at = f" at byte {offset}" if offset is not None else ""
        ctx = []
        if exporter:
            ctx.append(f"exporter {exporter}")
        if template_id is not None:
            ctx.append(f"template {template_id}")
        tail = f" ({', '.join(ctx)})" if ctx else ""
        super().__init__(f"{where + ': ' if where else ''}{reason}{at}{tail}")


class DecodeError(CaptureError):
    """Input bytes that cannot be decoded: a capture file, a block, an export set."""


class StateError(CaptureError):
    """Saved state (flow templates, sampling) that cannot be read back."""


class FilterError(CaptureError):
    """A kernel filter libpcap refuses or cannot compile (or no libpcap)."""
