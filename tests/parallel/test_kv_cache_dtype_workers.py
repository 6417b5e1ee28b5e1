"""A quantized KV cache in worker processes (`runtime.worker=process`): each worker builds its
cache in the configured format and the greedy output equals the in-process engine's with the
same format, with a small pool and prompts prefilled in chunks; a tensor-parallel decode
server's workers take int8 rows from a prefill server, each its KV-head shard."""

from __future__ import annotations

import asyncio

import pytest

from stallfree import Engine, SamplingParams
from tests.disagg.disagg_util import engine_pair
from tests.engine_util import engine_config, random_prompts, run_greedy, settle

PROMPTS = random_prompts(6, seed=3)
STRESSED = {
    "scheduler": {"chunked_prefill_size": 7, "max_prefill_tokens": 16},
}


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
async def test_worker_processes_equal_in_process(llama: str, kv_cache_dtype: str) -> None:
    cache = {"kv_cache_dtype": kv_cache_dtype, "page_size": 4, "max_total_tokens": 128}
    outputs = {}
    for worker in ("inprocess", "process"):
        cfg = engine_config(llama, cache=cache, runtime={"worker": worker}, **STRESSED)
        async with Engine(cfg) as engine:
            outputs[worker] = await run_greedy(engine, PROMPTS, 24)
            await engine.wait_idle()
            assert engine.pool_usage().all_free
            # the host keeps the format (for sizing and the handshake); the workers the rows
            assert engine.core.ctx.kv_cache.format.name == kv_cache_dtype
    async with Engine(engine_config(llama, cache={"page_size": 4})) as plain:
        assert await run_greedy(plain, PROMPTS, 24) != outputs["inprocess"]
    assert outputs["process"] == outputs["inprocess"]


@pytest.mark.slow
async def test_tp2_decode_workers_take_int8_shards_with_their_scales(llama: str) -> None:
    """A prefill at size 1 sends int8 rows to a decode server at tensor-parallel size 2: each
    worker writes its KV-head shard, scales included, and greedy output equals the colocated
    engine's over the same cache."""
    prompts = random_prompts(4, seed=9, lo=5, hi=30)
    cache = {"kv_cache_dtype": "int8", "page_size": 4, "max_total_tokens": 1024}
    async with Engine(engine_config(llama, cache=cache)) as colocated:
        want = await run_greedy(colocated, prompts, 16)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    async with engine_pair(
        llama, decode_sections={"parallel": {"tp_size": 2}}, cache=cache
    ) as pair:
        assert pair.d.shards() == [[0, 1], [1, 2]]
        got = await asyncio.gather(
            *(pair.run(ids, params, room=400 + i) for i, ids in enumerate(prompts))
        )
        assert [tokens for tokens, _ in got] == want
        assert pair.decode.snapshot().counters.prefill_tokens == 0
        await settle(pair.prefill)
        await settle(pair.decode)
        for engine in (pair.prefill, pair.decode):
            assert engine.pool_usage().all_free
