"""The worker probes the Rust routers call (api/probes.py), on a live server: SGLang's
/model_info, /get_model_info, /get_server_info and flat /server_info keys, /get_load,
/health_generate; vLLM's /v1/completions/render and /v1/chat/completions/render, whose token
ids are the ones /tokenize gives; all behind the API key; and the bootstrap fields' list form
(sglang-router's, one entry per prompt) on a prefill and a decode server, refused with a 400 or
403 naming the field when it does not fit."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio

from tests.server_util import Live, module_loop, serving

pytestmark = module_loop

KEY = "probe-key"
MODEL = "test-model"
PROBES = [
    ("GET", "/model_info"),
    ("GET", "/get_model_info"),
    ("GET", "/get_server_info"),
    ("GET", "/get_load"),
    ("GET", "/health_generate"),
    ("POST", "/v1/completions/render"),
    ("POST", "/v1/chat/completions/render"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def live(llama: str) -> AsyncIterator[Live]:
    async with serving(llama, api_key=KEY) as server:
        yield server


async def test_every_probe_is_behind_the_key(live: Live) -> None:
    async with httpx.AsyncClient(base_url=live.server.url) as bare:
        for method, path in PROBES:
            r = await bare.request(method, path, json={})
            assert r.status_code == 401, (path, r.status_code)


async def test_model_info_names_the_served_model_in_sglangs_shape(live: Live, llama: str) -> None:
    info = (await live.http.get("/model_info")).json()
    assert info == (await live.http.get("/get_model_info")).json()
    assert info["served_model_name"] == MODEL and info["model_path"] == llama
    assert info["tokenizer_path"] == llama and info["is_generation"] is True
    assert info["has_image_understanding"] is False


async def test_server_info_carries_sglangs_flat_keys_beside_the_configuration(
    live: Live, llama: str
) -> None:
    info = (await live.http.get("/server_info")).json()
    old = (await live.http.get("/get_server_info")).json()
    flat = {k: v for k, v in info.items() if k != "config"}
    assert flat == old
    assert info["served_model_name"] == MODEL and info["model_path"] == llama
    assert (info["tp_size"], info["dp_size"], info["disaggregation_mode"]) == (1, 1, "null")
    assert info["config"]["server"]["api_key"] == "<redacted>" and KEY not in json.dumps(info)
    assert info["context_length"] == live.engine.max_context_len


async def test_get_load_counts_a_running_request(live: Live) -> None:
    idle = (await live.http.get("/get_load")).json()
    assert idle == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 200, "ignore_eos": True}
    async with live.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = r.aiter_lines()
        while not (await lines.__anext__()).startswith("data: "):
            pass
        [busy] = (await live.http.get("/get_load")).json()
    assert busy["num_reqs"] == 1 and busy["num_tokens"] > 0
    await live.engine.wait_idle()
    assert (await live.http.get("/get_load")).json() == idle


async def test_health_generate_runs_one_token(live: Live) -> None:
    before = live.engine.snapshot().counters.generation_tokens
    r = await live.http.get("/health_generate")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert live.engine.snapshot().counters.generation_tokens == before + 1


async def test_completion_render_gives_the_ids_tokenize_gives(live: Live) -> None:
    prompts = ["hello world", "the quick brown fox"]
    r = await live.http.post("/v1/completions/render", json={"model": MODEL, "prompt": prompts})
    assert r.status_code == 200, r.text
    rendered = r.json()
    assert [p["prompt"] for p in rendered] == prompts
    for text, got in zip(prompts, rendered, strict=True):
        want = (await live.http.post("/tokenize", json={"prompt": text})).json()["tokens"]
        assert got["prompt_token_ids"] == want
    ids = rendered[0]["prompt_token_ids"]
    by_ids = await live.http.post("/v1/completions/render", json={"model": MODEL, "prompt": ids})
    assert [p["prompt_token_ids"] for p in by_ids.json()] == [ids]


async def test_chat_render_gives_the_conversation_and_the_ids_tokenize_gives(live: Live) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = await live.http.post(
        "/v1/chat/completions/render", json={"model": MODEL, "messages": messages}
    )
    assert r.status_code == 200, r.text
    conversation, [prompt] = r.json()
    assert conversation == messages
    want = await live.http.post("/tokenize", json={"messages": messages})
    assert prompt["prompt_token_ids"] == want.json()["tokens"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions/render", {"model": "other", "prompt": "x"}, 404, "model"),
        ("/v1/completions/render", {"model": MODEL, "prompt": []}, 400, "prompt"),
        ("/v1/completions/render", {"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
        ("/v1/chat/completions/render", {"model": MODEL, "messages": []}, 400, "messages"),
        ("/v1/chat/completions/render", {"model": MODEL}, 400, "messages"),
    ],
)
async def test_render_refuses_what_generation_refuses(
    live: Live, path: str, body: dict[str, object], status: int, param: str
) -> None:
    r = await live.http.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


# ------------------------------------------------------------ the bootstrap fields' list form


async def test_a_prefill_server_takes_one_room_per_prompt_and_refuses_a_list_that_does_not_fit(
    llama: str,
) -> None:
    dis = {"mode": "prefill", "bootstrap_port": 0, "transfer_timeout_s": 2}
    async with serving(llama, disaggregation=dis) as live:
        base = {"model": MODEL, "prompt": ["a b", "c d", "e f"], "max_tokens": 4}
        before = live.engine.snapshot().counters.prompt_tokens
        for field, value in [
            ("bootstrap_room", [1, 2]),
            ("bootstrap_port", [9000] * 4),
            ("bootstrap_host", ["127.0.0.1"]),
        ]:
            r = await live.http.post("/v1/completions", json={**base, field: value})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == field and "for 3 prompt(s)" in error["message"]
        for bad in ([], [-1, 0, 1], [1, "x", 2], [2**63, 0, 1]):
            r = await live.http.post("/v1/completions", json={**base, "bootstrap_room": bad})
            assert r.status_code == 400, (bad, r.text)
        # refused before any engine request
        assert live.engine.snapshot().counters.prompt_tokens == before
        assert live.engine.snapshot().running == 0


async def test_a_decode_server_checks_each_prompts_prefill_against_its_trusted_hosts(
    llama: str,
) -> None:
    dis = {"mode": "decode", "transfer_timeout_s": 2}
    async with serving(llama, disaggregation=dis) as live:
        body = {
            "model": MODEL,
            "prompt": ["a b", "c d"],
            "max_tokens": 4,
            "bootstrap_room": [5, 9],
            "bootstrap_host": ["127.0.0.1", "203.0.113.7"],
            "bootstrap_port": [9000, 9000],
        }
        r = await asyncio.wait_for(live.http.post("/v1/completions", json=body), 30)
        assert r.status_code == 403, r.text
        assert r.json()["error"]["param"] == "bootstrap_host"
        assert "203.0.113.7" in r.json()["error"]["message"]
        assert live.engine.snapshot().running == 0
