"""A quantized KV cache in worker processes (`runtime.worker=process`): each worker builds its
cache in the configured format and the greedy output equals the in-process engine's with the
same format, with a small pool and prompts prefilled in chunks."""

from __future__ import annotations

import pytest

from stallfree import Engine
from tests.engine_util import engine_config, random_prompts, run_greedy

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
