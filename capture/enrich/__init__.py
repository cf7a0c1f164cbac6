"""Enrichment: fields looked up by address in prefix databases (AS numbers, countries), computed
right after unpack for the fields a plan reads, then ordinary catalogue fields for every later
stage (prefilter bits, residual, LFTA keys, Spark).

The package: ``mmdb`` (MaxMind DB files read and their trie walked in numba), ``lpm`` (the
compiled longest-prefix-match index and its numba search), ``databases`` (the configured
databases and a batch's enrichment), ``batch`` (a batch with its enrichment columns).

One ``Enrichment`` serves the whole process (``current()``); ``configure`` sets it and
``Reloader`` compiles a database whose file changed in the background and swaps the new set in
with one reference assignment: an engine takes ``current()`` once per batch, so a batch is
enriched by one version whole.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from capture.enrich.batch import EnrichedBatch
from capture.enrich.databases import (
    DATABASES,
    PRECEDENCES,
    Database,
    Enrichment,
    Networks,
    load,
    load_table,
)
from capture.enrich.dictionary import publish
from capture.enrich.mmdb import MmdbError
from capture.enrich.table import file_stamp

log = logging.getLogger("flowsieve.enrich")
_current = Enrichment()
_config: tuple[dict, str] = ({}, "exporter")
_publish: Path | None = None  # where the texts of text codes go (dictionary.folder_of(spool))
_polled: dict = {}  # the interfaces SNMP found: {(device, ifIndex): Interface}
_swap = threading.Lock()  # one swap at a time (the reloader's, the SNMP poller's)


def current() -> Enrichment:
    return _current


def configure(databases: dict[str, tuple[str, dict[str, str]]],
              asn_precedence: str = "exporter",
              publish_to: str | os.PathLike | None = None) -> Enrichment:
    """Load the databases ``{name: (path, record paths)}`` now (errors raised: MmdbError),
    and publish their texts into the dictionary folder ``publish_to``."""
    global _current, _config, _publish
    fresh = load(databases, asn_precedence, _polled)
    _publish = Path(publish_to) if publish_to is not None else None
    _published(fresh, list(fresh.databases))
    _current = fresh
    _config = (dict(databases), asn_precedence)
    return _current


def _published(e: Enrichment, names: list[str]) -> None:
    """The texts of the databases ``names`` written before any batch they enrich."""
    if _publish is not None:
        for name in names:
            publish(_publish, name, e.databases[name].texts)


def missing(stream: str, names) -> list[tuple[str, str]]:
    """(field, database) of enrichment fields among ``names`` that no configured database
    gives (a flow's AS comes from its exporter too: not missing)."""
    from capture.fields import enriched
    table = enriched(stream)
    return [(n, table[n].database) for n in names
            if n in table and not table[n].exported and table[n].database not in
            _current.databases]


def reload_changed(on_error: Callable[[str, Exception], None] | None = None) -> list[str]:
    """Compile again each configured database whose file changed, and swap the new set in;
    a database that fails to load keeps the last one (``on_error(name, error)``). The names
    reloaded."""
    global _current
    with _swap:
        databases, precedence = _config
        now = _current
        fresh = dict(now.databases)
        done = []
        for name, (path, paths) in databases.items():
            old = now.databases.get(name)
            try:
                if old is not None and (not path or file_stamp(path) == old.stamp):
                    continue
                fresh[name] = load_table(name, path, paths, _polled)
                done.append(name)
            except (OSError, MmdbError) as e:
                log.error("enrich.%s: %s: keeping the database loaded before", name, e)
                if on_error is not None:
                    on_error(name, e)
        if done:
            swapped = Enrichment(fresh, precedence)
            _published(swapped, done)
            _current = swapped
            log.info("enrichment reloaded: %s", ", ".join(done))
    return done


def set_polled(polled: dict) -> None:
    """What SNMP found now ({(device, ifIndex): Interface}): the interfaces table made again
    (the static file over it) and swapped in, its texts published first."""
    global _current, _polled
    with _swap:
        _polled = dict(polled)
        databases, precedence = _config
        if "interfaces" not in databases:
            return
        fresh = dict(_current.databases)
        fresh["interfaces"] = load_table("interfaces", databases["interfaces"][0], None,
                                         _polled)
        swapped = Enrichment(fresh, precedence)
        _published(swapped, ["interfaces"])
        _current = swapped


class Reloader(threading.Thread):
    """Checks the configured files every ``every_s`` and reloads those that changed."""

    def __init__(self, every_s: float, on_reload: Callable[[list[str]], None] | None = None,
                 on_error: Callable[[str, Exception], None] | None = None):
        super().__init__(name="enrich-reload", daemon=True)
        self.every_s, self.on_reload, self.on_error = every_s, on_reload, on_error
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(self.every_s):
            done = reload_changed(self.on_error)
            if done and self.on_reload is not None:
                self.on_reload(done)

    def stop(self) -> None:
        self.stopping.set()


__all__ = ["DATABASES", "PRECEDENCES", "Database", "EnrichedBatch", "Enrichment", "MmdbError",
           "Networks", "Reloader", "configure", "current", "missing", "reload_changed",
           "set_polled"]
