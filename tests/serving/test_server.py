"""The HTTP server on a loopback port, driven by the official `openai` client and httpx."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from stallfree import SamplingParams
from stallfree.disagg.stats import DisaggStats
from stallfree.entrypoints.cli import build_parser, config_from_args
from tests.engine_util import settle
from tests.http_util import MODEL, stallfree_serve
from tests.metrics_util import samples, value
from tests.server_util import module_loop, serving

ROOT = Path(__file__).resolve().parents[2]
GREEDY = {"temperature": 0.0}
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def llama_no_template(llama, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("plain") / "llama"
    shutil.copytree(llama, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return str(out)


# ---------------------------------------------------------------- happy paths


@module_loop
async def test_completion_equals_the_embedded_engine(live):
    prompt = "The quick brown fox"
    result = await live.client.completions.create(
        model="test-model", prompt=prompt, max_tokens=12, extra_body=NO_EOS, **GREEDY
    )
    embedded = await live.engine.complete(
        prompt, SamplingParams(max_new_tokens=12, ignore_eos=True)
    )
    assert result.choices[0].text == embedded.text
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None
    assert result.usage.prompt_tokens == len(prompt.encode())
    assert result.usage.completion_tokens == 12
    assert result.usage.total_tokens == len(prompt.encode()) + 12
    assert result.model == "test-model"


@module_loop
async def test_streamed_completion_adds_up_to_the_whole(live):
    kwargs = {"model": "test-model", "prompt": "Streaming", "max_tokens": 10, "extra_body": NO_EOS}
    whole = await live.client.completions.create(**kwargs, **GREEDY)
    stream = await live.client.completions.create(
        **kwargs, **GREEDY, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10


@module_loop
async def test_batched_prompts_get_one_choice_each(live):
    prompts = ["first prompt", "second"]
    result = await live.client.completions.create(
        model="test-model", prompt=prompts, max_tokens=5, extra_body=NO_EOS, **GREEDY
    )
    assert [c.index for c in result.choices] == [0, 1]
    for prompt, choice in zip(prompts, result.choices, strict=True):
        alone = await live.engine.complete(
            prompt, SamplingParams(max_new_tokens=5, ignore_eos=True)
        )
        assert choice.text == alone.text
    assert result.usage is not None and result.usage.completion_tokens == 10


@module_loop
async def test_chat_uses_the_template_and_streams(live):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    whole = await live.client.chat.completions.create(
        model="test-model", messages=messages, max_tokens=8, extra_body=NO_EOS, **GREEDY
    )
    rendered = live.engine.tokenizer.apply_chat_template(messages)
    embedded = await live.engine.complete(
        rendered, SamplingParams(max_new_tokens=8, ignore_eos=True)
    )
    assert whole.choices[0].message.content == embedded.text
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == embedded.prompt_tokens
    assert whole.usage.completion_tokens == 8
    stream = await live.client.chat.completions.create(
        model="test-model",
        messages=messages,
        max_tokens=8,
        extra_body=NO_EOS,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == embedded.text
    assert (
        chunks[-1].usage is not None and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    )


@module_loop
async def test_native_generate_plain_and_streaming(live):
    body = {"text": "native", "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
    plain = (await live.http.post("/generate", json=body)).json()
    embedded = await live.engine.complete(
        "native", SamplingParams(max_new_tokens=6, ignore_eos=True)
    )
    assert plain["text"] == embedded.text and plain["output_ids"] == embedded.token_ids
    assert plain["meta_info"]["finish_reason"] == "length"
    async with live.http.stream("POST", "/generate", json=body | {"stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(e["text"] for e in events) == embedded.text
    assert [t for e in events for t in e["output_ids"]] == embedded.token_ids
    assert events[-1]["finished"] and events[-1]["meta_info"]["completion_tokens"] == 6


@module_loop
async def test_models_health_and_metrics_endpoints(live):
    models = await live.client.models.list()
    assert [m.id for m in models.data] == ["test-model"]
    health = await live.http.get("/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    scrape = await live.http.get("/metrics")
    assert scrape.status_code == 200
    assert scrape.headers["content-type"].startswith("text/plain")
    assert 'stallfree:generation_tokens_total{engine="' in scrape.text
    assert 'model_name="test-model"' in scrape.text


# ---------------------------------------------------------------- metrics after a known workload


@module_loop
async def test_metrics_agree_with_what_the_client_saw(llama):
    async with serving(llama) as s:
        params = {"model": "test-model", "extra_body": NO_EOS, **GREEDY}
        prompts = ["one", "two two", "three three three"]
        results = await asyncio.gather(
            *(
                s.client.completions.create(prompt=p, max_tokens=4 + i, **params)
                for i, p in enumerate(prompts)
            )
        )
        chat = await s.client.chat.completions.create(
            messages=[{"role": "user", "content": "hey"}], max_tokens=3, **params
        )
        # a stop token: the first token the model would produce ends the request at once
        first = (await s.http.post("/generate", json={"text": "stop here"})).json()["output_ids"][0]
        stopped = await s.client.completions.create(
            prompt="stop here",
            max_tokens=20,
            model="test-model",
            extra_body={"stop_token_ids": [first]},
            **GREEDY,
        )
        assert stopped.choices[0].finish_reason == "stop"
        await settle(s.engine)
        scrape = samples((await s.http.get("/metrics")).text)
    usages = [r.usage for r in results] + [chat.usage, stopped.usage]
    # the /generate probe ran with default params: 128 tokens or EOS; count it from the engine
    generated = sum(u.completion_tokens for u in usages if u is not None)
    prompt_tokens = sum(u.prompt_tokens for u in usages if u is not None) + len(b"stop here")
    probe_tokens = value(scrape, "stallfree:generation_tokens_total") - generated
    assert 1 <= probe_tokens <= 128
    assert value(scrape, "stallfree:prompt_tokens_total") == prompt_tokens
    finished = {
        r: value(scrape, "stallfree:request_success_total", finished_reason=r)
        for r in ("stop", "length", "abort", "error")
    }
    probe_reason = "length" if probe_tokens == 128 else "stop"
    want = {"stop": 1, "length": 4, "abort": 0, "error": 0}
    want[probe_reason] += 1
    assert finished == want
    assert value(scrape, "stallfree:e2e_request_latency_seconds_count") == 6
    assert value(scrape, "stallfree:time_to_first_token_seconds_count") == 6


@module_loop
async def test_metrics_counters_equal_served_tokens_exactly(llama):
    async with serving(llama) as s:
        results = await asyncio.gather(
            *(
                s.client.completions.create(
                    model="test-model", prompt="x" * (i + 3), max_tokens=i + 2, extra_body=NO_EOS
                )
                for i in range(4)
            )
        )
        await settle(s.engine)
        scrape = samples((await s.http.get("/metrics")).text)
    assert value(scrape, "stallfree:generation_tokens_total") == sum(
        r.usage.completion_tokens for r in results if r.usage
    )
    assert value(scrape, "stallfree:prompt_tokens_total") == sum(
        r.usage.prompt_tokens for r in results if r.usage
    )
    assert value(scrape, "stallfree:request_success_total", finished_reason="length") == 4


@module_loop
async def test_dashboard_queries_only_metrics_that_exist(live):
    dashboard = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v.get("definition", "") for v in dashboard["templating"]["list"]]
    queried = {m for e in exprs for m in re.findall(r"stallfree:[a-z0-9_]+", e)}
    assert len(queried) > 15
    exposed = {name for name, _ in samples((await live.http.get("/metrics")).text)}
    # families with no series yet (stalls by site with mirrors on) still print HELP/TYPE lines
    text = (await live.http.get("/metrics")).text
    # the disaggregation row's families: a prefill or decode server appends them
    text += DisaggStats("decode").render().decode()
    declared = set(re.findall(r"^# TYPE (stallfree:[a-z0-9_]+) (\w+)", text, re.M))
    for name, kind in declared:
        exposed |= {name, name + "_total"} if kind == "counter" else {name}
        if kind == "histogram":
            exposed |= {name + "_bucket", name + "_sum", name + "_count"}
    assert queried <= exposed, queried - exposed
    hit_rate = next(p for p in dashboard["panels"] if p["title"] == "HiSparse buffer hit rate")
    assert "hisparse_hits_total" in hit_rate["targets"][0]["expr"]
    assert "hisparse_misses_total" in hit_rate["targets"][0]["expr"]


# ---------------------------------------------------------------- bad requests


def _post(path: str, body: Any) -> tuple[str, bytes]:
    return path, body if isinstance(body, bytes) else json.dumps(body).encode()


BAD_REQUESTS = [
    (
        "malformed JSON",
        *_post("/v1/completions", b'{"model": "test-model", '),
        400,
        None,
        "malformed JSON",
    ),
    (
        "output-changing field",
        *_post("/v1/completions", {"model": "test-model", "prompt": "x", "suffix": "end"}),
        400,
        "suffix",
        "not supported",
    ),
    (
        "bad temperature",
        *_post("/v1/completions", {"model": "test-model", "prompt": "x", "temperature": -1}),
        400,
        "temperature",
        "temperature",
    ),
    (
        "bad top_k",
        *_post("/v1/completions", {"model": "test-model", "prompt": "x", "top_k": 0}),
        400,
        "top_k",
        "top_k",
    ),
    (
        "n over its bound",
        *_post("/v1/completions", {"model": "test-model", "prompt": "x", "n": 17}),
        400,
        "n",
        "less than or equal to 16",
    ),
    (
        "unknown role",
        *_post(
            "/v1/chat/completions",
            {"model": "test-model", "messages": [{"role": "wizard", "content": "x"}]},
        ),
        400,
        "messages.0.role",
        "role",
    ),
    (
        "no messages",
        *_post("/v1/chat/completions", {"model": "test-model", "messages": []}),
        400,
        "messages",
        "messages",
    ),
    (
        "unknown model",
        *_post("/v1/completions", {"model": "nope", "prompt": "x"}),
        404,
        "model",
        "does not exist",
    ),
    ("missing model", *_post("/v1/completions", {"prompt": "x"}), 400, "model", "model"),
    (
        "max_tokens too large",
        *_post("/v1/completions", {"model": "test-model", "prompt": "hello", "max_tokens": 5000}),
        400,
        "max_tokens",
        "max_tokens is too large",
    ),
    (
        "prompt over the context",
        *_post("/v1/completions", {"model": "test-model", "prompt": "x" * 1500}),
        400,
        "prompt",
        "maximum context length is 1024",
    ),
    (
        "chat over the context",
        *_post(
            "/v1/chat/completions",
            {"model": "test-model", "messages": [{"role": "user", "content": "x" * 1500}]},
        ),
        400,
        "messages",
        "maximum context length",
    ),
    (
        "empty prompt",
        *_post("/v1/completions", {"model": "test-model", "prompt": ""}),
        400,
        "prompt",
        "empty",
    ),
    (
        "token id out of range",
        *_post("/v1/completions", {"model": "test-model", "prompt": [1, 99999]}),
        400,
        None,
        "out of range",
    ),
    (
        "generate: text and ids",
        *_post("/generate", {"text": "x", "input_ids": [1]}),
        400,
        "text",
        "exactly one",
    ),
    (
        "generate: bad param",
        *_post("/generate", {"text": "x", "sampling_params": {"top_p": 2}}),
        400,
        "sampling_params.top_p",
        "top_p",
    ),
    ("unknown route", *_post("/v1/moderations", {"model": "test-model"}), 404, None, "Not Found"),
]


@module_loop
@pytest.mark.parametrize(
    ("path", "body", "status", "param", "match"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
async def test_bad_requests_get_a_clear_error_and_the_server_keeps_serving(
    live, path, body, status, param, match
):
    r = await live.http.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert match in error["message"]
    if param is not None:
        assert error["param"] == param
    ok = await live.client.completions.create(model="test-model", prompt="ok", max_tokens=2)
    assert ok.usage is not None and ok.usage.completion_tokens >= 1


@module_loop
async def test_openai_client_sees_the_error_as_bad_request(live):
    with pytest.raises(openai.BadRequestError, match="max_tokens is too large"):
        await live.client.completions.create(model="test-model", prompt="hi", max_tokens=10_000)


@module_loop
async def test_chat_without_a_template_is_a_400_that_says_so(llama_no_template):
    async with serving(llama_no_template) as s:
        with pytest.raises(openai.BadRequestError, match="no chat template") as info:
            await s.client.chat.completions.create(
                model="test-model", messages=[{"role": "user", "content": "hi"}]
            )
        assert info.value.code == "no_chat_template"
        ok = await s.client.completions.create(model="test-model", prompt="plain", max_tokens=2)
        assert ok.choices[0].text is not None


@module_loop
async def test_api_key_is_required_when_set(llama):
    async with serving(llama, api_key="s3cret") as s:
        base = s.server.url
        async with httpx.AsyncClient(base_url=base) as anonymous:
            missing = await anonymous.get("/v1/models")
            wrong = await anonymous.get("/v1/models", headers={"Authorization": "Bearer nope"})
            gen = await anonymous.post("/generate", json={"text": "x"})
            health = await anonymous.get("/health")
            metrics = await anonymous.get("/metrics")
        assert missing.status_code == wrong.status_code == gen.status_code == 401
        assert "missing API key" in missing.json()["error"]["message"]
        assert wrong.json()["error"]["code"] == "invalid_api_key"
        assert health.status_code == metrics.status_code == 200
        assert (await s.client.models.list()).data[0].id == "test-model"
        stranger = AsyncOpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await stranger.models.list()
        await stranger.close()


# ---------------------------------------------------------------- disconnects


@module_loop
async def test_disconnect_mid_stream_aborts_and_frees_memory(live):
    before = samples((await live.http.get("/metrics")).text)
    body = {"model": "test-model", "prompt": "long", "max_tokens": 900, "stream": True}
    async with live.http.stream("POST", "/v1/completions", json=body | NO_EOS) as r:
        assert r.status_code == 200
        seen = 0
        async for line in r.aiter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                break
    await settle(live.engine)
    after = samples((await live.http.get("/metrics")).text)
    aborted = value(after, "stallfree:request_success_total", finished_reason="abort")
    assert aborted == value(before, "stallfree:request_success_total", finished_reason="abort") + 1
    generated = value(after, "stallfree:generation_tokens_total") - value(
        before, "stallfree:generation_tokens_total"
    )
    assert 3 <= generated < 900


@module_loop
async def test_disconnect_while_waiting_for_a_whole_answer_aborts(live):
    aborts = live.engine.snapshot().counters.finished.get("abort", 0)
    body = {"model": "test-model", "prompt": "long", "max_tokens": 900} | NO_EOS
    with pytest.raises(httpx.ReadTimeout):
        await live.http.post("/v1/completions", json=body, timeout=0.3)
    # the server sees the disconnect on the ASGI receive channel at once (no polling)
    await settle(live.engine)
    assert live.engine.snapshot().counters.finished.get("abort", 0) == aborts + 1


# ---------------------------------------------------------------- process: config and SIGTERM


def test_flags_toml_and_env_map_to_one_config(tmp_path, monkeypatch):
    parse = build_parser().parse_args
    flags = config_from_args(parse(["serve", "--port", "9001", "--api-key", "k", "--no-metrics"]))
    assert (flags.server.port, flags.server.api_key, flags.metrics.enabled) == (9001, "k", False)
    assert flags.server.host == "127.0.0.1"
    toml = tmp_path / "stallfree.toml"
    toml.write_text('[server]\nport = 9002\nserved_model_name = "m"\n[metrics]\nenabled = false\n')
    from_file = config_from_args(parse(["serve", "--config", str(toml)]))
    assert (from_file.server.port, from_file.server.served_model_name) == (9002, "m")
    monkeypatch.setenv("STALLFREE_SERVER__PORT", "9003")
    monkeypatch.setenv("STALLFREE_SERVER__API_KEY", "env-key")
    env = config_from_args(parse(["serve", "--config", str(toml)]))
    assert (env.server.port, env.server.api_key, env.metrics.enabled) == (9003, "env-key", False)
    flag_wins = config_from_args(parse(["serve", "--config", str(toml), "--port", "9004"]))
    assert flag_wins.server.port == 9004


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_then_exits():
    with stallfree_serve() as (proc, base):
        body = {"model": MODEL, "prompt": "drain me", "max_tokens": 400, "stream": True} | NO_EOS
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break
            proc.send_signal(signal.SIGTERM)
            last = None
            for line in lines:
                if line.startswith("data: {"):
                    last = json.loads(line[6:])
                elif line == "data: [DONE]":
                    break
        assert last is not None and last["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=30) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(base + "/health", timeout=1)
