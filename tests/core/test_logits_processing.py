"""Logit bias, min_tokens, penalties and logprobs, checked against transformers.

Penalties are compared with transformers' logits processors (RepetitionPenalty, MinNewTokens,
SequenceBias, and an OpenAI-formula presence/frequency processor written here), greedy, token for
token, in all four overlap × mirrors modes and under chunked prefill with retraction, with the
read guard on: the penalty state never costs a device read on the schedule path.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from stallfree import Engine, SamplingParams
from stallfree.runtime.request.errors import InvalidRequestError
from tests.engine_util import MODES, engine_config, guarded, random_prompts
from tests.hf_models import EOS_ID, _load_hf, hf_logits, make_qwen2

NEW_TOKENS = 16
PROMPTS = random_prompts(6, seed=7, lo=5, hi=40)

# one setting per prompt, so one batch mixes rows with and without each feature
CASES: list[dict] = [
    {"repetition_penalty": 1.3},
    {"presence_penalty": 0.8, "frequency_penalty": 0.6},
    {},
    {"logit_bias": {11: 3.0, 17: -5.0}, "repetition_penalty": 0.8},
    {"presence_penalty": -1.5, "frequency_penalty": 2.0, "repetition_penalty": 1.1},
    # EOS pushed up: without min_tokens the output would end at once
    {"logit_bias": {EOS_ID: 40.0}, "min_tokens": 5},
]


class _PresenceFrequency:
    """OpenAI's formula over the generated tokens only: logit -= count·f + (count > 0)·p."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        out = input_ids[:, self.prompt_len :]
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence


def hf_processed_greedy(path, prompt: list[int], case: dict, new_tokens: int) -> list[int]:
    from transformers import (
        GenerationConfig,
        LogitsProcessorList,
        MinNewTokensLengthLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    model = _load_hf(str(path))
    processors = LogitsProcessorList()
    # stallfree's order, as vLLM's: bias and min_tokens masks, then repetition, then
    # frequency and presence
    if case.get("logit_bias"):
        bias = {(tok,): value for tok, value in case["logit_bias"].items()}
        processors.append(SequenceBiasLogitsProcessor(sequence_bias=bias))
    if case.get("min_tokens"):
        processors.append(
            MinNewTokensLengthLogitsProcessor(len(prompt), case["min_tokens"], EOS_ID)
        )
    if case.get("repetition_penalty", 1.0) != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(case["repetition_penalty"]))
    if case.get("presence_penalty") or case.get("frequency_penalty"):
        processors.append(
            _PresenceFrequency(
                len(prompt), case.get("presence_penalty", 0.0), case.get("frequency_penalty", 0.0)
            )
        )
    stops = "min_tokens" in case  # that case is about EOS; the others run to the length
    gen = GenerationConfig(
        do_sample=False,
        max_new_tokens=new_tokens,
        eos_token_id=EOS_ID if stops else None,
        pad_token_id=EOS_ID,
    )
    model.generation_config.eos_token_id = None
    inputs = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            generation_config=gen,
            logits_processor=processors,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def _params(case: dict) -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos="min_tokens" not in case, **case)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_and_reference(request, tmp_path_factory):
    if request.param == "llama":
        path = Path(request.getfixturevalue("llama"))  # the suite's one tiny Llama
    else:
        path = make_qwen2(tmp_path_factory.mktemp(request.param))
    reference = [
        hf_processed_greedy(path, p, case, NEW_TOKENS)
        for p, case in zip(PROMPTS, CASES, strict=True)
    ]
    return str(path), reference


STRESSED = {
    "cache": {"page_size": 4, "max_total_tokens": 160, "max_running_requests": 6},
    "scheduler": {"chunked_prefill_size": 7, "max_prefill_tokens": 16},
}


