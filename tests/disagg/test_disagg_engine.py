"""Prefill/decode disaggregation between two engines in one process (loopback transport):
greedy output equals the colocated engine's, and both pools end all free."""

from __future__ import annotations

import asyncio

import pytest

from stallfree import Engine, SamplingParams
from tests.disagg.disagg_util import engine_pair
from tests.engine_util import engine_config, random_prompts, run_greedy, settle


@pytest.mark.parametrize("page_size", [1, 4])
async def test_greedy_equals_colocated(llama: str, page_size: int) -> None:
    prompts = random_prompts(6, seed=3, lo=5, hi=40)
    cache = {"page_size": page_size, "max_total_tokens": 2048}
    async with Engine(engine_config(llama, cache=cache)) as colocated:
        want = await run_greedy(colocated, prompts, 12)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    async with engine_pair(
        llama,
        prefill_sections={"scheduler": {"chunked_prefill_size": 8}},
        cache={**cache, "prefix_caching": True},
    ) as pair:
        got = await asyncio.gather(
            *(pair.run(ids, params, room=100 + i) for i, ids in enumerate(prompts))
        )
        assert [tokens for tokens, _ in got] == want
        assert all(reason == "length" for _, reason in got)
        await settle(pair.prefill)
        await settle(pair.decode)
        assert pair.p.stats.transfers == len(prompts) == pair.d.stats.transfers
        assert len(pair.p.rooms) == 0 and len(pair.d.rooms) == 0
        # the decode engine computed no prompt: every prompt token's KV came over
        assert pair.decode.snapshot().counters.prefill_tokens == 0
        assert pair.prefill.snapshot().counters.generation_tokens == len(prompts)
