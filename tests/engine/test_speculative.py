"""Speculative decoding through the engine: lossless greedy output in every mode, acceptance
where it should be, limits inside the draft window, memory back to full, and no schedule-path
device read under overlap.

The models are float64: a `k + 1`-position verify forward and a one-position decode forward
sum in different orders, and only in float64 are those differences far below any gap between
two logits, so greedy equality can be exact.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from stallfree import Engine, SamplingParams
from stallfree.runtime.request.req import Req
from tests.engine_util import MODES, engine_config, guarded, random_prompts

# NOTE: in the slow set (CI runs it as its own step). Run in one process before
# tests/serving/test_offloop.py, this module left that timing test's /health reads timing out
# (each half alone does not); not understood yet, so they run apart.
pytestmark = pytest.mark.slow

F64 = {"dtype": "float64"}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}

# a prompt that repeats a passage: prompt lookup finds it, and the model copies it
REPEAT = [7, 19, 33, 41, 52, 60, 71, 85, 90, 101, 113, 127] * 4


def method_spec(method: str, model: str, k: int) -> dict[str, Any]:
    """The n-gram section, or a draft-model one whose draft is `model` itself."""
    if method == "ngram":
        return {**NGRAM, "num_speculative_tokens": k}
    return {"method": "draft_model", "draft_model": model, "num_speculative_tokens": k}


def spec_config(path: str, spec: dict[str, Any] | None, **sections: dict[str, Any]):
    """Float64, and (unless `spec` says otherwise) drafts not left to measured step costs,
    which are noise for a tiny model: the drafts each test sees are the same every run."""
    sections.setdefault("model", {}).update(F64)
    if spec is not None:
        sections["speculative"] = {"cost_aware": False, **spec}
    return engine_config(path, **sections)


async def run_all(
    engine: Engine, prompts: list[list[int]], max_new_tokens: int, **params: Any
) -> list[list[int]]:
    sp = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, **params)
    results = await asyncio.gather(*(engine.complete(p, sp) for p in prompts))
    for r in results:
        assert r.error is None, r.error
    return [r.token_ids for r in results]


async def generate(config, prompts, max_new_tokens, **params):
    async with Engine(config) as engine:
        out = await run_all(engine, prompts, max_new_tokens, **params)
        await engine.wait_idle()
        return out, engine.snapshot()


@pytest.fixture(scope="module")
def workload() -> list[list[int]]:
    return [*random_prompts(5, seed=3, lo=5, hi=40), REPEAT]


# the stress every equality run carries: chunked prefill, a pool small enough to retract,
# and the prefix cache
def stressed(page_size: int) -> dict[str, dict[str, Any]]:
    return {
        "cache": {"page_size": page_size, "max_total_tokens": 224, "prefix_caching": True},
        "scheduler": {"chunked_prefill_size": 16, "max_prefill_tokens": 32},
        "runtime": {"check_mirrors": True},
    }


_REFERENCE: dict[tuple[str, int], list[list[int]]] = {}


async def reference(model: str, workload: list[list[int]], page_size: int) -> list[list[int]]:
    key = (model, page_size)
    if key not in _REFERENCE:
        cfg = spec_config(model, None, **stressed(page_size))
        _REFERENCE[key], _ = await generate(cfg, workload, 40)
    return _REFERENCE[key]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("overlap,mirrors", MODES)
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
async def test_greedy_output_is_the_same_with_speculation(
    llama, workload, method, overlap, mirrors, page_size
):
    ref = await reference(llama, workload, page_size)
    spec = method_spec(method, llama, 3)
    sections = stressed(page_size)
    sections["runtime"].update(overlap=overlap, cpu_mirrors=mirrors)
    out, snap = await generate(spec_config(llama, spec, **sections), workload, 40)
    assert out == ref
    assert snap.pools.all_free
    assert snap.counters.retractions > 0  # the small pool retracted mid-window
    assert snap.counters.prefix_cache_hits > 0  # REPEAT's own prefix
    assert snap.spec is not None and snap.spec.num_accepted_tokens > 0
    if method == "draft_model":  # the draft is the target: every draft is accepted
        assert snap.spec.num_accepted_tokens == snap.spec.num_draft_tokens


# ---------------------------------------------------------------------------- acceptance


async def test_random_prompts_accept_little_and_turn_speculation_off(llama):
    prompts = random_prompts(4, seed=11, lo=20, hi=40)
    ref, _ = await generate(spec_config(llama, None), prompts, 48)
    out, snap = await generate(spec_config(llama, NGRAM), prompts, 48)
    assert out == ref
    assert snap.spec is not None and snap.spec.num_draft_tokens > 0
    assert snap.spec.acceptance_rate < 0.35
    assert snap.spec.requests_disabled >= 1
    assert snap.counters.spec_requests_disabled == snap.spec.requests_disabled


@pytest.fixture(scope="module")
def bigram_llama(llama, tmp_path_factory) -> str:
    """The tiny Llama with every attention and MLP output zeroed: the residual stream is the
    current token's embedding, so the next token is a fixed function of the current one, and
    greedy text soon cycles. Text that repeats, from a real (if degenerate) model."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    out = tmp_path_factory.mktemp("bigram") / "llama"
    model.save_pretrained(out, safe_serialization=True)
    from tests.hf_models import write_tokenizer

    write_tokenizer(out)
    return str(out)


