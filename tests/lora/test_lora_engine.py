"""Many LoRA adapters in one batch: greedy output under each adapter equals transformers + peft
with that adapter merged, with the three adapters and the base model sharing the batch, in every
overlap x mirrors mode."""

from __future__ import annotations

import asyncio

import pytest

from stallfree import Engine, SamplingParams
from tests.engine_util import MODES, engine_config, guarded, random_prompts
from tests.lora_models import ADAPTERS, make_adapter, merged_greedy

NEW_TOKENS = 16
PROMPTS = random_prompts(8, seed=7, lo=3, hi=40)
# row i runs under NAMES[i % 4]: each adapter and the base model twice
NAMES: list[str | None] = [*ADAPTERS, None]


@pytest.fixture(scope="module")
def adapters(llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: str(make_adapter(llama, root / name, seed=i, **cfg))
        for i, (name, cfg) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def reference(llama, adapters) -> list[list[int]]:
    out = []
    for i, prompt in enumerate(PROMPTS):
        name = NAMES[i % len(NAMES)]
        out.append(merged_greedy(llama, adapters.get(name or ""), prompt, NEW_TOKENS))
    return out


def lora_config(path: str, adapters: dict[str, str], **sections):
    lora = {
        "lora_modules": [{"name": n, "path": p} for n, p in adapters.items()],
        "max_loras": 4,
        "max_lora_rank": 16,
    }
    return engine_config(path, lora=lora | sections.pop("lora", {}), **sections)


async def run_mixed(engine: Engine, prompts=PROMPTS, n=NEW_TOKENS) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    results = await asyncio.gather(
        *(
            engine.complete(p, params, lora_name=NAMES[i % len(NAMES)])
            for i, p in enumerate(prompts)
        )
    )
    for r in results:
        assert r.error is None, r.error
    return [r.token_ids for r in results]


def test_adapters_change_the_output(llama, adapters, reference):
    """The test means something: every adapter's reference differs from the base model's."""
    base = [merged_greedy(llama, None, p, NEW_TOKENS) for p in PROMPTS]
    for i, want in enumerate(reference):
        if NAMES[i % len(NAMES)] is not None:
            assert want != base[i], f"adapter {NAMES[i % len(NAMES)]} left prompt {i} unchanged"


@pytest.mark.parametrize(("overlap", "mirrors"), MODES)
async def test_mixed_batch_equals_merged_peft(llama, adapters, reference, overlap, mirrors):
    runtime = {"overlap": overlap, "cpu_mirrors": mirrors, "strict": mirrors}
    async with guarded(Engine(lora_config(llama, adapters, runtime=runtime))) as engine:
        outputs = await run_mixed(engine)
        await engine.wait_idle()
        assert engine.pool_usage().all_free
        assert engine.lora is not None and engine.lora.held() == 0
    for i, (got, want) in enumerate(zip(outputs, reference, strict=True)):
        assert got == want, f"prompt {i} under {NAMES[i % len(NAMES)]} diverged"


@pytest.mark.parametrize("share", [0, 10**9], ids=["one-pass", "by-adapter"])
async def test_each_delta_path_alone(llama, adapters, reference, monkeypatch, share):
    """Every step in one pass over the batch (used slots side by side, masked), or every
    adapter's rows apart: both equal the reference (the defaults mix them by width)."""
    from stallfree.runtime.model import lora

    monkeypatch.setattr(lora, "DENSE_MAX_SHARE", share)
    async with Engine(lora_config(llama, adapters)) as engine:
        outputs = await run_mixed(engine)
    assert outputs == reference
