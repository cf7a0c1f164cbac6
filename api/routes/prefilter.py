"""Explain and rebuild the prefilter."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import CollectorDep

router = APIRouter(prefix="/prefilter", tags=["prefilter"])


@router.get("")
def get_prefilter(c: CollectorDep) -> dict:
    """The running plan: predicates (with selectivities measured since), bits, rectangles,
    signatures, residuals (the JSON of `flowsieve plan`)."""
    if c.plan is None:
        return {}
    doc = c.plan.to_json()
    measured = c.meter.selectivities()
    for p in doc["predicates"]:
        p["selectivity"] = measured.get(p["text"], p["selectivity"])
    doc["asc_runtime"] = [e.asc_state() for e in c.engines if e.asc_state() is not None]
    return doc


@router.post("/rebuild")
def rebuild_prefilter(c: CollectorDep) -> dict:
    """Recompile the registered queries into a new plan version."""
    plan = c.rebuild()
    return {"version": plan.version}
