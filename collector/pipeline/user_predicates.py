"""User predicates: Python functions a query calls by name in WHERE, ``is_bogon(src_ip)`` or
``suffix_in(dns_qname, 'example.com')``. They are residual predicates
(collector/pipeline/residual.py): never a prefilter bit nor a BPF term, run only on tuples whose
query bit is set, in the order A-Greedy keeps, their outcomes kept by value in the residual value
cache.

A predicate takes one value and the call's constant arguments and returns whether the tuple
passes: ``def is_bogon(addr: ipaddress.IPv4Address | IPv6Address) -> bool``. Values are ``int``
for integer fields, ``str`` for strings, ``ipaddress`` objects for addresses (IPv4 ones as
IPv4Address); NULL is false without a call, as for every predicate. It must be pure: the same
value gives the same answer (the cache relies on it). An exception counts as false for that
value, is counted by predicate (``flowsieve_residual_errors_total``) and logged once. A predicate
runs once per distinct value of a batch (and not again for a value the cache holds).

Predicates are found by name in the ``flowsieve.predicates`` entry-point group of installed
packages, and in the configuration (``predicates: {name: "package.module:function"}``, or a
file, ``"/etc/flowsieve/predicates.py:function"``), which wins over an entry point of the same
name.
"""

from __future__ import annotations

import importlib
import importlib.util
import ipaddress
import logging
import threading
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path

import numpy as np
import pyarrow as pa

from capture.fields import IP, STRING, fields
from planner.ir import Query, QueryError
from planner.where import NAME_RE

log = logging.getLogger("flowsieve.functions")
GROUP = "flowsieve.predicates"
_lock = threading.Lock()
_funcs: dict[str, Callable[..., bool]] = {}
_errors: dict[str, int] = {}  # exceptions raised since the metrics last took them, by name
_said: set[str] = set()
FEW = 64  # rows below which distinct values are not worth finding


def load(ref: str) -> Callable[..., bool]:
    """The function a ``package.module:function`` or ``/path/file.py:function`` reference
    names (ValueError with why)."""
    mod, sep, attr = ref.rpartition(":")
    if not sep or not mod or not attr:
        raise ValueError(f"{ref!r} is not 'package.module:function' or '/path/file.py:function'")
    try:
        if mod.endswith(".py"):
            path = Path(mod)
            spec = importlib.util.spec_from_file_location(f"flowsieve_user_{path.stem}", path)
            if spec is None or not path.is_file():
                raise FileNotFoundError(f"no file {path}")
            obj = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(obj)
        else:
            obj = importlib.import_module(mod)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's module's
        raise ValueError(f"cannot import {mod!r}: {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ValueError(f"module {mod!r} has no {attr!r}")
    if not callable(obj):
        raise ValueError(f"{ref} is not callable")
    return obj


def configure(refs: dict[str, str]) -> None:
    """The predicates of installed entry points and of the configuration (name -> reference);
    a bad reference is a ValueError naming it."""
    found: dict[str, Callable[..., bool]] = {}
    for ep in entry_points(group=GROUP):
        try:
            found[ep.name.lower()] = ep.load()
        except Exception as e:  # noqa: BLE001 - a broken plugin must not stop the daemon
            log.error("user predicate %s (entry point %s): %s: %s", ep.name, ep.value,
                      type(e).__name__, e)
    for name, ref in refs.items():
        if not NAME_RE.match(name):
            raise ValueError(f"user predicate name {name!r}: letters, digits and '_'")
        try:
            found[name.lower()] = load(ref)
        except ValueError as e:
            raise ValueError(f"user predicate {name}: {e}") from None
    with _lock:
        _funcs.clear()
        _funcs.update(found)


def register(name: str, fn: Callable[..., bool]) -> None:
    """Add one predicate from Python (an embedding program, tests)."""
    with _lock:
        _funcs[name.lower()] = fn


def names() -> list[str]:
    with _lock:
        return sorted(_funcs)


def check(q: Query) -> None:
    """Every user predicate ``q`` calls is known; else a QueryError at the call."""
    for p in (p for part in q.parts for p in part.predicates):  # a join: its parts'
        for a in p.atoms:
            if a.op == "call" and a.values[0] not in _funcs:
                line, col = _position(q.text, a.values[0])
                known = ", ".join(names()) or "none"
                raise QueryError(f"unknown function {a.values[0]}() (in_prefix, in_table, "
                                 f"regexp; user predicates: {known})", line, col, q.name)


def _position(text: str, name: str) -> tuple[int, int]:
    low = text.lower()
    at = low.find(name + "(")
    if at < 0:
        return 0, 0
    before = text[:at]
    return before.count("\n") + 1, at - (before.rfind("\n") + 1) + 1


def distinct(stream: str, field: str, tb, rows: np.ndarray) -> tuple[list, np.ndarray]:
    """The field's distinct values on ``rows`` as a predicate receives them (None for NULL)
    and each row's index into them: a predicate runs once per distinct value of a batch."""
    kind = fields(stream)[field].kind
    if kind == STRING:
        col = tb.strings[field].take(pa.array(rows))
        if len(rows) <= FEW:  # encoding costs more than it saves
            return col.to_pylist(), np.arange(len(rows))
        if isinstance(col, pa.ChunkedArray):
            col = col.combine_chunks()
        enc = col.dictionary_encode()
        values = enc.dictionary.to_pylist()
        idx = enc.indices.fill_null(len(values)).to_numpy(zero_copy_only=False)
        return values + [None], idx.astype(np.int64)
    if kind == IP:
        ok = tb.ip_valid(field)[rows]
        raw = np.ascontiguousarray(tb.column(field)[rows][ok]).view("V16").ravel()
        uniq, inverse = np.unique(raw, return_inverse=True)
        values = []
        for b in uniq.tolist():
            a = ipaddress.IPv6Address(bytes(b))
            values.append(a.ipv4_mapped or a)
        idx = np.full(len(rows), len(values), np.int64)
        idx[ok] = inverse.ravel()
        return values + [None], idx
    col = tb.column(field)[rows].astype(np.int64)
    uniq, idx = np.unique(col, return_inverse=True)
    return [int(v) if v >= 0 else None for v in uniq.tolist()], idx.ravel()


def take_errors() -> dict[str, int]:
    """Exceptions raised by each predicate since the last call (the metrics count them)."""
    with _lock:
        out = dict(_errors)
        _errors.clear()
    return out


def call(name: str, args: tuple, value) -> bool:
    """One predicate on one value; an exception or a missing predicate is false."""
    fn = _funcs.get(name)
    if fn is None:
        if name not in _said:
            _said.add(name)
            log.error("user predicate %s() is no longer configured: it holds for no value", name)
        return False
    try:
        return bool(fn(value, *args))
    except Exception as e:  # noqa: BLE001 - a user function's bug must not stop capture
        with _lock:
            _errors[name] = _errors.get(name, 0) + 1
        if name not in _said:
            _said.add(name)
            log.error("user predicate %s(%r) raised %s: %s (counted as false)", name, value,
                      type(e).__name__, e)
        return False
