"""Sources' own statistics as counters: a flow listener's datagrams, kernel drops and receive
errors, a live capture's kernel packets and drops, and a flow decoder's errors, sequence loss
and pending sets. Each is reported as a running total by the source; ``Totals`` turns a total
into the increment since the last report."""

from __future__ import annotations

from collector.metrics import Metrics


class Totals:
    """The last total seen per key: a counter is incremented by what a total grew by."""

    def __init__(self):
        self._seen: dict = {}

    def add(self, counter, key, total: int) -> None:
        seen = self._seen.get(key, 0)
        if total > seen:
            counter.inc(total - seen)
            self._seen[key] = total


def stats_callback(metrics: Metrics, cfg):
    """The callback a source reports its cumulative statistics to, as counters."""
    return listener_stats(metrics, cfg.name) if cfg.listens else \
        kernel_stats(metrics, cfg.name)


def listener_stats(metrics: Metrics, name: str):
    """A callback turning a flow listener's cumulative statistics into counters."""
    totals = Totals()
    metrics.kernel_drops.labels(name)  # exported as 0 from the start
    metrics.flow_datagrams.labels(name)

    def update(st) -> None:
        totals.add(metrics.flow_datagrams.labels(name), "datagrams", st.datagrams)
        totals.add(metrics.kernel_drops.labels(name), "drops", st.kernel_drops)
        for reason, n in list(st.errors.items()):
            totals.add(metrics.receive_errors.labels(name, reason), reason, n)
    return update


def kernel_stats(metrics: Metrics, name: str):
    """A callback turning a live source's cumulative kernel statistics into counters."""
    totals = Totals()
    metrics.kernel_packets.labels(name)  # exported as 0 from the start
    metrics.kernel_drops.labels(name)

    def update(k) -> None:
        totals.add(metrics.kernel_packets.labels(name), "packets", k.packets)
        totals.add(metrics.kernel_drops.labels(name), "drops", k.drops)
    return update


class FlowCounters:
    """A flow or sFlow source's decoder counters (errors by reason, sequence loss per exporter
    or agent, sets pending a template, sFlow samples decoded and lost) as metric increments,
    after each batch."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self._totals: dict[str, Totals] = {}

    def update(self, src) -> None:
        totals = self._totals.setdefault(src.name, Totals())
        dec, m = src.decoder, self.metrics
        errors = getattr(dec, "all_errors", dec.errors)  # sFlow's: with what it skipped
        for reason, n in list(errors.items()):
            totals.add(m.decode_errors.labels(src.name, reason), reason, n)
        flow = counter = 0
        for st in dec.streams():
            # an exporter's streams (v9/IPFIX domains, sFlow sub-agents) add to its counter
            key = (st["exporter"], st.get("version"), st.get("observation_domain"),
                   st.get("sub_agent"))
            totals.add(m.flow_sequence_lost.labels(src.name, st["exporter"]), ("lost", key),
                       st["sequence"]["lost"])
            if st.get("protocol") == "sflow":
                totals.add(m.sflow_samples_lost.labels(src.name, st["exporter"]),
                           ("samples lost", key), st["samples"]["lost"])
                flow += st["samples"]["flow"]
                counter += st["samples"]["counter"]
        if hasattr(dec, "pending_sets"):
            m.flow_pending.labels(src.name).set(dec.pending_sets)
        else:
            feed = getattr(src, "counters", None)  # sFlow: its counters stream's queue full
            if feed is not None:
                totals.add(m.decode_errors.labels(src.name, "sflow_counters_queue_full"),
                           "counters queue full", feed.dropped)
            totals.add(m.sflow_samples.labels(src.name, "flow"), "flow samples", flow)
            totals.add(m.sflow_samples.labels(src.name, "counter"), "counter samples", counter)
