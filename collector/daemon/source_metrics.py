"""Sources' own statistics as counters: a flow listener's datagrams, kernel drops and receive
errors, a live capture's kernel packets and drops (each reported cumulatively by the source, as
increments here), and a flow decoder's errors, sequence loss and pending sets."""

from __future__ import annotations

from collector.metrics import Metrics


def stats_callback(metrics: Metrics, cfg):
    """The callback a source reports its cumulative statistics to, as counters."""
    return listener_stats(metrics, cfg.name) if cfg.type == "netflow" else \
        kernel_stats(metrics, cfg.name)


def listener_stats(metrics: Metrics, name: str):
    """A callback turning a flow listener's cumulative statistics into counters."""
    seen = [0, 0]
    metrics.kernel_drops.labels(name)
    metrics.flow_datagrams.labels(name)

    errors: dict[str, int] = {}

    def update(st) -> None:
        if st.datagrams > seen[0]:
            metrics.flow_datagrams.labels(name).inc(st.datagrams - seen[0])
        if st.kernel_drops > seen[1]:
            metrics.kernel_drops.labels(name).inc(st.kernel_drops - seen[1])
        seen[0], seen[1] = max(seen[0], st.datagrams), max(seen[1], st.kernel_drops)
        for reason, n in list(st.errors.items()):
            if n > errors.get(reason, 0):
                metrics.receive_errors.labels(name, reason).inc(n - errors.get(reason, 0))
                errors[reason] = n
    return update


def kernel_stats(metrics: Metrics, name: str):
    """A callback turning a live source's cumulative kernel statistics into counters."""
    seen = [0, 0]
    metrics.kernel_packets.labels(name)  # exported as 0 from the start
    metrics.kernel_drops.labels(name)

    def update(k) -> None:
        if k.packets > seen[0]:
            metrics.kernel_packets.labels(name).inc(k.packets - seen[0])
        if k.drops > seen[1]:
            metrics.kernel_drops.labels(name).inc(k.drops - seen[1])
        seen[0], seen[1] = max(seen[0], k.packets), max(seen[1], k.drops)
    return update


class FlowCounters:
    """A flow source's decoder counters (errors by reason, sequence loss, sets pending a
    template) turned into metric increments after each batch."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self._seen: dict[str, dict] = {}

    def update(self, src) -> None:
        """Decoder counters (errors by reason, sequence loss) as metric increments."""
        seen = self._seen.setdefault(src.name, {})
        dec = src.decoder
        for reason, n in list(dec.errors.items()):
            if n > seen.get(reason, 0):
                self.metrics.decode_errors.labels(src.name, reason).inc(n - seen.get(reason, 0))
                seen[reason] = n
        for st in dec.streams():
            k = ("lost", st["exporter"])
            lost = seen.get(k, 0)
            if st["sequence"]["lost"] > lost:
                self.metrics.flow_sequence_lost.labels(src.name, st["exporter"]).inc(
                    st["sequence"]["lost"] - lost)
                seen[k] = st["sequence"]["lost"]
        self.metrics.flow_pending.labels(src.name).set(dec.pending_sets)