async def test_repetitive_text_is_accepted_and_takes_fewer_steps(bigram_llama):
    prompt = await cycling_prompt(bigram_llama)  # the model's own walk: it is in its cycle
    ref, base = await generate(spec_config(bigram_llama, None), [prompt], 40)
    out, snap = await generate(spec_config(bigram_llama, NGRAM), [prompt], 40)
    assert out == ref
    assert snap.spec is not None and snap.spec.acceptance_rate > 0.8
    assert snap.spec.mean_acceptance_length > 3.0
    assert snap.spec.requests_disabled == 0
    # several tokens per verify step: under half the decode steps
    assert snap.counters.decode_batches < base.counters.decode_batches * 0.5


async def test_cost_aware_speculation_gives_the_same_output(llama, workload):
    """With step costs measured (the default) the drafts depend on timing; the output does
    not."""
    ref = await reference(llama, workload, 1)
    spec = {**NGRAM, "cost_aware": True}
    out, snap = await generate(spec_config(llama, spec, **stressed(1)), workload, 40)
    assert out == ref
    assert snap.pools.all_free


async def test_without_adaptive_every_request_keeps_proposing(llama):
    prompts = random_prompts(3, seed=11, lo=20, hi=40)
    spec = {**NGRAM, "adaptive": False}
    _, snap = await generate(spec_config(llama, spec), prompts, 32)
    assert snap.spec is not None and snap.spec.requests_disabled == 0


# ---------------------------------------------------------------------------- limits in the window


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5, 7])
async def test_max_new_tokens_is_exact_when_k_exceeds_what_remains(llama, max_new_tokens):
    spec = {**NGRAM, "num_speculative_tokens": 6}
    async with Engine(spec_config(llama, spec)) as engine:
        r = await engine.complete(
            REPEAT, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        )
        assert len(r.token_ids) == max_new_tokens and r.finish_reason == "length"
        await engine.wait_idle()
        assert engine.pool_usage().all_free


async def test_the_context_limit_is_exact_inside_the_window(llama):
    spec = {**NGRAM, "num_speculative_tokens": 6}
    cfg = spec_config(llama, spec, model={"max_context_len": len(REPEAT) + 5})
    async with Engine(cfg) as engine:
        r = await engine.complete(REPEAT, SamplingParams(max_new_tokens=5, ignore_eos=True))
        assert len(r.token_ids) == 5
        await engine.wait_idle()
        assert engine.pool_usage().all_free


async def cycling_prompt(model: str) -> list[int]:
    (walk,), _ = await generate(spec_config(model, None), [[3]], 40)
    return [3, *walk]


@pytest.mark.parametrize("stop_at", [5, 6, 7])
async def test_a_stop_token_inside_the_window_ends_the_request_there(bigram_llama, stop_at):
    prompt = await cycling_prompt(bigram_llama)
    ref, _ = await generate(spec_config(bigram_llama, None), [prompt], 30)
    tok = ref[0][stop_at]  # every token here comes from a window of accepted drafts
    first = ref[0].index(tok)
    async with Engine(spec_config(bigram_llama, NGRAM)) as engine:
        sp = SamplingParams(max_new_tokens=30, stop_token_ids=[tok], ignore_eos=True)
        r = await engine.complete(prompt, sp)
        assert r.token_ids == ref[0][: first + 1] and r.finish_reason == "stop"
        snap = engine.snapshot()
        assert snap.spec is not None and snap.spec.num_accepted_tokens > 0
        await engine.wait_idle()
        assert engine.pool_usage().all_free


