"""The FastAPI control plane over the collector's services."""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.deps import CollectorDep
from api.routes import alerts, enrichment, exporters, prefilter, queries
from api.security import DOCS_STATIC, OPEN_PATHS, Guard, problem
from collector.daemon.cluster import ProbeOnly
from collector.daemon.service import Collector


def create_app(collector: Collector, manage: bool = False) -> FastAPI:
    """An app over ``collector``; with ``manage`` the app starts and stops it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage and not collector.started:
            collector.start()
        yield
        if manage:
            collector.stop()

    # Swagger UI (/docs) and ReDoc (/redoc) from assets the daemon serves itself (the
    # fastapi-offline package ships them): the pages work on a host with no internet
    app = FastAPIOffline(title="flowsieve", version="0.1.0", lifespan=lifespan,
                         static_url=DOCS_STATIC,
                         description="Register continuous queries over packets and flows, "
                                     "read their results, explain the prefilter.")
    app.state.collector = collector
    api = collector.settings.api
    if api.cors_origins:  # none unless configured
        app.add_middleware(CORSMiddleware, allow_origins=api.cors_origins,
                           allow_methods=["GET", "POST", "PATCH", "DELETE"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(Guard, config=api)  # refusals before anything runs
    app.add_middleware(RequestMetrics, metrics=collector.metrics)  # outermost: refusals count

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        """422 problem details with where and why (``errors``), never the request echoed back
        (FastAPI's default includes the input: a 500 kB body came back as a 500 kB error)."""
        return problem(422, "the request is not valid", extra={"errors": [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
            for e in exc.errors()[:20]]})

    @app.exception_handler(ProbeOnly)
    async def probe_only(request: Request, exc: ProbeOnly) -> JSONResponse:
        """A capture probe (``role: capture``) takes its queries from the control plane."""
        return problem(409, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Every error as RFC 9457 problem details; a dict detail (a query's reason, line and
        column) becomes extension members beside its message."""
        if isinstance(exc.detail, dict):
            extra = {k: v for k, v in exc.detail.items() if k != "message"}
            return problem(exc.status_code, str(exc.detail.get("message", "")), exc.headers,
                           extra)
        return problem(exc.status_code, str(exc.detail), exc.headers)
    app.include_router(queries.router)
    app.include_router(prefilter.router)
    app.include_router(exporters.router)
    app.include_router(enrichment.router)
    app.include_router(alerts.router)

    @app.get("/metrics", tags=["metrics"], response_class=Response)
    def metrics() -> Response:
        """Prometheus metrics (served at /metrics itself: no redirect to /metrics/)."""
        return Response(generate_latest(collector.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", tags=["health"])
    def healthz(c: CollectorDep) -> dict:
        """Liveness: plan version, queries, Spark and source state. ``degraded`` while a Spark
        streaming query is down (it restarts after a back-off; capture goes on into the
        bounded spool); ``spark_failures`` lists the latest failures."""
        spark_errors = c.job.check() if c.job is not None else []
        ok = not spark_errors
        return {"status": "ok" if ok else "degraded",
                "plan_version": c.plan.version if c.plan else None,
                "queries": len(c.plan.queries) if c.plan else 0,
                "spark": "running" if c.job is not None else "off",
                "spark_errors": spark_errors,
                "spark_failures": c.job.errors[-10:] if c.job is not None else [],
                "source_errors": c.source_errors[-10:]}

    @app.get("/readyz", tags=["health"], responses={503: {"description": "not ready"}})
    def readyz(c: CollectorDep) -> Response:
        """Readiness: Spark runs every streaming query and every source runs (or a file
        source has reached its end); else 503 with the reasons (``/healthz`` is liveness)."""
        reasons = c.not_ready()
        if reasons:
            return problem(503, "; ".join(reasons))
        return JSONResponse({"status": "ready", "sources": dict(c.source_state)})

    app.openapi = lambda: _openapi(app, api)
    return app


class RequestMetrics:
    """Counts every HTTP request by route template (``/queries/{name}``, never the path a
    client made up: bounded label values), method and status, and times it; one the guard
    refused before routing counts as route ``unrouted``."""

    def __init__(self, app, metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]  # an exception before a response is a 500

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
        t0 = time.perf_counter()
        try:
            await self.app(scope, receive, sending)
        finally:
            route = getattr(scope.get("route"), "path", "unrouted")
            method = scope.get("method", "")
            self.metrics.api_requests.labels(route, method, str(status[0])).inc()
            self.metrics.api_seconds.labels(route, method).observe(time.perf_counter() - t0)


PROBLEM_SCHEMA = {
    "title": "Problem", "type": "object", "additionalProperties": True,
    "description": "RFC 9457 problem details; a query error adds reason, line and column, "
                   "an invalid request adds errors",
    "required": ["type", "title", "status", "detail"],
    "properties": {"type": {"type": "string"}, "title": {"type": "string"},
                   "status": {"type": "integer"}, "detail": {"type": "string"},
                   "reason": {"type": "string"}, "line": {"type": "integer"},
                   "column": {"type": "integer"}, "errors": {"type": "array"}}}
# what any route may answer: the guard (401/403/411/413) and the request's validation (422)
COMMON_ERRORS = {"401": "no or an unknown bearer token",
                 "403": "the token's scope or the request's origin does not allow this",
                 "411": "a body without Content-Length", "413": "the body is too large",
                 "422": "the request is not valid"}


def _openapi(app: FastAPI, api) -> dict:
    """FastAPI's schema, with every error documented as it is sent: problem details in
    ``application/problem+json`` (FastAPI documents its own 422 body in JSON), and each
    operation's need of a token as this daemon is configured (``api``)."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, description=app.description,
                      routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas["Problem"] = PROBLEM_SCHEMA
    # a bearer token (api.token, api.tokens): Swagger UI's Authorize button sends it
    doc["components"]["securitySchemes"] = {"bearer": {
        "type": "http", "scheme": "bearer", "description": "api.token (admin: every route) "
        "or a token of api.tokens (read: GET routes, which need one with api.protect_reads)"}}
    required, optional = [{"bearer": []}], [{}, {"bearer": []}]
    tokens = bool(api.scopes())
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    content = {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}
    for route, path in doc.get("paths", {}).items():
        for method, op in path.items():
            if route in OPEN_PATHS:  # health checks never need a token
                op["security"] = []
            elif not tokens:  # no token configured: loopback only, nothing needs one
                op["security"] = optional
            elif method.upper() in ("GET", "HEAD"):
                op["security"] = required if api.protect_reads else optional
            else:
                op["security"] = required
            responses = op.setdefault("responses", {})
            for code, text in COMMON_ERRORS.items():
                responses.setdefault(code, {"description": text})
            for code, r in responses.items():
                if code.startswith(("4", "5")):
                    r["content"] = content
    app.openapi_schema = doc
    return doc
