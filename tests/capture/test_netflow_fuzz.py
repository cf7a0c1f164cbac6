"""Fuzzing the decoder with mutated real exports (short run in CI; ``make bench`` runs 100k+
inputs, bench/bench_netflow_fuzz.py). Nothing may crash or hang; rejected input is counted."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capture.netflow import KERNEL_REASONS, Datagrams, Decoder
from tests.flowtools import HEX, LOGSTASH, read_hex, split_payloads

SEEDS = (read_hex(HEX / "PACKET_V9_TEMPLATE.hex") + read_hex(HEX / "PACKETS_V9.hex")
         + read_hex(HEX / "PACKET_IPFIX_TEMPLATE.hex") + read_hex(HEX / "PACKET_IPFIX.hex")
         + read_hex(HEX / "PACKET_IPFIX_PADDING.hex") + read_hex(HEX / "PACKET_V5.hex")
         + split_payloads((LOGSTASH / "ipfix_test_netscaler_tpl.dat").read_bytes())
         + split_payloads((LOGSTASH / "ipfix_test_netscaler_data.dat").read_bytes()))


@st.composite
def mutated(draw):
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 8))):
        op = draw(st.integers(0, 3))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == 0 and data:
            data[pos] = draw(st.integers(0, 255))
        elif op == 1:
            data = data[:pos]
        elif op == 2:
            data[pos:pos] = draw(st.binary(max_size=64))
        elif op == 3 and len(data) > pos + 4:  # a 16-bit length or id field
            v = draw(st.sampled_from([0, 1, 3, 4, 255, 256, 65535, draw(st.integers(0, 65535))]))
            data[pos:pos + 2] = v.to_bytes(2, "big")
    return bytes(data)


@pytest.mark.timeout(600)  # a hang fails the test instead of stalling CI
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(mutated(), min_size=1, max_size=6))
def test_mutated_exports_never_crash(batch):
    d = Decoder(pending_max_bytes=1 << 14)
    fb = d.decode(Datagrams.from_payloads(SEEDS[:1] + SEEDS[6:8] + batch))
    d.finish()
    rows = fb.rows()
    for r in rows:
        assert r["version"] in (5, 9, 10)
        assert r["sampling_interval"] >= 1
    assert set(d.errors) <= set(KERNEL_REASONS) | {
        "template_truncated", "template_no_fields", "template_too_many_fields",
        "template_zero_length", "template_id", "template_scope", "template_missing",
        "template_invalid_data", "pending_evicted", "record_truncated", "too_many_exporters",
        "too_many_templates"}
