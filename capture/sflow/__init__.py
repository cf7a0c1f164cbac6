"""sFlow v5: datagrams in, the ``samples`` and ``counters`` streams out.

A numba kernel walks a batch of datagrams sample by sample and record by record (flow samples
and expanded flow samples; raw packet headers, sampled Ethernet, IPv4 and IPv6, extended
switch, router and gateway records; counter samples and expanded ones with generic interface and
Ethernet counters). Each flow sample's raw header stays where it is in the datagram buffer and
goes through the packet kernel (capture/unpack.py), so the ``samples`` stream has every
``packets`` field and a packet query runs unchanged ``FROM samples``; the sample's own fields
(agent, sub-agent, data source, sampling rate, pool, drops, interfaces, the extended records')
stand beside them, and ``est_packets``/``est_bytes`` scale it by its rate. A record of a format
this decoder does not know is skipped by its length and counted; a length that runs past its
container drops the datagram, counted by reason.

The package: ``elements`` (sFlow's numbers and the kernel's tables), ``kernel`` (numba),
``sequences`` (datagram and sample sequence numbers: loss, late arrivals, agent restarts),
``decoder`` (datagrams to batches) and ``batch`` (the two streams' batches).
"""

from capture.sflow.batch import CounterBatch, SampleBatch
from capture.sflow.decoder import SflowBatch, SflowDecoder, capture_sflow

DEFAULT_SFLOW_PORTS: tuple[int, ...] = (6343,)

__all__ = ["DEFAULT_SFLOW_PORTS", "CounterBatch", "SampleBatch", "SflowBatch", "SflowDecoder",
           "capture_sflow"]
