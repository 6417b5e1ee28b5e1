"""`create_app`: the router's FastAPI app.

`/v1/completions` and `/v1/chat/completions` are relayed to a prefill and a decode server
(`dispatch`); `/v1/models` is the first healthy decode server's answer; `/health` says whether
at least one server of each kind is up; `/metrics` is the router's own registry. Every refusal
is a JSON body in the OpenAI error shape.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from stallfree.entrypoints.router.dispatch import CLIENT_CLOSED_REQUEST, Router, encode_json
from stallfree.entrypoints.router.leg_failure import error_payload
from stallfree.entrypoints.router.pool import HEALTH_TIMEOUT_S

_CLOSE = (b"connection", b"close")


class RouterError(Exception):
    """A request the router itself refuses (the servers are never asked)."""

    def __init__(
        self, status: int, message: str, type: str = "invalid_request_error", close: bool = False
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.close = close

    def response(self) -> Response:
        headers = {"connection": "close"} if self.close else None
        body = encode_json(error_payload(str(self), self.type, self.status))
        return Response(body, self.status, headers, media_type="application/json")


class ApiKeyCheck:
    """ASGI middleware: `/v1/*` needs `Authorization: Bearer KEY`, checked on the request's
    head, before a byte of its body is read. The header itself is passed on to the servers."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    def _allowed(self, scope: Scope) -> bool:
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = given.partition(b" ")
        # compare_digest on the token whatever the scheme: the time taken says nothing
        same = hmac.compare_digest(token.strip(), self.key)
        return same and scheme.lower() == b"bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if (path == "/v1" or path.startswith("/v1/")) and not self._allowed(scope):
            err = RouterError(
                401, "missing or wrong API key: send 'Authorization: Bearer <key>'", close=True
            )
            await err.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused with 413 once it passes `limit` bytes: at once from a
    Content-Length over it, else while it is read."""
    declared = request.headers.get("content-length", "")
    too_big = RouterError(413, f"the body is over {limit} bytes", close=True)
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_big
    return bytes(body)


def parse_object(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except RecursionError:
        raise RouterError(400, "the body is not valid JSON: it is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, too many digits
        raise RouterError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise RouterError(400, f"the body must be a JSON object, not {type(value).__name__}")
    return value


async def openai_http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own HTTP errors (a method no route takes: 405, and the like) in the OpenAI
    error shape, as one server answers them."""
    assert isinstance(exc, StarletteHTTPException)
    return RouterError(exc.status_code, str(exc.detail)).response()


def _unpassable(exc: Exception) -> RouterError:
    """The 400 for a body that parsed but cannot be sent on as JSON."""
    if isinstance(exc, UnicodeEncodeError):
        what = "not valid Unicode text: it holds a lone surrogate code point (such as \\ud800)"
    elif isinstance(exc, RecursionError):
        what = "nested too deeply"
    else:
        what = f"not valid JSON ({exc}; NaN and Infinity are not JSON numbers)"
    return RouterError(400, f"the body is {what}")


async def relay(request: Request, route: str) -> Response:
    """A completions or chat request, relayed to a prefill and a decode server."""
    router: Router = request.app.state.router
    started = time.monotonic()
    try:
        body = parse_object(await read_body(request, router.settings.max_body_bytes))
        try:
            return router.relay(
                route,
                request.url.path,
                body,
                request.headers.get("authorization"),
                request.headers.get("x-request-id"),
                started,
            )
        except (ValueError, RecursionError) as exc:
            raise _unpassable(exc) from None
    except RouterError as err:
        router.metrics.answered(route, err.status, time.monotonic() - started)
        return err.response()
    except ClientDisconnect:
        router.metrics.leg_failures.labels(leg="client").inc()
        router.metrics.answered(route, CLIENT_CLOSED_REQUEST, time.monotonic() - started)
        return Response(status_code=CLIENT_CLOSED_REQUEST)


async def models(request: Request) -> Response:
    """The first healthy decode server's model list (the client's key passed on)."""
    router: Router = request.app.state.router
    up = await router.health.up()
    auth = request.headers.get("authorization")
    headers = {b"authorization": auth.encode("latin-1")} if auth is not None else {}
    for server in router.pool.decode:
        if not up.get(server.url):
            continue
        try:
            resp = await router.client.get(
                f"{server.url}/v1/models", headers=headers, timeout=HEALTH_TIMEOUT_S
            )
        except httpx.HTTPError:
            continue
        media = resp.headers.get("content-type", "application/json")
        return Response(resp.content, resp.status_code, media_type=media)
    return RouterError(503, "no decode server is up", "service_unavailable").response()


async def health(request: Request) -> Response:
    router: Router = request.app.state.router
    up = await router.health.up()
    pool = router.pool
    if any(up.get(s.url) for s in pool.prefill) and any(up.get(s.url) for s in pool.decode):
        return JSONResponse({"status": "ok"})
    down = [s.url for s in pool.servers if not up.get(s.url)]
    return JSONResponse({"status": "unavailable", "down": down}, 503)


async def metrics(request: Request) -> Response:
    router: Router = request.app.state.router
    return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def create_app(router: Router) -> FastAPI:
    """The app over `router`; its lifespan closes the router (its client, its settling legs)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await router.aclose()

    app = FastAPI(
        title="stallfree router",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.router = router

    async def completions(request: Request) -> Response:
        return await relay(request, "completions")

    async def chat(request: Request) -> Response:
        return await relay(request, "chat")

    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])

    app.add_exception_handler(StarletteHTTPException, openai_http_error)
    if router.settings.api_key:
        app.add_middleware(ApiKeyCheck, api_key=router.settings.api_key)
    return app