@pytest.mark.parametrize("stressed", [False, True], ids=["roomy", "stressed"])
@pytest.mark.parametrize(("overlap", "mirrors"), MODES)
async def test_penalties_equal_transformers_processors(
    model_and_reference, overlap, mirrors, stressed
):
    path, reference = model_and_reference
    sections = STRESSED if stressed else {}
    cfg = engine_config(
        path, runtime={"overlap": overlap, "cpu_mirrors": mirrors, "strict": mirrors}, **sections
    )
    async with guarded(Engine(cfg)) as engine:
        results = await asyncio.gather(
            *(engine.complete(p, _params(c)) for p, c in zip(PROMPTS, CASES, strict=True))
        )
        await engine.wait_idle()
        assert engine.pool_usage().all_free
        counters = engine.snapshot().counters
        monitor = engine.core.monitor
    for i, (got, want) in enumerate(zip(results, reference, strict=True)):
        assert got.token_ids == want, f"prompt {i} with {CASES[i]} diverged"
    # the min_tokens case: exactly min_tokens outputs, then the boosted EOS
    eos_case = results[-1].token_ids
    assert len(eos_case) == CASES[-1]["min_tokens"] + 1 and eos_case[-1] == EOS_ID
    assert results[-1].finish_reason == "stop"
    if stressed:
        assert counters.retractions > 0  # penalty rows were rebuilt from host outputs
    if mirrors:
        assert monitor.schedule_path_reads == 0
        assert monitor.total_stalls() == 0


async def test_penalties_change_the_output(model_and_reference):
    """The comparison above could pass with penalties ignored only if they changed nothing."""
    path, _ = model_and_reference
    async with Engine(engine_config(path)) as engine:
        plain = await engine.complete(PROMPTS[0], SamplingParams(max_new_tokens=NEW_TOKENS))
        for case in CASES[:2]:
            got = await engine.complete(PROMPTS[0], _params(case))
            assert got.token_ids != plain.token_ids, case


@pytest.mark.parametrize(("overlap", "chunk"), [(True, 3), (False, 64)], ids=["overlap", "plain"])
async def test_logprobs_equal_transformers_log_softmax(model_and_reference, overlap, chunk):
    path, _ = model_and_reference
    cfg = engine_config(
        path,
        runtime={"overlap": overlap, "strict": True},
        scheduler={"chunked_prefill_size": chunk, "max_prefill_tokens": max(chunk, 16)},
    )
    prompt = PROMPTS[1]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=4, prompt_logprobs=3)
    async with guarded(Engine(cfg)) as engine:
        first = await engine.complete(prompt, params)
        again = await engine.complete(prompt, params)  # the prompt is cached now
        await engine.wait_idle()
        assert engine.pool_usage().all_free
    ids = prompt + first.token_ids
    want = torch.log_softmax(hf_logits(path, ids), dim=-1)
    assert first.logprobs is not None and first.prompt_logprobs is not None
    assert len(first.logprobs) == 6
    for i, entry in enumerate(first.logprobs):
        pos = len(prompt) + i - 1
        assert entry.token_id == first.token_ids[i]
        assert math.isclose(entry.logprob, float(want[pos, entry.token_id]), abs_tol=1e-4)
        top_ids = want[pos].topk(4).indices.tolist()
        assert [t for t, _ in entry.top] == top_ids
        for tok, lp in entry.top:
            assert math.isclose(lp, float(want[pos, tok]), abs_tol=1e-4)
        assert entry.top[0][0] == entry.token_id  # greedy took the most likely token
    assert len(first.prompt_logprobs) == len(prompt) and first.prompt_logprobs[0] is None
    for j, entry in enumerate(first.prompt_logprobs[1:], start=1):
        assert entry is not None and entry.token_id == prompt[j]
        assert math.isclose(entry.logprob, float(want[j - 1, prompt[j]]), abs_tol=1e-4)
        assert [t for t, _ in entry.top] == want[j - 1].topk(3).indices.tolist()
    # prompt logprobs bypass the prefix cache: the second run scored every prompt token again
    assert again.prompt_logprobs == first.prompt_logprobs
    assert again.cached_tokens == 0


async def test_logprobs_without_alternatives_and_per_row_counts(model_and_reference):
    path, _ = model_and_reference
    async with Engine(engine_config(path)) as engine:
        a, b, c = await asyncio.gather(
            engine.complete(PROMPTS[0], SamplingParams(max_new_tokens=4, logprobs=0)),
            engine.complete(PROMPTS[1], SamplingParams(max_new_tokens=4, logprobs=5)),
            engine.complete(PROMPTS[2], SamplingParams(max_new_tokens=4)),
        )
    assert a.logprobs is not None and all(e.top == [] for e in a.logprobs)
    assert b.logprobs is not None and all(len(e.top) == 5 for e in b.logprobs)
    assert c.logprobs is None and c.prompt_logprobs is None
    assert all(e.logprob <= 0.0 for e in a.logprobs + b.logprobs)


