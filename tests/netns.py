"""Network namespaces the tests create, joined to this host by a veth pair (traffic never leaves
the machine): for a second Spark worker (the cluster test) and for an SNMP agent serving the
interfaces a test made (the enrichment test)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

from tests.helpers import need


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


def stale_namespaces(prefix: str) -> None:
    """Remove the namespaces and veth pairs of earlier runs whose process is gone (a killed run
    leaves its address on a host link, and the kernel would route this run's replies there)."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for ns in names:
        m = re.fullmatch(prefix + r"(\d+)", ns)
        if m and not os.path.exists(f"/proc/{m[1]}"):
            subprocess.run(["ip", "link", "del", f"{ns}a"], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def free_subnet(first: int = 7) -> tuple[str, str]:
    """Two addresses of a /30 that no link of this host uses or routes, searched from
    10.213.``first``.0 (each user its own range: two xdist workers may look at once)."""
    taken = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True,
                           text=True).stdout
    for third in range(first, 256):
        if f"10.213.{third}." not in taken:
            return f"10.213.{third}.1", f"10.213.{third}.2"
    raise AssertionError("no free /30 in 10.213.0.0/16")


@contextmanager
def namespace(prefix: str, why: str, first: int = 7) -> Iterator[tuple[str, str, str]]:
    """A namespace ``<prefix><pid>`` joined by a veth pair: (namespace, the address here, the
    address there); removed afterwards."""
    need(os.geteuid() == 0 and shutil.which("ip") is not None,
         f"{why} needs root and iproute2 (ip netns, veth)")
    stale_namespaces(prefix)
    host, peer = free_subnet(first)
    ns = f"{prefix}{os.getpid()}"
    here, there = f"{ns}a", f"{ns}b"
    sh("ip", "netns", "add", ns)
    try:
        sh("ip", "link", "add", here, "type", "veth", "peer", "name", there)
        sh("ip", "link", "set", there, "netns", ns)
        sh("ip", "addr", "add", f"{host}/30", "dev", here)
        sh("ip", "link", "set", here, "up")
        for cmd in (["ip", "addr", "add", f"{peer}/30", "dev", there],
                    ["ip", "link", "set", there, "up"], ["ip", "link", "set", "lo", "up"]):
            sh("ip", "netns", "exec", ns, *cmd)
        yield ns, host, peer
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
