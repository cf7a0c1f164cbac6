"""Register, list, delete queries and read their results."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Query, Response, status
from pydantic import BaseModel, Field

from api.deps import CollectorDep
from api.formats import columns as printed_columns
from api.formats import csv_header, csv_rows, json_lines, parquet_bytes, with_times
from collector.config import parse_duration, parse_size
from collector.daemon.alerts.rules import AlertRule
from collector.daemon.registry import UNLIMITED, QueryExists
from collector.daemon.results import CursorError, page, page_windows
from collector.daemon.retention import held_bytes
from planner.ir import QueryError

router = APIRouter(prefix="/queries", tags=["queries"])


class QueryCreate(BaseModel):
    name: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$",
                             description="REST id; else from `-- name:` or q1")
    sql: str = Field(..., min_length=1, max_length=100_000)
    alert: AlertRule | None = Field(None, description="its rows become alerts (else the SQL's "
                                    "-- alert: directive, if any)")


Limit = int | float | str | None


class QueryPatch(BaseModel):
    """What to change; a field left out stays as it is."""

    enabled: bool | None = Field(None, description="false pauses the query: it leaves the plan "
                                 "(costs nothing in the prefilter) and keeps its slot and "
                                 "answers")
    max_age: Limit = Field(None, description="keep answers written within this long: seconds "
                           "or 90s, 12h, 30d, 2w; \"unlimited\"; null: results.max_age",
                           examples=["7d"])
    max_bytes: Limit = Field(None, description="keep at most this many bytes of answers, the "
                             "oldest removed first: bytes or 512MiB, 8GiB; \"unlimited\"; "
                             "null: results.max_bytes", examples=["1GiB"])
    alert: AlertRule | None = Field(None, description="its alert rule; null removes it (its "
                                    "firing alerts are resolved)")


class Retention(BaseModel):
    max_age_s: float | None = Field(description="answers are kept this long (null: forever)")
    max_bytes: int | None = Field(description="at most this many bytes (null: no limit)")
    bytes: int = Field(description="bytes of answers the query holds now")


class QueryPublic(BaseModel):
    name: str
    slot: int
    enabled: bool = True
    stream: str
    period_s: int | None
    sql: str
    columns: list[str]
    signature: list[int] = []
    residual: list[int] = []
    retention: Retention | None = None
    alert: AlertRule | None = None


class ResultsPublic(BaseModel):
    name: str
    columns: list[str]
    rows: list[dict]
    next_cursor: str | None = None
    complete_before: float | None = Field(None, description="every window starting before "
                                          "this time (epoch seconds) is answered for good: "
                                          "later pages or reads add no row before it")


PARQUET = "application/vnd.apache.parquet"
NOT_FOUND = {404: {"description": "no query of that name"}}


def _public(c, q, slot) -> QueryPublic:
    qp = None
    if c.plan is not None:
        try:
            qp = c.plan.by_name(q.name)
        except KeyError:
            qp = None
    limits = c.retention_limits().get(q.name)
    return QueryPublic(name=q.name, slot=slot, enabled=c.enabled(q.name), stream=q.stream,
                       period_s=q.period, sql=q.text,
                       columns=[o.name for o in q.outputs],
                       signature=qp.signature if qp else [], residual=qp.residual if qp else [],
                       retention=Retention(max_age_s=limits.max_age_s, max_bytes=limits.max_bytes,
                                           bytes=held_bytes(c.settings.results_dir, q.name))
                       if limits is not None else None, alert=c.alert_rule(q.name))


def _limit(value: Limit, parse) -> float | None:
    """A PATCH limit as the registry keeps it: a number, UNLIMITED, or None (the default)."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in ("unlimited", "none"):
        return UNLIMITED
    try:
        n = parse(value)
    except ValueError as e:
        raise HTTPException(422, str(e)) from e
    if n <= 0:
        raise HTTPException(422, f"a retention limit must be positive: {value!r}")
    return n


@router.post("", status_code=status.HTTP_201_CREATED, response_model=QueryPublic,
             responses={409: {"description": "a query of that name exists"},
                        422: {"description": "the SQL is not a valid query (reason, line, "
                                             "column)"},
                        429: {"description": "api.max_queries are registered"}})
def create_query(body: QueryCreate, c: CollectorDep) -> QueryPublic:
    """Register a query; the prefilter is rebuilt and the engine takes it between batches.
    Past ``api.max_queries`` registered queries: 429."""
    limit = c.settings.api.max_queries
    if len(c.queries()) >= limit:
        raise HTTPException(429, f"{limit} queries are registered (api.max_queries); delete "
                                 "one first")
    try:
        q = c.register(body.name, body.sql, body.alert)
    except QueryError as e:
        raise HTTPException(422, {"reason": e.reason, "line": e.line, "column": e.col,
                                  "message": str(e)}) from e
    except QueryExists as e:
        raise HTTPException(409, str(e)) from e
    found = c.query(q.name)
    return _public(c, *found)


