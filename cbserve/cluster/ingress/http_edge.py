"""What every HTTP request of the ingress goes through besides its route: the API key, the HTTP metrics, the
OpenAI error shape for bad bodies and for failures, and streamed bodies closed however a response ends.

``HttpEdge`` is an ASGI middleware on the ingress's FastAPI app: it checks ``Authorization: Bearer <key>``
(every path but /health and the API docs; 401 otherwise), refuses requests while the ingress drains (503 with
Retry-After) and counts a request as in flight, with its duration running, until its response's last byte is
sent or the client goes away. It finds the ingress (its config and
metrics) on ``app.state.ingress``; without one (the app outside Serve) it passes requests through.
"""

from __future__ import annotations

import hmac
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cbserve.frontend.protocol import APIError
from cbserve.frontend.validation import invalid_body_error

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
DRAINING_PATHS = OPEN_PATHS | {"/stats"}  # still answered while the ingress drains
RETRY_AFTER_S = 5  # what a request refused during a drain is told


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that closes its body however the response ends. Starlette's leaves a body cut short
    (the client went away: ``send`` raised, or Serve cancelled the handler) suspended at its last ``yield``,
    to be closed whenever the garbage collector gets to it; only then would the request's generators run
    their ``finally`` blocks, the engine's abort among them, and the request ran on to its end meanwhile."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def api_key_error(api_key: str | None, authorization: str) -> APIError | None:
    """The 401 for a request whose ``Authorization`` header does not carry ``api_key`` (None: let it in)."""
    if not api_key:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode()):
        return None
    return APIError(401, "invalid or missing API key (Authorization: Bearer <key>)", "authentication_error")


class HttpEdge:
    """Auth and HTTP metrics around the app (see the module's docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ingress = getattr(scope["app"].state, "ingress", None) if scope["type"] == "http" else None
        if ingress is None:
            await self.app(scope, receive, send)
            return
        if scope["path"] not in OPEN_PATHS:
            headers = dict(scope.get("headers") or [])
            error = api_key_error(ingress.config.api_key, headers.get(b"authorization", b"").decode("latin-1"))
            if error is not None:
                await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
                return
        if ingress.draining and scope["path"] not in DRAINING_PATHS:
            error = APIError(503, "the server is shutting down; retry the request", "service_unavailable")
            headers = {"Retry-After": str(RETRY_AFTER_S)}
            await JSONResponse(error.body(), status_code=503, headers=headers)(scope, receive, send)
            return
        metrics, start, status = ingress.metrics, time.perf_counter(), [500]

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        ingress.http_in_flight += 1  # the gauge follows it (deployment.py's tick)
        try:
            await self.app(scope, receive, sending)
        finally:
            ingress.http_in_flight -= 1
            route = scope.get("route")
            if route is not None:  # a known route (its template, not the path: bounded label values)
                metrics.observe_http(route.path, status[0], time.perf_counter() - start)


def install_error_handlers(app: FastAPI) -> None:
    """Bad bodies (FastAPI's validation of the typed request bodies) and APIErrors in OpenAI's error shape; any
    other exception is a bug, answered as a 500 that says so."""

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = invalid_body_error(exc.errors(), strip=("body",))
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path, exc_info=exc)
        err = APIError(500, f"internal server error: {type(exc).__name__}: {exc}", "internal_error")
        return JSONResponse(err.body(), status_code=500)
