"""The decoder: datagrams in, a ``SampleBatch`` (flow samples, their headers unpacked by the
packet kernel) and a ``CounterBatch`` (counter samples) out; per agent and sub-agent the datagram
sequence, per data source the sample sequence, and counters of what was dropped or skipped, by
reason."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from capture.errors import DecodeError
from capture.fields import COUNTER_FIELDS, IP, NULL_INT, PACKET_INT_INDEX, fields, ip_bytes, ip_text
from capture.jit import readonly
from capture.netflow.batch import Datagrams
from capture.records import RawBatch
from capture.sflow.batch import CounterBatch, SampleBatch
from capture.sflow.elements import (
    CS,
    CS_COLS,
    DATAGRAM_REASONS,
    DG,
    DG_COLS,
    FI,
    FS,
    FS_COLS,
    FS_IPS,
    HEADER_LINKTYPE,
    REASON_TEXT,
    SKIP_REASONS,
)
from capture.sflow.kernel import count_samples, decode_sflow
from capture.sflow.sequences import (
    Q_COUNT,
    Q_GAPS,
    Q_LAST_NS,
    Q_LATE,
    Q_LOST,
    Q_NEXT,
    Q_RESTARTS,
    Q_UPTIME,
    Sequences,
)
from capture.unpack import unpack

_PACKET_FIELDS = frozenset(fields("packets"))
_LINKTYPE = np.full(256, -1, np.int32)
for _proto, _lt in HEADER_LINKTYPE.items():
    _LINKTYPE[_proto] = _lt
# the sample's own columns, as the kernel's table has them
_DIRECT = ("source_id_type", "source_id", "sampling_rate", "sample_pool", "drops",
           "output_if_format", "header_protocol", "frame_length", "src_vlan", "dst_vlan",
           "src_priority", "dst_priority", "src_mask", "dst_mask", "router_as", "src_as",
           "src_peer_as", "dst_peer_as", "dst_as", "as_path_len", "community", "local_pref")
_COUNTER_INTS = tuple(f.name for f in COUNTER_FIELDS if f.kind != IP and f.name not in
                      ("ts", "time"))
INT32_MAX = (1 << 31) - 1


def _within(col: np.ndarray, hi: int, dtype=np.int32) -> np.ndarray:
    """``col`` where 0 <= value <= hi, else NULL."""
    return np.where((col >= 0) & (col <= hi), col, NULL_INT).astype(dtype)


def _bounded(stream: str, cols: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each column within its catalogue field's range (an sFlow word is 32 bits, a VLAN 12, a
    32-bit field's value may not fit int32): a value outside it is NULL."""
    cat = fields(stream)
    for name, col in cols.items():
        f = cat[name]
        hi = f.values - 1 if f.values else (INT32_MAX if f.kind == "int32" else None)
        if hi is not None:
            cols[name] = _within(col, hi, np.int64)
    return cols


