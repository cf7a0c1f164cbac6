"""Who may call the control plane (``api.*`` in the configuration).

- Every mutating request (POST, PUT, PATCH, DELETE) needs an ``admin`` bearer token once any
  token is configured; with ``api.protect_reads`` GET requests need a ``read`` or ``admin`` one
  (``/healthz`` and ``/readyz`` stay open for orchestrators, and the API's documents, which
  hold no data, for browsers: ``/docs``, ``/redoc``, ``/openapi.json``). Tokens are compared
  in constant time (``hmac.compare_digest``, every configured token tried) and never logged.
- Without a token the API must listen on a loopback address (``flowsieve run`` refuses
  otherwise). A browser on that host could still send a cross-origin request: a mutating
  request whose ``Origin`` is neither the API's own (its docs page) nor in
  ``api.cors_origins`` is refused, token or not.
- Request bodies are bounded (``api.max_body_bytes``; a mutating request must say its length).

Refusals are RFC 9457 problem details (``application/problem+json``).
"""

from __future__ import annotations

import hmac
import ipaddress
from http import HTTPStatus

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from collector.config import ApiConfig

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
# the API's documents (no data in them): Swagger UI, ReDoc, the schema and their assets, open
# so that a browser can load them and then send a token from the Authorize button
DOCS_STATIC = "/docs/static"
DOC_PATHS = frozenset({"/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def problem(status: int, detail: str, headers: dict | None = None,
            extra: dict | None = None) -> JSONResponse:
    """An RFC 9457 problem details response (``extra``: extension members)."""
    return JSONResponse({"type": "about:blank", "title": HTTPStatus(status).phrase,
                         "status": status, "detail": detail, **(extra or {})},
                        status_code=status, media_type="application/problem+json",
                        headers=headers)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def scope_of(tokens: list[tuple[bytes, str]], authorization: str | None) -> str | None:
    """The scope of a ``Bearer`` credential, or None. Every token is compared, in constant
    time, whatever matched before."""
    if not authorization or not authorization[:7].lower() == "bearer ":
        return None
    given = authorization[7:].strip().encode()
    found = None
    for token, scope in tokens:
        if hmac.compare_digest(given, token) and found != "admin":
            found = scope
    return found


class Guard:
    """ASGI middleware applying the rules of the module docstring before any route runs."""

    def __init__(self, app: ASGIApp, config: ApiConfig):
        self.app = app
        self.tokens = config.scopes()
        self.protect_reads = config.protect_reads
        self.origins = frozenset(config.cors_origins)
        self.max_body = config.max_body_bytes

    def refuse(self, scope: Scope) -> JSONResponse | None:
        method = scope["method"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope["headers"]}
        mutating = method not in SAFE_METHODS
        if mutating:
            origin = headers.get("origin")
            own = f"{scope.get('scheme', 'http')}://{headers.get('host', '')}"
            if origin is not None and origin != own and origin not in self.origins:
                return problem(403, f"cross-origin request from {origin} refused (allow it in "
                                    "api.cors_origins)")
            length = headers.get("content-length")
            if length is None and "chunked" in headers.get("transfer-encoding", ""):
                return problem(411, "a request body needs a Content-Length")
            if length is not None and (not length.isdigit() or int(length) > self.max_body):
                return problem(413, f"request body over api.max_body_bytes "
                                    f"({self.max_body} bytes)")
        path = scope["path"]
        need = "admin" if mutating else (
            "read" if self.protect_reads and path not in OPEN_PATHS and path not in DOC_PATHS
            and not path.startswith(DOCS_STATIC + "/") else None)
        if need is None or not self.tokens:
            return None
        have = scope_of(self.tokens, headers.get("authorization"))
        if have is None:
            return problem(401, "a bearer token is required (Authorization: Bearer …)",
                           {"WWW-Authenticate": 'Bearer realm="flowsieve"'})
        if need == "admin" and have != "admin":
            return problem(403, "this token may only read")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refused = self.refuse(scope)
            if refused is not None:
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)
