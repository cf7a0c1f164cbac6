"""Prometheus metrics of every stage. One registry per collector, so tests can run several."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class Metrics:
    """The collector's counters and gauges (names are part of the documented interface)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
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
                                "Memory of the LFTA tables (bounded by lfta.capacity per node)",
                                ["stream"], registry=r)
        self.lfta_flushes = Counter("flowsieve_lfta_flushes",
                                    "LFTA table flushes by reason (full, window, age, shutdown)",
                                    ["stream", "reason"], registry=r)
        self.spool_files = Counter("flowsieve_spool_files", "Spool files written",
                                   ["stream", "folder"], registry=r)
        self.spool_rows = Counter("flowsieve_spool_rows", "Rows written to the spool",
                                  ["stream", "folder"], registry=r)
        self.spool_dropped = Counter("flowsieve_spool_rows_dropped",
                                     "Rows dropped because the spool was full", ["stream"],
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
            "for v9)", ["source", "exporter"], registry=r)
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
        self.spool_quarantined = Gauge("flowsieve_spool_quarantined_files",
                                       "Unreadable spool files set aside in <folder>/bad/",
                                       registry=r)
        self.spark_up = Gauge("flowsieve_spark_up", "1 while every Spark streaming query runs",
                              registry=r)
        self.spark_batches = Counter("flowsieve_spark_batches", "Spark micro-batches completed",
                                     ["stream", "folder"], registry=r)