async def test_a_stop_string_inside_the_window_ends_the_request_there(bigram_llama):
    prompt = await cycling_prompt(bigram_llama)
    async with Engine(spec_config(bigram_llama, None)) as engine:
        ref = await engine.complete(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
    stop = ref.text[6:10]
    assert stop
    async with Engine(spec_config(bigram_llama, None)) as engine:
        sp = SamplingParams(max_new_tokens=30, stop=[stop], ignore_eos=True)
        plain = await engine.complete(prompt, sp)
    async with Engine(spec_config(bigram_llama, NGRAM)) as engine:
        r = await engine.complete(prompt, sp)
        assert r.finish_reason == "stop" and stop not in r.text
        assert (r.text, r.token_ids) == (plain.text, plain.token_ids)
        await engine.wait_idle()
        assert engine.pool_usage().all_free


async def test_logits_processing_applies_per_accepted_position(llama):
    """Penalties, min_tokens, logit_bias and logprobs with speculation on: the same tokens
    and logprobs as without (rows that need the exact output index carry no drafts)."""
    cases = [
        {"frequency_penalty": 0.7, "presence_penalty": 0.3},
        {"repetition_penalty": 1.3},
        {"min_tokens": 12, "stop_token_ids": [REPEAT[3]]},
        {"logit_bias": {REPEAT[5]: 4.0}},
        {"logprobs": 2},
    ]
    for params in cases:
        sp = SamplingParams(max_new_tokens=20, **params)
        async with Engine(spec_config(llama, None)) as engine:
            want = await engine.complete(REPEAT, sp)
        async with Engine(spec_config(llama, NGRAM)) as engine:
            got = await engine.complete(REPEAT, sp)
            await engine.wait_idle()
            assert engine.pool_usage().all_free
        assert got.token_ids == want.token_ids, params
        if "logprobs" in params:
            assert got.logprobs is not None and want.logprobs is not None
            assert len(got.logprobs) == len(want.logprobs) == len(got.token_ids)
            for a, b in zip(got.logprobs, want.logprobs, strict=True):
                assert a.token_id == b.token_id
                assert a.logprob == pytest.approx(b.logprob, abs=1e-9)


# ---------------------------------------------------------------------------- memory


async def test_abort_mid_window_returns_every_page(llama):
    async with Engine(spec_config(llama, NGRAM)) as engine:
        chunks = engine.generate(
            REPEAT, SamplingParams(max_new_tokens=200, ignore_eos=True), rid="x"
        )
        got = 0
        async for chunk in chunks:
            got += len(chunk.token_ids)
            if got >= 6:
                assert engine.abort("x")
                break
        await engine.wait_idle()
        assert engine.pool_usage().all_free


async def test_retraction_mid_window_returns_every_page(llama, workload):
    cfg = spec_config(llama, NGRAM, cache={"max_total_tokens": 160, "prefix_caching": False})
    ref, _ = await generate(spec_config(llama, None, cache={"max_total_tokens": 160}), workload, 40)
    out, snap = await generate(cfg, workload, 40)
    assert out == ref
    assert snap.counters.retractions > 0 and snap.pools.all_free


async def test_an_imported_request_speculates_from_its_imported_prompt(bigram_llama):
    import torch
    from transformers import AutoModelForCausalLM

    llama = bigram_llama
    prompt = await cycling_prompt(llama)
    hf = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float64).eval()
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
    first = int(out.logits[0, -1].argmax())
    kv = []
    for layer in range(hf.config.num_hidden_layers):
        k, v = out.past_key_values.layers[layer].keys, out.past_key_values.layers[layer].values
        kv.append((k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()))
    ref, _ = await generate(spec_config(llama, None), [prompt], 16)
    async with Engine(spec_config(llama, NGRAM)) as engine:
        ids: list[int] = []
        async for chunk in engine.generate_imported(
            prompt, kv, first, {"max_new_tokens": 16, "ignore_eos": True}
        ):
            ids.extend(chunk.token_ids)
        await engine.wait_idle()
        assert engine.pool_usage().all_free
        snap = engine.snapshot()
    assert ids == ref[0]
    assert snap.spec is not None and snap.spec.num_accepted_tokens > 0


