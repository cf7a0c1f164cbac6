"""Interface names, descriptions and speeds over SNMP from a real ``snmpd`` serving the links a
test made in its own namespace: SNMP v2c and v3 (SHA, AES) equal iproute2's names and
descriptions and net-snmp's own speeds; a failed poll keeps the last interfaces and is counted
by reason; the static file overrides what SNMP found; flows and samples get the fields by their
exporter's (agent's) address and ifIndex."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import generate_latest

from capture import enrich
from capture.fields import ip_bytes
from collector.config import EnrichConfig, SnmpConfig, SnmpCredentials
from collector.daemon.snmp import SnmpError, SnmpPoller, walk
from collector.metrics import Metrics
from collector.pipeline import enrichment
from tests.processes import metric
from tests.snmptools import AUTH_KEY, COMMUNITY, LINKS, PRIV_KEY, USER, snmp_agent  # noqa: F401

V2C = {"community": COMMUNITY}
V3 = {"user": USER, "auth_key": AUTH_KEY, "priv_key": PRIV_KEY, "auth_protocol": "sha",
      "priv_protocol": "aes"}


def creds(agent, **kw) -> SnmpCredentials:
    return SnmpCredentials(port=agent.port, **kw)


@pytest.mark.parametrize("version", [V2C, V3], ids=["v2c", "v3"])
def test_walk_equals_the_namespaces_links(snmp_agent, version):  # noqa: F811
    found = walk(snmp_agent.address, creds(snmp_agent, **version))
    links, speeds = snmp_agent.links(), snmp_agent.speeds()
    assert {i: (f.name, f.description) for (_, i), f in found.items()} == links
    assert {i: f.speed or 0 for (_, i), f in found.items()} == speeds
    names = {f.name for f in found.values()}
    assert set(LINKS) <= names and "lo" in names  # not vacuous


def test_wrong_credentials_and_an_absent_agent_are_errors(snmp_agent):  # noqa: F811
    with pytest.raises(SnmpError) as e:
        walk(snmp_agent.address, creds(snmp_agent, community="wrong"), timeout_s=0.3,
             retries=0)
    assert e.value.reason == "requesttimedout"
    with pytest.raises(SnmpError):
        walk(snmp_agent.address, creds(snmp_agent, user=USER, auth_key="not-the-key-1",
                                       priv_key=PRIV_KEY), timeout_s=0.3, retries=0)


class Flows:
    """A stand-in batch of the flows stream: exporter address and interface indexes."""

    stream = "flows"

    def __init__(self, exporters, inputs, outputs):
        self.cols = {"exporter": np.frombuffer(b"".join(ip_bytes(a) for a in exporters),
                                               np.uint8).reshape(-1, 16),
                     "input_if": np.array(inputs, np.int64),
                     "output_if": np.array(outputs, np.int64)}

    def __len__(self):
        return len(self.cols["input_if"])

    def column(self, name):
        return self.cols[name]

    def ip_valid(self, name):
        return np.ones(len(self), bool)


def test_poller_table_overrides_and_failures(snmp_agent, tmp_path):  # noqa: F811
    """The poller's table enriches flows by (exporter, ifIndex); the static file overrides it;
    a poll that fails keeps the last interfaces and counts why."""
    links = snmp_agent.links()
    index = {name: i for i, (name, _) in links.items()}
    static = tmp_path / "interfaces.yaml"
    static.write_text(f"{snmp_agent.address}:\n  {index['fsbare2']}: {{description: spare, "
                      f"speed: 2500000000}}\n192.0.2.7:\n  9: ge-0/0/9\n")
    config = SnmpConfig(devices={snmp_agent.address: creds(snmp_agent, **V2C)}, timeout_s=0.5,
                        retries=0)
    enrichment.configure(EnrichConfig(interfaces=static, snmp=config))
    metrics = Metrics()
    poller = SnmpPoller(config, lambda: [], metrics)
    try:
        poller.poll()
        fb = Flows([snmp_agent.address] * 3 + ["192.0.2.7", "192.0.2.8"],
                   [index["fsup0"], index["fsbare2"], 999, 9, index["fsup0"]],
                   [index["fscust1"], -1, index["fsup0"], 9, 1])
        fields = ["in_if_name", "in_if_description", "in_if_speed", "out_if_name"]
        got = enrich.current().apply(fb, fields)
        rows = [dict(zip(fields, r, strict=True)) for r in zip(
            *(got.arrow(f).to_pylist() for f in fields), strict=True)]
        assert rows == [
            {"in_if_name": "fsup0", "in_if_description": "uplink to core",
             "in_if_speed": snmp_agent.speeds()[index["fsup0"]] or None,
             "out_if_name": "fscust1"},
            {"in_if_name": "fsbare2", "in_if_description": "spare", "in_if_speed": 2500000000,
             "out_if_name": None},
            {"in_if_name": None, "in_if_description": None, "in_if_speed": None,
             "out_if_name": "fsup0"},
            {"in_if_name": "ge-0/0/9", "in_if_description": None, "in_if_speed": None,
             "out_if_name": "ge-0/0/9"},
            {"in_if_name": None, "in_if_description": None, "in_if_speed": None,
             "out_if_name": None}]
        text = generate_latest(metrics.registry).decode()
        assert metric(text, "flowsieve_enrich_snmp_polls_total",
                      f'device="{snmp_agent.address}",outcome="ok"') == 1
        assert metric(text, "flowsieve_enrich_snmp_interfaces",
                      f'device="{snmp_agent.address}"') == len(links)
        # the agent stops answering: the poll fails, the interfaces stay
        poller.config = config.model_copy(update={"devices": {
            snmp_agent.address: creds(snmp_agent, community="wrong")}})
        poller.poll()
        text = generate_latest(metrics.registry).decode()
        assert metric(text, "flowsieve_enrich_snmp_polls_total",
                      f'device="{snmp_agent.address}",outcome="requesttimedout"') == 1
        again = enrich.current().apply(fb, ["in_if_name"]).arrow("in_if_name").to_pylist()
        assert again[:2] == ["fsup0", "fsbare2"]
        assert snmp_agent.address in poller.errors
    finally:
        enrich.configure({})
