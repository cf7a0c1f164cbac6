"""Flow exporters seen by the NetFlow/IPFIX listeners."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import CollectorDep

router = APIRouter(prefix="/exporters", tags=["exporters"])


@router.get("")
def get_exporters(c: CollectorDep) -> list[dict]:
    """Per exporter address: last seen (epoch seconds) and each export stream (version and
    source id / observation domain) with its templates, sampling (from options data, by sampler
    id; a configured override), sequence loss (`lost` in records for v5 and IPFIX, in datagrams
    for v9; `gaps`; `out_of_order`), datagrams, records and records of unknown sampling."""
    return c.exporters()
