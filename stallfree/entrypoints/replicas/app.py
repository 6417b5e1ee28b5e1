"""`create_front_app`: the replicas' HTTP front.

`/health` and `/metrics` are the front's own (module `front`, module `metrics`), and so is CORS
(`server.allowed_origins`). Every other
route is a replica's: a POST is placed (module `placement`) and relayed whole, its answer
streamed back (module `relay`); a GET goes to the least loaded replica and its answer comes
back whole. The front's door is one server's (`Guard`): the API key and the Host header are
checked on the request head, before any body is read or placed, then the body and concurrency
limits, and while it drains new requests get 503. The replicas validate bodies themselves, so
a client sees the same answers, errors included, as from one server; once every replica has
exited, the front answers 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from stallfree.entrypoints.replicas.front import Front
from stallfree.entrypoints.replicas.metrics import merge_expositions
from stallfree.entrypoints.replicas.placement import NoReplica, prompt_key
from stallfree.entrypoints.replicas.relay import ReplicaRelay
from stallfree.entrypoints.router.app import RouterError, openai_http_error, read_body
from stallfree.entrypoints.router.dispatch import CLIENT_CLOSED_REQUEST, Plan
from stallfree.entrypoints.router.pool import HEALTH_TIMEOUT_S, describe
from stallfree.entrypoints.server.transport.guard import Guard

ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/generate": "generate"}
_NO_REPLICA = RouterError(503, "no replica is serving", "service_unavailable")


def _key(raw: bytes) -> str | None:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None  # the replica answers it with its own 400
    return prompt_key(body) if isinstance(body, dict) else None


def _target(request: Request) -> str:
    query = request.url.query
    return request.url.path + (f"?{query}" if query else "")


async def relay(request: Request) -> Response:
    front: Front = request.app.state.front
    router = front.router
    route = ROUTES.get(request.url.path, "other")
    started = time.monotonic()
    try:
        raw = await read_body(request, router.settings.max_body_bytes)
        replica, reason = front.placement.choose(_key(raw))
    except RouterError as err:
        router.metrics.answered(route, err.status, time.monotonic() - started)
        return err.response()
    except NoReplica:
        router.metrics.answered(route, 503, time.monotonic() - started)
        return _NO_REPLICA.response()
    except ClientDisconnect:
        router.metrics.answered(route, CLIENT_CLOSED_REQUEST, time.monotonic() - started)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    front.metrics.routed.labels(engine=replica.label, reason=reason).inc()
    router.pool.hold(replica.server)
    plan = Plan(
        route,
        _target(request),
        raw,
        b"",
        request.headers.get("authorization"),
        request.state.request_id,  # the Guard's: the client's own when it sent a valid one
        started,
    )
    return ReplicaRelay(router, plan, replica.server)


async def forward_get(request: Request) -> Response:
    """A GET, answered by the least loaded replica (the client's key passed on)."""
    front: Front = request.app.state.front
    try:
        replica, _ = front.placement.choose(None)
    except NoReplica:
        return _NO_REPLICA.response()
    auth = request.headers.get("authorization")
    headers = {b"authorization": auth.encode("latin-1")} if auth is not None else {}
    url = replica.server.url + _target(request)
    try:
        resp = await front.router.client.get(url, headers=headers)
    except httpx.HTTPError as exc:
        err = RouterError(502, f"replica {replica.index} failed: {describe(exc)}", "upstream_error")
        return err.response()
    media = resp.headers.get("content-type", "application/json")
    return Response(resp.content, resp.status_code, media_type=media)


async def health(request: Request) -> Response:
    """200 while every replica is up; the body lists each one: its process id, its own URL
    (on loopback) and whether it is up."""
    front: Front = request.app.state.front
    down = await front.healthy()
    replicas = [
        {"engine": r.label, "pid": proc.pid, "url": r.server.url, "up": r.index not in down}
        for r, proc in zip(front.replicas, front.processes, strict=True)
    ]
    status = "draining" if front.draining else "unavailable" if down else "ok"
    return JSONResponse({"status": status, "replicas": replicas}, 200 if status == "ok" else 503)


async def metrics(request: Request) -> Response:
    front: Front = request.app.state.front
    if not front.config.metrics.enabled:
        err = RouterError(404, "metrics are disabled (metrics.enabled = false)", "not_found")
        return err.response()
    await front.healthy()  # replica_up as of this scrape
    scrapes = [_scrape(front, r.server.url) for r in front.replicas if r.alive]
    texts = [t for t in await asyncio.gather(*scrapes) if t is not None]
    texts += [front.router.metrics.render(), front.metrics.render()]
    return Response(merge_expositions(texts), media_type=CONTENT_TYPE_LATEST)


async def _scrape(front: Front, url: str) -> bytes | None:
    """A replica's exposition; None when it does not answer (replica_up says which)."""
    try:
        resp = await front.router.client.get(f"{url}/metrics", timeout=HEALTH_TIMEOUT_S)
    except httpx.HTTPError:
        return None
    return resp.content if resp.status_code == 200 else None


def create_front_app(front: Front) -> FastAPI:
    """The front over `front`; its lifespan watches the replicas' processes, probes their
    /health, and at the end closes the router's client."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        front.watch()
        probing = asyncio.create_task(front.probe_forever())
        try:
            yield
        finally:
            probing.cancel()
            await asyncio.gather(probing, return_exceptions=True)
            await front.router.aclose()

    app = FastAPI(
        title="stallfree replicas",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.front = front
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/{path:path}", relay, methods=["POST"])
    app.add_api_route("/{path:path}", forward_get, methods=["GET"])

    app.add_exception_handler(StarletteHTTPException, openai_http_error)
    limits = front.config.server
    # one server's door: the API key and the Host checked on the head before any body is
    # read, the body limits, the concurrency limit, the drain's 503, request ids
    app.add_middleware(Guard, limits=limits, lifecycle=front.lifecycle)
    if limits.allowed_origins:
        # the front answers preflights and adds the headers; the replicas' own are not passed
        app.add_middleware(
            CORSMiddleware,
            allow_origins=limits.allowed_origins,
            allow_methods=limits.allowed_methods,
            allow_headers=limits.allowed_headers,
            allow_credentials=limits.allow_credentials,
        )
    return app
