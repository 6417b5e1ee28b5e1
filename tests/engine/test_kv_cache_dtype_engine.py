"""A quantized KV cache (`cache.kv_cache_dtype`) through the whole engine: the native paged
decode op and the torch path give the same greedy output over the same stored rows; the prefix
cache shares quantized pages (scales included); speculative verification reads them; HiSparse
keeps quantized rows in its host pool and its buffers and still equals the oracle over the
same cache; every pool ends full."""

from __future__ import annotations

import pytest
import torch

from stallfree import Engine, SamplingParams
from stallfree.hisparse import TopkOracleAttention
from stallfree.runtime.model import cpu_kernels
from tests.engine_util import engine_config, guarded, random_prompts, run_greedy

PROMPTS = random_prompts(6, seed=3)
LONG_PROMPTS = random_prompts(4, seed=4, lo=150, hi=200)
NEW_TOKENS = 24
QUANTIZED = ["int8", "fp8_e4m3", "fp8_e5m2"]


async def _greedy(path: str, prompts: list[list[int]], **sections) -> tuple[list, Engine]:
    engine = guarded(Engine(engine_config(path, **sections)))
    async with engine:
        out = await run_greedy(engine, prompts, NEW_TOKENS)
        await engine.wait_idle()
        assert engine.pool_usage().all_free
    return out, engine


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
async def test_native_and_torch_attention_agree_on_a_quantized_cache(
    llama: str, kv_cache_dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = {"kv_cache_dtype": kv_cache_dtype}
    native, engine = await _greedy(llama, PROMPTS, cache=cache)
    kv = engine.core.ctx.kv_cache
    assert kv.format.quantized and kv.dtype == kv.k_buffers[0].dtype != torch.float32
    assert kv.k_buffers[0].shape[-1] == kv.format.row_width(kv.shape.head_dim)
    if cpu_kernels.available():  # every decode step took the native op, none the buckets
        assert engine.core.loaded.model.attn_backend._plan_fb is None
    monkeypatch.setenv("STALLFREE_CPU_KERNELS", "0")
    cpu_kernels.reset()
    try:
        reference, engine = await _greedy(llama, PROMPTS, cache=cache)
        assert engine.core.loaded.model.attn_backend._plan_fb is not None  # the torch path
    finally:
        monkeypatch.undo()
        cpu_kernels.reset()
    assert native == reference
    plain, _ = await _greedy(llama, PROMPTS)
    assert native != plain  # the cache's rounding is really in the path


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
async def test_prefix_cache_reuses_quantized_pages(llama: str, kv_cache_dtype: str) -> None:
    """A prompt that extends a finished one reads its cached quantized pages: the output is
    the output without the prefix cache, and the cache reports the hit."""
    base = PROMPTS[0] * 3
    prompts = [base, base + PROMPTS[1]]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    got = {}
    for caching in (True, False):
        cfg = engine_config(
            llama, cache={"kv_cache_dtype": kv_cache_dtype, "prefix_caching": caching}
        )
        async with Engine(cfg) as engine:
            first = await engine.complete(prompts[0], params)
            second = await engine.complete(prompts[1], params)
            await engine.wait_idle()
            assert engine.pool_usage().all_free
        got[caching] = ([first.token_ids, second.token_ids], second.cached_tokens)
    assert got[True][0] == got[False][0]
    assert got[True][1] >= len(base) - 1 and got[False][1] == 0


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
async def test_hisparse_host_pool_holds_quantized_rows_and_equals_the_oracle(
    llama: str, kv_cache_dtype: str
) -> None:
    cache = {"kv_cache_dtype": kv_cache_dtype}
    hisparse = {"enabled": True, "top_k": 16, "device_buffer_size": 32}
    cfg = engine_config(llama, cache=cache, hisparse=hisparse)
    async with guarded(Engine(cfg)) as engine:
        co = engine.core.ctx.sparse
        kv = engine.core.ctx.kv_cache
        for pool in (co.host.k[0], co.host.v[0], co.buffers.k[0], co.buffers.v[0]):
            assert pool.dtype == kv.dtype and pool.shape[-1] == kv.row_width
        outputs = await run_greedy(engine, LONG_PROMPTS, NEW_TOKENS)
        await engine.wait_idle()
        assert engine.pool_usage().all_free and co.usage().all_free
        stats = co.stats(sync=True)
    assert stats.misses > 0 and stats.hits > 0  # rows moved host -> buffer and back
    async with Engine(engine_config(llama, cache=cache)) as engine:
        model = engine.core.loaded.model
        model.attn_backend = TopkOracleAttention(16, 0, [1], model.attn_backend)
        oracle = await run_greedy(engine, LONG_PROMPTS, NEW_TOKENS)
    assert outputs == oracle


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
async def test_speculative_verification_reads_the_quantized_cache(
    llama: str, kv_cache_dtype: str
) -> None:
    """Drafts verified over quantized rows (the verify path decodes at its gather): greedy
    output equals decoding one token at a time over the same cache. The draft model is the
    target itself, with a cache of its own in the weights' dtype."""
    prompts = PROMPTS[:3]
    cache = {"kv_cache_dtype": kv_cache_dtype}
    plain, _ = await _greedy(llama, prompts, cache=cache)
    spec = {
        "method": "draft_model",
        "draft_model": llama,
        "num_speculative_tokens": 3,
        "cost_aware": False,
        "adaptive": False,
    }
    cfg = engine_config(llama, cache=cache, speculative=spec)
    async with Engine(cfg) as engine:
        verified = await run_greedy(engine, prompts, NEW_TOKENS)
        await engine.wait_idle()
        snap = engine.snapshot()
    assert snap.pools.all_free
    assert snap.spec is not None and snap.spec.num_accepted_tokens > 0
    assert verified == plain