class SflowDecoder:
    """Decodes batches of sFlow v5 datagrams; keeps the agents' sequences and counters."""

    def __init__(self, max_agents: int = 65536):
        self.max_agents = max_agents
        self.agents: dict[bytes, int] = {}
        self.agent_names: list[str] = []
        self.datagrams = Sequences()  # key (agent, sub-agent, 0)
        self.samples = Sequences()  # key (agent, sub-agent, source type << 32 | index)
        self.errors: dict[str, int] = {}
        self.skipped = np.zeros(len(SKIP_REASONS), np.int64)
        self.last_error: dict[str, DecodeError] = {}
        self.counter_samples: dict[tuple[int, int], int] = {}

    # -- agents
    def _agent(self, addr: bytes) -> int:
        a = self.agents.get(addr)
        if a is None:
            if len(self.agent_names) >= self.max_agents:
                return -1
            a = len(self.agent_names)
            self.agents[addr] = a
            self.agent_names.append(ip_text(addr))
        return a

    def _count(self, reason: str, n: int, agent: str = "") -> None:
        self.errors[reason] = self.errors.get(reason, 0) + n
        if agent:
            self.last_error[agent] = DecodeError(REASON_TEXT.get(reason, reason), kind=reason,
                                                 layer="sflow", exporter=agent)

    @property
    def all_errors(self) -> dict[str, int]:
        """Datagrams dropped and records skipped, by reason."""
        out = dict(self.errors)
        for reason, n in zip(SKIP_REASONS, self.skipped.tolist(), strict=True):
            if n:
                out[reason] = n
        return out

    # -- decoding
    def decode(self, dg: Datagrams) -> SflowBatch:
        """A batch of datagrams decoded, in order: its flow samples' headers are unpacked when
        the ``samples`` stream is asked for (with the fields the plan reads)."""
        n = len(dg)
        flows, counters = np.zeros(n, np.int64), np.zeros(n, np.int64)
        buf = readonly(dg.buf)  # one type whatever the source
        count_samples(buf, dg.offset, dg.length, flows, counters)
        nf, nc = int(flows.sum()), int(counters.sum())
        table = np.empty((len(DG_COLS), n), np.int64)
        agent = np.zeros((n, 16), np.uint8)
        fs = np.empty((len(FS_COLS), nf), np.int64)
        fips = np.zeros((len(FS_IPS), nf, 16), np.uint8)
        fipset = np.zeros((len(FS_IPS), nf), np.bool_)
        cs = np.empty((len(CS_COLS), nc), np.int64)
        nf, nc = decode_sflow(buf, dg.offset, dg.length, table, agent, fs, fips, fipset, cs,
                              self.skipped)
        fs, fips, fipset, cs = fs[:, :nf], fips[:, :nf], fipset[:, :nf], cs[:, :nc]
        status = table[DG["status"]]
        ok = status == 0
        agent_idx = self._agent_indexes(agent, ok)
        for code in np.unique(status[~ok]).tolist():
            bad = np.flatnonzero(status == code)
            # the agent's address where the datagram got that far, else its sender's
            last = agent[bad[-1]] if agent[bad[-1]].any() else dg.exporter[bad[-1]]
            self._count(DATAGRAM_REASONS[code], len(bad), ip_text(last.tobytes()))
        # sequences: datagrams per agent and sub-agent, samples per data source
        over = int((ok & (agent_idx < 0)).sum())
        if over:  # decoded, but beyond max_agents: no sequence kept
            self._count("sflow_too_many_agents", over)
        good = np.flatnonzero(ok & (agent_idx >= 0))
        sub, up = table[DG["sub_agent"]], table[DG["uptime_ms"]]
        self.datagrams.account(agent_idx[good], sub[good], np.zeros(len(good), np.int64),
                               table[DG["sequence"], good], up[good], dg.ts_ns[good])
        d = fs[FS["dgram"]]
        known = agent_idx[d] >= 0
        src = (fs[FS["source_id_type"]] << 32) | fs[FS["source_id"]]
        self.samples.account(agent_idx[d][known], sub[d][known], src[known],
                             fs[FS["sample_seq"], known], up[d][known], dg.ts_ns[d][known])
        dc = cs[CS["dgram"]]
        for a, s in zip(agent_idx[dc].tolist(), sub[dc].tolist(), strict=True):
            self.counter_samples[(a, s)] = self.counter_samples.get((a, s), 0) + 1
        return SflowBatch(dg, table, agent, fs, fips, fipset, cs)

    def _agent_indexes(self, agent: np.ndarray, ok: np.ndarray) -> np.ndarray:
        idx = np.full(len(agent), -1, np.int64)
        if ok.any():
            rows = np.flatnonzero(ok)
            uniq, inv = np.unique(np.ascontiguousarray(agent[rows]).view("V16").ravel(),
                                  return_inverse=True)
            codes = np.array([self._agent(u.tobytes()) for u in uniq], np.int64)
            idx[rows] = codes[inv]
        return idx

    # -- sequence state across restarts
    def sequences(self) -> list[dict]:
        """The next number expected of every datagram and sample stream, and the agent's uptime
        then (a durable source commits them with what it spooled: after a restart the gap at
        each stream counts what was lost; an agent that restarted meanwhile loses nothing)."""
        out = []
        for kind, seqs in (("datagrams", self.datagrams), ("samples", self.samples)):
            for (a, sub, src), row in seqs.rows():
                out.append({"kind": kind, "agent": self.agent_names[a], "sub_agent": sub,
                            "source": src, "next": int(row[Q_NEXT]),
                            "uptime_ms": int(row[Q_UPTIME])})
        return out

    def resume_sequences(self, state: list[dict]) -> int:
        n = 0
        for e in state:
            seqs = self.datagrams if e.get("kind") == "datagrams" else self.samples
            a = self._agent(ip_bytes(e["agent"]))
            if a >= 0 and seqs.expect((a, e["sub_agent"], e["source"]), e["next"],
                                      e["uptime_ms"]):
                n += 1
        return n

    # -- state for the API
    def streams(self) -> list[dict]:
        """Per agent and sub-agent: datagrams, their sequence, its data sources' samples and
        theirs, counter samples, the last error."""
        per: dict[tuple[int, int], dict] = {}
        for (a, sub, _), row in self.datagrams.rows():
            per[(a, sub)] = {
                "exporter": self.agent_names[a], "agent": self.agent_names[a],
                "sub_agent": sub, "protocol": "sflow",
                "datagrams": int(row[Q_COUNT]), "last_seen_ns": int(row[Q_LAST_NS]) or None,
                "uptime_ms": int(row[Q_UPTIME]),
                "sequence": {"next": int(row[Q_NEXT]), "lost": int(row[Q_LOST]),
                             "gaps": int(row[Q_GAPS]), "out_of_order": int(row[Q_LATE]),
                             "restarts": int(row[Q_RESTARTS]), "unit": "datagrams"},
                "samples": {"flow": 0, "lost": 0, "counter":
                            self.counter_samples.get((a, sub), 0)},
                "sources": [],
                "last_error": str(self.last_error[self.agent_names[a]])
                if self.agent_names[a] in self.last_error else None}
        for (a, sub, src), row in self.samples.rows():
            entry = per.get((a, sub))
            if entry is None:
                continue
            entry["samples"]["flow"] += int(row[Q_COUNT])
            entry["samples"]["lost"] += int(row[Q_LOST])
            entry["sources"].append({"source_id_type": src >> 32, "source_id": src & 0xFFFFFFFF,
                                     "samples": int(row[Q_COUNT]), "next": int(row[Q_NEXT]),
                                     "lost": int(row[Q_LOST]), "gaps": int(row[Q_GAPS]),
                                     "out_of_order": int(row[Q_LATE])})
        return sorted(per.values(), key=lambda e: (e["agent"], e["sub_agent"]))


