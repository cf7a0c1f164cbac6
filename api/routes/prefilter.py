"""Explain and rebuild the prefilter."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field

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
    doc["residual_runtime"] = [e.residual_state() for e in c.engines
                               if e.residual_state() is not None]
    doc["om_runtime"] = [n for e in c.engines for n in e.om_state()]
    return doc


@router.get("/versions")
def plan_versions(c: CollectorDep, limit: Annotated[int, Query(ge=1, le=100_000)] = 100
                  ) -> list[dict]:
    """Tuples each plan version processed, by source, newest version first (version 0: read
    before the first plan). A batch is processed under one version whole, so across versions
    they add up to the tuples the sources read."""
    return c.plan_versions()[:limit]


class RebuildOptions(BaseModel):
    bit_budget: int | None = Field(None, ge=0, le=4096, description="prefilter bits (null: "
                                   "the configuration's planner.bit_budget)")
    use_selectivities: bool = Field(True, description="order and compress bits by the "
                                    "selectivities measured on the traffic so far")


@router.post("/rebuild")
def rebuild_prefilter(c: CollectorDep, options: RebuildOptions | None = None) -> dict:
    """Recompile the registered queries into a new plan version. Options (a JSON body) stay
    in force for later rebuilds until new options or a restart; no body: as before."""
    opts = None
    if options is not None:
        opts = {"use_selectivities": options.use_selectivities}
        if options.bit_budget is not None:
            opts["bit_budget"] = options.bit_budget
    plan = c.rebuild(opts)
    return {"version": plan.version, "bits": len(plan.bits), "bit_budget": plan.bit_budget,
            "options": c.plan_overrides}
