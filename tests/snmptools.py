"""A real SNMP agent (net-snmp's ``snmpd``) in a network namespace a test creates, serving the
interfaces the test made there (veth pairs, some with descriptions, and the namespace's own
veth end); the truth of its
ifTable read with iproute2 (names, descriptions, indexes) and net-snmp's own ``snmpbulkwalk``
(speeds)."""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import need_tool
from tests.netns import namespace, sh
from tests.processes import stop_daemon

COMMUNITY = "fs-s3cret"
WRITE = "fs-write"
USER, AUTH_KEY, PRIV_KEY = "flowsieve", "auth-key-123", "priv-key-456"
LINKS = {"fsup0": "uplink to core", "fscust1": "customer: ACME, Zürich", "fsbare2": None}


@dataclass
class Agent:
    ns: str
    address: str  # the agent's, inside the namespace
    port: int

    def links(self) -> dict[int, tuple[str, str | None]]:
        """ifIndex -> (name, description) of the namespace's links: names as iproute2 lists
        them, descriptions as the test set them (``describe``)."""
        out = subprocess.run(["ip", "-n", self.ns, "-j", "link", "show"], capture_output=True,
                             text=True, check=True).stdout
        return {x["ifindex"]: (x["ifname"], LINKS.get(x["ifname"])) for x in json.loads(out)}

    def describe(self) -> None:
        """Each link's description (ifAlias) set over SNMP, as an operator sets a router's
        (net-snmp keeps its own, not the kernel's alias)."""
        for index, (name, _) in self.links().items():
            if LINKS.get(name):
                subprocess.run(["snmpset", "-m", "", "-v2c", "-c", WRITE,
                                f"{self.address}:{self.port}",
                                f"1.3.6.1.2.1.31.1.1.1.18.{index}", "s", LINKS[name]],
                               capture_output=True, check=True)

    def speeds(self) -> dict[int, int]:
        """ifIndex -> ifHighSpeed × 10^6 as net-snmp's snmpbulkwalk reads them (0: none)."""
        out = subprocess.run(["snmpbulkwalk", "-m", "", "-On", "-Oq", "-v2c", "-c", COMMUNITY,
                              f"{self.address}:{self.port}", "1.3.6.1.2.1.31.1.1.1.15"],
                             capture_output=True, text=True, check=True).stdout
        return {int(oid.rsplit(".", 1)[1]): int(v) * 1_000_000
                for oid, v in (line.split() for line in out.splitlines() if line.strip())}


def start_agent(folder: Path, ns: str, address: str, port: int) -> subprocess.Popen:
    conf = folder / "snmpd.conf"
    conf.write_text(f"rocommunity {COMMUNITY} default\nrwcommunity {WRITE} default\n"
                    f'createUser {USER} SHA "{AUTH_KEY}" AES "{PRIV_KEY}"\n'
                    f"rouser {USER} priv\npersistentDir {folder / 'persist'}\n")
    proc = subprocess.Popen(["ip", "netns", "exec", ns, "snmpd", "-f", "-Lf",
                             str(folder / "snmpd.log"), "-C", "-c", str(conf), "-p",
                             str(folder / "snmpd.pid"), f"udp:{address}:{port}"],
                            env={"MIBS": "", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # until it answers (a hang fails here, not a timing)
        r = subprocess.run(["snmpget", "-m", "", "-v2c", "-c", COMMUNITY, "-t", "0.5",
                            f"{address}:{port}", "1.3.6.1.2.1.1.3.0"], capture_output=True)
        if r.returncode == 0:
            return proc
        assert proc.poll() is None, (folder / "snmpd.log").read_text()[-2000:]
    raise AssertionError("snmpd did not answer in 30 s")


@pytest.fixture(scope="module")
def snmp_agent(tmp_path_factory):
    """snmpd in a namespace with three veth pairs (two with a description) beside its own veth
    end, on port 1161 of the namespace's address."""
    need_tool("snmpd")
    need_tool("snmpbulkwalk")
    with namespace("fss", "the SNMP test", first=131) as (ns, _, peer):
        for name in LINKS:  # veth pairs (this kernel may lack dummy links)
            sh("ip", "-n", ns, "link", "add", name, "type", "veth", "peer", "name", f"{name}p")
            sh("ip", "-n", ns, "link", "set", name, "up")
        folder = tmp_path_factory.mktemp("snmpd")
        proc = start_agent(folder, ns, peer, 1161)
        agent = Agent(ns, peer, 1161)
        agent.proc, agent.folder = proc, folder
        agent.describe()
        try:
            yield agent
        finally:
            stop_daemon(agent.proc, 10)
