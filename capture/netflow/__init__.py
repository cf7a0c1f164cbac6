"""NetFlow v5, v9 and IPFIX: export datagrams in, flow records (catalogue columns) out.

One numba kernel walks a batch of datagrams set by set and decodes every data record through its
template's compiled field table (an operation, a target column and a length per field; IPFIX
variable-length fields read their length in line). NetFlow v5 is a built-in template. Whatever is
rare and stateful — template and options-template sets, options data (sampling), data whose
template has not arrived yet — makes the kernel return where it stopped; Python handles that one
set and the kernel resumes after it, so in-datagram order is kept (a data set before its template
in the same datagram waits in the pending buffer and is decoded when the template comes).

State is kept per exporter address and per export stream (exporter, version, source id /
observation domain): templates, sampling, sequence numbers. ``TemplateStore.save``/``load`` keep
templates and sampling across restarts (under ``var/``).

Sampling rule: a configured per-exporter override wins; then the record's own sampling fields
(samplingInterval 34, samplerRandomInterval 50, samplingPacketInterval/Space 305/306); then the
options data of its sampler id (48/302), then the stream's latest options sampling; for v5 the
header's interval (0 means unsampled: 1). When none is known the record gets
``default_sampling_interval`` (1: the exporter is assumed unsampled, as nfdump and pmacct do) and
is counted in ``sampling_unknown``. ``est_packets``/``est_bytes`` = ``packets``/``bytes`` ×
``sampling_interval``.

The package, by concern: ``elements`` (the information elements and the kernel's constants),
``kernel`` (numba), ``templates`` (templates, their compiled tables, persistence), ``decoder``
(the kernel's driver with its pending buffer and counters), ``batch`` (datagrams in, flow records
out) and ``exports`` (export datagrams inside packet captures).
"""

from capture.netflow.batch import Datagrams, FlowBatch, empty_flows
from capture.netflow.decoder import Decoder
from capture.netflow.elements import FLOW_INT_FIELDS, FLOW_INT_INDEX, FLOW_IP_FIELDS, KERNEL_REASONS
from capture.netflow.exports import DEFAULT_FLOW_PORTS, capture_flows, export_datagrams
from capture.netflow.templates import Template, TemplateStore

__all__ = ["DEFAULT_FLOW_PORTS", "FLOW_INT_FIELDS", "FLOW_INT_INDEX", "FLOW_IP_FIELDS",
           "KERNEL_REASONS", "Datagrams", "Decoder", "FlowBatch", "Template", "TemplateStore",
           "capture_flows", "empty_flows", "export_datagrams"]
