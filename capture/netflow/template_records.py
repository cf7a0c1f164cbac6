"""Template and options records of NetFlow v9 and IPFIX, as the decoder meets them: a
template (data or options) stored, replaced or withdrawn for its export stream and the kernel's
tables rebuilt; an options record's sampling interval kept for the data that follows.

``TemplateRecords`` is one side of ``Decoder`` (decoder.py): it writes the template store, the
sampling table and the counters the decoder holds.
"""

from __future__ import annotations

from capture.netflow.elements import (
    KIND_DATA,
    KIND_OPTIONS,
    MAX_TEMPLATE_FIELDS,
    S_CUR_RECS,
    S_OPTIONS,
    S_RECORDS,
    VARLEN,
)
from capture.netflow.templates import Template, compile_fields


class TemplateRecords:
    """The decoder's template and options records."""

    def _put(self, t: Template) -> None:
        key = (self._stream_key(t.exporter, t.version, t.domain) << 16) | t.template_id
        self.tables.put(key, compile_fields(t.fields, self.store.enterprise), t.kind)

    def _put_sampling(self, exporter, version, domain, sampler, interval) -> None:
        self.store.set_sampling(exporter, version, domain, sampler, interval)
        self.sdict[(self._stream_key(exporter, version, domain) << 16)
                   | ((sampler + 1) & 0xFFFF if sampler else 0)] = interval

    # -- template sets (rare: Python)
    def _templates(self, exporter: str, ver: int, domain: int, body: bytes, ts_ns: int) -> None:
        sid = int.from_bytes(body[0:2], "big")
        options = sid in (1, 3)
        p, end = 4, len(body)
        learned = []
        while end - p >= 4:
            tid = int.from_bytes(body[p:p + 2], "big")
            count = int.from_bytes(body[p + 2:p + 4], "big")
            if ver == 9 and options:
                if end - p < 6:
                    break
                scope_len, opt_len = count, int.from_bytes(body[p + 4:p + 6], "big")
                p += 6
                if scope_len % 4 or opt_len % 4 or p + scope_len + opt_len > end:
                    self._count("template_truncated", exporter=exporter, template_id=tid)
                    return
                nf, scope = (scope_len + opt_len) // 4, scope_len // 4
            elif ver == 10 and options:
                p += 4
                if count == 0:
                    self._withdraw(exporter, ver, domain, tid, KIND_OPTIONS)
                    continue
                if end - p < 2:
                    self._count("template_truncated", exporter=exporter, template_id=tid)
                    return
                nf, scope = count, int.from_bytes(body[p:p + 2], "big")
                p += 2
                if scope == 0 or scope > nf:
                    self._count("template_scope", exporter=exporter, template_id=tid)
                    return
            else:
                p += 4
                if count == 0:
                    if ver == 10:
                        self._withdraw(exporter, ver, domain, tid, KIND_DATA)
                        continue
                    self._count("template_no_fields", exporter=exporter, template_id=tid)
                    continue
                nf, scope = count, 0
            if nf > MAX_TEMPLATE_FIELDS:
                self._count("template_too_many_fields", exporter=exporter, template_id=tid)
                self.bad_templates.add((exporter, ver, domain, tid))
                return
            flds = []
            for _ in range(nf):
                if p + 4 > end:
                    self._count("template_truncated", exporter=exporter, template_id=tid)
                    return
                ie = int.from_bytes(body[p:p + 2], "big")
                ln = int.from_bytes(body[p + 2:p + 4], "big")
                p += 4
                pen = 0
                if ver == 10 and ie & 0x8000:
                    if p + 4 > end:
                        self._count("template_truncated", exporter=exporter, template_id=tid)
                        return
                    pen = int.from_bytes(body[p:p + 4], "big")
                    ie &= 0x7FFF
                    p += 4
                elif ver == 9 and len(flds) < scope:
                    pen = 0xFFFFFFFF  # v9 scope types are not information elements
                if ver == 9 and ln == VARLEN:
                    ln = VARLEN - 1  # v9 has no variable-length encoding
                flds.append((ie, pen, ln))
            key = (exporter, ver, domain, tid)
            if tid < 256:
                self._count("template_id", exporter=exporter, template_id=tid)
                continue
            if sum(1 if ln == VARLEN else ln for _, _, ln in flds) == 0:
                self._count("template_zero_length", exporter=exporter, template_id=tid)
                self.bad_templates.add(key)
                continue
            self.bad_templates.discard(key)
            t = Template(exporter, ver, domain, tid, tuple(flds),
                         KIND_OPTIONS if options else KIND_DATA, scope, ts_ns)
            if key not in self.store.templates and \
                    len(self.store.templates) >= self.max_templates:
                self._count("too_many_templates", exporter=exporter, template_id=tid)
                continue
            if self.store.learn(t):
                self._put(t)
            learned.append(key)
        for key in learned:
            self._release(key)

    def _withdraw(self, exporter, ver, domain, tid, kind) -> None:
        all_ = tid == (2 if kind == KIND_DATA else 3)
        for key in self.store.withdraw(exporter, ver, domain, None if all_ else tid, kind):
            self.tables.drop((self._stream_key(*key[:3]) << 16) | key[3])

    def _options(self, exporter: str, ver: int, domain: int, tid: int, body: bytes, slot: int,
                 count_seq: bool) -> None:
        """Options data: sampling interval / space / sampler id per record."""
        t = self.store.templates[(exporter, ver, domain, tid)]
        p, end = 4, len(body)
        minlen = sum(1 if ln == VARLEN else ln for _, _, ln in t.fields)
        n = 0
        while end - p >= minlen:
            vals: dict[int, int] = {}
            for ie, pen, ln in t.fields:
                if ln == VARLEN:
                    if p >= end:
                        self._count("record_truncated", exporter=exporter, template_id=tid)
                        return
                    ln = body[p]
                    p += 1
                    if ln == 255:
                        ln = int.from_bytes(body[p:p + 2], "big")
                        p += 2
                if p + ln > end:
                    self._count("record_truncated", exporter=exporter, template_id=tid)
                    return
                if pen == 0 and ln <= 8:
                    vals.setdefault(ie, int.from_bytes(body[p:p + ln], "big"))
                p += ln
            n += 1
            interval = vals.get(34) or vals.get(50) or vals.get(305)
            if interval and 306 in vals and 305 in vals:
                interval = (vals[305] + vals[306]) // vals[305]
            if vals.get(309) and vals.get(310):  # random n-out-of-N
                interval = max(1, vals[310] // vals[309])
            if interval:
                sampler = vals.get(48, vals.get(302, 0))
                self._put_sampling(exporter, ver, domain, 0, interval)
                if sampler:
                    self._put_sampling(exporter, ver, domain, sampler, interval)
        self.options_records += n
        self.st[slot, S_OPTIONS] += n
        if count_seq:
            self.st[slot, S_CUR_RECS] += n
            self.st[slot, S_RECORDS] += n
