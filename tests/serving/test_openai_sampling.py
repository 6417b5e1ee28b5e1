"""Sampling features through the OpenAI API, with the official client: logprobs (completions and
chat, streaming and not, against transformers' log-softmax), echo, `n` choices sharing the
prompt's KV, penalties and logit_bias, and the hostile values of each."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import httpx
import openai
import pytest
import torch

from stallfree import SamplingParams
from tests.engine_util import settle
from tests.hf_models import hf_logits
from tests.metrics_util import samples, value
from tests.server_util import module_loop

GREEDY: dict[str, Any] = {"temperature": 0.0}
NO_EOS = {"ignore_eos": True}
PROMPT = "The quick brown fox"
EOS = 257  # the test tokenizer's </s>


def _log_softmax(path: str, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(hf_logits(path, ids), dim=-1)  # type: ignore[arg-type]


def _close(a: float | None, b: float) -> bool:
    return a is not None and math.isclose(a, b, abs_tol=1e-4)


def _text(token_id: int) -> str:
    """How the API shows a token of the byte tokenizer: its byte, or `\\xNN` when that byte is
    only part of a character."""
    return bytes([token_id]).decode("utf-8", "backslashreplace")


# ---------------------------------------------------------------- completions: logprobs, echo


@module_loop
async def test_completion_logprobs_equal_transformers(live, llama):
    result = await live.client.completions.create(
        model="test-model", prompt=PROMPT, max_tokens=6, logprobs=3, extra_body=NO_EOS, **GREEDY
    )
    choice = result.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    embedded = await live.engine.complete(PROMPT, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert embedded.text == choice.text
    # the byte tokenizer: every token is one byte; offsets count the tokens' characters
    assert lp.tokens == [_text(t) for t in embedded.token_ids]
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(6)]
    ids = list(PROMPT.encode()) + embedded.token_ids
    want = _log_softmax(llama, ids)
    for i, (token_id, logprob, top) in enumerate(
        zip(embedded.token_ids, lp.token_logprobs, lp.top_logprobs, strict=True)
    ):
        pos = len(PROMPT.encode()) + i - 1
        # greedy: the chosen token is the most likely, and the top 3 are transformers' top 3
        assert top is not None and 3 <= len(top) <= 4
        assert logprob == max(top.values()) == top[_text(token_id)]
        assert _close(logprob, float(want[pos, token_id]))
        for alt in want[pos].topk(3).indices.tolist():
            assert _close(top[_text(alt)], float(want[pos, alt]))


@module_loop
async def test_streamed_completion_logprobs_add_up_to_the_whole(live):
    kwargs: dict[str, Any] = {
        "model": "test-model",
        "prompt": PROMPT,
        "max_tokens": 8,
        "logprobs": 2,
        "extra_body": NO_EOS,
        **GREEDY,
    }
    whole = (await live.client.completions.create(**kwargs)).choices[0]
    stream = await live.client.completions.create(**kwargs, stream=True)
    tokens, logprobs, offsets, text = [], [], [], ""
    async for chunk in stream:
        for c in chunk.choices:
            text += c.text
            assert c.logprobs is not None and c.logprobs.tokens is not None
            tokens += c.logprobs.tokens
            logprobs += c.logprobs.token_logprobs or []
            offsets += c.logprobs.text_offset or []
    assert whole.logprobs is not None
    assert text == whole.text
    assert tokens == whole.logprobs.tokens
    # NOTE: equal to float rounding (one of the runs may read the prompt's KV from the cache)
    assert len(logprobs) == 8
    assert all(
        _close(a, b) for a, b in zip(logprobs, whole.logprobs.token_logprobs or [], strict=True)
    )
    assert offsets == whole.logprobs.text_offset


@module_loop
async def test_echo_returns_the_prompt_and_its_logprobs(live, llama):
    plain = await live.client.completions.create(
        model="test-model", prompt=PROMPT, max_tokens=4, extra_body=NO_EOS, **GREEDY
    )
    echoed = await live.client.completions.create(
        model="test-model", prompt=PROMPT, max_tokens=4, echo=True, extra_body=NO_EOS, **GREEDY
    )
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert echoed.choices[0].logprobs is None
    assert echoed.usage is not None and echoed.usage.prompt_tokens == len(PROMPT)

    with_lp = await live.client.completions.create(
        model="test-model",
        prompt=PROMPT,
        max_tokens=4,
        echo=True,
        logprobs=2,
        extra_body=NO_EOS,
        **GREEDY,
    )
    choice = with_lp.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert choice.text == PROMPT + plain.choices[0].text
    embedded = await live.engine.complete(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True))
    ids = list(PROMPT.encode()) + embedded.token_ids
    assert lp.tokens == [_text(t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None for x in lp.token_logprobs[1:])
    want = _log_softmax(llama, ids)
    for j in range(1, len(ids)):
        assert _close(lp.token_logprobs[j], float(want[j - 1, ids[j]]))
        top = lp.top_logprobs[j]
        assert top is not None
        for alt in want[j - 1].topk(2).indices.tolist():
            assert _close(top[_text(alt)], float(want[j - 1, alt]))

    # streaming: the first event of the choice opens with the prompt and its logprobs
    stream = await live.client.completions.create(
        model="test-model",
        prompt=PROMPT,
        max_tokens=4,
        echo=True,
        logprobs=2,
        stream=True,
        extra_body=NO_EOS,
        **GREEDY,
    )
    events = [c.choices[0] async for c in stream if c.choices]
    assert events[0].text.startswith(PROMPT)
    assert events[0].logprobs is not None and events[0].logprobs.token_logprobs is not None
    assert events[0].logprobs.token_logprobs[0] is None
    assert "".join(e.text for e in events) == choice.text
    streamed = [x for e in events if e.logprobs for x in e.logprobs.token_logprobs or []]
    assert len(streamed) == len(ids) and streamed[0] is None
    assert all(_close(a, b) for a, b in zip(streamed[1:], lp.token_logprobs[1:], strict=True))


# ---------------------------------------------------------------- chat logprobs


@module_loop
async def test_chat_logprobs_equal_transformers_streaming_and_not(live, llama):
    messages = [{"role": "user", "content": "Hi!"}]
    kwargs: dict[str, Any] = {
        "model": "test-model",
        "messages": messages,
        "max_tokens": 5,
        "logprobs": True,
        "top_logprobs": 3,
        "extra_body": NO_EOS,
        **GREEDY,
    }
    whole = await live.client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert len(content) == 5
    rendered = live.engine.tokenizer.apply_chat_template(messages)
    prompt_ids = live.engine.tokenizer.encode(rendered, add_special_tokens=False)
    output = [entry.bytes[0] for entry in content if entry.bytes]
    want = _log_softmax(llama, prompt_ids + output)
    for i, entry in enumerate(content):
        pos = len(prompt_ids) + i - 1
        assert entry.bytes is not None and len(entry.bytes) == 1
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == max(t.logprob for t in entry.top_logprobs)
        assert entry.top_logprobs[0].bytes == entry.bytes
        assert _close(entry.logprob, float(want[pos, entry.bytes[0]]))
        top_ids = want[pos].topk(3).indices.tolist()
        assert [t.bytes for t in entry.top_logprobs] == [[t] for t in top_ids]
    assert bytes(output).decode("utf-8", "replace") == choice.message.content

    stream = await live.client.chat.completions.create(**kwargs, stream=True)
    streamed: list[Any] = []
    async for chunk in stream:
        for c in chunk.choices:
            if c.delta.role is not None or c.finish_reason is not None:
                assert c.logprobs is None  # only deltas with tokens carry logprobs
            elif c.logprobs is not None:
                streamed += c.logprobs.content or []
    # NOTE: equal to float rounding: the second run reads the prompt's KV from the cache
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
    for got, was in zip(streamed, content, strict=True):
        assert _close(got.logprob, was.logprob)
        assert [t.bytes for t in got.top_logprobs] == [t.bytes for t in was.top_logprobs]

    without = await live.client.chat.completions.create(
        **(kwargs | {"logprobs": False, "top_logprobs": None})
    )
    assert without.choices[0].logprobs is None
    zero = await live.client.chat.completions.create(**(kwargs | {"top_logprobs": 0}))
    assert zero.choices[0].logprobs is not None and zero.choices[0].logprobs.content
    assert all(e.top_logprobs == [] for e in zero.choices[0].logprobs.content)


# ---------------------------------------------------------------- n choices


@module_loop
async def test_n_choices_are_seeded_distinct_and_reproducible(live):
    kwargs: dict[str, Any] = {
        "model": "test-model",
        "prompt": PROMPT,
        "max_tokens": 12,
        "n": 3,
        "temperature": 1.0,
        "seed": 11,
        "extra_body": NO_EOS,
    }
    first = await live.client.completions.create(**kwargs)
    again = await live.client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]
    assert len(set(texts)) == 3
    assert first.usage is not None
    assert first.usage.prompt_tokens == len(PROMPT)  # the prompt counts once
    assert first.usage.completion_tokens == 36
    # choice i samples with seed + i: choice 1 of seed 11 is choice 0 of seed 12
    shifted = await live.client.completions.create(**(kwargs | {"n": 1, "seed": 12}))
    assert shifted.choices[0].text == texts[1]

    stream = await live.client.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    streamed = ["", "", ""]
    usage = None
    async for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] += c.text
        usage = chunk.usage or usage
    assert streamed == texts
    assert usage is not None and usage.completion_tokens == 36
    assert usage.prompt_tokens == len(PROMPT)

    chat = await live.client.chat.completions.create(
        model="test-model",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=8,
        n=2,
        temperature=1.0,
        seed=3,
        extra_body=NO_EOS,
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.usage is not None and chat.usage.completion_tokens == 16
    chat_stream = await live.client.chat.completions.create(
        model="test-model",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=8,
        n=2,
        temperature=1.0,
        seed=3,
        stream=True,
        extra_body=NO_EOS,
    )
    parts = ["", ""]
    roles, finishes = set(), set()
    async for chunk in chat_stream:
        for c in chunk.choices:
            parts[c.index] += c.delta.content or ""
            if c.delta.role:
                roles.add(c.index)
            if c.finish_reason:
                finishes.add(c.index)
    assert parts == [c.message.content for c in chat.choices]
    assert roles == finishes == {0, 1}


@module_loop
async def test_batched_prompts_times_n_index_choices_by_prompt(live):
    result = await live.client.completions.create(
        model="test-model", prompt=["one", "two!"], max_tokens=3, n=2, extra_body=NO_EOS, **GREEDY
    )
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    texts = [c.text for c in result.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: the choices agree
    assert result.usage is not None
    assert result.usage.prompt_tokens == len("one") + len("two!")
    assert result.usage.completion_tokens == 12


@module_loop
async def test_n_choices_share_the_prompt_through_the_prefix_cache(live):
    await settle(live.engine)
    assert live.engine.flush_cache()
    prompt = "a shared prompt for all choices: " * 3
    before = live.engine.snapshot().counters
    result = await live.client.completions.create(
        model="test-model", prompt=prompt, max_tokens=4, n=4, extra_body=NO_EOS, **GREEDY
    )
    await settle(live.engine)
    after = live.engine.snapshot().counters
    assert len(result.choices) == 4
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    computed = after.prompt_tokens - before.prompt_tokens
    # the first choice prefills the prompt; each of the 3 others finds it cached but for the
    # last token, which is computed again to give that choice its first logits
    assert hits == 3 * (len(prompt) - 1), (hits, computed)


@module_loop
async def test_disconnect_aborts_every_choice(live):
    aborted = live.engine.snapshot().counters.finished.get("abort", 0)
    body = {"model": "test-model", "prompt": "long", "max_tokens": 900, "n": 3, "stream": True}
    async with live.http.stream("POST", "/v1/completions", json=body | NO_EOS) as r:
        assert r.status_code == 200
        seen = 0
        async for line in r.aiter_lines():
            seen += line.startswith("data: ")
            if seen == 6:
                break
    await settle(live.engine)
    assert live.engine.snapshot().counters.finished.get("abort", 0) == aborted + 3
    with pytest.raises(httpx.ReadTimeout):
        await live.http.post("/v1/completions", json=body | NO_EOS | {"stream": False}, timeout=0.3)
    await settle(live.engine)
    assert live.engine.snapshot().counters.finished.get("abort", 0) == aborted + 6


# ---------------------------------------------------------------- penalties and logit_bias


PENALTIES = {"presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.3}


@module_loop
async def test_penalties_reach_the_engine(live):
    prompt = "ab ab ab ab ab ab"
    served = await live.client.completions.create(
        model="test-model",
        prompt=prompt,
        max_tokens=24,
        presence_penalty=PENALTIES["presence_penalty"],
        frequency_penalty=PENALTIES["frequency_penalty"],
        extra_body=NO_EOS | {"repetition_penalty": PENALTIES["repetition_penalty"]},
        **GREEDY,
    )
    embedded = await live.engine.complete(
        prompt, SamplingParams(max_new_tokens=24, ignore_eos=True, **PENALTIES)
    )
    plain = await live.engine.complete(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert served.choices[0].text == embedded.text
    assert embedded.token_ids != plain.token_ids  # the penalties change this output


@module_loop
async def test_logit_bias_and_min_tokens(live):
    forced = await live.client.completions.create(
        model="test-model", prompt="x", max_tokens=5, logit_bias={"65": 100}, **GREEDY
    )
    assert forced.choices[0].text == "AAAAA"
    # EOS made certain: min_tokens holds it off for 3 tokens, then it ends the request
    eos_first = await live.client.completions.create(
        model="test-model",
        prompt="x",
        max_tokens=10,
        logit_bias={str(EOS): 100},
        extra_body={"min_tokens": 3},
        **GREEDY,
    )
    choice = eos_first.choices[0]
    assert choice.finish_reason == "stop"
    assert eos_first.usage is not None and eos_first.usage.completion_tokens == 4
    chat = await live.client.chat.completions.create(
        model="test-model",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        logit_bias={"66": 100},
        **GREEDY,
    )
    assert chat.choices[0].message.content == "BBB"


@module_loop
async def test_generate_takes_the_new_sampling_fields(live, llama):
    body = {
        "text": PROMPT,
        "sampling_params": {
            "max_new_tokens": 3,
            "ignore_eos": True,
            "logprobs": 2,
            "prompt_logprobs": 1,
            "logit_bias": {"67": 100},
            "min_tokens": 1,
            "presence_penalty": 0.5,
        },
    }
    r = await live.http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output_ids"] == [67, 67, 67]
    assert [e["token_id"] for e in out["logprobs"]] == [67, 67, 67]
    assert all(len(e["top"]) == 2 for e in out["logprobs"])
    prompt_ids = list(PROMPT.encode())
    assert out["prompt_logprobs"][0] is None and len(out["prompt_logprobs"]) == len(prompt_ids)
    want = _log_softmax(llama, prompt_ids)
    for j, entry in enumerate(out["prompt_logprobs"][1:], start=1):
        assert entry["token_id"] == prompt_ids[j]
        assert _close(entry["logprob"], float(want[j - 1, prompt_ids[j]]))
    async with live.http.stream("POST", "/generate", json=body | {"stream": True}) as s:
        lines = [line async for line in s.aiter_lines() if line.startswith("data: {")]
    events = [json.loads(line[6:]) for line in lines]
    assert [e["token_id"] for ev in events for e in ev["logprobs"]] == [67, 67, 67]
    assert "prompt_logprobs" in events[0] and all("prompt_logprobs" not in e for e in events[1:])
    plain = (await live.http.post("/generate", json={"text": "x"})).json()
    assert "logprobs" not in plain and "prompt_logprobs" not in plain


# ---------------------------------------------------------------- hostile values


def _raw(body: dict[str, Any], **literals: str) -> bytes:
    """JSON text with some values written as raw literals (NaN, 1e999)."""
    text = json.dumps(body)
    for key, literal in literals.items():
        text = text.replace(f'"@{key}@"', literal)
    return text.encode()


COMPLETION = {"model": "test-model", "prompt": "hi", "max_tokens": 2}
CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
HOSTILE = [
    ("n huge", "/v1/completions", COMPLETION | {"n": 10**9}, "n"),
    ("n zero", "/v1/completions", COMPLETION | {"n": 0}, "n"),
    ("n over the bound", "/v1/chat/completions", CHAT | {"n": 17}, "n"),
    ("n times prompts", "/v1/completions", COMPLETION | {"prompt": ["a"] * 9, "n": 16}, "prompt"),
    ("best_of not n", "/v1/completions", COMPLETION | {"n": 2, "best_of": 3}, "best_of"),
    ("best_of huge", "/v1/completions", COMPLETION | {"best_of": 10**9}, "best_of"),
    ("logprobs too many", "/v1/completions", COMPLETION | {"logprobs": 21}, "logprobs"),
    ("logprobs negative", "/v1/completions", COMPLETION | {"logprobs": -1}, "logprobs"),
    ("top_logprobs negative", "/v1/chat/completions", CHAT | {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("top_logprobs too many", "/v1/chat/completions", CHAT | {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("top_logprobs alone", "/v1/chat/completions", CHAT | {"top_logprobs": 2}, "top_logprobs"),
    ("logprobs not a bool", "/v1/chat/completions", CHAT | {"logprobs": 5}, "logprobs"),
    ("logit_bias word key", "/v1/completions", COMPLETION | {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("logit_bias negative key", "/v1/completions", COMPLETION | {"logit_bias": {"-1": 1}}, "logit_bias"),
    ("logit_bias float key", "/v1/chat/completions", CHAT | {"logit_bias": {"1.5": 1}}, "logit_bias"),
    ("logit_bias huge key", "/v1/completions", COMPLETION | {"logit_bias": {"9" * 40: 1}}, "logit_bias"),
    ("logit_bias out of vocab", "/v1/completions", COMPLETION | {"logit_bias": {"99999": 1}}, "logit_bias"),
    ("logit_bias value", "/v1/completions", COMPLETION | {"logit_bias": {"5": 1000}}, "logit_bias"),
    ("logit_bias not a map", "/v1/completions", COMPLETION | {"logit_bias": [1, 2]}, "logit_bias"),
    ("presence too big", "/v1/completions", COMPLETION | {"presence_penalty": 3}, "presence_penalty"),
    ("frequency too small", "/v1/chat/completions", CHAT | {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("repetition zero", "/v1/completions", COMPLETION | {"repetition_penalty": 0}, "repetition_penalty"),
    ("min_tokens negative", "/v1/completions", COMPLETION | {"min_tokens": -1}, "min_tokens"),
    ("min_tokens over max", "/v1/completions", COMPLETION | {"min_tokens": 5}, "min_tokens"),
]  # fmt: skip
NAN_CASES = [
    ("presence NaN", "/v1/completions", "presence_penalty", "NaN"),
    ("frequency inf", "/v1/chat/completions", "frequency_penalty", "Infinity"),
    ("repetition NaN", "/v1/completions", "repetition_penalty", "NaN"),
    ("logit_bias NaN", "/v1/completions", "logit_bias", '{"5": NaN}'),
    ("repetition 1e999", "/v1/chat/completions", "repetition_penalty", "1e999"),
]


@module_loop
@pytest.mark.parametrize(
    ("path", "body", "param"), [c[1:] for c in HOSTILE], ids=[c[0] for c in HOSTILE]
)
async def test_hostile_sampling_values_are_400_naming_the_field(live, path, body, param):
    r = await live.http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


@module_loop
@pytest.mark.parametrize(
    ("path", "field", "literal"), [c[1:] for c in NAN_CASES], ids=[c[0] for c in NAN_CASES]
)
async def test_non_finite_penalties_are_400(live, path, field, literal):
    base = COMPLETION if path == "/v1/completions" else CHAT
    content = _raw(base | {field: "@x@"}, x=literal)
    r = await live.http.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(field), r.text


@module_loop
async def test_edge_values_are_served(live):
    # the largest seed with n > 1 wraps around instead of overflowing
    top = await live.client.completions.create(
        model="test-model", prompt="hi", max_tokens=2, n=2, seed=2**63 - 1, temperature=1.0
    )
    assert len(top.choices) == 2
    limits = await live.client.completions.create(
        model="test-model",
        prompt="hi",
        max_tokens=2,
        n=16,
        best_of=16,
        logprobs=20,
        echo=True,
        presence_penalty=-2,
        frequency_penalty=2,
        logit_bias={"0": -100, "259": 100},
    )
    assert len(limits.choices) == 16
    for choice in limits.choices:
        assert choice.logprobs is not None and choice.logprobs.top_logprobs is not None
        assert all(t is None or len(t) <= 21 for t in choice.logprobs.top_logprobs)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        await live.client.completions.create(
            model="test-model", prompt="hi", max_tokens=2, n=1, best_of=2
        )
    await asyncio.wait_for(live.engine.wait_idle(), 10)
    assert live.engine.pool_usage().all_free
    scrape = samples((await live.http.get("/metrics")).text)
    assert value(scrape, "stallfree:request_success_total", finished_reason="error") == 0


@module_loop
async def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(live):
    prompt = "Qz#7 usage probe: a prompt long enough to fill a few pages of the cache"
    first = await live.client.completions.create(
        model="test-model", prompt=prompt, max_tokens=2, temperature=0
    )
    again = await live.client.completions.create(
        model="test-model", prompt=prompt, max_tokens=2, temperature=0
    )
    before = first.usage.prompt_tokens_details.cached_tokens
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert before < 4  # no earlier request shared more than a few leading bytes
    # the second reads most of the prompt from the cache; its last token is always computed
    assert again.usage.prompt_tokens // 2 < cached < again.usage.prompt_tokens
    chat = await live.client.chat.completions.create(
        model="test-model",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    usages = [c.usage async for c in chat if c.usage is not None]
    assert len(usages) == 1 and usages[0].prompt_tokens_details is not None


# ---------------------------------------------------------------------- min_p


@module_loop
async def test_min_p_one_keeps_only_the_likeliest_token(live):
    """min_p = 1 leaves only the top token at any temperature: hot, seeded sampling then
    gives the greedy text; a small min_p leaves sampling free (it differs from greedy)."""
    base = {"model": "test-model", "prompt": PROMPT, "max_tokens": 12, **NO_EOS}
    greedy = await live.http.post("/v1/completions", json={**base, **GREEDY})
    hot = {**base, "temperature": 2.0, "seed": 3}
    cut = await live.http.post("/v1/completions", json={**hot, "min_p": 1.0})
    free = await live.http.post("/v1/completions", json={**hot, "min_p": 0.0001})
    assert greedy.status_code == cut.status_code == free.status_code == 200
    assert cut.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    assert free.json()["choices"][0]["text"] != greedy.json()["choices"][0]["text"]
    native = await live.http.post(
        "/generate",
        json={
            "text": PROMPT,
            "sampling_params": {
                "max_new_tokens": 12,
                "ignore_eos": True,
                "temperature": 2.0,
                "min_p": 1.0,
            },
        },
    )
    assert native.json()["text"] == greedy.json()["choices"][0]["text"]


@module_loop
@pytest.mark.parametrize("bad", [-0.1, 1.5, "x"])
async def test_a_bad_min_p_is_a_400_naming_it(live, bad):
    body = {"model": "test-model", "prompt": PROMPT, "max_tokens": 2, "min_p": bad}
    r = await live.http.post("/v1/completions", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "min_p"


# ---------------------------------------------------------------------- include_stop_str_in_output


@module_loop
async def test_include_stop_str_in_output_keeps_the_stop_string(live):
    base = {"model": "test-model", "prompt": PROMPT, "max_tokens": 24, **NO_EOS, **GREEDY}
    whole = (await live.http.post("/v1/completions", json=base)).json()["choices"][0]["text"]
    stop = whole[6:8]  # two characters the greedy text holds; it ends where they first appear
    cut = whole.index(stop)
    trimmed = await live.http.post("/v1/completions", json={**base, "stop": [stop]})
    kept = await live.http.post(
        "/v1/completions",
        json={**base, "stop": ["zzzz-never", stop], "include_stop_str_in_output": True},
    )
    assert trimmed.json()["choices"][0]["text"] == whole[:cut]
    assert kept.json()["choices"][0]["text"] == whole[: cut + len(stop)]
    assert kept.json()["choices"][0]["finish_reason"] == "stop"
    # streamed: the deltas add up to the same text
    streamed = await live.http.post(
        "/v1/completions",
        json={**base, "stop": [stop], "include_stop_str_in_output": True, "stream": True},
    )
    deltas = [
        json.loads(line[6:])["choices"][0]["text"]
        for line in streamed.text.splitlines()
        if line.startswith("data: {")
    ]
    assert "".join(deltas) == whole[: cut + len(stop)]
    # SGLang's spelling on /generate
    native = await live.http.post(
        "/generate",
        json={
            "text": PROMPT,
            "sampling_params": {
                "max_new_tokens": 24,
                "ignore_eos": True,
                "temperature": 0,
                "stop": [stop],
                "no_stop_trim": True,
            },
        },
    )
    assert native.json()["text"] == whole[: cut + len(stop)]


# ---------------------------------------------------------------------- allowed_token_ids


@module_loop
async def test_allowed_token_ids_limit_every_sampled_token(live):
    allowed = [40, 41, 97]
    hot = {"max_new_tokens": 24, "ignore_eos": True, "temperature": 1.5, "seed": 5}
    native = await live.http.post(
        "/generate",
        json={"text": PROMPT, "sampling_params": {**hot, "allowed_token_ids": allowed}},
    )
    ids = native.json()["output_ids"]
    assert len(ids) == 24 and set(ids) <= set(allowed) and len(set(ids)) > 1
    free = await live.http.post("/generate", json={"text": PROMPT, "sampling_params": hot})
    assert not set(free.json()["output_ids"]) <= set(allowed)  # the limit did the work
    one = await live.http.post(
        "/v1/completions",
        json={
            "model": "test-model",
            "prompt": PROMPT,
            "max_tokens": 5,
            "allowed_token_ids": [97],
            **NO_EOS,
            **GREEDY,
        },
    )
    assert one.json()["choices"][0]["text"] == "aaaaa"  # token 97 is the byte "a"


@module_loop
@pytest.mark.parametrize("bad", [[10**6], [-1], []])
async def test_bad_allowed_token_ids_are_a_400(live, bad):
    body = {"model": "test-model", "prompt": PROMPT, "max_tokens": 2, "allowed_token_ids": bad}
    r = await live.http.post("/v1/completions", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"].startswith("allowed_token_ids")


# ---------------------------------------------------------------------- truncate_prompt_tokens


@module_loop
async def test_truncate_prompt_tokens_keeps_the_last_tokens(live):
    ids = list(range(65, 65 + 20))  # "ABCD...": 20 byte tokens
    base = {"model": "test-model", "max_tokens": 4, **NO_EOS, **GREEDY}
    cut = await live.http.post(
        "/v1/completions",
        json={**base, "prompt": ids, "truncate_prompt_tokens": 6, "echo": True},
    )
    tail = await live.http.post("/v1/completions", json={**base, "prompt": ids[-6:]})
    assert cut.status_code == 200, cut.text
    assert cut.json()["usage"]["prompt_tokens"] == 6
    text = cut.json()["choices"][0]["text"]
    assert text == "OPQRST" + tail.json()["choices"][0]["text"]  # echo shows what was kept
    whole = await live.http.post(
        "/v1/completions", json={**base, "prompt": ids, "truncate_prompt_tokens": -1}
    )
    assert whole.json()["usage"]["prompt_tokens"] == 20  # -1: as much as the context holds
    chat = await live.http.post(
        "/v1/chat/completions",
        json={
            **base,
            "messages": [{"role": "user", "content": "a long question"}],
            "truncate_prompt_tokens": 3,
        },
    )
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == 3
    for bad in (0, -2):
        r = await live.http.post(
            "/v1/completions", json={**base, "prompt": ids, "truncate_prompt_tokens": bad}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