@dataclass
class SflowBatch:
    """A batch of datagrams as the kernel decoded it: its two streams on demand."""

    dg: Datagrams
    table: np.ndarray  # per datagram (elements.DG_COLS)
    agent: np.ndarray  # (n, 16) per datagram
    fs: np.ndarray  # per flow sample (elements.FS_COLS)
    fips: np.ndarray
    fipset: np.ndarray
    cs: np.ndarray  # per counter sample (elements.CS_COLS)
    stream: str = "samples"

    def __len__(self) -> int:
        return self.fs.shape[1]

    @property
    def ts_ns(self) -> np.ndarray:
        return self.dg.ts_ns[self.fs[FS["dgram"]]]

    @property
    def caplen(self) -> np.ndarray:
        """The sampled headers' lengths (0 for a sample without one)."""
        return np.where(self.fs[FS["header_off"]] >= 0, self.fs[FS["header_len"]], 0)

    def samples(self, want: Iterable[str] | None = None) -> SampleBatch:
        """The flow samples: the packets fields in ``want`` (default all) of their headers,
        and every sFlow field."""
        dg, fs, fips, fipset, agent, table = (self.dg, self.fs, self.fips, self.fipset,
                                              self.agent, self.table)
        n = fs.shape[1]
        d = fs[FS["dgram"]]
        hlen = np.where(fs[FS["header_off"]] >= 0, fs[FS["header_len"]], 0)
        proto = fs[FS["header_protocol"]]
        linktype = np.where((proto >= 0) & (proto < 256) & (hlen > 0),
                            _LINKTYPE[np.clip(proto, 0, 255)], -1).astype(np.int32)
        # the packet's length as a capture would have it: the frame less what the agent
        # stripped (Ethernet's FCS, tags); without a header, a sampled Ethernet record's length
        # less its FCS, else a sampled IP record's
        eth_len = fs[FS["eth_length"]]
        wire = np.where(fs[FS["header_off"]] >= 0,
                        fs[FS["frame_length"]] - np.maximum(fs[FS["stripped"]], 0),
                        np.where(eth_len >= 4, eth_len - 4, fs[FS["ip_length"]]))
        wire = np.where(wire >= 0, np.maximum(wire, hlen), NULL_INT)
        raw = RawBatch(dg.buf, np.maximum(fs[FS["header_off"]], 0), hlen.astype(np.int32),
                       np.minimum(wire, INT32_MAX).astype(np.int32), dg.ts_ns[d],
                       linktype, np.zeros(n, np.int32))
        names = None if want is None else set(want) & _PACKET_FIELDS
        tb = unpack(raw, names)
        ints = tb.ints
        # a sample without a header: its sampled IPv4/IPv6 and Ethernet records
        bare = (linktype < 0) & (fs[FS["ip_version"]] >= 0)
        if bare.any():
            for field, col, hi in (("ip_version", "ip_version", 6),
                                   ("protocol", "ip_protocol", 255),
                                   ("src_port", "ip_src_port", 65535),
                                   ("dst_port", "ip_dst_port", 65535),
                                   ("tcp_flags", "ip_tcp_flags", 255), ("tos", "ip_tos", 255),
                                   ("ip_len", "ip_length", INT32_MAX)):
                ints[PACKET_INT_INDEX[field], bare] = _within(fs[FS[col], bare], hi)
            for name, k in (("src_ip", FI["ip_src"]), ("dst_ip", FI["ip_dst"])):
                if name in tb.ips:
                    tb.ips[name][bare] = fips[k, bare]
        eth = (linktype < 0) & (fs[FS["eth_type"]] >= 0)
        ints[PACKET_INT_INDEX["eth_type"], eth] = _within(fs[FS["eth_type"], eth], 65535)
        ints[PACKET_INT_INDEX["wirelen"]] = np.minimum(wire, INT32_MAX).astype(np.int32)
        ints[PACKET_INT_INDEX["caplen"]] = hlen.astype(np.int32)
        extra = {c: fs[FS[c]] for c in _DIRECT}
        extra["sub_agent"] = table[DG["sub_agent"], d]
        fmt, val = fs[FS["input_if_format"]], fs[FS["input_if_value"]]
        extra["input_if"] = np.where(fmt == 0, val, NULL_INT)
        fmt, val = fs[FS["output_if_format"]], fs[FS["output_if_value"]]
        extra["output_if"] = np.where(fmt == 0, val, NULL_INT)
        extra["discard_reason"] = np.where(fmt == 1, val, NULL_INT)
        extra["frame_length"] = np.where(fs[FS["header_off"]] >= 0, fs[FS["frame_length"]],
                                         np.where(eth_len >= 0, eth_len, fs[FS["ip_length"]]))
        rate = fs[FS["sampling_rate"]]
        extra["est_packets"] = rate
        extra["est_bytes"] = np.where(wire >= 0, wire * np.maximum(rate, 0), NULL_INT)
        tb.ips["agent"] = agent[d]
        tb.ip_ok["agent"] = np.ones(n, np.bool_)
        for name in ("next_hop", "bgp_next_hop"):
            tb.ips[name], tb.ip_ok[name] = fips[FI[name]], fipset[FI[name]]
        return SampleBatch("samples", tb.ts_ns, ints, tb.ips, tb.strings, tb.ip_ok,
                           _bounded("samples", extra))

    def counters(self) -> CounterBatch:
        """The counter samples."""
        dg, cs, agent, table = self.dg, self.cs, self.agent, self.table
        d = cs[CS["dgram"]]
        ints = {c: cs[CS[c]] for c in _COUNTER_INTS if c in CS}
        ints["sub_agent"] = table[DG["sub_agent"], d]
        status = cs[CS["if_status"]]
        ints["if_admin_up"] = np.where(status >= 0, status & 1, NULL_INT)
        ints["if_oper_up"] = np.where(status >= 0, (status >> 1) & 1, NULL_INT)
        return CounterBatch(dg.ts_ns[d], _bounded("counters", ints), {"agent": agent[d]},
                            {"agent": np.ones(len(d), np.bool_)})


def capture_sflow(source, ports, decoder: SflowDecoder | None = None, batch_size: int = 4096):
    """The sFlow datagrams of a capture (UDP to ``ports``), decoded batch by batch (``decode
    --stream samples|counters`` and ``replay``): the listener's decoder. ``source`` is what
    ``open_capture`` takes, or a reader it returned."""
    from capture.netflow.exports import export_datagrams
    from capture.pcap import open_capture
    decoder = decoder or SflowDecoder()
    reader = source if hasattr(source, "stats") else open_capture(source, batch_size)
    for raw in reader:
        dg = export_datagrams(raw, ports)
        if len(dg):
            yield decoder.decode(dg)
