"""`/tokenize`, `/detokenize`, `/version`, `/server_info`, the abort routes and the client's
`X-Request-Id`: each with httpx, behind the API key, and with bad input."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from stallfree import __version__
from tests.http_util import MODEL, NO_EOS, SLOW, completion, serving

KEY = "sk-utility"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture
async def live():
    async with serving(server={"api_key": KEY, "chat_template": TEMPLATE}, faults=SLOW) as live:
        live.http.headers.update(AUTH)
        yield live


async def test_tokenize_a_prompt_and_back(live):
    tokenizer = live.engine.tokenizer
    text = "hello there, tokens"
    got = (await live.http.post("/tokenize", json={"model": MODEL, "prompt": text})).json()
    assert got["tokens"] == tokenizer.encode(text)
    assert got["count"] == len(got["tokens"])
    assert got["max_model_len"] == live.engine.max_context_len
    bare = await live.http.post(
        "/tokenize", json={"prompt": text, "add_special_tokens": False, "return_token_strs": True}
    )
    bare_ids = tokenizer.encode(text, add_special_tokens=False)
    assert bare.json()["tokens"] == bare_ids
    assert bare.json()["token_strs"] == [tokenizer.decode([i]) for i in bare_ids]
    back = await live.http.post("/detokenize", json={"tokens": bare_ids})
    assert back.status_code == 200 and back.json() == {"prompt": tokenizer.decode(bare_ids)}


async def test_tokenize_messages_as_the_chat_route_renders_them(live):
    messages = [{"role": "user", "content": "hi"}]
    got = (await live.http.post("/tokenize", json={"messages": messages})).json()
    text = live.engine.tokenizer.apply_chat_template(messages)
    assert got["tokens"] == live.engine.tokenizer.encode(text, add_special_tokens=False)
    chat = await live.http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 1, **NO_EOS},
    )
    assert chat.json()["usage"]["prompt_tokens"] == got["count"]


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
        ("/tokenize", {}, None),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        (
            "/tokenize",
            {
                "messages": [{"role": "user", "content": "b"}],
                "add_generation_prompt": True,
                "continue_final_message": True,
            },
            "add_generation_prompt",
        ),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/detokenize", {"tokens": ["x"]}, "tokens.0"),
        ("/abort_request", {}, None),
        ("/abort_request", {"rid": "a", "abort_all": True}, None),
        ("/abort_request", {"rid": "a", "extra": 1}, "extra"),
        ("/abort_requests", {"request_ids": []}, "request_ids"),
    ],
)
async def test_bad_bodies_are_4xx_naming_the_field(live, route, body, param):
    r = await live.http.post(route, json=body)
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    # and the server goes on serving
    assert (await live.http.get("/version")).status_code == 200


async def test_every_utility_route_is_behind_the_key(live):
    async with httpx.AsyncClient(base_url=live.http.base_url, timeout=10) as keyless:
        for method, route in [
            ("POST", "/tokenize"),
            ("POST", "/detokenize"),
            ("GET", "/version"),
            ("GET", "/server_info"),
            ("POST", "/abort_request"),
            ("POST", "/abort_requests"),
        ]:
            r = await keyless.request(method, route, json={})
            assert r.status_code == 401, (route, r.status_code)


async def test_version_and_server_info_without_secrets(live):
    assert (await live.http.get("/version")).json() == {"version": __version__}
    info = await live.http.get("/server_info")
    assert info.status_code == 200
    config = info.json()["config"]
    assert config["server"]["api_key"] == "<redacted>"
    assert KEY not in info.text
    assert config["model"]["path"] == "tiny" and config["server"]["served_model_name"] == MODEL


# ---------------------------------------------------------------------- request ids and aborts


async def test_the_clients_request_id_is_used_and_echoed(live):
    r = await live.http.post(
        "/v1/completions", json=completion(), headers={"X-Request-Id": "job-7.a"}
    )
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "job-7.a"
    assert r.json()["id"] == "cmpl-job-7.a"
    fresh = await live.http.post("/v1/completions", json=completion())
    assert len(fresh.headers["x-request-id"]) == 32  # none sent: one is made


@pytest.mark.parametrize("bad", ["x" * 129, "two words", "semi;colon", ""])
async def test_a_bad_request_id_is_a_400(live, bad):
    r = await live.http.post("/v1/completions", json=completion(), headers={"X-Request-Id": bad})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "x-request-id"
    assert r.headers["x-request-id"] != bad


async def _stream_until_first_token(live, route: str, body: dict, headers: dict):
    """Open a stream; returns (response, its line iterator) once the first event arrived."""
    request = live.http.build_request("POST", route, json=body, headers=headers)
    response = await live.http.send(request, stream=True)
    assert response.status_code == 200
    lines = response.aiter_lines()
    async for line in lines:
        if line.startswith("data: {"):
            break
    return response, lines


async def _finish_reason(lines) -> str | None:
    reason = None
    async for line in lines:
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            if "choices" in event:
                reason = event["choices"][0]["finish_reason"] or reason
            else:
                reason = event["meta_info"]["finish_reason"] or reason
    return reason


async def test_abort_requests_by_the_clients_id(live):
    body = completion(max_tokens=2000, stream=True, **NO_EOS)
    response, lines = await _stream_until_first_token(
        live, "/v1/completions", body, {"X-Request-Id": "long-1"}
    )
    try:
        aborted = await live.http.post("/abort_requests", json={"request_ids": ["nope", "long-1"]})
        assert aborted.json() == {"aborted": 1}
        reason = await asyncio.wait_for(_finish_reason(lines), 30)
    finally:
        await response.aclose()
    assert reason == "abort"  # vLLM's reason for an aborted request (a deadline: length)
    assert (await live.http.post("/abort_requests", json={"request_ids": ["long-1"]})).json() == {
        "aborted": 0
    }
    await live.engine.wait_idle()
    assert live.engine.snapshot().counters.finished.get("abort", 0) == 1


async def test_sglang_abort_request_by_rid_and_all(live):
    gen = {"text": "hi", "rid": "gen-x", "stream": True}
    gen["sampling_params"] = {"max_new_tokens": 2000, "ignore_eos": True}
    response, lines = await _stream_until_first_token(live, "/generate", gen, {})
    try:
        assert (await live.http.post("/abort_request", json={"rid": "nope"})).json() == {
            "aborted": 0
        }
        assert (await live.http.post("/abort_request", json={"rid": "gen-x"})).json() == {
            "aborted": 1
        }
        assert await asyncio.wait_for(_finish_reason(lines), 30) == "abort"
    finally:
        await response.aclose()
    streams = [
        await _stream_until_first_token(
            live, "/v1/completions", completion(max_tokens=2000, stream=True, **NO_EOS), {}
        )
        for _ in range(2)
    ]
    try:
        assert (await live.http.post("/abort_request", json={"abort_all": True})).json() == {
            "aborted": 2
        }
        for _, lines in streams:
            assert await asyncio.wait_for(_finish_reason(lines), 30) == "abort"
    finally:
        for response, _ in streams:
            await response.aclose()
    await live.engine.wait_idle()
    pools = live.engine.snapshot().pools
    assert pools.req_slots_free == pools.req_slots_total  # nothing leaked


async def test_a_request_id_in_use_is_refused_not_mixed_up(live):
    body = completion(max_tokens=2000, stream=True, **NO_EOS)
    response, lines = await _stream_until_first_token(
        live, "/v1/completions", body, {"X-Request-Id": "dup"}
    )
    try:
        second = await live.http.post(
            "/v1/completions", json=completion(), headers={"X-Request-Id": "dup"}
        )
        assert second.status_code == 400
        assert "already in use" in second.json()["error"]["message"]
        assert (await live.http.post("/abort_requests", json={"request_ids": ["dup"]})).json() == {
            "aborted": 1
        }
        assert await asyncio.wait_for(_finish_reason(lines), 30) == "abort"
    finally:
        await response.aclose()
