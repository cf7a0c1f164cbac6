"""The SNMP poller: interface names, descriptions and speeds of flow exporters and sFlow agents.

Every ``enrich.snmp.refresh_s`` each device is walked (GETBULK) for IF-MIB's ifName, ifAlias and
ifHighSpeed: the devices ``enrich.snmp.devices`` names, and with ``default`` credentials every
exporter and agent the listeners have seen. A device that fails keeps what it answered last
(the failure counted by reason); after each round the interfaces table is made again, the static
file (``enrich.interfaces``) over it, and swapped in between batches (``enrich.set_polled``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from capture import enrich
from capture.enrich.interfaces import Interface
from collector.config import SnmpConfig, SnmpCredentials
from collector.metrics import Metrics

log = logging.getLogger("flowsieve.snmp")
IF_NAME = "1.3.6.1.2.1.31.1.1.1.1"
IF_ALIAS = "1.3.6.1.2.1.31.1.1.1.18"
IF_HIGH_SPEED = "1.3.6.1.2.1.31.1.1.1.15"  # Mbit/s
COLUMNS = {IF_NAME: "name", IF_ALIAS: "description", IF_HIGH_SPEED: "speed"}


class SnmpError(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _auth(c: SnmpCredentials):
    from pysnmp.hlapi.v3arch import asyncio as hl
    if c.community is not None:
        return hl.CommunityData(c.community.get_secret_value(), mpModel=1)
    auth = {"md5": hl.usmHMACMD5AuthProtocol, "sha": hl.usmHMACSHAAuthProtocol,
            "sha224": hl.usmHMAC128SHA224AuthProtocol, "sha256": hl.usmHMAC192SHA256AuthProtocol,
            "sha384": hl.usmHMAC256SHA384AuthProtocol,
            "sha512": hl.usmHMAC384SHA512AuthProtocol}[c.auth_protocol]
    priv = {"des": hl.usmDESPrivProtocol, "aes": hl.usmAesCfb128Protocol,
            "aes192": hl.usmAesCfb192Protocol, "aes256": hl.usmAesCfb256Protocol}[
                c.priv_protocol]
    return hl.UsmUserData(
        c.user, c.auth_key.get_secret_value() if c.auth_key else None,
        c.priv_key.get_secret_value() if c.priv_key else None,
        authProtocol=auth if c.auth_key else hl.usmNoAuthProtocol,
        privProtocol=priv if c.priv_key else hl.usmNoPrivProtocol)


async def _walk(device: str, c: SnmpCredentials, timeout_s: float, retries: int
                ) -> dict[tuple[str, int], Interface]:
    from pysnmp.hlapi.v3arch import asyncio as hl
    engine = hl.SnmpEngine()
    try:
        target = await hl.UdpTransportTarget.create((c.host or device, c.port),
                                                    timeout=timeout_s, retries=retries)
        found: dict[int, dict] = {}
        for column, what in COLUMNS.items():
            async for err, status, _, binds in hl.bulk_walk_cmd(
                    engine, _auth(c), target, hl.ContextData(), 0, 50,
                    hl.ObjectType(hl.ObjectIdentity(column)), lexicographicMode=False):
                if err:
                    raise SnmpError(type(err).__name__.lower()
                                    if not isinstance(err, str) else "error", str(err))
                if status:
                    raise SnmpError("agent_error", status.prettyPrint())
                for oid, value in binds:
                    if str(oid).startswith(column + "."):
                        found.setdefault(int(oid[-1]), {})[what] = value
        out = {}
        for index, v in found.items():
            speed = int(v["speed"]) * 1_000_000 if "speed" in v else None
            name, alias = (bytes(v[k]).decode("utf-8", "replace") if k in v else None
                           for k in ("name", "description"))
            out[(device, index)] = Interface(name or None, alias or None, speed or None)
        return out
    finally:
        engine.close_dispatcher()


def walk(device: str, credentials: SnmpCredentials, timeout_s: float = 2.0, retries: int = 1
         ) -> dict[tuple[str, int], Interface]:
    """One device's interfaces (SnmpError: why not)."""
    try:
        return asyncio.run(_walk(device, credentials, timeout_s, retries))
    except SnmpError:
        raise
    except Exception as e:  # noqa: BLE001 - a device's failure is counted, never fatal
        raise SnmpError("error", repr(e)) from e


class SnmpPoller(threading.Thread):
    """Polls the devices every ``refresh_s`` (the first round at once)."""

    def __init__(self, config: SnmpConfig, seen: Callable[[], list[str]], metrics: Metrics):
        super().__init__(name="snmp-poller", daemon=True)
        self.config, self.seen, self.metrics = config, seen, metrics
        self.stopping = threading.Event()
        self.found: dict[str, dict[tuple[str, int], Interface]] = {}
        self.errors: dict[str, str] = {}  # device -> its last failure
        self.rounds = 0

    def devices(self) -> dict[str, SnmpCredentials]:
        out = dict(self.config.devices)
        if self.config.default is not None:
            for device in self.seen():
                out.setdefault(device, self.config.default)
        return out

    def poll(self) -> None:
        """One round: every device walked, the table swapped in."""
        for device, c in self.devices().items():
            if self.stopping.is_set():
                return
            try:
                self.found[device] = walk(device, c, self.config.timeout_s, self.config.retries)
                self.errors.pop(device, None)
                self.metrics.snmp_polls.labels(device, "ok").inc()
                self.metrics.snmp_interfaces.labels(device).set(len(self.found[device]))
            except SnmpError as e:
                self.errors[device] = str(e)
                self.metrics.snmp_polls.labels(device, e.reason).inc()
                log.warning("SNMP %s: %s (keeping its last interfaces: %d)", device, e,
                            len(self.found.get(device, {})))
        enrich.set_polled({k: v for found in self.found.values() for k, v in found.items()})
        self.rounds += 1

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the poller must outlive a bad round
                log.exception("SNMP poll round failed")
            self.stopping.wait(self.config.refresh_s)

    def stop(self) -> None:
        self.stopping.set()
