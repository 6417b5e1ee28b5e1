"""LoRA on fused projections, slot eviction and leases, loading and unloading under load, the
prefix cache kept apart per adapter, and refused adapters that leak nothing."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch

from stallfree import Engine, SamplingParams
from stallfree.runtime.lora.checkpoint import AdapterError, AdapterNotFoundError
from stallfree.runtime.model.lora import TARGETS
from tests.engine_util import engine_config, random_prompts
from tests.lora.test_lora_engine import NEW_TOKENS, PROMPTS, lora_config
from tests.lora_models import ADAPTERS, make_adapter, merged_greedy

PARAMS = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: str(make_adapter(llama, root / name, seed=i, **cfg))
        for i, (name, cfg) in enumerate(ADAPTERS.items())
    }


async def test_fused_projections_equal_merged_peft(llama, adapters, monkeypatch):
    """q/k/v and gate/up stacked into one matmul each (as every non-float32 model runs):
    the fused-target adapter adds into the right columns of the fused output."""
    from stallfree.runtime.model import loader

    monkeypatch.setattr(loader, "fuses", lambda *args: True)
    name = "fused-r8"
    async with Engine(lora_config(llama, {name: adapters[name]})) as engine:
        proj, part = engine.lora.table.targets[(0, "k_proj")]
        assert proj.parts[part][0] == "k_proj" and len(proj.parts) == 3  # the fused q/k/v
        results = await asyncio.gather(
            *(engine.complete(p, PARAMS, lora_name=name) for p in PROMPTS[:4])
        )
    for p, r in zip(PROMPTS[:4], results, strict=True):
        assert r.token_ids == merged_greedy(llama, adapters[name], p, NEW_TOKENS)


async def test_one_slot_serves_every_adapter_in_turn(llama, adapters):
    """max_loras=1: requests under three adapters and the base model all finish right; an
    adapter waits for the slot and evicts only once no request holds it."""
    names = [*ADAPTERS, None]
    prompts = PROMPTS[:8]
    cfg = lora_config(llama, adapters, lora={"max_loras": 1, "max_cpu_loras": 1})
    async with Engine(cfg) as engine:
        results = await asyncio.gather(
            *(engine.complete(p, PARAMS, lora_name=names[i % 4]) for i, p in enumerate(prompts))
        )
        await engine.wait_idle()
        assert engine.lora.held() == 0 and engine.lora.free_slots() == 1
        assert len(engine.lora.host) <= 1  # the others were read from disk again
    for i, (p, r) in enumerate(zip(prompts, results, strict=True)):
        path = adapters.get(names[i % 4] or "")
        assert r.token_ids == merged_greedy(llama, path, p, NEW_TOKENS), f"row {i}"


async def test_load_and_unload_under_load_lose_no_request(llama, adapters):
    name, other = "attn-r4", "mlp-r16-rs"
    cfg = lora_config(llama, {name: adapters[name]}, lora={"max_loras": 2})
    prompts = random_prompts(24, seed=3, lo=3, hi=20)
    async with Engine(cfg) as engine:
        first = [engine.complete(p, PARAMS, lora_name=name) for p in prompts[:12]]
        tasks = [asyncio.ensure_future(c) for c in first]
        await asyncio.sleep(0)
        await engine.lora.load(other, adapters[other])
        second = [
            asyncio.ensure_future(engine.complete(p, PARAMS, lora_name=other)) for p in prompts[12:]
        ]
        await asyncio.sleep(0.05)
        engine.lora.unload(name)  # its running requests finish on it
        results = await asyncio.gather(*tasks, *second)
        with pytest.raises(AdapterNotFoundError):
            await engine.complete(prompts[0], PARAMS, lora_name=name)
        await engine.wait_idle()
        assert engine.pool_usage().all_free and engine.lora.held() == 0
    assert all(r.error is None and len(r.token_ids) == NEW_TOKENS for r in results)
    for p, r in zip(prompts[:3], results[:3], strict=True):
        assert r.token_ids == merged_greedy(llama, adapters[name], p, NEW_TOKENS)
    for p, r in zip(prompts[12:15], results[12:15], strict=True):
        assert r.token_ids == merged_greedy(llama, adapters[other], p, NEW_TOKENS)


async def test_prefix_cache_never_shares_kv_between_adapters(llama, adapters):
    prompt = random_prompts(1, seed=5, lo=40, hi=40)[0]
    names = [None, "attn-r4", "fused-r8", None, "attn-r4"]
    cfg = lora_config(llama, adapters, cache={"page_size": 4})
    async with Engine(cfg) as engine:
        results = [await engine.complete(prompt, PARAMS, lora_name=n) for n in names]
    cached = [r.cached_tokens for r in results]
    assert cached[:3] == [0, 0, 0]  # the same prompt under another adapter: nothing cached
    assert cached[3] > 0 and cached[4] > 0  # the same adapter again: its own prefix
    for n, r in zip(names, results, strict=True):
        assert r.token_ids == merged_greedy(llama, adapters.get(n or ""), prompt, NEW_TOKENS)


def _copy(src: str, dst, edit=None) -> str:
    shutil.copytree(src, dst)
    if edit is not None:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        edit(cfg)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return str(dst)


async def test_refused_adapters_name_the_reason_and_leak_nothing(llama, adapters, tmp_path):
    big = make_adapter(llama, tmp_path / "big", r=32, lora_alpha=32, target_modules=["q_proj"])
    from tests.hf_models import make_llama

    other = make_llama(tmp_path / "other", hidden_size=32, intermediate_size=64)
    wrong = make_adapter(other, tmp_path / "wrong", r=4, target_modules=["q_proj"])
    dora = _copy(adapters["attn-r4"], tmp_path / "dora", lambda c: c.update(use_dora=True))
    cases = {
        str(big): "exceeds the maximum LoRA rank 16",
        str(wrong): "does not fit this base model",
        str(tmp_path): "is not a LoRA adapter",
        llama: "is not a LoRA adapter",
        dora: "DoRA",
    }
    async with Engine(lora_config(llama, {"attn-r4": adapters["attn-r4"]})) as engine:
        reg = engine.lora
        for i, (path, reason) in enumerate(cases.items()):
            with pytest.raises(AdapterError, match=reason):
                await reg.load(f"bad{i}", path)
        with pytest.raises(AdapterError, match="base model"):
            await reg.load("x", adapters["fused-r8"], base_model_name="some/other-model")
        with pytest.raises(AdapterError, match="already loaded"):
            await reg.load("attn-r4", adapters["attn-r4"])
        with pytest.raises(AdapterNotFoundError):
            await engine.complete([1, 2, 3], PARAMS, lora_name="missing")
        assert sorted(reg.adapters) == ["attn-r4"]
        ok = await engine.complete([1, 2, 3], PARAMS, lora_name="attn-r4")
        assert ok.error is None
        await engine.wait_idle()
        assert engine.pool_usage().all_free and reg.held() == 0
        assert reg.free_slots() == reg.config.max_loras


async def test_an_engine_without_lora_refuses_an_adapter_name(llama):
    async with Engine(engine_config(llama)) as engine:
        assert engine.lora is None
        with pytest.raises(AdapterNotFoundError):
            await engine.complete([1, 2, 3], PARAMS, lora_name="anything")
        await engine.wait_idle()
        assert engine.pool_usage().all_free


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (lambda c: c.update(r=0), "not a positive whole number"),
        (lambda c: c.update(lora_alpha="big"), "not a finite number"),
        (lambda c: c.update(rank_pattern={"q_proj(": 4}), "not a regular expression"),
        (lambda c: c.update(peft_type="IA3"), "only LoRA adapters"),
    ],
)
async def test_broken_adapter_configs_are_refused(llama, adapters, tmp_path, edit, reason):
    path = _copy(adapters["attn-r4"], tmp_path / "broken", edit)
    async with Engine(lora_config(llama, {}, lora={"enable_lora": True})) as engine:
        with pytest.raises(AdapterError, match=reason):
            await engine.lora.load("broken", path)
        assert not engine.lora.adapters


async def test_a_request_cancelled_while_waiting_for_a_slot_holds_nothing(llama, adapters):
    """max_loras=1: a request under a second adapter waits for the slot; cancelled there, it
    leaves no lease and no waiter, and the slot goes on serving."""
    cfg = lora_config(llama, adapters, lora={"max_loras": 1})
    long = SamplingParams(max_new_tokens=64, ignore_eos=True)
    async with Engine(cfg) as engine:
        first = asyncio.ensure_future(engine.complete([1, 2, 3], long, lora_name="attn-r4"))
        await asyncio.sleep(0)
        waiting = asyncio.ensure_future(engine.complete([4, 5], PARAMS, lora_name="fused-r8"))
        await asyncio.sleep(0.01)
        assert not waiting.done() and engine.lora.held() == 1
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert (await first).error is None
        assert engine.lora.held() == 0 and not engine.lora._waiters
        after = await engine.complete([4, 5], PARAMS, lora_name="fused-r8")
        assert after.token_ids == merged_greedy(llama, adapters["fused-r8"], [4, 5], NEW_TOKENS)
        await engine.wait_idle()
        assert engine.pool_usage().all_free


@pytest.mark.parametrize("quantization", ["int8", "int4"])
async def test_adapters_on_a_quantized_model(llama, adapters, quantization):
    """The slots take the activations' dtype, whatever the base projections' weights are."""
    name = "fused-r8"
    model = {"quantization": quantization, "dtype": "bfloat16"}
    async with Engine(lora_config(llama, {name: adapters[name]}, model=model)) as engine:
        proj, _ = engine.lora.table.targets[(0, "q_proj")]
        assert proj.a[0].dtype == torch.bfloat16
        base = await engine.complete([1, 2, 3], PARAMS)
        tuned = await engine.complete([1, 2, 3], PARAMS, lora_name=name)
        await engine.wait_idle()
        assert engine.pool_usage().all_free
    assert base.error is None and tuned.error is None
    assert tuned.token_ids != base.token_ids


async def test_a_family_with_its_own_mlp(tmp_path):
    """Gemma 2 (its own MLP activation and attention): the per-projection wrappers equal
    transformers + peft merged."""
    from tests.hf_models import make_gemma2

    model = make_gemma2(tmp_path)
    path = make_adapter(model, tmp_path / "g", r=8, lora_alpha=8, target_modules=list(TARGETS))
    prompts = PROMPTS[:3]
    async with Engine(lora_config(str(model), {"g": str(path)})) as engine:
        results = await asyncio.gather(
            *(engine.complete(p, PARAMS, lora_name="g") for p in prompts)
        )
    for p, r in zip(prompts, results, strict=True):
        assert r.token_ids == merged_greedy(model, path, p, NEW_TOKENS)
