"""HTTP under misbehaving clients: mid-stream disconnects at load, and fuzzed request bodies."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stallfree import Engine
from stallfree.entrypoints.server import create_app, start_server
from tests.engine_util import engine_config, random_prompts
from tests.hf_models import make_llama
from tests.test_metrics import samples, value


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return str(make_llama(tmp_path_factory.mktemp("llama")))


class ThreadServer:
    """A live server on its own uvloop thread, so synchronous hypothesis tests can call it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.loop = uvloop.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = self.call(start_server(create_app(engine)))
        self.url = self.server.url

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.call(self.server.stop())
        self.call(self.engine.shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def fuzz_server(llama) -> Iterator[ThreadServer]:
    # a short context keeps every fuzzed generation small
    engine = Engine(engine_config(llama, model={"max_context_len": 64}))
    server = ThreadServer(engine)
    yield server
    server.close()


def json_values(depth: int = 2):
    leaves = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**63), max_value=2**64),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=20),
    )
    if depth == 0:
        return leaves
    return st.one_of(
        leaves,
        st.lists(json_values(depth - 1), max_size=4),
        st.dictionaries(st.text(max_size=8), json_values(depth - 1), max_size=3),
    )


FIELDS = {
    "/v1/completions": [
        "model",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "stream",
        "stop",
        "seed",
        "n",
        "top_k",
        "ignore_eos",
        "stop_token_ids",
        "stream_options",
        "logprobs",
        "echo",
    ],
    "/v1/chat/completions": [
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "stream",
        "stop",
        "seed",
        "tools",
    ],
    "/generate": ["text", "input_ids", "sampling_params", "stream", "rid"],
}


@st.composite
def bodies(draw, route: str):
    keys = draw(st.lists(st.sampled_from([*FIELDS[route], "bogus"]), unique=True, max_size=6))
    body = {k: draw(json_values()) for k in keys}
    # mostly-valid bodies reach deeper code than pure noise
    if draw(st.booleans()):
        if route == "/generate":
            body.setdefault("text", draw(st.text(max_size=30)))
        elif route == "/v1/completions":
            body.setdefault("model", "tiny")
            body.setdefault(
                "prompt",
                draw(st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 300), max_size=8))),
            )
        else:
            body.setdefault("model", "tiny")
            body.setdefault(
                "messages",
                [
                    {
                        "role": draw(st.sampled_from(["user", "system", "robot"])),
                        "content": draw(st.text(max_size=20)),
                    }
                ],
            )
    return body


def check_response(resp: httpx.Response) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:300])
    if resp.status_code >= 400:
        body = resp.json()
        assert "error" in body and body["error"]["message"], body


@pytest.mark.parametrize("route", list(FIELDS))
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_fuzzed_bodies_never_5xx(fuzz_server, route, data):
    body = data.draw(bodies(route))
    with httpx.Client(base_url=fuzz_server.url, timeout=30) as http:
        if body.get("stream") is True:
            with http.stream("POST", route, json=body) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    check_response(resp)
                else:
                    assert resp.status_code == 200
                    for line in resp.iter_lines():
                        assert not line or line.startswith("data: ") or line.startswith(":")
        else:
            check_response(http.post(route, json=body))


@pytest.mark.parametrize("raw", [b"", b"{", b"[]", b"null", b"\xff\xfe", b'{"prompt": "x"', b"42"])
@pytest.mark.parametrize("route", list(FIELDS))
def test_malformed_json_is_4xx(fuzz_server, route, raw):
    with httpx.Client(base_url=fuzz_server.url, timeout=30) as http:
        resp = http.post(route, content=raw, headers={"content-type": "application/json"})
        check_response(resp)
        assert 400 <= resp.status_code < 500
        assert http.get("/health").status_code == 200


async def test_streaming_disconnects_at_load_free_everything(llama):
    rng = random.Random(13)
    prompts = random_prompts(120, seed=14, lo=3, hi=30)
    engine = Engine(
        engine_config(
            llama,
            cache={"max_total_tokens": 512, "max_running_requests": 32},
            server={"served_model_name": "m"},
        )
    )
    server = await start_server(create_app(engine))
    try:
        reference = {
            i: (await engine.complete(p, {"max_new_tokens": 16, "ignore_eos": True})).token_ids
            for i, p in enumerate(prompts[:20])
        }
        gate = asyncio.Semaphore(32)
        client_seen: Counter = Counter()

        async def one(i: int, prompt: list[int], http: httpx.AsyncClient) -> None:
            leave_after = rng.randint(1, 8) if rng.random() < 0.3 else None
            body = {
                "model": "m",
                "prompt": prompt,
                "max_tokens": 16,
                "stream": True,
                "ignore_eos": True,
                "temperature": 0,
            }
            async with gate, http.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                chunks, reason = 0, None
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    chunks += 1
                    reason = event["choices"][0]["finish_reason"] if event["choices"] else reason
                    if leave_after is not None and chunks >= leave_after:
                        client_seen["left"] += 1
                        return  # closing the stream mid-way is a disconnect
                client_seen[reason] += 1

        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            await asyncio.gather(*(one(i, p, http) for i, p in enumerate(prompts)))
            await asyncio.wait_for(engine.wait_idle(), 30)
            assert engine.pool_usage().all_free
            metrics = samples((await http.get("/metrics")).text)
        assert client_seen["left"] > 15 and client_seen["length"] > 60
        assert client_seen["left"] + client_seen["length"] == len(prompts)
        length = value(metrics, "stallfree:request_success_total", finished_reason="length")
        abort = value(metrics, "stallfree:request_success_total", finished_reason="abort")
        # 20 reference requests, then every HTTP request ends as length or abort, once
        assert length + abort == len(prompts) + 20
        assert abort <= client_seen["left"]
        # the engine still produces the same greedy tokens after the storm
        for i in range(5):
            again = await engine.complete(prompts[i], {"max_new_tokens": 16, "ignore_eos": True})
            assert again.token_ids == reference[i]
    finally:
        await server.stop()
        await engine.shutdown()


async def test_failed_closed_engine_is_unhealthy_and_rejects_with_503(llama):
    engine = Engine(
        engine_config(
            llama,
            runtime={"max_consecutive_step_failures": 2},
            faults={"enabled": True, "fail_step_rate": 1.0},
            server={"served_model_name": "m"},
        )
    )
    server = await start_server(create_app(engine))
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            assert (await http.get("/health")).status_code == 200
            body = {"model": "m", "prompt": "boom", "max_tokens": 4}
            failed = await asyncio.gather(
                *(http.post("/v1/completions", json=body) for _ in range(4))
            )
            # a failed step is a server-side error; requests that come after the engine
            # failed closed are refused as unavailable
            for r in failed:
                error = r.json()["error"]
                assert (r.status_code, error["code"]) in {(500, None), (503, "engine_unhealthy")}
                assert "step failed" in error["message"] or "failed closed" in error["message"]
            assert any("step failed" in r.json()["error"]["message"] for r in failed)
            await asyncio.sleep(0.05)
            health = await http.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "unavailable"
            rejected = await http.post("/v1/completions", json=body)
            assert rejected.status_code == 503
            assert rejected.json()["error"]["code"] == "engine_unhealthy"
            assert "failed closed" in rejected.json()["error"]["message"]
        assert engine.pool_usage().all_free
    finally:
        await server.stop()
        await engine.shutdown()
