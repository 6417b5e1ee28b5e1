"""A decode server at tensor-parallel size 2 (two gloo worker processes) receiving KV from a
prefill at size 1: each rank writes only its KV-head shard, and greedy output equals the
colocated engine's. Also a model whose one KV head both ranks replicate."""

from __future__ import annotations

import asyncio

import pytest

from stallfree import Engine, SamplingParams
from tests.disagg.disagg_util import engine_pair
from tests.engine_util import engine_config, random_prompts, run_greedy, settle
from tests.hf_models import make_qwen2

pytestmark = pytest.mark.slow  # worker processes (see pyproject)


@pytest.mark.parametrize("kv_heads", [2, 1])
async def test_tp2_decode_takes_shards_from_tp1_prefill(
    llama: str, tmp_path, kv_heads: int
) -> None:
    model = llama if kv_heads == 2 else str(make_qwen2(tmp_path, num_key_value_heads=1))
    prompts = random_prompts(4, seed=9, lo=5, hi=30)
    cache = {"page_size": 4, "max_total_tokens": 1024}
    async with Engine(engine_config(model, cache=cache)) as colocated:
        want = await run_greedy(colocated, prompts, 10)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    async with engine_pair(
        model, decode_sections={"parallel": {"tp_size": 2}}, cache=cache
    ) as pair:
        assert pair.d.shards() == ([[0, 1], [1, 2]] if kv_heads == 2 else [[0, 1], [0, 1]])
        got = await asyncio.gather(
            *(pair.run(ids, params, room=300 + i) for i, ids in enumerate(prompts))
        )
        assert [tokens for tokens, _ in got] == want
        assert pair.decode.snapshot().counters.prefill_tokens == 0
        await settle(pair.prefill)
        await settle(pair.decode)