@router.get("", response_model=list[QueryPublic])
def list_queries(c: CollectorDep) -> list[QueryPublic]:
    """Every registered query, in slot order."""
    return [_public(c, q, slot) for q, slot in c.queries()]


@router.get("/{name}", response_model=QueryPublic, responses=NOT_FOUND)
def get_query(name: str, c: CollectorDep) -> QueryPublic:
    """One registered query."""
    found = c.query(name)
    if found is None:
        raise HTTPException(404, "query not found")
    return _public(c, *found)


@router.patch("/{name}", response_model=QueryPublic, responses=NOT_FOUND)
def patch_query(name: str, body: QueryPatch, c: CollectorDep) -> QueryPublic:
    """Pause (``{"enabled": false}``) or resume a query (a new plan version either way), or
    set how long its answers are kept (``{"max_age": "7d", "max_bytes": "1GiB"}``; null goes
    back to the configured ``results`` limits, ``"unlimited"`` keeps everything)."""
    if c.query(name) is None:
        raise HTTPException(404, "query not found")
    given = body.model_fields_set
    limits = {}
    if "max_age" in given:
        limits["max_age_s"] = _limit(body.max_age, parse_duration)
    if "max_bytes" in given:
        limits["max_bytes"] = _limit(body.max_bytes, parse_size)
    if limits and not c.set_retention(name, **limits):
        raise HTTPException(404, "query not found")
    if "alert" in given:
        try:
            c.set_alert(name, body.alert)
        except QueryError as e:
            raise HTTPException(422, {"reason": e.reason, "line": e.line, "column": e.col,
                                      "message": str(e)}) from e
    if body.enabled is not None and not c.set_enabled(name, body.enabled):
        raise HTTPException(404, "query not found")
    return _public(c, *c.query(name))


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT, responses=NOT_FOUND)
def delete_query(name: str, c: CollectorDep) -> None:
    """Unregister a query; its slot is held until no spool file can reference it."""
    if not c.delete(name):
        raise HTTPException(404, "query not found")


@router.get("/{name}/results", response_model=ResultsPublic,
            responses={200: {"content": {"text/csv": {}, PARQUET: {}}},
                       400: {"description": "the cursor is not one this route gave"},
                       **NOT_FOUND})
def query_results(
        name: str, c: CollectorDep,
        windows: Annotated[int | None, Query(ge=1, le=100_000, description="only the latest "
                                             "N closed windows")] = None,
        start: Annotated[datetime | None, Query(alias="from", description="windows starting "
                                                "at or after (ISO 8601 or epoch seconds)")] = None,
        end: Annotated[datetime | None, Query(alias="to", description="windows starting "
                                              "before")] = None,
        limit: Annotated[int, Query(ge=1, le=100_000, description="rows per page")] = 1000,
        cursor: Annotated[str | None, Query(max_length=200, description="next_cursor of the "
                                            "previous page")] = None,
        order: Literal["newest", "oldest"] = "newest",
        format: Literal["json", "csv", "parquet"] = "json",  # noqa: A002 - the query parameter
        time: Annotated[Literal["iso", "epoch", "bucket"], Query(
            description="window_start and window_end as ISO 8601 UTC, epoch seconds, or left "
                        "out (bucket: the query's own time/N column only)")] = "iso",
) -> Response | ResultsPublic:
    """The query's answers for its closed windows: by window start range, paged (newest window
    first by default; ``next_cursor`` continues), as JSON, CSV or a Parquet download. CSV and
    Parquet carry the next page's cursor in the ``X-Next-Cursor`` header."""
    found = c.query(name)
    if found is None:
        raise HTTPException(404, "query not found")
    q = found[0]
    complete = c.complete_before(q)  # read first: the rows read next include all before it
    start_s = start.timestamp() if start else None
    end_s = end.timestamp() if end else None
    try:
        # only the windows this page can reach are read (their sizes from the files' footers)
        table = page_windows(c.settings.results_dir, q, start_s, end_s, order == "newest",
                             limit, cursor, windows)
        table, nxt = page(table, start_s, end_s, order == "newest", limit, cursor)
    except CursorError as e:
        raise HTTPException(400, str(e)) from e
    headers = {"X-Next-Cursor": nxt} if nxt else {}
    if complete is not None:
        headers["X-Complete-Before"] = f"{complete:.3f}"
    if format == "parquet":  # the answer table as Spark wrote it, no row conversion
        return Response(parquet_bytes(with_times(table, time)), media_type=PARQUET, headers={
            **headers, "Content-Disposition": f'attachment; filename="{name}.parquet"'})
    names = printed_columns(q, time)
    if format == "csv":
        return Response(csv_header(names) + csv_rows(table, names, time=time),
                        media_type="text/csv", headers=headers)
    # JSON written from the columns (no object per row): ResultsPublic's shape
    rows = json_lines(table, names, end=",", time=time)[:-1]
    body = (f'{{"name":{json.dumps(name)},"columns":{json.dumps(names)},"rows":['.encode()
            + rows + f'],"next_cursor":{json.dumps(nxt)},'
            f'"complete_before":{json.dumps(complete)}}}'.encode())
    return Response(body, media_type="application/json")
