"""MMDB databases for the enrichment tests, written with ``mmdb-writer`` (an independent writer),
and the ``maxminddb`` reader as the oracle of every look-up."""

from __future__ import annotations

import ipaddress
import random
from pathlib import Path

import maxminddb
import numpy as np
from mmdb_writer import MMDBWriter
from netaddr import IPSet

from capture.fields import ip_bytes

DATA = Path(__file__).parent / "data" / "mmdb"
SHARED = ("GeoLite2-ASN-Test", "GeoIP2-Country-Test", "GeoLite2-Country-Test",
          "GeoLite2-City-Test")


def write_db(path, records: dict[str, dict], ip_version: int = 6,
             database_type: str = "flowsieve-test") -> Path:
    """A database of ``{network: record}``; a network inserted later wins where they overlap
    (mmdb-writer's rule)."""
    w = MMDBWriter(ip_version=ip_version, database_type=database_type,
                   ipv4_compatible=ip_version == 6)
    for net, rec in records.items():
        w.insert_network(IPSet([net]), rec)
    w.to_db_file(str(path))
    return Path(path)


def random_networks(n: int, seed: int, v6_share: float = 0.3) -> list[str]:
    """Prefixes of mixed lengths (IPv4 /8 to /32, IPv6 /16 to /128), overlapping at random,
    wider ones first (so narrower ones nest inside them)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if rng.random() < v6_share:
            length = rng.choice([16, 24, 29, 32, 36, 40, 44, 48, 48, 56, 64, 64, 96, 127, 128])
            bits = rng.getrandbits(length) << (128 - length)
            out.append((length, f"{ipaddress.IPv6Address(bits)}/{length}"))
        else:
            length = rng.choice([8, 12, 16, 18, 20, 22, 24, 24, 24, 26, 28, 30, 31, 32])
            bits = rng.getrandbits(length) << (32 - length)
            out.append((length + 96, f"{ipaddress.IPv4Address(bits)}/{length}"))
    return [net for _, net in sorted(out, key=lambda t: t[0])]


def probe_addresses(reader: maxminddb.Reader, seed: int, per_network: int = 2,
                    uniform: int = 2000) -> list[str]:
    """Each network's first and last address and their neighbours outside, random addresses
    inside, and uniform random IPv4 and IPv6 addresses."""
    rng = random.Random(seed)
    out: list[str] = []
    for net, _ in reader:
        first, last = int(net.network_address), int(net.broadcast_address)
        cls = type(net.network_address)
        top = (1 << net.max_prefixlen) - 1
        for v in (first, last, first - 1, last + 1,
                  *(rng.randint(first, last) for _ in range(per_network))):
            if 0 <= v <= top:
                out.append(str(cls(v)))
    out += [str(ipaddress.IPv4Address(rng.getrandbits(32))) for _ in range(uniform)]
    out += [str(ipaddress.IPv6Address(rng.getrandbits(128))) for _ in range(uniform)]
    return out


def address_column(addrs: list[str]) -> np.ndarray:
    """Addresses as the catalogue holds them: (n, 16) bytes, IPv4 as IPv4-mapped."""
    return np.frombuffer(b"".join(ip_bytes(a) for a in addrs), np.uint8).reshape(-1, 16).copy()


def oracle(reader: maxminddb.Reader, addr: str, path: tuple[str, ...]):
    """``maxminddb``'s value at a record path (None: no record, or no value there); an IPv6
    address in an IPv4 database has none."""
    try:
        value = reader.get(addr)
    except ValueError:
        return None
    try:
        for part in path:  # the test databases' paths are map keys only
            value = value[part]
    except (KeyError, TypeError):
        return None
    return value
