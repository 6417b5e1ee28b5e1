"""Disaggregated serving over HTTP in one process: a prefill server and a decode server (KV over
a real gloo pair) behind `stallfree router`, against a colocated server on the same model. The
router's answers equal the colocated server's, streaming and not, completions and chat, n > 1;
both servers' pools end all free."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import pytest_asyncio

from stallfree import Engine
from stallfree.entrypoints.router.flags import RouterSettings, Upstream
from stallfree.entrypoints.router.launch import start_router
from stallfree.entrypoints.server import create_app, start_server
from tests.engine_util import engine_config, settle

module_loop = pytest.mark.asyncio(loop_scope="module")
pytestmark = module_loop

MODEL = "test-model"


@dataclass
class Deployment:
    prefill: Engine
    decode: Engine
    router: httpx.AsyncClient
    colocated: httpx.AsyncClient
    prefill_http: httpx.AsyncClient
    decode_http: httpx.AsyncClient


@contextlib.asynccontextmanager
async def deployment(model: str) -> AsyncIterator[Deployment]:
    server = {"served_model_name": MODEL}
    cache = {"page_size": 4, "max_total_tokens": 4096}
    prefill = Engine(
        engine_config(
            model,
            server=server,
            cache=cache,
            scheduler={"chunked_prefill_size": 16},
            disaggregation={"mode": "prefill", "bootstrap_port": 0, "transfer_timeout_s": 20},
        )
    )
    decode = Engine(
        engine_config(model, server=server, cache=cache, disaggregation={"mode": "decode"})
    )
    colocated = Engine(engine_config(model, server=server, cache=cache))
    servers = [await start_server(create_app(e)) for e in (prefill, decode, colocated)]
    p_srv, d_srv, c_srv = servers
    bootstrap = p_srv.server.config.app.state.sf.disagg.bootstrap
    settings = RouterSettings(
        prefill=(Upstream(p_srv.url, bootstrap.port),), decode=(Upstream(d_srv.url),), port=0
    )
    router = await start_router(settings, prefill_grace_s=5.0)
    clients = [
        httpx.AsyncClient(base_url=url, timeout=30)
        for url in (router.url, c_srv.url, p_srv.url, d_srv.url)
    ]
    try:
        yield Deployment(prefill, decode, *clients)
    finally:
        for c in clients:
            await c.aclose()
        await router.stop()
        for s in servers:
            await s.stop()
        for e in (prefill, decode, colocated):
            await e.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def dep(llama: str) -> AsyncIterator[Deployment]:
    async with deployment(llama) as d:
        yield d


def completion(**extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": "The quick brown fox jumps over", "max_tokens": 10}
    body.update(temperature=0, ignore_eos=True, **extra)
    return body


async def sse_texts(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[int, str]:
    """Each choice's streamed text."""
    out: dict[int, str] = {}
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                piece = choice.get("text")
                if piece is None:
                    piece = (choice.get("delta") or {}).get("content") or ""
                out[choice["index"]] = out.get(choice["index"], "") + piece
    return out


def texts(answer: dict[str, Any]) -> dict[int, str]:
    return {
        c["index"]: c["text"] if "text" in c else c["message"]["content"] for c in answer["choices"]
    }


async def both(dep: Deployment, path: str, body: dict[str, Any]) -> tuple[Any, Any]:
    a, b = await asyncio.gather(
        dep.router.post(path, json=body), dep.colocated.post(path, json=body)
    )
    assert a.status_code == 200, a.text
    assert b.status_code == 200, b.text
    return a.json(), b.json()


async def test_completions_equal_colocated_with_n(dep: Deployment) -> None:
    body = completion(n=3, prompt=["one two three four five six", "a b c d e f g h i j k l m"])
    got, want = await both(dep, "/v1/completions", body)
    assert texts(got) == texts(want) and len(texts(got)) == 6
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"] == 60


async def test_streaming_completions_equal_colocated(dep: Deployment) -> None:
    body = completion(max_tokens=16)
    got = await sse_texts(dep.router, "/v1/completions", body)
    want = await sse_texts(dep.colocated, "/v1/completions", body)
    assert got == want and got[0]


async def test_chat_equals_colocated_streaming_and_not(dep: Deployment) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something long about rivers."}],
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "n": 2,
    }
    got, want = await both(dep, "/v1/chat/completions", body)
    assert texts(got) == texts(want)
    assert await sse_texts(dep.router, "/v1/chat/completions", body) == texts(want)


async def test_servers_refuse_requests_that_skip_the_router(dep: Deployment) -> None:
    for client in (dep.prefill_http, dep.decode_http):
        r = await client.post("/v1/completions", json=completion())
        assert r.status_code == 400 and "router" in r.json()["error"]["message"], r.text
    r = await dep.router.post("/v1/completions", json=completion(logprobs=2))
    assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"], r.text


async def test_pools_free_and_transfers_counted(dep: Deployment) -> None:
    await dep.router.post("/v1/completions", json=completion())
    for _ in range(200):
        scrape = (await dep.prefill_http.get("/metrics")).text
        if 'stallfree:disagg_queue_reqs{queue="transfer",role="prefill"} 0.0' in scrape:
            break
        await asyncio.sleep(0.02)
    await settle(dep.prefill)
    await settle(dep.decode)
    d_scrape = (await dep.decode_http.get("/metrics")).text
    sent = [
        line for line in d_scrape.splitlines() if line.startswith("stallfree:kv_transfers_total")
    ]
    assert sent and float(sent[0].split()[-1]) >= 1, sent
    assert dep.decode.snapshot().counters.prefill_tokens == 0
    router_scrape = (await dep.router.get("/metrics")).text
    assert 'stallfree:router_requests_total{route="completions",status="200"}' in router_scrape
