"""The enrichment databases of the configuration (capture/enrich/), and the check that a query
reads only enrichment fields some configured database gives."""

from __future__ import annotations

import os
import re

from capture import enrich
from capture.enrich.dictionary import folder_of
from capture.fields import key_field
from collector.config import EnrichConfig
from planner.ir import Query, QueryError


def configure(config: EnrichConfig, spool_root: str | os.PathLike | None = None
              ) -> enrich.Enrichment:
    """Load the configured databases (a bad file: ValueError with the file and reason), their
    texts published beside the spool at ``spool_root`` (Spark's answers read them)."""
    return enrich.configure(config.databases(), config.asn_precedence,
                            folder_of(spool_root) if spool_root is not None else None)


def read_fields(q: Query) -> set[str]:
    """The catalogue fields a query (each part of a join) reads."""
    out: set[str] = set()
    for part in q.parts:
        out.update(key_field(k)[0] for k in part.node_keys)
        out.update(part.measures)
        out.update(key_field(o.field)[0] for o in part.outputs if o.field)
        for p in part.predicates:
            out.update(p.fields)
    return out


def check(q: Query) -> None:
    """A QueryError at the first enrichment field ``q`` reads that no database gives."""
    for part in q.parts:
        for name, database in sorted(enrich.missing(part.stream, read_fields(part))):
            m = re.search(rf"\b{re.escape(name)}\b", q.text)
            before = q.text[:m.start()] if m else ""
            line = before.count("\n") + 1 if m else 0
            col = m.start() - (before.rfind("\n") + 1) + 1 if m else 0
            raise QueryError(f"{name} needs an enrichment database: set enrich.{database} in "
                             f"the configuration (an MMDB file)", line, col, q.name)
