"""Every request limit of the HTTP server at its edge: the value just served and the one just
refused (issue 42, "every limit tested at its edge"). The numbers are written out, not read
from the constants, so moving a limit by one fails here. The engine API's edges are in
tests/engine/test_limit_edges.py.

Two servers: `kv` has a KV cache of 64 tokens under a context of 100 (the KV cache binds);
`small` a context of 48 and small server limits (body, prompts per request, request cost)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from stallfree import Engine
from stallfree.entrypoints.server import create_app, start_server
from tests.engine_util import engine_config
from tests.server_util import Live, module_loop

pytestmark = module_loop

KV = 64
CONTEXT = 48
BODY_LIMIT = 65536
PROMPTS_LIMIT = 10
COST_LIMIT = 130
HEAD_LIMIT = 16 * 1024
NO_EOS = {"ignore_eos": True, "temperature": 0}


@contextlib.asynccontextmanager
async def serving(path: str, context: int, **sections: Any) -> AsyncIterator[Live]:
    """A server on loopback (`tests.server_util.serving`, with the model's context set)."""
    sections.setdefault("server", {})["served_model_name"] = "test-model"
    model = {"path": path, "max_context_len": context}
    engine = Engine(engine_config(path, model=model, **sections))
    server = await start_server(create_app(engine))
    http = httpx.AsyncClient(base_url=server.url, timeout=30)
    try:
        yield Live(engine, server, None, http)  # type: ignore[arg-type]
    finally:
        await http.aclose()
        await server.stop()
        await engine.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def kv(llama: str) -> AsyncIterator[Live]:
    async with serving(llama, 100, cache={"max_total_tokens": KV}) as server:
        yield server


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def small(llama: str) -> AsyncIterator[Live]:
    limits = {
        "max_body_bytes": BODY_LIMIT,
        "max_prompts_per_request": PROMPTS_LIMIT,
        "max_request_cost": COST_LIMIT,
    }
    async with serving(llama, CONTEXT, server=limits) as server:
        yield server


def completion(prompt: Any, **fields: Any) -> dict[str, Any]:
    return {"model": "test-model", "prompt": prompt, "max_tokens": 1, **NO_EOS, **fields}


def chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": "test-model", "messages": [{"role": "user", "content": content}]} | fields


async def post(live: Live, route: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    answer = await live.http.post(route, json=body)
    return answer.status_code, answer.json()


def refusal(answer: dict[str, Any]) -> tuple[str | None, str | None]:
    return answer["error"]["param"], answer["error"]["code"]


# ---------------------------------------------------------------- the KV cache


async def test_a_prompt_one_short_of_the_kv_cache_is_served_and_one_of_its_size_is_not(
    kv: Live,
) -> None:
    status, answer = await post(kv, "/v1/completions", completion([1] * (KV - 1)))
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 1
    status, answer = await post(kv, "/v1/completions", completion([1] * KV))
    assert status == 400
    assert refusal(answer) == ("prompt", "kv_capacity_exceeded")
    status, answer = await post(kv, "/generate", {"input_ids": [1] * KV})
    assert (status, answer["error"]["code"]) == (400, "kv_capacity_exceeded")


async def test_a_chat_one_short_of_the_kv_cache_without_max_tokens_gets_one_token(
    kv: Live,
) -> None:
    """No max_tokens: as many as fit. One token fits after a prompt one short of the KV cache;
    a prompt of its size could never get one."""
    base = await kv.http.post("/tokenize", json={"messages": chat("")["messages"]})
    overhead = base.json()["count"]  # the template's tokens around an empty message
    fits = chat("x" * (KV - 1 - overhead), **NO_EOS)
    tokens = await kv.http.post("/tokenize", json={"messages": fits["messages"]})
    assert tokens.json()["count"] == KV - 1
    status, answer = await post(kv, "/v1/chat/completions", fits)
    assert status == 200, answer
    usage = answer["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (KV - 1, 1)
    status, answer = await post(kv, "/v1/chat/completions", chat("x" * (KV - overhead)))
    assert status == 400
    assert refusal(answer) == ("messages", "kv_capacity_exceeded")


async def test_max_tokens_that_fill_the_kv_cache_are_served_and_one_more_is_not(
    kv: Live,
) -> None:
    status, answer = await post(kv, "/v1/completions", completion([1] * 10, max_tokens=KV - 10))
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == KV - 10
    status, answer = await post(kv, "/v1/completions", completion([1] * 10, max_tokens=KV - 10 + 1))
    assert status == 400
    assert refusal(answer) == ("max_tokens", "kv_capacity_exceeded")


# ---------------------------------------------------------------- the context


async def test_a_prompt_one_short_of_the_context_is_served_and_one_of_its_length_is_not(
    small: Live,
) -> None:
    status, answer = await post(small, "/v1/completions", completion([1] * (CONTEXT - 1)))
    assert status == 200, answer
    status, answer = await post(small, "/v1/completions", completion([1] * CONTEXT))
    assert status == 400
    assert refusal(answer) == ("prompt", "context_length_exceeded")
    status, answer = await post(small, "/generate", {"input_ids": [1] * CONTEXT})
    assert (status, answer["error"]["code"]) == (400, "context_length_exceeded")


async def test_max_tokens_that_fill_the_context_are_served_and_one_more_is_not(
    small: Live,
) -> None:
    body = completion([1] * 10, max_tokens=CONTEXT - 10)
    status, answer = await post(small, "/v1/completions", body)
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == CONTEXT - 10
    status, answer = await post(small, "/v1/completions", body | {"max_tokens": CONTEXT - 9})
    assert status == 400
    assert refusal(answer) == ("max_tokens", "context_length_exceeded")


# ---------------------------------------------------------------- request fields


@pytest.mark.parametrize(
    ("route", "served", "refused", "param"),
    [
        ("/v1/completions", {"max_tokens": 1}, {"max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"n": 16}, {"n": 17}, "n"),
        ("/v1/chat/completions", {"n": 16}, {"n": 17}, "n"),
        (
            "/v1/completions",
            {"stop": [f"s{i}" for i in range(64)]},
            {"stop": [f"s{i}" for i in range(65)]},
            "stop",
        ),
        ("/v1/chat/completions", {"stop": ["x" * 512]}, {"stop": ["x" * 513]}, "stop"),
        ("/v1/completions", {"logprobs": 20}, {"logprobs": 21}, "logprobs"),
        (
            "/v1/chat/completions",
            {"logprobs": True, "top_logprobs": 20},
            {"logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        ("/v1/completions", {"prompt_logprobs": 20}, {"prompt_logprobs": 21}, "prompt_logprobs"),
        (
            "/generate",
            {"sampling_params": {"max_new_tokens": 1, "stop": ["x"] * 64}},
            {"sampling_params": {"max_new_tokens": 1, "stop": ["x"] * 65}},
            "sampling_params.stop",
        ),
    ],
    ids=[
        "max-tokens",
        "n",
        "chat-n",
        "stop-count",
        "stop-length",
        "logprobs",
        "top-logprobs",
        "prompt-logprobs",
        "generate-stop",
    ],
)
async def test_each_request_field_serves_its_edge_and_refuses_one_past(
    kv: Live, route: str, served: dict[str, Any], refused: dict[str, Any], param: str
) -> None:
    if route == "/generate":
        base: dict[str, Any] = {"input_ids": [1, 2, 3]}
    elif route == "/v1/chat/completions":
        base = chat("hi", max_tokens=1, **NO_EOS)
    else:
        base = completion([1, 2, 3])
    status, answer = await post(kv, route, base | served)
    assert status == 200, answer
    if "n" in served:
        assert len(answer["choices"]) == served["n"]
    status, answer = await post(kv, route, base | refused)
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer


# ---------------------------------------------------------------- server limits


async def test_prompts_times_n_at_the_limit_are_served_and_one_more_is_not(small: Live) -> None:
    for prompts, n in ((PROMPTS_LIMIT, 1), (PROMPTS_LIMIT // 2, 2)):
        status, answer = await post(small, "/v1/completions", completion([[1]] * prompts, n=n))
        assert status == 200, answer
        assert len(answer["choices"]) == PROMPTS_LIMIT
    for prompts, n, param in (
        (PROMPTS_LIMIT + 1, 1, "prompt"),
        (PROMPTS_LIMIT // 2 + 1, 2, "prompt"),
    ):
        status, answer = await post(small, "/v1/completions", completion([[1]] * prompts, n=n))
        assert status == 400
        assert refusal(answer) == (param, "too_many_prompts")
    status, answer = await post(small, "/v1/chat/completions", chat("hi", n=PROMPTS_LIMIT + 1))
    assert (status, refusal(answer)) == (400, ("n", "too_many_prompts"))


async def test_a_request_costing_the_budget_is_served_and_one_entry_more_is_not(
    small: Live,
) -> None:
    # prompt tokens once + n 1 x max_tokens 25 x (logprobs 4 + 1)
    body = completion([1] * 5, max_tokens=25, logprobs=4)
    status, answer = await post(small, "/v1/completions", body)
    assert status == 200, answer
    status, answer = await post(small, "/v1/completions", body | {"prompt": [1] * 6})
    assert status == 400
    assert answer["error"]["code"] == "request_too_costly"
    assert f"costs {COST_LIMIT + 1} token entries" in answer["error"]["message"]


def _padded(size: int) -> bytes:
    """A completion body of exactly `size` bytes (JSON allows trailing whitespace)."""
    body = json.dumps(completion([1, 2, 3])).encode()
    return body + b" " * (size - len(body))


async def test_a_body_of_the_limit_is_served_and_one_byte_more_is_413(small: Live) -> None:
    headers = {"content-type": "application/json"}
    ok = await small.http.post("/v1/completions", content=_padded(BODY_LIMIT), headers=headers)
    assert ok.status_code == 200, ok.text
    over = await small.http.post(
        "/v1/completions", content=_padded(BODY_LIMIT + 1), headers=headers
    )
    assert over.status_code == 413
    assert over.json()["error"]["code"] == "request_too_large"


async def test_a_content_length_one_past_the_limit_is_413_before_the_body(small: Live) -> None:
    """Refused from the header alone: the body is never sent (the server's body timeout, 30 s,
    is far past the answer's deadline here)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", small.server.port)
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: " + str(BODY_LIMIT + 1).encode() + b"\r\n\r\n"
        )
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 10)
    finally:
        writer.close()
    assert status.rstrip() == b"HTTP/1.1 413 Request Entity Too Large"


async def test_a_chunked_body_of_the_limit_is_served_and_one_byte_more_is_413(
    small: Live,
) -> None:
    async def chunks(body: bytes) -> AsyncIterator[bytes]:
        for start in range(0, len(body), 8192):
            yield body[start : start + 8192]

    headers = {"content-type": "application/json"}
    ok = await small.http.post(
        "/v1/completions", content=chunks(_padded(BODY_LIMIT)), headers=headers
    )
    assert ok.status_code == 200, ok.text
    over = await small.http.post(
        "/v1/completions", content=chunks(_padded(BODY_LIMIT + 1)), headers=headers
    )
    assert over.status_code == 413


async def _status_of_head(port: int, size: int, pieces: int) -> bytes:
    """The status line answering a GET whose line and headers take exactly `size` bytes, sent
    in `pieces` writes."""
    head = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: "
    end = b"\r\n\r\n"
    data = head + b"a" * (size - len(head) - len(end)) + end
    assert len(data) == size
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        step = -(-size // pieces)
        for start in range(0, size, step):
            writer.write(data[start : start + step])
            await writer.drain()
            await asyncio.sleep(0.01)  # each piece its own read
        return (await reader.readline()).rstrip()
    finally:
        writer.close()


@pytest.mark.parametrize("pieces", [1, 3])
async def test_a_head_of_the_limit_is_served_and_one_byte_more_is_431(
    kv: Live, pieces: int
) -> None:
    """Counted the same whether the head arrives in one read or several."""
    assert await _status_of_head(kv.server.port, HEAD_LIMIT, pieces) == b"HTTP/1.1 200 OK"
    refused = await _status_of_head(kv.server.port, HEAD_LIMIT + 1, pieces)
    assert refused == b"HTTP/1.1 431 Request Header Fields Too Large"
    assert (await kv.http.get("/health")).status_code == 200
