"""Alerts: the instances firing (and pending) now, and those resolved lately."""

from __future__ import annotations

import base64
from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Query
from pydantic import BaseModel, Field

from api.deps import CollectorDep

router = APIRouter(prefix="/alerts", tags=["alerts"])


class AlertPublic(BaseModel):
    query: str
    state: Literal["pending", "firing", "resolved"]
    key: list = Field(description="the key columns' values (the rule's keys, in order)")
    labels: dict[str, str]
    summary: str
    row: dict = Field(description="the latest answer row that qualified")
    starts_at: str | None = Field(None, description="when it fired (its first window's start)")
    ends_at: str | None = Field(None, description="resolved: the end of its last window")


class AlertsPage(BaseModel):
    alerts: list[AlertPublic]
    next_cursor: str | None = None


@router.get("", response_model=AlertsPage, responses={400: {"description": "a bad cursor"}})
def list_alerts(
        c: CollectorDep,
        state: Literal["firing", "pending", "resolved", "all"] = "all",
        query: Annotated[str | None, Query(max_length=64, description="one query's")] = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 500,
        cursor: Annotated[str | None, Query(max_length=40)] = None) -> AlertsPage:
    """Firing alerts first (oldest first), then pending, then those resolved within
    ``alerts.keep_resolved_s`` (newest first), paged."""
    found = c.alerts.alerts() if c.alerts is not None else []
    found = [a for a in found if (state == "all" or a["state"] == state)
             and (query is None or a["query"] == query)]
    start = 0
    if cursor is not None:
        try:
            start = int(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode())
        except ValueError as e:
            raise HTTPException(400, "not a cursor of this route") from e
    page = found[start:start + limit]
    nxt = None
    if start + limit < len(found):
        nxt = base64.urlsafe_b64encode(str(start + limit).encode()).decode().rstrip("=")
    return AlertsPage(alerts=[AlertPublic(**{k: a.get(k) for k in AlertPublic.model_fields})
                              for a in page], next_cursor=nxt)
