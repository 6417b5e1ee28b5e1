"""HTTP under misbehaving clients: mid-stream disconnects at load, and fuzzed request bodies."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvloop
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from stallfree import Engine
from stallfree.entrypoints.server import create_app, start_server
from tests.engine_util import engine_config, random_prompts
from tests.metrics_util import samples, value


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
    engine = Engine(
        engine_config(llama, model={"max_context_len": 64}, server={"served_model_name": "tiny"})
    )
    server = ThreadServer(engine)
    yield server
    server.close()


# lone surrogates (\ud800-\udfff) are what JSON can carry and Unicode cannot
SURROGATES = st.text(
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3
)
TEXT = st.one_of(
    st.text(max_size=20),
    st.builds(lambda a, s, b: a + s + b, st.text(max_size=8), SURROGATES, st.text(max_size=8)),
)


def post_json(http: httpx.Client, route: str, body: Any) -> httpx.Response:
    """POST `body` as JSON text with non-ASCII escaped (so a lone surrogate is `\\ud800`)."""
    return http.post(route, content=json.dumps(body), headers={"content-type": "application/json"})


def json_values(depth: int = 2):
    leaves = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**63), max_value=2**64),
        st.floats(allow_nan=False, allow_infinity=False),
        TEXT,
    )
    if depth == 0:
        return leaves
    return st.one_of(
        leaves,
        st.lists(json_values(depth - 1), max_size=4),
        st.dictionaries(TEXT, json_values(depth - 1), max_size=3),
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
            body.setdefault("text", draw(TEXT))
        elif route == "/v1/completions":
            body.setdefault("model", "tiny")
            body.setdefault(
                "prompt",
                draw(st.one_of(TEXT, st.lists(st.integers(-5, 300), max_size=8))),
            )
        else:
            body.setdefault("model", "tiny")
            body.setdefault(
                "messages",
                [
                    {
                        "role": draw(st.sampled_from(["user", "system", "robot"])),
                        "content": draw(TEXT),
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
            content = json.dumps(body)
            headers = {"content-type": "application/json"}
            with http.stream("POST", route, content=content, headers=headers) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    check_response(resp)
                else:
                    assert resp.status_code == 200
                    for line in resp.iter_lines():
                        assert not line or line.startswith("data: ") or line.startswith(":")
        else:
            check_response(post_json(http, route, body))


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b"[]",
        b"null",
        b"\xff\xfe",
        b'{"prompt": "x"',
        b"42",
        b"[" * 100_000,
        b'"\xed\xa0\x80"',
    ],
    ids=["empty", "brace", "list", "null", "bom", "unclosed", "number", "deep", "cesu"],
)
@pytest.mark.parametrize("route", list(FIELDS))
def test_malformed_json_is_4xx(fuzz_server, route, raw):
    with httpx.Client(base_url=fuzz_server.url, timeout=30) as http:
        resp = http.post(route, content=raw, headers={"content-type": "application/json"})
        check_response(resp)
        assert 400 <= resp.status_code < 500
        assert http.get("/health").status_code == 200


# ---------------------------------------------------------------- hostile values, every field

# JSON text for numbers Python cannot hold as a float: the server's parser reads 1e309 as inf
_RAW = {"__1e309__": "1e309", "__-1e309__": "-1e309", "__1e-400__": "1e-400"}
HOSTILE_NUMBERS = st.sampled_from(
    [
        2**63,
        2**63 - 1,
        -(2**63) - 1,
        2**64,
        10**400,
        -(10**400),
        -1,
        0,
        -0.0,
        1e308,
        -1e308,
        5e-324,
        1e-300,
        float("inf"),
        float("-inf"),
        float("nan"),
        *_RAW,
    ]
)
# values at the edge of what is valid somewhere: they get past validation into the engine
EDGE = st.sampled_from(
    [
        1,
        2,
        4,
        63,
        True,
        False,
        None,
        0.0,
        1.0,
        2.0,
        1e-300,
        2**63 - 1,
        "tiny",
        "",
        "hi",
        ["hi"],
        [1, 2],
    ]
)
HOSTILE_LEAVES = st.one_of(
    EDGE,
    HOSTILE_NUMBERS,
    st.integers(),
    st.floats(),
    TEXT,
    st.booleans(),
    st.none(),
)
HOSTILE = st.one_of(
    HOSTILE_LEAVES,
    st.lists(HOSTILE_LEAVES, max_size=4),
    st.dictionaries(TEXT, HOSTILE_LEAVES, max_size=3),
    # huge lists
    st.builds(lambda v, n: [v] * n, HOSTILE_LEAVES, st.sampled_from([1_000, 5_000, 20_000])),
)

MODEL_FIELDS = {
    "/v1/completions": [
        "model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream",
        "stream_options", "stop", "seed", "presence_penalty", "frequency_penalty",
        "logit_bias", "user", "top_k", "ignore_eos", "stop_token_ids", "echo", "logprobs",
        "best_of", "suffix",
    ],
    "/v1/chat/completions": [
        "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
        "stream", "stream_options", "stop", "seed", "presence_penalty", "frequency_penalty",
        "logit_bias", "user", "top_k", "ignore_eos", "stop_token_ids", "logprobs",
        "top_logprobs", "tools", "tool_choice", "response_format",
    ],
    "/generate": ["text", "input_ids", "sampling_params", "stream", "rid"],
}  # fmt: skip
SAMPLING_FIELDS = [
    "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "stop",
    "ignore_eos",
]  # fmt: skip
VALID = {
    "/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 4},
    "/v1/chat/completions": {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
    },
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 4}},
}


@st.composite
def hostile_bodies(draw, route: str) -> dict[str, Any]:
    """A valid body with one or two fields (or nested fields) replaced by hostile values."""
    body = json.loads(json.dumps(VALID[route]))
    for field in draw(st.lists(st.sampled_from(MODEL_FIELDS[route]), min_size=1, max_size=2)):
        # NOTE: nested only into a field still as VALID has it (not already replaced)
        nested = draw(st.booleans()) and body.get(field) == VALID[route].get(field)
        if field == "sampling_params" and nested:
            for sub in draw(st.lists(st.sampled_from(SAMPLING_FIELDS), min_size=1, max_size=2)):
                body["sampling_params"][sub] = draw(HOSTILE)
        elif field == "messages" and nested:
            key = draw(st.sampled_from(["role", "content", "name"]))
            body["messages"][0][key] = draw(HOSTILE)
        elif field == "stream_options" and nested:
            body["stream_options"] = {"include_usage": draw(HOSTILE)}
        else:
            body[field] = draw(HOSTILE)
    return body


def _json_text(body: dict[str, Any]) -> str:
    text = json.dumps(body)
    for marker, literal in _RAW.items():
        text = text.replace(f'"{marker}"', literal)
    return text


def _send_hostile(http: httpx.Client, route: str, body: dict[str, Any], seen: Counter) -> None:
    content = _json_text(body)
    headers = {"content-type": "application/json"}
    with http.stream("POST", route, content=content, headers=headers) as resp:
        seen[resp.status_code] += 1
        if resp.status_code != 200:
            resp.read()
            check_response(resp)
            return
        if not resp.headers["content-type"].startswith("text/event-stream"):
            resp.read()
            assert "error" not in resp.json(), resp.text
            return
        events = [line for line in resp.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events), events
    assert events[-1] == "data: [DONE]", events[-3:]
    # an error event would mean the engine failed on a request it had accepted
    assert not any(line.startswith('data: {"error"') for line in events), events


async def _drained_pools(engine: Engine) -> Any:
    await asyncio.wait_for(engine.wait_idle(), 30)
    return engine.pool_usage()


# valid, at the extremes: each is run as an explicit example, so every run gets past validation
EXTREMES = {
    "/v1/completions": [
        {"temperature": 1e-300},
        {"top_p": 5e-324, "seed": 2**63 - 1},
        {"top_k": 1, "stop": ["\U0001f600", "x" * 512]},
        {"max_tokens": 1, "stream": True, "stream_options": {"include_usage": True}},
        {"prompt": [[1, 2], [3]], "stream": True},
    ],
    "/v1/chat/completions": [
        {"temperature": 2.0, "top_p": 1.0},
        {
            "messages": [
                {"role": "system", "content": ""},
                {"role": "user", "content": [{"type": "text", "text": "\U0001f600"}]},
            ]
        },
        {"max_completion_tokens": 1, "stream": True},
    ],
    "/generate": [
        {"sampling_params": {"max_new_tokens": 10**9}},
        {"sampling_params": {"temperature": 1e-300, "top_k": 1}, "stream": True},
        {"sampling_params": {"stop_token_ids": [0, 259]}, "rid": "x" * 200},
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("route", list(MODEL_FIELDS))
def test_hostile_values_in_every_field_leave_the_server_whole(fuzz_server, route):
    seen: Counter = Counter()

    @settings(
        max_examples=120,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(body=hostile_bodies(route))
    def send(body: dict[str, Any]) -> None:
        with httpx.Client(base_url=fuzz_server.url, timeout=30) as http:
            _send_hostile(http, route, body, seen)

    for extreme in EXTREMES[route]:
        send = example(body=VALID[route] | extreme)(send)
    send()
    print(f"{route}: status counts {dict(sorted(seen.items()))}")  # shown with -s
    assert not [code for code in seen if code >= 500], seen
    with httpx.Client(base_url=fuzz_server.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        ok = http.post(route, json=VALID[route])
        assert ok.status_code == 200, ok.text
    assert fuzz_server.call(_drained_pools(fuzz_server.engine)).all_free
    # the examples reached past validation, not only into it
    assert seen[200] > 0 and seen[400] > 0, seen


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


async def test_failed_closed_engine_is_unhealthy_and_rejects_with_503(llama, caplog):
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
                # 5xx bodies name the request id, never the internal error
                assert r.headers["x-request-id"] in error["message"]
                assert "injected" not in r.text and "step failed" not in r.text
            internal = [r for r in failed if r.status_code == 500]
            assert internal and all(r.json()["error"]["type"] == "internal_error" for r in internal)
            # the details are in the log, under the same request id
            logged = [rec.getMessage() for rec in caplog.records if rec.name == "stallfree.server"]
            for r in internal:
                rid = r.headers["x-request-id"]
                assert any(rid in m and "generation failed" in m for m in logged), logged
            assert any("injected forward failure" in m for m in logged), logged
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
