"""The replicas' front in this process, over two fake replicas (small FastAPI apps on loopback
ports) and stand-in processes whose exit the test decides: the front's door refuses a request
without the API key or with an unknown Host before any replica sees it, a replica whose
process exits is marked down at once (/health 503, replica_up 0, replica_exits 1, a log line)
and the next requests go to the other, and a replica whose stream breaks ends the client's
stream with one error event."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest_asyncio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from stallfree.config import StallfreeConfig
from stallfree.entrypoints.replicas.app import create_front_app
from stallfree.entrypoints.replicas.front import Front


class Quiet(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class StandIn:
    """What the front reads of a replica's process: a sentinel that turns readable when it
    'exits' (`exit`), a pid, an exit code."""

    def __init__(self, index: int) -> None:
        self._read, self._write = os.pipe()
        self.sentinel = self._read
        self.pid = 40000 + index
        self.name = f"stand-in{index}"
        self.exitcode: int | None = None

    def exit(self, code: int) -> None:
        self.exitcode = code
        os.close(self._write)

    def join(self, timeout: float | None = None) -> None:
        pass

    def close(self) -> None:
        os.close(self._read)
        if self.exitcode is None:
            os.close(self._write)


@dataclass(eq=False)
class Fake:
    name: str
    bodies: list[dict[str, Any]] = field(default_factory=list)
    mode: str = "ok"  # ok | break (two events, then the connection drops)


def fake_app(fake: Fake) -> FastAPI:
    app = FastAPI()

    async def health() -> Response:
        return JSONResponse({})

    async def completions(request: Request) -> Response:
        body = await request.json()
        fake.bodies.append(body)
        if not body.get("stream"):
            return JSONResponse({"replica": fake.name, "choices": [{"text": "x"}]})

        async def events() -> AsyncIterator[bytes]:
            for i in range(2):
                yield b"data: " + json.dumps({"replica": fake.name, "i": i}).encode() + b"\n\n"
            if fake.mode == "break":
                raise RuntimeError("the replica died")  # uvicorn drops the connection
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    return app


async def serve(app: Any) -> tuple[str, Quiet, asyncio.Task[None]]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = Quiet(uvicorn.Config(app, log_level="critical", lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, task


@dataclass
class Setup:
    url: str
    fakes: list[Fake]
    stand_ins: list[StandIn]
    front: Front


@contextlib.asynccontextmanager
async def front_over_fakes(**server: Any) -> AsyncIterator[Setup]:
    fakes = [Fake("a"), Fake("b")]
    running = [await serve(fake_app(f)) for f in fakes]
    stand_ins = [StandIn(i) for i in range(2)]
    config = StallfreeConfig(server=server)
    front = Front(config, stand_ins, [url for url, _, _ in running])  # type: ignore[arg-type]
    url, server_, task = await serve(create_front_app(front))
    try:
        yield Setup(url, fakes, stand_ins, front)
    finally:
        for s, t in [(server_, task), *((s, t) for _, s, t in running)]:
            s.should_exit = True
            await t
        for p in stand_ins:
            p.close()


@pytest_asyncio.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        yield client


def families(text: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


async def test_the_door_refuses_before_any_replica_sees_the_request(http):
    async with front_over_fakes(api_key="k", allowed_hosts=["good.example"]) as s:
        body = {"prompt": "hello", "max_tokens": 2}
        keyless = await http.post(
            f"{s.url}/v1/completions", json=body, headers={"host": "good.example"}
        )
        wrong_host = await http.post(
            f"{s.url}/v1/completions",
            json=body,
            headers={"authorization": "Bearer k", "host": "evil.example"},
        )
        good = await http.post(
            f"{s.url}/v1/completions",
            json=body,
            headers={"authorization": "Bearer k", "host": "good.example", "x-request-id": "r1"},
        )
        assert keyless.status_code == 401
        assert keyless.json()["error"]["code"] == "invalid_api_key"
        assert wrong_host.status_code == 400
        assert good.status_code == 200 and good.headers.get_list("x-request-id") == ["r1"]
        assert sum(len(f.bodies) for f in s.fakes) == 1
        assert sum(r.sent for r in s.front.replicas) == 1  # the refused ones were never placed
        headers = {"authorization": "Bearer k", "host": "good.example"}
        wrong_method = await http.delete(f"{s.url}/v1/completions", headers=headers)
        assert wrong_method.status_code == 405
        assert wrong_method.json()["error"]["type"] == "invalid_request_error"


async def test_a_replica_that_exits_is_marked_down_and_skipped(http, caplog):
    async with front_over_fakes() as s:
        assert (await http.get(f"{s.url}/health")).status_code == 200
        with caplog.at_level(logging.ERROR, logger="stallfree.replicas"):
            s.stand_ins[0].exit(-9)
            while s.front.replicas[0].alive:
                await asyncio.sleep(0.01)
        health = await http.get(f"{s.url}/health")
        assert health.status_code == 503
        assert [r["up"] for r in health.json()["replicas"]] == [False, True]
        assert "replica 0 (pid 40000) exited with code -9" in caplog.text
        for i in range(3):
            r = await http.post(f"{s.url}/v1/completions", json={"prompt": f"{i} p"})
            assert r.json()["replica"] == "b"
        samples = families((await http.get(f"{s.url}/metrics")).text)
        up = {x.labels["engine"]: x.value for x in samples["stallfree:replica_up"]}
        assert up == {"0": 0.0, "1": 1.0}
        exits = [x for x in samples["stallfree:replica_exits"] if x.name.endswith("_total")]
        assert {x.labels["engine"]: x.value for x in exits} == {"0": 1.0, "1": 0.0}
        s.stand_ins[1].exit(0)
        while s.front.replicas[1].alive:
            await asyncio.sleep(0.01)
        assert s.front.exited.is_set()
        assert (await http.post(f"{s.url}/v1/completions", json={"prompt": "x"})).status_code == 503


async def test_a_broken_replica_stream_ends_with_one_error_event(http):
    async with front_over_fakes() as s:
        for fake in s.fakes:
            fake.mode = "break"
        body = {"prompt": "hello", "stream": True}
        async with http.stream("POST", f"{s.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        events = [json.loads(line[6:]) for line in lines]
        assert [e.get("i") for e in events[:2]] == [0, 1]
        assert len(events) == 3 and events[2]["error"]["code"] == 502
        assert "replica server" in events[2]["error"]["message"]
