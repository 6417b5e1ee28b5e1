"""Every request limit of the engine API at its edge: the value just served and the one just
refused (issue 42, "every limit tested at its edge"). The numbers are written out, not read
from the constants, so moving a limit by one fails here.

The pools: a KV cache of 64 tokens under a context of 100 (the KV cache binds), and a context
of 48 over the default pool (the context binds)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from stallfree import Engine, InvalidRequestError, SamplingParams
from tests.engine_util import engine_config

NO_EOS = {"ignore_eos": True}
KV = 64
CONTEXT = 48


@pytest.fixture
async def kv_bound(llama: str):
    cfg = engine_config(llama, model={"max_context_len": 100}, cache={"max_total_tokens": KV})
    async with Engine(cfg) as engine:
        assert (engine.validator.kv_tokens, engine.max_context_len) == (KV, 100)
        yield engine
        assert engine.pool_usage().all_free


@pytest.fixture
async def context_bound(llama: str):
    async with Engine(engine_config(llama, model={"max_context_len": CONTEXT})) as engine:
        assert engine.validator.kv_tokens > CONTEXT
        yield engine
        assert engine.pool_usage().all_free


async def _refused(engine: Engine, prompt: list[int], params: dict[str, Any]) -> Any:
    with pytest.raises(InvalidRequestError) as err:
        await engine.complete(prompt, params)
    return err.value


# ---------------------------------------------------------------- the KV cache


@pytest.mark.parametrize("max_new_tokens", [1, 10**9], ids=["one", "as-many-as-fit"])
async def test_a_prompt_one_short_of_the_kv_cache_is_served_and_one_of_its_size_is_not(
    kv_bound: Engine, max_new_tokens: int
) -> None:
    """A prompt of the KV cache's size leaves no slot for a new token: it could never finish."""
    served = await kv_bound.complete([1] * (KV - 1), {"max_new_tokens": max_new_tokens, **NO_EOS})
    assert (served.finish_reason, served.completion_tokens) == ("length", 1)
    err = await _refused(kv_bound, [1] * KV, {"max_new_tokens": max_new_tokens, **NO_EOS})
    assert (err.code, err.param) == ("kv_capacity_exceeded", "prompt")
    assert f"has {KV} tokens; the KV cache holds {KV} tokens" in err.message
    with pytest.raises(InvalidRequestError) as check:
        kv_bound.validator.check_prompt([1] * KV)
    assert check.value.code == "kv_capacity_exceeded"
    kv_bound.validator.check_prompt([1] * (KV - 1))


async def test_max_tokens_that_fill_the_kv_cache_are_served_and_one_more_is_not(
    kv_bound: Engine,
) -> None:
    prompt = [1] * 10
    served = await kv_bound.complete(prompt, {"max_new_tokens": KV - 10, **NO_EOS})
    assert (served.finish_reason, served.completion_tokens) == ("length", KV - 10)
    err = await _refused(kv_bound, prompt, {"max_new_tokens": KV - 10 + 1, **NO_EOS})
    assert (err.code, err.param) == ("kv_capacity_exceeded", "max_tokens")
    kv_bound.validator.check_prompt(prompt, KV - 10)
    with pytest.raises(InvalidRequestError) as check:
        kv_bound.validator.check_prompt(prompt, KV - 10 + 1)
    assert (check.value.code, check.value.param) == ("kv_capacity_exceeded", "max_tokens")


# ---------------------------------------------------------------- the context


async def test_a_prompt_one_short_of_the_context_is_served_and_one_of_its_length_is_not(
    context_bound: Engine,
) -> None:
    served = await context_bound.complete([1] * (CONTEXT - 1), {"max_new_tokens": 1, **NO_EOS})
    assert (served.finish_reason, served.completion_tokens) == ("length", 1)
    err = await _refused(context_bound, [1] * CONTEXT, {"max_new_tokens": 1, **NO_EOS})
    assert (err.code, err.param) == ("context_length_exceeded", "prompt")
    assert f"maximum context length is {CONTEXT} tokens" in err.message


async def test_max_tokens_that_fill_the_context_are_served_and_one_more_is_refused_or_capped(
    context_bound: Engine,
) -> None:
    """The explicit check (the OpenAI routes') refuses one token past the context; `generate`
    reads it as "as many as fit" and caps it."""
    prompt = [1] * 10
    context_bound.validator.check_prompt(prompt, CONTEXT - 10)
    with pytest.raises(InvalidRequestError) as check:
        context_bound.validator.check_prompt(prompt, CONTEXT - 10 + 1)
    assert (check.value.code, check.value.param) == ("context_length_exceeded", "max_tokens")
    assert f"at most {CONTEXT - 10} new tokens fit" in check.value.message
    for asked in (CONTEXT - 10, CONTEXT - 10 + 1):
        out = await context_bound.complete(prompt, {"max_new_tokens": asked, **NO_EOS})
        assert (out.finish_reason, out.completion_tokens) == ("length", CONTEXT - 10)


# ---------------------------------------------------------------- sampling parameters


@pytest.mark.parametrize(
    ("field", "served", "refused"),
    [
        ("max_new_tokens", {"max_new_tokens": 1}, {"max_new_tokens": 0}),
        ("max_new_tokens", {"max_new_tokens": 2**31 - 1}, {"max_new_tokens": 2**31}),
        ("stop", {"stop": [f"s{i}" for i in range(64)]}, {"stop": [f"s{i}" for i in range(65)]}),
        ("stop", {"stop": ["x" * 512]}, {"stop": ["x" * 513]}),
        ("stop", {"stop": ["x"]}, {"stop": [""]}),
        ("logprobs", {"logprobs": 20}, {"logprobs": 21}),
        ("logprobs", {"logprobs": 0}, {"logprobs": -1}),
        ("prompt_logprobs", {"prompt_logprobs": 20}, {"prompt_logprobs": 21}),
        ("stop_token_ids", {"stop_token_ids": [5] * 256}, {"stop_token_ids": [5] * 257}),
        ("min_tokens", {"min_tokens": 4}, {"min_tokens": 5}),
    ],
    ids=[
        "max-tokens-low",
        "max-tokens-high",
        "stop-count",
        "stop-length",
        "stop-empty",
        "logprobs-high",
        "logprobs-low",
        "prompt-logprobs",
        "stop-token-ids",
        "min-tokens",
    ],
)
async def test_each_sampling_bound_serves_its_edge_and_refuses_one_past(
    context_bound: Engine, field: str, served: dict[str, Any], refused: dict[str, Any]
) -> None:
    params = {"max_new_tokens": 4, **NO_EOS}
    out = await context_bound.complete([1, 2, 3], params | served)
    assert out.finish_reason == "length" and out.error is None
    with pytest.raises((ValidationError, InvalidRequestError)) as err:
        await context_bound.complete([1, 2, 3], params | refused)
    if isinstance(err.value, ValidationError):
        assert [e["loc"][0] for e in err.value.errors()] == [field]
    else:
        assert err.value.param == field
    SamplingParams(**(params | served))
    if logprobs := served.get("logprobs"):
        assert out.logprobs is not None and all(len(t.top) == logprobs for t in out.logprobs)