# ---------------------------------------------------------------------------- overlap and strict


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
async def test_speculating_under_overlap_reads_nothing_on_the_schedule_path(
    llama, workload, method
):
    spec = method_spec(method, llama, 2)
    cfg = spec_config(llama, spec, runtime={"strict": True, "overlap": True})
    async with guarded(Engine(cfg)) as engine:
        await run_all(engine, workload, 24)
        snap = engine.snapshot()
        assert sum(snap.stalls.values()) == 0
        assert engine.core.monitor.guard.violations == 0
        assert snap.counters.overlap_steps > 0
        assert snap.mirror_reads.get("seq_lens_cpu", 0) > 0


async def test_the_legacy_mode_still_shows_its_stalls(llama, workload):
    cfg = spec_config(llama, NGRAM, runtime={"cpu_mirrors": False})
    async with Engine(cfg) as engine:
        await run_all(engine, workload, 16)
        assert engine.snapshot().stalls.get("schedule.page_count", 0) > 0


async def test_two_schedules_before_any_result_under_the_strict_guard(llama):
    """Batch N + 1 is built and launched before batch N's verify result is processed, and
    N + 2 before N + 1's: the host schedules from upper bounds alone."""
    cfg = spec_config(llama, NGRAM, runtime={"strict": True, "check_mirrors": True})
    engine = guarded(Engine(cfg))  # never started: the test drives the scheduler by hand
    core = engine.core
    try:
        sched, runner = core.scheduler, core.runner
        sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
        req = Req("h", list(REPEAT), sp, max_context_len=core.max_context_len)
        sched.add_request(req)
        launched = []
        for _ in range(4):
            batch = sched.get_next_batch()
            assert batch is not None
            launched.append(runner.launch(batch.step_input(), sched.on_launched()))
        assert req.spec_window > 0  # three verify steps in flight, none processed
        for lb in launched:
            sched.process(await lb.result())
        assert req.spec_window == 0
        assert sched.queues.running_batch.committed_lens_cpu.tolist() == [req.num_computed_tokens]
        assert sum(core.monitor.stall_counts.values()) == 0
        assert len(req.output_ids) >= 4
    finally:
        core.stream.close()


# ---------------------------------------------------------------------------- sampling


async def test_seeded_sampling_with_speculation_is_reproducible(llama, workload):
    params = {"temperature": 0.8, "top_p": 0.95, "seed": 1234}
    a, snap = await generate(spec_config(llama, NGRAM), workload, 24, **params)
    b, _ = await generate(spec_config(llama, NGRAM), workload, 24, **params)
    assert a == b
    assert snap.spec is not None and snap.spec.num_draft_tokens > 0


async def test_sampling_at_a_high_temperature_stays_in_the_vocabulary(llama, workload):
    async with Engine(spec_config(llama, NGRAM)) as engine:
        out = await run_all(engine, workload, 24, temperature=1.5)
        await engine.wait_idle()
        vocab = engine.core.arch.vocab_size
        assert engine.pool_usage().all_free
    assert all(len(o) == 24 for o in out)
    assert all(0 <= t < vocab for o in out for t in o)


# ---------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "sections,match",
    [
        ({"speculative": {"method": "eagle"}}, "not supported"),
        ({"speculative": {"method": "ngram"}, "hisparse": {"enabled": True}}, "hisparse"),
        ({"speculative": {"method": "draft_model"}}, "draft_model"),
        ({"speculative": {"method": "ngram", "prompt_lookup_min": 5}}, "prompt_lookup_min"),
    ],
)
def test_what_does_not_compose_is_a_configuration_error(llama, sections, match):
    with pytest.raises(ValueError, match=match):
        engine_config(llama, **sections)


def test_a_draft_model_with_another_vocabulary_is_refused(llama, tmp_path):
    import threading

    from stallfree.runtime.model.arch import ModelLoadError
    from tests.hf_models import make_llama

    other = make_llama(tmp_path, vocab_size=300)
    cfg = spec_config(llama, {"method": "draft_model", "draft_model": str(other)})
    before = threading.active_count()
    with pytest.raises(ModelLoadError, match="vocabulary"):
        Engine(cfg)
    assert threading.active_count() == before  # the started stream's worker is closed
