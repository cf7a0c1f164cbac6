"""The decoder: runs the kernel over datagram batches and does the rare, stateful work it stops
for (templates, options sampling, data held until its template comes); keeps sequence, sampling
and error counters per exporter and export stream."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
from numba import types
from numba.typed import Dict

from capture.errors import DecodeError
from capture.fields import NULL_INT, ip_bytes, ip_text
from capture.jit import readonly
from capture.netflow.batch import Datagrams, FlowBatch, empty_flows
from capture.netflow.elements import (
    DONE,
    FLOW_INT_FIELDS,
    KERNEL_REASONS,
    MAX_EXPORTERS,
    N_STATE,
    REASON_TEXT,
    REPLAY,
    S_CUR_UNKNOWN,
    S_DGRAMS,
    S_DOMAIN,
    S_EXP,
    S_GAPS,
    S_KNOWN,
    S_LAST_NS,
    S_LOST,
    S_NEXT,
    S_OPTIONS,
    S_RECORDS,
    S_REORDER,
    S_UNKNOWN_SAMPLING,
    S_VERSION,
    STOP_FULL,
    STOP_NO_TEMPLATE,
    STOP_OPTIONS,
    STOP_STREAMS,
    STOP_TEMPLATE,
    VCODE,
)
from capture.netflow.kernel import decode_kernel
from capture.netflow.template_records import TemplateRecords
from capture.netflow.templates import KernelTables, TemplateStore


@dataclass
class _Pending:
    key: tuple[str, int, int, int]
    exp: int
    header: bytes
    data: bytes
    addr: bytes
    ts_ns: int
    done: bool = False

    @property
    def size(self) -> int:
        return len(self.header) + len(self.data)


class Decoder(TemplateRecords):
    """Decodes batches of export datagrams; keeps templates, sampling, sequence state and
    counters per exporter and export stream."""

    def __init__(self, store: TemplateStore | None = None, *,
                 sampling_override: dict[str, int] | None = None,
                 default_sampling_interval: int = 1, pending_max_bytes: int = 4 << 20,
                 pending_ttl_s: float = 300.0, max_templates: int = 65536):
        self.store = store or TemplateStore()
        self.max_templates = max_templates
        self.exporters: dict[bytes, int] = {}
        self.exporter_names: list[str] = []
        self._exp_index: dict[str, int] = {}
        self.override = np.zeros(MAX_EXPORTERS + 1, np.int64)
        self.sampling_override = {ip_bytes(k): int(v)
                                  for k, v in (sampling_override or {}).items()}
        self.default_interval = int(default_sampling_interval)
        self.st_dict = Dict.empty(types.int64, types.int64)
        self.st = np.zeros((64, N_STATE), np.int64)
        self.st_n = np.zeros(1, np.int64)
        self.errors: dict[str, int] = {}
        self.last_error: dict[str, DecodeError] = {}
        self._errs = np.zeros(len(KERNEL_REASONS), np.int64)
        # held data sets: by template key, and in arrival order (for eviction and expiry)
        self._held: dict[tuple[str, int, int, int], list[_Pending]] = {}
        self._order: deque[_Pending] = deque()
        self.pending_sets = 0
        self.pending_bytes = 0
        self.pending_max_bytes = pending_max_bytes
        self.pending_ttl_ns = int(pending_ttl_s * 1e9)
        self.bad_templates: set[tuple[str, int, int, int]] = set()
        self.options_records = 0
        self._now = 0
        self.sdict = Dict.empty(types.int64, types.int64)  # stream key << 16 | sampler -> interval
        for exp in {t.exporter for t in self.store.templates.values()} | \
                {k[0] for k in self.store.sampling}:
            self._exporter(ip_bytes(exp))
        self._rebuild_tables()

    def _rebuild_tables(self) -> None:
        self.tables = KernelTables()
        for t in self.store.templates.values():
            self._put(t)
        for (exp, ver, dom, sampler), interval in self.store.sampling.items():
            self._put_sampling(exp, ver, dom, sampler, interval)

    def _stream_key(self, exporter: str, version: int, domain: int) -> int:
        return ((self._exp_index[exporter] * 4 + VCODE[version]) << 32) | domain

    @property
    def pending(self) -> list[_Pending]:
        """The data sets waiting for their template, oldest first."""
        return [x for x in self._order if not x.done]

    # -- exporters and streams
    def _exporter(self, addr: bytes) -> int:
        e = self.exporters.get(addr)
        if e is None:
            if len(self.exporter_names) >= MAX_EXPORTERS:
                return -1
            e = len(self.exporter_names)
            self.exporters[addr] = e
            self.exporter_names.append(ip_text(addr))
            self._exp_index[self.exporter_names[-1]] = e
            self.override[e] = self.sampling_override.get(addr, 0)
        return e

    def _count(self, reason: str, n: int = 1, exporter: str = "",
               template_id: int | None = None) -> None:
        """Count bad input under its reason; keep the last error of each exporter (with the
        template id where known) for GET /exporters."""
        self.errors[reason] = self.errors.get(reason, 0) + n
        if exporter:
            self.last_error[exporter] = DecodeError(REASON_TEXT.get(reason, reason),
                                                    kind=reason, layer="netflow",
                                                    exporter=exporter, template_id=template_id)

    # -- decoding
    def decode(self, dg: Datagrams) -> FlowBatch:
        """The flow records of a batch of datagrams (in order)."""
        n = len(dg)
        if n == 0:
            return empty_flows(0)
        self._now = max(self._now, int(dg.ts_ns.max()))
        uniq, inv = np.unique(np.ascontiguousarray(dg.exporter).view("V16").ravel(),
                              return_inverse=True)
        idx = np.array([self._exporter(u.tobytes()) for u in uniq], np.int64)
        exp = idx[inv.reshape(-1)]
        flags = dg.flags if dg.flags is not None else np.zeros(n, np.uint8)
        if (exp < 0).any():
            self._count("too_many_exporters", int((exp < 0).sum()))
            keep = exp >= 0
            dg = Datagrams(dg.buf, dg.offset[keep], dg.length[keep], dg.exporter[keep],
                           dg.ts_ns[keep], flags[keep])
            exp, flags = exp[keep], flags[keep]
        cap = max(256, int(dg.length.sum()) // 40)
        self._out = [np.full((len(FLOW_INT_FIELDS), cap), NULL_INT, np.int64),
                     np.zeros((4, cap, 16), np.uint8), np.zeros((4, cap), np.bool_), 0]
        self._run(dg, exp, flags)
        self._expire()
        ints, ips, ipset, k = self._out
        self._out = None
        return FlowBatch(ints[:, :k], ips[:, :k], ipset[:, :k])

    def _grow(self, need: int) -> None:
        ints, ips, ipset, k = self._out
        cap = max(2 * ints.shape[1], k + need)
        ni = np.full((ints.shape[0], cap), NULL_INT, np.int64)
        ni[:, :k] = ints[:, :k]
        np_ = np.zeros((4, cap, 16), np.uint8)
        np_[:, :k] = ips[:, :k]
        ns = np.zeros((4, cap), np.bool_)
        ns[:, :k] = ipset[:, :k]
        self._out = [ni, np_, ns, k]

    def _run(self, dg: Datagrams, exp: np.ndarray, flags: np.ndarray) -> None:
        d, p = 0, 0
        exp = exp.astype(np.int32)
        # one type whatever the source (a listener's bytes are read-only, a held set's copy not)
        buf, addrs = readonly(dg.buf), readonly(np.ascontiguousarray(dg.exporter))
        while True:
            if self.tables.garbage > 2 * len(self.tables.tdict) + 256:
                self._rebuild_tables()
            ints, ips, ipset, k = self._out
            code, d, p, k, slot, key = decode_kernel(
                buf, dg.offset, dg.length, exp, dg.ts_ns, flags, addrs, d, p,
                *self.tables.args(), self.st_dict, self.st, self.st_n, self.sdict,
                self.override, self.default_interval, ints, ips, ipset, k, self._errs)
            self._out[3] = k
            if code == DONE:
                break
            if code == STOP_FULL:
                self._grow(max(1024, int(dg.length[d]) // 4))
                continue
            if code == STOP_STREAMS:
                self.st = np.concatenate([self.st, np.zeros_like(self.st)])
                continue
            base = int(dg.offset[d])
            ver = (int(buf[base]) << 8) | int(buf[base + 1])
            slen = (int(buf[base + p + 2]) << 8) | int(buf[base + p + 3])
            body = buf[base + p:base + p + slen].tobytes()
            domain = int(self.st[slot, S_DOMAIN])
            exporter = self.exporter_names[int(exp[d])]
            if code == STOP_TEMPLATE:
                self._templates(exporter, ver, domain, body, int(dg.ts_ns[d]))
            elif code == STOP_OPTIONS:
                self._options(exporter, ver, domain, key & 0xFFFF, body, slot,
                              not flags[d] & REPLAY)
            elif code == STOP_NO_TEMPLATE:
                tkey = (exporter, ver, domain, key & 0xFFFF)
                if tkey in self.bad_templates:
                    self._count("template_invalid_data", exporter=exporter,
                                template_id=key & 0xFFFF)
                else:
                    hl = 20 if ver == 9 else 16
                    self._hold(_Pending(tkey, int(exp[d]), buf[base:base + hl].tobytes(),
                                        body, addrs[d].tobytes(), int(dg.ts_ns[d])))
                    if not flags[d] & REPLAY:
                        self.st[slot, S_CUR_UNKNOWN] = 1
            p += slen
        self._flush_errs()

    def _flush_errs(self) -> None:
        for i, v in enumerate(self._errs):
            if v:
                self._count(KERNEL_REASONS[i], int(v))
        self._errs[:] = 0

    # -- pending data (template not seen yet)
    def _hold(self, item: _Pending) -> None:
        if item.size > self.pending_max_bytes:
            self._count("template_missing")
            return
        self._held.setdefault(item.key, []).append(item)
        self._order.append(item)
        self.pending_sets += 1
        self.pending_bytes += item.size
        while self.pending_bytes > self.pending_max_bytes:
            self._discard(self._oldest(), "pending_evicted")

    def _oldest(self) -> _Pending:
        while self._order[0].done:
            self._order.popleft()
        return self._order[0]

    def _discard(self, item: _Pending, reason: str | None) -> None:
        """Take a held set out of the buffer (counted under ``reason`` unless released)."""
        item.done = True
        self.pending_sets -= 1
        self.pending_bytes -= item.size
        held = self._held[item.key]
        held.remove(item)
        if not held:
            del self._held[item.key]
        if reason:
            self._count(reason)

    def _release(self, key) -> None:
        """Decode the held sets of a template that just arrived."""
        ready = list(self._held.get(key, ()))
        if not ready:
            return
        payloads = []
        for x in ready:
            self._discard(x, None)
            h = bytearray(x.header)
            if x.key[1] == 10:
                h[2:4] = (len(h) + len(x.data)).to_bytes(2, "big")
            payloads.append(bytes(h) + x.data)
        dg = Datagrams.from_payloads(payloads)
        dg.exporter = np.array([np.frombuffer(x.addr, np.uint8) for x in ready])
        dg.ts_ns = np.array([x.ts_ns for x in ready], np.int64)
        self._run(dg, np.array([x.exp for x in ready], np.int64),
                  np.full(len(ready), REPLAY, np.uint8))

    def _expire(self) -> None:
        limit = self._now - self.pending_ttl_ns
        while self.pending_sets and self._oldest().ts_ns < limit:
            self._discard(self._oldest(), "template_missing")

    def finish(self) -> None:
        """End of input: what still waits for a template is counted as missing."""
        while self.pending_sets:
            self._discard(self._oldest(), "template_missing")
        self._order.clear()

    # -- sequence state across restarts
    def sequences(self) -> list[dict]:
        """The next sequence number expected of every export stream (a durable source commits
        it with what it has spooled: after a restart, the gap at each stream's next export
        counts what was lost, held in memory or sent while the collector was down)."""
        out = []
        for slot in range(int(self.st_n[0])):
            r = self.st[slot]
            if r[S_KNOWN]:
                out.append({"exporter": self.exporter_names[int(r[S_EXP])],
                            "version": int(r[S_VERSION]), "domain": int(r[S_DOMAIN]),
                            "next": int(r[S_NEXT])})
        return out

    def resume_sequences(self, state: list[dict]) -> int:
        """Expect each stream's next export at the committed sequence number (a decoder that
        has seen a stream already keeps its own); returns the streams resumed."""
        n = 0
        for e in state:
            e_idx = self._exporter(ip_bytes(e["exporter"]))
            ver = int(e["version"])
            if e_idx < 0 or ver not in VCODE:
                continue
            skey = ((e_idx * 4 + VCODE[ver]) << 32) | int(e["domain"])
            if skey in self.st_dict:
                continue
            slot = int(self.st_n[0])
            if slot >= self.st.shape[0]:
                self.st = np.concatenate([self.st, np.zeros_like(self.st)])
            self.st_n[0] += 1
            self.st_dict[skey] = slot
            row = self.st[slot]
            row[S_EXP], row[S_VERSION], row[S_DOMAIN] = e_idx, ver, int(e["domain"])
            row[S_NEXT], row[S_KNOWN] = int(e["next"]) & 0xFFFFFFFF, 1
            n += 1
        return n

    # -- state for the API
    def streams(self) -> list[dict]:
        out = []
        for slot in range(int(self.st_n[0])):
            r = self.st[slot]
            exporter = self.exporter_names[int(r[S_EXP])]
            ver, dom = int(r[S_VERSION]), int(r[S_DOMAIN])
            tpls = sorted(t.template_id for (e, v, d, _), t in self.store.templates.items()
                          if (e, v, d) == (exporter, ver, dom))
            smp = {str(s or "default"): i for (e, v, d, s), i in self.store.sampling.items()
                   if (e, v, d) == (exporter, ver, dom)}
            out.append({"exporter": exporter, "version": ver, "observation_domain": dom,
                        "datagrams": int(r[S_DGRAMS]), "records": int(r[S_RECORDS]),
                        "options_records": int(r[S_OPTIONS]),
                        "last_seen_ns": int(r[S_LAST_NS]) or None,
                        "sequence": {"lost": int(r[S_LOST]), "gaps": int(r[S_GAPS]),
                                     "out_of_order": int(r[S_REORDER]),
                                     "unit": "datagrams" if ver == 9 else "records"},
                        "templates": tpls, "sampling": smp,
                        "sampling_override": int(self.override[int(r[S_EXP])]) or None,
                        "records_sampling_unknown": int(r[S_UNKNOWN_SAMPLING]),
                        "last_error": str(self.last_error[exporter])
                        if exporter in self.last_error else None})
        return out
