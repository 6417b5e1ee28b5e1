"""Fake prefill and decode servers for the router tests, and a cluster of them behind a router.

Each fake is a small FastAPI app on a loopback port (uvicorn, in the test's event loop). It
answers /health and /disagg/connect, records the bodies and headers of the generation requests
it gets, and answers them as its `mode` says: `ok` (a JSON body, or for a streaming decode
request three SSE events and `[DONE]`), `error` (`error_status` with an OpenAI error body),
`hang` (no answer until the router closes the connection), `slow` (an SSE event every 50 ms,
forever) or `break` (two SSE events, then the connection drops). `cancelled` is set when the
router closed a request it had not answered in full.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest_asyncio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from stallfree.entrypoints.router.flags import RouterSettings, Upstream
from stallfree.entrypoints.router.launch import RunningRouter, start_router

BOOTSTRAP_PORT = 9000


class QuietServer(uvicorn.Server):
    """uvicorn without signal handlers: several run at once in the test's loop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass(eq=False)
class Fake:
    name: str
    role: str
    mode: str = "ok"
    error_status: int = 400
    healthy: bool = True
    connect_status: int = 200
    connect_message: str = "refused"
    gate: asyncio.Event | None = None  # awaited before answering
    hold: asyncio.Event | None = None  # awaited after the first SSE event
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    connects: list[dict[str, Any]] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    first_sent: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""
    server: QuietServer | None = None
    task: asyncio.Task[None] | None = None

    async def stop(self) -> None:
        if self.server is not None and self.task is not None:
            self.server.should_exit = True
            await self.task
            self.server = None


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def decode_events(name: str) -> list[bytes]:
    """What a fake decode server streams in `ok` mode."""
    return [*(event({"id": name, "i": i}) for i in range(3)), b"data: [DONE]\n\n"]


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _wait_or_gone(fake: Fake, request: Request, waited: Awaitable[Any]) -> bool:
    """Wait for `waited`; True (and `cancelled` set) if the router hung up first."""
    work = asyncio.ensure_future(waited)
    gone = asyncio.ensure_future(_until_disconnect(request))
    await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    work.cancel()
    gone.cancel()
    if gone.done() and not gone.cancelled():
        fake.cancelled.set()
        return True
    return False


def _sse(fake: Fake, events: Callable[[], AsyncIterator[bytes]]) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        finished = False
        try:
            async for chunk in events():
                yield chunk
                fake.first_sent.set()
            finished = True
        finally:
            if not finished and fake.mode != "break":
                fake.cancelled.set()

    return StreamingResponse(body(), media_type="text/event-stream")


def fake_app(fake: Fake) -> FastAPI:
    app = FastAPI()

    async def health() -> Response:
        return JSONResponse({}, 200 if fake.healthy else 503)

    async def connect(request: Request) -> Response:
        fake.connects.append(await request.json())
        if fake.connect_status == 200:
            return JSONResponse({"ok": True})
        error = {"message": fake.connect_message, "type": "invalid_request_error"}
        return JSONResponse({"error": error}, fake.connect_status)

    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [{"id": fake.name}]})

    async def generate(request: Request) -> Response:
        body = await request.json()
        fake.bodies.append(body)
        fake.headers.append(dict(request.headers))
        fake.arrived.set()
        if fake.gate is not None and await _wait_or_gone(fake, request, fake.gate.wait()):
            return Response(status_code=499)
        if fake.mode == "error":
            error = {"message": f"{fake.name} says no", "type": "invalid_request_error"}
            return JSONResponse({"error": error}, fake.error_status)
        if fake.mode == "hang":
            await _wait_or_gone(fake, request, asyncio.Event().wait())
            return Response(status_code=499)
        if fake.role == "prefill":
            return JSONResponse({"id": fake.name, "prefill": True})
        if not body.get("stream"):
            return JSONResponse({"id": fake.name, "choices": [{"text": "hi"}]})
        return _sse(fake, lambda: _events(fake))

    for path in ("/v1/completions", "/v1/chat/completions"):
        app.add_api_route(path, generate, methods=["POST"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/disagg/connect", connect, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    return app


async def _events(fake: Fake) -> AsyncIterator[bytes]:
    if fake.mode == "slow":
        i = 0
        while True:
            yield event({"id": fake.name, "i": i})
            i += 1
            await asyncio.sleep(0.05)
    events = decode_events(fake.name)
    if fake.mode == "break":
        yield events[0]
        yield events[1]
        await asyncio.sleep(0.05)
        raise RuntimeError("the fake decode server breaks its stream")
    for i, chunk in enumerate(events):
        yield chunk
        if i == 0 and fake.hold is not None:
            await fake.hold.wait()


async def serve(app: FastAPI) -> tuple[QuietServer, asyncio.Task[None], str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
    server = QuietServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        assert not task.done(), "a fake server failed to start"
        await asyncio.sleep(0.005)
    return server, task, f"http://127.0.0.1:{sock.getsockname()[1]}"


@dataclass
class Cluster:
    prefill: list[Fake]
    decode: list[Fake]
    stack: contextlib.AsyncExitStack
    running: RunningRouter | None = None
    http: httpx.AsyncClient = field(default_factory=lambda: httpx.AsyncClient(trust_env=False))

    def settings(self, **overrides: Any) -> RouterSettings:
        values: dict[str, Any] = {
            "prefill": tuple(
                Upstream(f.url, BOOTSTRAP_PORT + i) for i, f in enumerate(self.prefill)
            ),
            "decode": tuple(Upstream(f.url) for f in self.decode),
            "port": 0,
            "startup_timeout_s": 2.0,
            "request_timeout_s": 10.0,
        }
        return RouterSettings(**(values | overrides))

    async def start(self, grace_s: float = 5.0, **overrides: Any) -> RunningRouter:
        running = await start_router(self.settings(**overrides), prefill_grace_s=grace_s)
        self.stack.push_async_callback(running.stop)
        self.running = running
        self.http = httpx.AsyncClient(base_url=running.url, timeout=5, trust_env=False)
        self.stack.push_async_callback(self.http.aclose)
        return running

    async def metric(self, name: str, **labels: str) -> float:
        """A sample of the router's /metrics (0 when it has none)."""
        text = (await self.http.get("/metrics")).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    return sample.value
        return 0.0


@pytest_asyncio.fixture
async def cluster() -> AsyncIterator[Callable[..., Awaitable[Cluster]]]:
    """`await cluster(prefill=1, decode=1, start=True, **router_settings)`: fakes on loopback
    ports and (unless `start=False`) a router in front of them; all stopped after the test."""
    async with contextlib.AsyncExitStack() as stack:

        async def make(prefill: int = 1, decode: int = 1, start: bool = True, **kw: Any) -> Cluster:
            fakes = [Fake(f"p{i}", "prefill") for i in range(prefill)]
            fakes += [Fake(f"d{i}", "decode") for i in range(decode)]
            for fake in fakes:
                fake.server, fake.task, fake.url = await serve(fake_app(fake))
                stack.push_async_callback(fake.stop)
            made = Cluster(fakes[:prefill], fakes[prefill:], stack)
            if start:
                await made.start(**kw)
            return made

        yield make
