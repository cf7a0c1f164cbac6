"""Explain and rebuild the prefilter."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import CollectorDep

router = APIRouter(prefix="/prefilter", tags=["prefilter"])


@router.get("")
def get_prefilter(c: CollectorDep) -> dict:
    """The running plan: predicates, bits, signatures, residuals (the JSON of `flowsieve plan`)."""
    return c.plan.to_json() if c.plan else {}


@router.post("/rebuild")
def rebuild_prefilter(c: CollectorDep) -> dict:
    """Recompile the registered queries into a new plan version."""
    plan = c.rebuild()
    return {"version": plan.version}
