"""Prometheus metrics of every stage. One registry per collector, so tests can run several."""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version

from prometheus_client import (
    GC_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
)

LAG_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)


class Metrics:
    """The collector's counters and gauges (names are part of the documented interface)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # what every process is expected to export: its memory, CPU, open files, Python's
        # version and garbage collections, and what is running
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        r.register(GC_COLLECTOR)
        self.build = Info("flowsieve_build", "The running flowsieve, Python and Spark",
                          registry=r)
        self.build.info({"version": _version("flowsieve"), "pyspark": _version("pyspark"),
                         "python": platform.python_version()})
        self.source_idle = Gauge("flowsieve_source_idle_seconds", "Seconds since the source "
                                 "last delivered a tuple (since the daemon started, before its "
                                 "first): a stalled exporter or link", ["source"], registry=r)
        self.api_requests = Counter("flowsieve_api_requests", "API requests answered, by route "
                                    "template, method and status", ["route", "method", "status"],
                                    registry=r)
        self.api_seconds = Histogram("flowsieve_api_request_duration_seconds", "API request "
                                     "durations, by route template and method",
                                     ["route", "method"], registry=r,
                                     buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                                              5, 10, 30))
        self.alerts_firing = Gauge("flowsieve_alerts_firing", "Alert instances firing, by "
                                   "query", ["query"], registry=r)
        self.alert_notifications = Counter(
            "flowsieve_alert_notifications", "Alert notifications by receiver and outcome: "
            "sent, failed (an attempt; retried), dropped (beyond the receiver's max_pending)",
            ["receiver", "outcome"], registry=r)
        self.alert_delivery = Histogram(
            "flowsieve_alert_delivery_seconds", "From a notification's making (its window "
            "evaluated) to its delivery", ["receiver"], registry=r,
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300, 1800))
        self.alert_outbox = Gauge("flowsieve_alert_outbox", "Notifications waiting for a "
                                  "receiver", ["receiver"], registry=r)
        self.packets_in = Counter("flowsieve_packets_in", "Packets read from sources",
                                  ["source"], registry=r)
        self.bytes_in = Counter("flowsieve_bytes_in", "Captured bytes read from sources",
                                ["source"], registry=r)
        self.prefilter_dropped = Counter(
            "flowsieve_packets_dropped_prefilter",
            "Tuples no query can match (query mask 0 after the prefilter and residual)",
            ["stream"], registry=r)
        self.query_matched = Counter("flowsieve_query_tuples_matched",
                                     "Tuples that matched a query's WHERE clause", ["query"],
                                     registry=r)
        self.decode_errors = Counter("flowsieve_decode_errors", "Inputs rejected, by reason",
                                     ["source", "reason"], registry=r)
        self.residual_evals = Counter("flowsieve_residual_evaluations",
                                      "Residual predicate evaluations (one per tuple and "
                                      "predicate)", ["stream"], registry=r)
        self.residual_reorders = Counter("flowsieve_residual_reorders",
                                         "Times the residual predicates' order changed "
                                         "(A-Greedy or its variant)", ["stream"], registry=r)
        self.residual_cache = Counter("flowsieve_residual_cache_lookups",
                                      "Regular-expression and user-predicate outcomes looked "
                                      "up by value, by result (hit, miss)",
                                      ["stream", "result"], registry=r)
        self.residual_position = Gauge("flowsieve_residual_position",
                                       "Each residual predicate's position in the order it "
                                       "runs (0 first)", ["stream", "predicate"], registry=r)
        self.residual_profile = Gauge("flowsieve_residual_profile_probability",
                                      "Probability a dropped tuple is profiled now (A-Greedy; "
                                      "residual.profile_probability while the order is being "
                                      "learned, 1/64 of it once it holds or does not pay)",
                                      ["stream"], registry=r)
        self.residual_seconds = Counter("flowsieve_residual_seconds",
                                        "Time in the residual stage, by part (filter: the "
                                        "predicates' real work; profile: profiling and "
                                        "reordering)", ["stream", "part"], registry=r)
        self.residual_saved = Gauge("flowsieve_residual_saved_seconds",
                                    "Time the adaptive parts saved, net of their own cost "
                                    "(order: evaluations the learned order spared against the "
                                    "order before it, less profiling; cache: hits times a "
                                    "value's cost, less the look-ups), since the engine started",
                                    ["stream", "by"], registry=r)
        self.residual_cache_on = Gauge("flowsieve_residual_cache_on",
                                       "1 while the value cache is used for a predicate, 0 "
                                       "while it is off because it did not pay",
                                       ["stream", "predicate"], registry=r)
        self.residual_errors = Counter("flowsieve_residual_errors",
                                       "Values on which a user predicate raised (counted as "
                                       "false; each distinct value of a batch once)",
                                       ["predicate"], registry=r)
        self.asc_evaluations = Counter("flowsieve_asc_evaluations",
                                       "ASC region look-ups (one per tuple and ASC evaluated)",
                                       ["stream"], registry=r)
        self.asc_rearrangements = Counter("flowsieve_asc_rearrangements",
                                          "Times the ASC sequence was re-chosen (eq. 5)",
                                          ["stream"], registry=r)
        self.lfta_rows_in = Counter("flowsieve_lfta_rows_in",
                                    "Tuples merged into LFTA partial-aggregate tables",
                                    ["stream"], registry=r)
        self.lfta_rows_out = Counter("flowsieve_lfta_rows_out",
                                     "Partial-aggregate rows the LFTA tables flushed to the spool",
                                     ["stream"], registry=r)
        self.lfta_evicted = Counter("flowsieve_lfta_evicted_rows",
                                    "Partial rows flushed because their table was full (before "
                                    "their window closed)", ["stream"], registry=r)
        self.lfta_entries = Gauge("flowsieve_lfta_entries",
                                  "Groups held in the LFTA tables now", ["stream"], registry=r)
        self.lfta_bytes = Gauge("flowsieve_lfta_bytes",
                                "Memory of the LFTA tables (bounded by lfta.capacity per "
                                "node) and direct arrays",
                                ["stream"], registry=r)
        om = ["stream", "node"]
        self.om_rounds = Counter("flowsieve_om_rounds", "Windows OM scheduled a plan for, by "
                                 "maintained node", om, registry=r)
        self.om_hits = Counter("flowsieve_om_hits", "Rounds whose plan was the cheapest at the "
                               "selectivity and rate then observed", om, registry=r)
        self.om_moves = Counter("flowsieve_om_moves", "Times the estimates crossed into "
                                "another chart region", om, registry=r)
        self.om_switches = Counter("flowsieve_om_switches", "Times a node changed physical "
                                   "plan", om, registry=r)
        self.om_fidelity = Gauge("flowsieve_om_fidelity", "Hits per round so far", om,
                                 registry=r)
        self.om_plan = Gauge("flowsieve_om_plan", "The physical plan a node runs (1)",
                             [*om, "plan"], registry=r)
        self.lfta_flushes = Counter("flowsieve_lfta_flushes",
                                    "LFTA table flushes by reason (full, window, age, shutdown)",
                                    ["stream", "reason"], registry=r)
        self.spool_files = Counter("flowsieve_spool_files", "Spool files written",
                                   ["stream", "folder"], registry=r)
        self.spool_rows = Counter("flowsieve_spool_rows", "Rows written to the spool",
                                  ["stream", "folder"], registry=r)
        self.spool_dropped = Counter("flowsieve_spool_rows_dropped",
                                     "Spool rows (partial aggregates, selected tuples) a live "
                                     "source dropped, by reason (spool_full, disk_full)",
                                     ["stream", "source", "reason"], registry=r)
        self.spool_wait = Counter("flowsieve_spool_wait_seconds",
                                  "Time a source waited for room in a full spool "
                                  "(back-pressure of the block policy)", ["source"],
                                  registry=r)
        self.align_wait = Counter("flowsieve_source_align_wait_seconds",
                                  "Time a file source with its own times waited for the "
                                  "others to catch up (event-time alignment)", ["source"],
                                  registry=r)
        self.kernel_packets = Counter(
            "flowsieve_capture_kernel_packets",
            "Packets that passed the kernel filter of a live source (PACKET_STATISTICS)",
            ["source"], registry=r)
        self.kernel_drops = Counter(
            "flowsieve_capture_kernel_drops",
            "Packets or datagrams the kernel dropped: capture ring full (PACKET_STATISTICS) or "
            "socket receive buffer full (SO_RXQ_OVFL)",
            ["source"], registry=r)
        self.receive_errors = Counter(
            "flowsieve_flow_receive_errors",
            "Datagrams a flow listener failed to receive, by reason (truncated, errno name)",
            ["source", "reason"], registry=r)
        self.flows_in = Counter("flowsieve_flows_in", "Flow records decoded from exports",
                                ["source"], registry=r)
        self.flow_datagrams = Counter("flowsieve_flow_datagrams",
                                      "Export datagrams received by a flow listener",
                                      ["source"], registry=r)
        self.flow_sequence_lost = Counter(
            "flowsieve_flow_sequence_lost",
            "Exported units missing by sequence number (records for v5 and IPFIX, datagrams "
            "for v9 and sFlow)", ["source", "exporter"], registry=r)
        self.sflow_samples = Counter(
            "flowsieve_sflow_samples", "sFlow samples decoded, by kind (flow, counter)",
            ["source", "kind"], registry=r)
        self.sflow_samples_lost = Counter(
            "flowsieve_sflow_samples_lost",
            "sFlow flow samples missing by their data sources' sequence numbers (a datagram's "
            "loss is flowsieve_flow_sequence_lost, in datagrams)", ["source", "agent"],
            registry=r)
        self.flow_pending = Gauge("flowsieve_flow_pending_sets",
                                  "Data sets held until their template arrives", ["source"],
                                  registry=r)
        self.plan_version = Gauge("flowsieve_plan_version", "Version of the running plan",
                                  registry=r)
        self.queries = Gauge("flowsieve_queries", "Registered queries", registry=r)
        self.result_rows = Counter("flowsieve_query_result_rows",
                                   "Result rows written by the Spark job", ["query"], registry=r)
        self.spark_failures = Counter("flowsieve_spark_failures",
                                      "Spark streaming queries that stopped on an error (each "
                                      "is restarted after a back-off)", ["stream", "folder"],
                                      registry=r)
        self.spark_batch_errors = Counter(
            "flowsieve_spark_batch_errors", "Spark answer batches that raised, by the class of "
            "the Python exception (the message: /readyz, /healthz's spark_failures, the log)",
            ["stream", "folder", "exception"], registry=r)
        self.spool_bytes = Gauge("flowsieve_spool_bytes",
                                 "Bytes the spool holds now (files Spark has not read yet)",
                                 registry=r)
        self.spool_disk_full = Gauge("flowsieve_spool_disk_full",
                                     "1 while the spool's file system is full: sources wait "
                                     "(policy block) or drop (reason disk_full)", registry=r)
        self.spool_max_bytes = Gauge("flowsieve_spool_max_bytes",
                                     "spool.max_bytes: at it, a source waits or drops",
                                     registry=r)
        self.results_bytes = Gauge("flowsieve_results_bytes", "Bytes of answers a query holds "
                                   "(after retention)", ["query"], registry=r)
        self.results_removed = Counter("flowsieve_results_removed_files",
                                       "Answer files removed by retention, by reason (age, "
                                       "bytes)", ["query", "reason"], registry=r)
        self.spool_quarantined = Gauge("flowsieve_spool_quarantined_files",
                                       "Unreadable spool files set aside in <folder>/bad/",
                                       registry=r)
        self.spark_up = Gauge("flowsieve_spark_up", "1 while every Spark streaming query runs",
                              registry=r)
        self.spark_jvm_restarts = Counter("flowsieve_spark_jvm_restarts",
                                          "Times the Spark JVM died and a new one was started",
                                          registry=r)
        self.spark_batches = Counter("flowsieve_spark_batches", "Spark micro-batches completed",
                                     ["stream", "folder"], registry=r)
        self.spark_batch_seconds = Histogram(
            "flowsieve_spark_batch_duration_seconds", "Spark micro-batch durations (Spark's "
            "own progress reports)", ["stream", "folder"], registry=r,
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120))
        self.spark_input_rows = Counter("flowsieve_spark_input_rows",
                                        "Spool rows Spark's micro-batches read", ["stream",
                                                                                  "folder"],
                                        registry=r)
        self.spark_late_rows = Counter("flowsieve_spark_late_rows",
                                       "Rows Spark dropped as late, their window closed "
                                       "(older than its watermark): counted after Spark's "
                                       "own partial aggregation, so at most the spool rows "
                                       "lost", ["stream", "folder"],
                                       registry=r)
        self.query_avoided = Counter("flowsieve_query_invocations_avoided",
                                     "Tuples of a query's stream the prefilter kept from it "
                                     "(its bits or ASCs ruled the query out)", ["query"],
                                     registry=r)
        self.query_windows = Counter("flowsieve_query_windows_closed",
                                     "Windows answered (closed and written)", ["query"],
                                     registry=r)
        self.query_lag = Histogram("flowsieve_query_output_lag_seconds",
                                   "From a window's end to its answer written (each "
                                   "answer job's newest window of the query)", ["query"],
                                   registry=r, buckets=LAG_BUCKETS)
        self.enrich_tuples = Counter("flowsieve_enrich_tuples", "Tuples enriched (their "
                                     "fields looked up in the enrichment databases)",
                                     ["stream"], registry=r)
        self.enrich_seconds = Counter("flowsieve_enrich_seconds", "Time spent enriching",
                                      ["stream"], registry=r)
        self.enrich_reloads = Counter("flowsieve_enrich_reloads", "Enrichment databases "
                                      "loaded again (their file changed)", ["database"],
                                      registry=r)
        self.enrich_errors = Counter("flowsieve_enrich_reload_errors", "Enrichment databases "
                                     "that failed to load again (the one loaded before "
                                     "stays)", ["database"], registry=r)
        self.enrich_networks = Gauge("flowsieve_enrich_networks", "Networks of an enrichment "
                                     "database", ["database"], registry=r)
        self.enrich_bytes = Gauge("flowsieve_enrich_bytes", "Memory of an enrichment "
                                  "database's compiled index", ["database"], registry=r)
        self.snmp_polls = Counter("flowsieve_enrich_snmp_polls", "SNMP walks of a device's "
                                  "interfaces, by outcome (ok, or why not: requesttimedout, "
                                  "agent_error, …)", ["device", "outcome"], registry=r)
        self.snmp_interfaces = Gauge("flowsieve_enrich_snmp_interfaces", "Interfaces a device "
                                     "answered in its last good walk", ["device"], registry=r)
        self.rebuild_seconds = Histogram("flowsieve_rebuild_duration_seconds",
                                         "Plan rebuilds (register, delete, pause, rebuild)",
                                         registry=r, buckets=(0.005, 0.01, 0.025, 0.05, 0.1,
                                                              0.25, 0.5, 1, 2.5, 5))

    def forget_query(self, name: str) -> None:
        """Remove a deleted query's series (its name may come back as another query)."""
        for m in (self.query_matched, self.result_rows, self.query_avoided,
                  self.query_windows, self.query_lag, self.results_bytes):
            try:
                m.remove(name)
            except KeyError:
                pass
        for reason in ("age", "bytes"):
            try:
                self.results_removed.remove(name, reason)
            except KeyError:
                pass

    def counts(self) -> list[tuple[str, dict[str, str], float]]:
        """Every counter's series as (attribute, labels, value): what a worker process (a
        byte range of ``replay``) hands back for ``add`` in its parent."""
        out = []
        for attr, m in vars(self).items():
            if isinstance(m, Counter):
                for metric in m.collect():
                    out += [(attr, s.labels, s.value) for s in metric.samples
                            if s.name.endswith("_total") and s.value]
        return out

    def add(self, counts: list[tuple[str, dict[str, str], float]]) -> None:
        """Add ``counts`` (another Metrics' ``counts()``) to these counters."""
        for attr, labels, value in counts:
            m = getattr(self, attr)
            (m.labels(**labels) if labels else m).inc(value)


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"
