"""LoRA with the rest of the engine: chunked prefill and retraction in every overlap x mirrors
mode, speculative decoding (ngram, and a draft model that runs without adapters), and
structured outputs."""

from __future__ import annotations

import asyncio
import json

import pytest

from stallfree import Engine, SamplingParams
from tests.engine_util import MODES, guarded
from tests.lora.test_lora_engine import NAMES, NEW_TOKENS, PROMPTS, lora_config
from tests.lora_models import ADAPTERS, make_adapter, merged_greedy

# page_size > 1, prefill chunks of 7 tokens, a pool small enough to force retraction
STRESSED = {
    "cache": {"page_size": 4, "max_total_tokens": 192, "max_running_requests": 8},
    "scheduler": {"chunked_prefill_size": 7, "max_prefill_tokens": 16},
}
# a prompt that repeats itself, so prompt lookup proposes drafts that are accepted
REPEAT = [7, 8, 9, 10, 11] * 6


@pytest.fixture(scope="module")
def adapters(llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: str(make_adapter(llama, root / name, seed=i, **cfg))
        for i, (name, cfg) in enumerate(ADAPTERS.items())
    }


async def complete_all(engine: Engine, prompts, params: SamplingParams) -> list[list[int]]:
    names = NAMES
    results = await asyncio.gather(
        *(engine.complete(p, params, lora_name=names[i % 4]) for i, p in enumerate(prompts))
    )
    for r in results:
        assert r.error is None, r.error
    return [r.token_ids for r in results]


@pytest.mark.parametrize(("overlap", "mirrors"), MODES)
async def test_chunked_prefill_and_retraction_keep_each_rows_adapter(
    llama, adapters, overlap, mirrors
):
    runtime = {"overlap": overlap, "cpu_mirrors": mirrors, "strict": mirrors}
    cfg = lora_config(llama, adapters, runtime=runtime, **STRESSED)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    async with guarded(Engine(cfg)) as engine:
        outputs = await complete_all(engine, PROMPTS, params)
        await engine.wait_idle()
        assert engine.pool_usage().all_free and engine.lora.held() == 0
        counters = engine.snapshot().counters
    assert counters.retractions > 0  # the stress did retract (and re-prefill under the adapter)
    for i, (p, got) in enumerate(zip(PROMPTS, outputs, strict=True)):
        want = merged_greedy(llama, adapters.get(NAMES[i % 4] or ""), p, NEW_TOKENS)
        assert got == want, f"prompt {i} under {NAMES[i % 4]} diverged"


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
async def test_speculative_decoding_under_adapters(llama, adapters, method):
    """Greedy speculation changes no token: the verify step runs each row's adapter; the draft
    model (the base itself here) proposes without adapters."""
    prompts = [REPEAT, *PROMPTS[:3]]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    f64 = {"dtype": "float64"}
    plain = lora_config(llama, adapters, model=f64)
    spec = {"method": method, "num_speculative_tokens": 3, "cost_aware": False, "adaptive": False}
    if method == "ngram":
        spec["prompt_lookup_max"] = 3
    else:
        spec["draft_model"] = llama
    speculating = lora_config(llama, adapters, model=f64, speculative=spec)
    async with Engine(plain) as engine:
        want = await complete_all(engine, prompts, params)
    async with Engine(speculating) as engine:
        got = await complete_all(engine, prompts, params)
        await engine.wait_idle()
        snap = engine.snapshot()
        assert engine.pool_usage().all_free and engine.lora.held() == 0
    assert got == want
    assert snap.spec is not None and snap.spec.num_drafts > 0  # verify steps ran
    if method == "draft_model":  # the base row takes the base model's drafts
        assert snap.spec.num_accepted_tokens > 0


async def test_structured_outputs_under_an_adapter(llama, adapters):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    params = SamplingParams(max_new_tokens=24, structured_outputs={"json": schema})
    async with Engine(lora_config(llama, adapters)) as engine:
        results = await asyncio.gather(*(engine.complete("x", params, lora_name=n) for n in NAMES))
        await engine.wait_idle()
        assert engine.pool_usage().all_free and engine.lora.held() == 0
    for r in results:
        assert r.error is None, r.error
        if r.finish_reason == "stop":
            assert isinstance(json.loads(r.text)["a"], int)
    assert any(r.finish_reason == "stop" for r in results)
