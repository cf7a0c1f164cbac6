"""The Spark driver JVM's own figures in the daemon's /metrics: heap and non-heap memory,
garbage collections, threads, read from the JVM's management beans through Py4J when Prometheus
scrapes (Spark's UI and its metrics servlet are off). Nothing is exported while no JVM runs."""

from __future__ import annotations

import logging

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pyspark import SparkContext

log = logging.getLogger("flowsieve.spark")

# (name, type, help, labels): what ``collect`` exports, declared for the registry (and the
# dashboard's check) without asking a JVM
FAMILIES = (
    ("flowsieve_jvm_memory_bytes", "gauge", "Spark driver JVM memory by area (heap, nonheap) "
     "and kind (used, committed, max)", ("area", "kind")),
    ("flowsieve_jvm_gc_collections", "counter", "Spark driver JVM garbage collections, by "
     "collector", ("gc",)),
    ("flowsieve_jvm_gc_seconds", "counter", "Time the Spark driver JVM spent in garbage "
     "collection, by collector", ("gc",)),
    ("flowsieve_jvm_threads", "gauge", "Live threads of the Spark driver JVM", ()),
    ("flowsieve_jvm_uptime_seconds", "gauge", "Seconds since the Spark driver JVM started "
     "(it restarts when it dies: flowsieve_spark_jvm_restarts_total)", ()),
)


def _family(name: str, kind: str, doc: str, labels) -> GaugeMetricFamily | CounterMetricFamily:
    cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
    return cls(name, doc, labels=list(labels))


class JvmCollector:
    """A Prometheus collector over the JVM this process launched for Spark (the gateway
    pyspark holds now: a JVM started again after a death is the one read)."""

    def describe(self):
        return [_family(*f) for f in FAMILIES]

    def collect(self):
        gateway = SparkContext._gateway
        if gateway is None:
            return []
        try:
            beans = gateway.jvm.java.lang.management.ManagementFactory
            memory = beans.getMemoryMXBean()
            fams = {f[0]: _family(*f) for f in FAMILIES}
            mem = fams["flowsieve_jvm_memory_bytes"]
            for area, usage in (("heap", memory.getHeapMemoryUsage()),
                                ("nonheap", memory.getNonHeapMemoryUsage())):
                mem.add_metric([area, "used"], usage.getUsed())
                mem.add_metric([area, "committed"], usage.getCommitted())
                if usage.getMax() >= 0:  # -1: undefined
                    mem.add_metric([area, "max"], usage.getMax())
            for gc in beans.getGarbageCollectorMXBeans():
                name = gc.getName()
                fams["flowsieve_jvm_gc_collections"].add_metric(
                    [name], max(0, gc.getCollectionCount()))
                fams["flowsieve_jvm_gc_seconds"].add_metric(
                    [name], max(0, gc.getCollectionTime()) / 1000)
            fams["flowsieve_jvm_threads"].add_metric(
                [], beans.getThreadMXBean().getThreadCount())
            fams["flowsieve_jvm_uptime_seconds"].add_metric(
                [], beans.getRuntimeMXBean().getUptime() / 1000)
            return list(fams.values())
        except Exception as e:  # noqa: BLE001 - a JVM dying or gone: no figures this scrape
            log.debug("JVM metrics: %s", e)
            return []
