"""Templates as exporters sent them, their compiled field tables, the store that keeps them (and
options sampling) across restarts, and the tables the kernel reads them from."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numba import types
from numba.typed import Dict

from capture import disk
from capture.errors import StateError
from capture.fields import IP, TS
from capture.netflow.elements import (
    FLOW_INT_INDEX,
    FLOW_IP_FIELDS,
    IE,
    IP_OPS,
    KIND_DATA,
    KIND_OPTIONS,
    OP_DELTA_US,
    OP_DUR_MS,
    OP_DUR_US,
    OP_ICMP_TC,
    OP_IP4,
    OP_IP6,
    OP_MS,
    OP_NTP,
    OP_SAMPLER_ID,
    OP_SAMPLING,
    OP_SEC,
    OP_SKIP,
    OP_SPACE,
    OP_SYSINIT,
    OP_TCP_FLAGS,
    OP_UINT,
    OP_UINT_FB,
    OP_UPTIME,
    T_DELTA_FIRST,
    T_DELTA_LAST,
    T_DUR,
    T_DUR_US,
    T_INIT,
    T_INTERVAL,
    T_SAMPLER,
    T_SPACE,
    T_UP_FIRST,
    T_UP_LAST,
    TIME_LEN,
    V5_FIELDS,
    VARLEN,
    F,
)


@dataclass
class Template:
    """A data or options template as the exporter sent it."""

    exporter: str
    version: int
    domain: int
    template_id: int
    fields: tuple[tuple[int, int, int], ...]  # (element id, enterprise number, length)
    kind: int = KIND_DATA
    scope_count: int = 0
    learned_ns: int = 0

    def to_json(self) -> dict:
        return {"exporter": self.exporter, "version": self.version, "domain": self.domain,
                "template_id": self.template_id, "kind": "options" if self.kind else "data",
                "scope_count": self.scope_count, "fields": [list(f) for f in self.fields],
                "learned_ns": self.learned_ns}

    @classmethod
    def from_json(cls, d: dict) -> Template:
        return cls(d["exporter"], d["version"], d["domain"], d["template_id"],
                   tuple(tuple(f) for f in d["fields"]),
                   KIND_OPTIONS if d["kind"] == "options" else KIND_DATA, d["scope_count"],
                   d.get("learned_ns", 0))


def _target(op: int, name: str) -> int:
    if op in (OP_IP4, OP_IP6):
        return FLOW_IP_FIELDS.index(name)
    if op in (OP_UINT, OP_UINT_FB, OP_TCP_FLAGS, OP_SEC, OP_MS, OP_NTP):
        return FLOW_INT_INDEX[name]
    return {OP_UPTIME: {"first": T_UP_FIRST, "last": T_UP_LAST}.get(name, -1),
            OP_DELTA_US: {"first": T_DELTA_FIRST, "last": T_DELTA_LAST}.get(name, -1),
            OP_SYSINIT: T_INIT, OP_DUR_MS: T_DUR, OP_DUR_US: T_DUR_US, OP_SAMPLER_ID: T_SAMPLER,
            OP_SAMPLING: T_INTERVAL, OP_SPACE: T_SPACE, OP_ICMP_TC: 0}[op]


def compile_fields(fields_: tuple[tuple[int, int, int], ...],
                   enterprise: dict[tuple[int, int], str]) -> list[tuple[int, int, int]]:
    """(operation, target, length) per field; unknown or ill-sized fields are skipped."""
    out = []
    for ie, pen, ln in fields_:
        if pen:
            name = enterprise.get((pen, ie))
            if name is None:
                op, name = OP_SKIP, ""
            else:
                kind = F[name].kind
                op = (OP_IP6 if ln == 16 else OP_IP4) if kind == IP else \
                    (OP_MS if kind == TS else OP_UINT)
        else:
            op, name = IE.get(ie, (OP_SKIP, ""))
        if op in IP_OPS and ln != IP_OPS[op]:
            op = OP_SKIP
        elif op in TIME_LEN and ln not in TIME_LEN[op]:
            op = OP_SKIP
        elif op != OP_SKIP and (ln == VARLEN or ln > 8 or ln == 0) and op not in IP_OPS:
            op = OP_SKIP
        out.append((op, _target(op, name) if op != OP_SKIP else 0, ln))
    return out


V5_TEMPLATE = tuple((ie, 0, ln) for ie, ln in V5_FIELDS)


class TemplateStore:
    """Templates and options sampling per export stream, as exporters sent them (the decoder
    compiles them for the kernel); saved and loaded as JSON."""

    def __init__(self, enterprise: dict[tuple[int, int], str] | None = None):
        self.enterprise = dict(enterprise or {})
        self.templates: dict[tuple[str, int, int, int], Template] = {}
        # (exporter, version, domain, sampler id or 0) -> interval
        self.sampling: dict[tuple[str, int, int, int], int] = {}
        self.dirty = False

    def learn(self, t: Template) -> bool:
        """Add or replace a template; True when it changed."""
        key = (t.exporter, t.version, t.domain, t.template_id)
        old = self.templates.get(key)
        if old is not None and old.fields == t.fields and old.kind == t.kind:
            return False
        self.templates[key] = t
        self.dirty = True
        return True

    def withdraw(self, exporter: str, version: int, domain: int, template_id: int | None,
                 kind: int) -> list[tuple[str, int, int, int]]:
        """Remove one template, or every template of a kind (IPFIX withdraw-all); the keys
        removed."""
        keys = [k for k, t in self.templates.items()
                if k[:3] == (exporter, version, domain) and t.kind == kind
                and (template_id is None or k[3] == template_id)]
        for k in keys:
            del self.templates[k]
        if keys:
            self.dirty = True
        return keys

    def set_sampling(self, exporter: str, version: int, domain: int, sampler: int,
                     interval: int) -> None:
        key = (exporter, version, domain, sampler)
        if self.sampling.get(key) != interval:
            self.sampling[key] = interval
            self.dirty = True

    # persistence
    def save(self, path: str | os.PathLike) -> None:
        path = Path(path)
        doc = {"version": 1,
               "templates": [t.to_json() for t in self.templates.values()],
               "sampling": [{"exporter": e, "version": v, "domain": d, "sampler": s,
                             "interval": i} for (e, v, d, s), i in self.sampling.items()]}
        disk.write_bytes(path, json.dumps(doc).encode())
        self.dirty = False

    def load(self, path: str | os.PathLike) -> int:
        """Templates saved by ``save``; a missing file is an empty store."""
        try:
            doc = json.loads(Path(path).read_text())
        except FileNotFoundError:
            return 0
        except (OSError, ValueError) as e:
            raise StateError(f"template state {path} is unreadable: {e}") from e
        for d in doc.get("templates", []):
            t = Template.from_json(d)
            self.templates[(t.exporter, t.version, t.domain, t.template_id)] = t
        for d in doc.get("sampling", []):
            self.sampling[(d["exporter"], d["version"], d["domain"], d["sampler"])] = \
                d["interval"]
        return len(self.templates)


class KernelTables:
    """Templates as the kernel reads them: per-slot and per-field arrays grown in place, and a
    typed dict from kernel key to slot. A learned template appends a slot; a replaced or
    withdrawn one leaves garbage until the decoder rebuilds (rarely: see ``garbage``)."""

    def __init__(self):
        self.tdict = Dict.empty(types.int64, types.int64)
        self.t = np.zeros((4, 64), np.int64)  # fstart, fn, minlen, kind per slot
        self.f = np.zeros((3, 1024), np.int64)  # op, target, length per field
        self.nt = self.nf = self.garbage = 0
        self.put(-1, compile_fields(V5_TEMPLATE, {}), KIND_DATA)  # slot 0: NetFlow v5

    def put(self, key: int, cf: list[tuple[int, int, int]], kind: int) -> None:
        if self.nt == self.t.shape[1]:
            self.t = np.concatenate([self.t, np.zeros_like(self.t)], axis=1)
        while self.nf + len(cf) > self.f.shape[1]:
            self.f = np.concatenate([self.f, np.zeros_like(self.f)], axis=1)
        if cf:
            self.f[:, self.nf:self.nf + len(cf)] = np.array(cf, np.int64).T
        minlen = sum(1 if ln == VARLEN else ln for _, _, ln in cf)
        self.t[:, self.nt] = (self.nf, len(cf), minlen, kind)
        if key >= 0:
            if key in self.tdict:
                self.garbage += 1
            self.tdict[key] = self.nt
        self.nt += 1
        self.nf += len(cf)

    def drop(self, key: int) -> None:
        if key in self.tdict:
            del self.tdict[key]
            self.garbage += 1

    def args(self):
        return (self.tdict, self.t[0], self.t[1], self.t[2], self.t[3], self.f[0], self.f[1],
                self.f[2])
