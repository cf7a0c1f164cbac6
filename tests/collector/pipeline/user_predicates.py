"""User predicates the tests register by reference
(``tests.collector.pipeline.user_predicates:…``)."""

from __future__ import annotations

import ipaddress

CALLS: list = []  # every value a predicate was called on (the value-cache test reads it)


def is_private(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    CALLS.append(addr)
    return addr.is_private


def suffix(name: str, tail: str) -> bool:
    CALLS.append(name)
    return name == tail or name.endswith("." + tail)


def port_in(port: int, lo: int, hi: int) -> bool:
    return lo <= port <= hi


def broken(value) -> bool:
    raise RuntimeError("a bug in the user's code")


NOT_CALLABLE = 3