async def test_streamed_chunks_carry_logprobs_for_their_tokens(model_and_reference):
    path, _ = model_and_reference
    async with Engine(engine_config(path)) as engine:
        params = SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=0)
        chunks = [c async for c in engine.generate(PROMPTS[3], params)]
    assert sum(len(c.token_ids) for c in chunks) == 8
    for c in chunks:
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        assert [e.token_id for e in c.logprobs] == c.token_ids
    with_prompt = [c for c in chunks if c.prompt_logprobs is not None]
    assert len(with_prompt) == 1 and with_prompt[0] is chunks[0]
    assert len(with_prompt[0].prompt_logprobs) == len(PROMPTS[3])


async def test_min_tokens_holds_back_stop_strings(llama):
    path = llama
    async with Engine(engine_config(path)) as engine:
        plain = await engine.complete(
            PROMPTS[0], SamplingParams(max_new_tokens=12, ignore_eos=True)
        )
        stop = engine.tokenizer.decode(plain.token_ids[1:2])
        assert stop
        early = await engine.complete(
            PROMPTS[0], SamplingParams(max_new_tokens=12, ignore_eos=True, stop=[stop])
        )
        held = await engine.complete(
            PROMPTS[0],
            SamplingParams(max_new_tokens=12, ignore_eos=True, stop=[stop], min_tokens=8),
        )
    assert early.finish_reason == "stop" and len(early.token_ids) <= 2
    assert len(held.token_ids) >= 8
    assert held.token_ids[:8] == plain.token_ids[:8]


async def test_bad_values_are_refused_with_the_field(llama):
    path = llama
    for bad in (
        {"presence_penalty": float("nan")},
        {"frequency_penalty": 2.5},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": float("inf")},
        {"logit_bias": {1: 101.0}},
        {"logit_bias": {1: float("nan")}},
        {"logit_bias": {-1: 1.0}},
        {"logprobs": 21},
        {"prompt_logprobs": -1},
        {"min_tokens": -1},
    ):
        with pytest.raises(ValidationError) as info:
            SamplingParams(**bad)
        assert next(iter(bad)) in str(info.value)
    async with Engine(engine_config(path)) as engine:
        with pytest.raises(InvalidRequestError) as refused:
            await engine.complete([1, 2, 3], {"logit_bias": {10**6: 1.0}})
        assert refused.value.param == "logit_bias"
        with pytest.raises(InvalidRequestError) as refused:
            await engine.complete([1, 2, 3], {"max_new_tokens": 4, "min_tokens": 5})
        assert refused.value.param == "min_tokens"
        ok = await engine.complete([1, 2, 3], {"max_new_tokens": 3})  # still serving
        assert len(ok.token_ids) >= 1
        await engine.wait_idle()
        assert engine.pool_usage().all_free


def test_frequency_and_presence_penalties_are_told_apart():
    """Token 5 three times and token 7 once in the output: a presence penalty takes p once from
    each, a frequency penalty f per occurrence. Swapped in the plan, the rows would differ."""
    from stallfree.runtime.execution.logits import build_logits_plan
    from stallfree.runtime.execution.logits_processor import StepRows
    from stallfree.runtime.execution.processors import LogitsProcessors
    from stallfree.runtime.request.req import Req

    vocab = 12
    reqs = []
    for slot, penalties in enumerate(
        [
            {"presence_penalty": 0.5},
            {"frequency_penalty": 0.5},
            {"presence_penalty": 0.25, "frequency_penalty": 1.0},
        ]
    ):
        req = Req(
            rid=f"r{slot}",
            origin_input_ids=[1, 2],
            sampling_params=SamplingParams(max_new_tokens=8, **penalties),
        )
        req.req_pool_idx = slot
        req.output_ids = [5, 5, 5, 7]
        reqs.append(req)
    plan = build_logits_plan(StepRows(reqs, [True] * 3, [4] * 3), None, lambda t: t)
    assert plan is not None
    out = LogitsProcessors(3).apply(torch.zeros(3, vocab), plan.parts)
    expected = torch.zeros(3, vocab)
    expected[0, 5], expected[0, 7] = -0.5, -0.5  # presence: once per token present
    expected[1, 5], expected[1, 7] = -1.5, -0.5  # frequency: per occurrence
    expected[2, 5], expected[2, 7] = -3.25, -1.25  # both: 3f + p, f + p
    torch.testing.assert_close(out, expected)
