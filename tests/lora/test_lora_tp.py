"""LoRA with tensor parallelism (`tp_size=2`, two gloo worker processes): three adapters and
the base model in one batch equal transformers + peft merged in every overlap x mirrors mode;
adapters loaded and unloaded under load reach both ranks (a freed slot refilled with another
adapter); over HTTP, an adapter above the maximum rank is still a 400."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from stallfree import Engine, SamplingParams
from stallfree.runtime.lora.checkpoint import AdapterNotFoundError
from tests.engine_util import MODES, guarded, random_prompts
from tests.lora.test_lora_engine import NAMES, NEW_TOKENS, PROMPTS, lora_config, run_mixed
from tests.lora_models import ADAPTERS, make_adapter, merged_greedy
from tests.server_util import serving

pytestmark = pytest.mark.slow  # each test starts two worker processes

TP2 = {"tp_size": 2}
PARAMS = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: str(make_adapter(llama, root / name, seed=i, **cfg))
        for i, (name, cfg) in enumerate(ADAPTERS.items())
    }


@pytest.mark.parametrize(("overlap", "mirrors"), MODES)
async def test_tp2_mixed_batch_equals_merged_peft(llama, adapters, overlap, mirrors):
    runtime = {"overlap": overlap, "cpu_mirrors": mirrors, "strict": mirrors}
    cfg = lora_config(llama, adapters, runtime=runtime, parallel=TP2)
    async with guarded(Engine(cfg)) as engine:
        assert engine.config.uses_worker_processes
        outputs = await run_mixed(engine)
        await engine.wait_idle()
        assert engine.pool_usage().all_free
        assert engine.lora is not None and engine.lora.held() == 0
    for i, (p, got) in enumerate(zip(PROMPTS, outputs, strict=True)):
        name = NAMES[i % len(NAMES)]
        assert got == merged_greedy(llama, adapters.get(name or ""), p, NEW_TOKENS), name


async def test_tp2_speculation_and_structured_outputs_under_adapters(llama, adapters):
    """Verify steps on the ranks run each row's adapter (prompt lookup's drafts change no
    greedy token); a JSON schema's grammar holds under an adapter."""
    spec = {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "cost_aware": False, "adaptive": False,
    }  # fmt: skip
    prompts = [[7, 8, 9, 10, 11] * 6, *PROMPTS[:3]]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    structured = SamplingParams(max_new_tokens=24, structured_outputs={"json": schema})
    cfg = lora_config(llama, adapters, speculative=spec, parallel=TP2)
    async with Engine(cfg) as engine:
        outputs = await run_mixed(engine, prompts)
        shaped = await engine.complete("x", structured, lora_name="fused-r8")
        await engine.wait_idle()
        snap = engine.snapshot()
        assert engine.pool_usage().all_free and engine.lora.held() == 0
    assert snap.spec is not None and snap.spec.num_accepted_tokens > 0  # verify steps ran
    for i, (p, got) in enumerate(zip(prompts, outputs, strict=True)):
        name = NAMES[i % len(NAMES)]
        assert got == merged_greedy(llama, adapters.get(name or ""), p, NEW_TOKENS), name
    assert shaped.error is None
    if shaped.finish_reason == "stop":
        assert isinstance(json.loads(shaped.text)["a"], int)


async def test_one_worker_process_equals_merged_peft(llama, adapters):
    """`runtime.worker=process` at tp_size=1: the whole adapter travels to the one rank."""
    cfg = lora_config(llama, adapters, runtime={"worker": "process"})
    async with Engine(cfg) as engine:
        assert engine.core.loaded is None  # the host holds no weights
        outputs = await run_mixed(engine)
    for i, (p, got) in enumerate(zip(PROMPTS, outputs, strict=True)):
        name = NAMES[i % len(NAMES)]
        assert got == merged_greedy(llama, adapters.get(name or ""), p, NEW_TOKENS), name


async def test_tp2_load_and_unload_under_load_refill_a_slot_on_both_ranks(llama, adapters):
    """Two slots, three adapters: the third waits for the slot the unloaded first one leaves
    once its requests end, and the refilled slot serves it on both ranks."""
    first, second, third = "attn-r4", "mlp-r16-rs", "fused-r8"
    cfg = lora_config(llama, {first: adapters[first]}, lora={"max_loras": 2}, parallel=TP2)
    prompts = random_prompts(16, seed=3, lo=3, hi=20)
    names = [first] * 6 + [second] * 5 + [third] * 5
    async with Engine(cfg) as engine:
        reg = engine.lora
        assert reg is not None
        tasks = [
            asyncio.ensure_future(engine.complete(p, PARAMS, lora_name=first)) for p in prompts[:6]
        ]
        await asyncio.sleep(0)
        await reg.load(second, adapters[second])
        tasks += [
            asyncio.ensure_future(engine.complete(p, PARAMS, lora_name=second))
            for p in prompts[6:11]
        ]
        await asyncio.sleep(0.05)
        first_slot = reg._resident(reg.adapters[first].uid)
        reg.unload(first)  # its running requests finish on it
        await reg.load(third, adapters[third])
        tasks += [
            asyncio.ensure_future(engine.complete(p, PARAMS, lora_name=third)) for p in prompts[11:]
        ]
        results = await asyncio.gather(*tasks)
        with pytest.raises(AdapterNotFoundError):
            await engine.complete(prompts[0], PARAMS, lora_name=first)
        assert reg._resident(reg.adapters[third].uid) == first_slot  # refilled
        await engine.wait_idle()
        assert engine.pool_usage().all_free and reg.held() == 0
    for i, (p, r, name) in enumerate(zip(prompts, results, names, strict=True)):
        assert r.error is None, r.error
        assert r.token_ids == merged_greedy(llama, adapters[name], p, NEW_TOKENS), f"row {i}"


async def test_tp2_over_http(llama, adapters, tmp_path):
    """Load at run time, pick by `model`, unload (then 404); a rank above the maximum is a
    400 naming why, and leaves the slots as they were."""
    big = make_adapter(llama, tmp_path / "big", r=32, lora_alpha=32, target_modules=["q_proj"])
    lora = {"lora_modules": [{"name": "attn-r4", "path": adapters["attn-r4"]}], "max_loras": 2}
    async with serving(llama, lora=lora, parallel=TP2) as live:
        r = await live.http.post(
            "/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(big)}
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (
            error["code"] == "rank_too_large"
            and "exceeds the maximum LoRA rank 16" in (error["message"])
        )
        r = await live.http.post(
            "/v1/load_lora_adapter",
            json={"lora_name": "fused-r8", "lora_path": adapters["fused-r8"]},
        )
        assert r.status_code == 200, r.text
        prompt = [5, 17, 99, 3, 42, 8]
        for model, path in (
            ("attn-r4", adapters["attn-r4"]),
            ("fused-r8", adapters["fused-r8"]),
            ("test-model", None),
        ):
            reply = await live.client.completions.create(
                model=model, prompt=prompt, max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            want = live.engine.tokenizer.decode(merged_greedy(llama, path, prompt, 12))
            assert reply.model == model and reply.choices[0].text == want, model
        r = await live.http.post("/v1/unload_lora_adapter", json={"lora_name": "fused-r8"})
        assert r.status_code == 200, r.text
        with pytest.raises(openai.NotFoundError):
            await live.client.completions.create(model="fused-r8", prompt=prompt, max_tokens=2)
        await live.engine.wait_idle()
        reg = live.engine.lora
        assert live.engine.pool_usage().all_free and reg is not None and reg.held() == 0
        assert sorted(reg.adapters) == ["attn-r4"] and reg.free_slots() == 2
