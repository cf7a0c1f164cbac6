"""The enrichment databases the daemon looks fields up in."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import CollectorDep
from capture import enrich

router = APIRouter(prefix="/enrichment", tags=["enrichment"])


@router.get("")
def get_enrichment(c: CollectorDep) -> dict:
    """The AS precedence and each configured database as loaded now: name, file, database type
    and build time (from its metadata), networks, distinct records, compiled intervals and
    bytes, load time, the record paths of its attributes."""
    now = enrich.current()
    return {"asn_precedence": now.asn_precedence,
            "databases": [db.describe() for db in now.databases.values()]}
