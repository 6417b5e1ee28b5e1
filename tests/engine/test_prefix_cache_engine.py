"""The prefix cache through the Engine: greedy outputs equal transformers and the cache-off run
in every mode, pool accounting and flush, eviction under a small pool, configuration, metrics."""

from __future__ import annotations

import asyncio
import random

import pytest

from stallfree import Engine, SamplingParams
from stallfree.runtime.memory.radix_cache import PrefixCacheConfigError
from stallfree.runtime.scheduling.sizing import prefix_caching_enabled
from tests.engine_util import engine_config, run_greedy
from tests.hf_models import hf_greedy

NEW_TOKENS = 12
_rng = random.Random(14)


def _ids(n: int) -> list[int]:
    return [_rng.randrange(0, 256) for _ in range(n)]


SYSTEM = _ids(48)
SAME = _ids(30)
BASE = _ids(10)
CONCURRENT = (
    [SYSTEM + _ids(_rng.randint(3, 12)) for _ in range(5)]  # shared system prompt
    + [list(SAME) for _ in range(3)]  # identical prompts
    + [BASE + _ids(8) for _ in range(3)]  # diverge at token 10, inside a page of 4
)
USER_TURNS = [_ids(6), _ids(5), _ids(7)]


@pytest.fixture(scope="module")
def model(llama):
    path = llama
    reference = [hf_greedy(path, p, NEW_TOKENS) for p in CONCURRENT]
    # a conversation that resends its history each turn
    turns, history = [], list(SYSTEM)
    for user in USER_TURNS:
        prompt = history + user
        out = hf_greedy(path, prompt, NEW_TOKENS)
        turns.append((prompt, out))
        history = prompt + out
    return str(path), reference, turns


MODES = [
    pytest.param(True, True, id="overlap-mirrors"),
    pytest.param(True, False, id="overlap-legacy"),
    pytest.param(False, True, id="plain-mirrors"),
    pytest.param(False, False, id="plain-legacy"),
]


async def _run(engine: Engine, turns) -> tuple[list[list[int]], list[list[int]]]:
    outputs = await run_greedy(engine, CONCURRENT, NEW_TOKENS)
    conversation = []
    for prompt, _ in turns:
        conversation += await run_greedy(engine, [prompt], NEW_TOKENS)
    return outputs, conversation


# every overlap x mirrors mode with the cache on and off at page size 4; page size 1 (no partial
# pages) in the default mode
CACHE_CASES = [
    pytest.param(*mode.values, caching, 4, id=f"{mode.id}-{'ps4' if caching else 'off'}")
    for mode in MODES
    for caching in (True, False)
] + [pytest.param(True, True, True, 1, id="overlap-mirrors-ps1")]


@pytest.mark.parametrize(("overlap", "mirrors", "caching", "page_size"), CACHE_CASES)
async def test_greedy_equals_transformers_with_and_without_the_cache(
    model, overlap, mirrors, caching, page_size
):
    path, reference, turns = model
    cfg = engine_config(
        path,
        runtime={"overlap": overlap, "cpu_mirrors": mirrors, "strict": mirrors},
        cache={"page_size": page_size, "prefix_caching": caching},
    )
    async with Engine(cfg) as engine:
        outputs, conversation = await _run(engine, turns)
        await engine.wait_idle()
        usage = engine.pool_usage()
        counters = engine.snapshot().counters
        assert usage.all_free
        if caching:
            assert usage.kv_tokens_cached > 0 and usage.kv_tokens_free < usage.kv_tokens_total
            assert engine.flush_cache()
            usage = engine.pool_usage()
            assert usage.kv_tokens_free == usage.kv_tokens_total and usage.kv_tokens_cached == 0
        else:
            assert engine.core.scheduler.cache is None
            assert usage.kv_tokens_free == usage.kv_tokens_total
        monitor = engine.core.monitor
    assert outputs == reference
    assert conversation == [out for _, out in turns]
    if caching:
        # every later turn finds at least the earlier turns (all but their last token) cached
        assert counters.prefix_cache_hits >= sum(len(p) for p, _ in turns[1:]) - 2 * page_size
        assert counters.prefill_tokens < counters.prompt_tokens
    else:
        assert counters.prefix_cache_queries == counters.prefix_cache_hits == 0
        assert counters.prefill_tokens == counters.prompt_tokens
    if mirrors:
        assert monitor.schedule_path_reads == 0 and monitor.total_stalls() == 0


@pytest.mark.parametrize("overlap", [True, False])
async def test_eviction_under_a_small_pool_fails_nothing(model, overlap):
    """Long shared prefixes in a pool that holds about two requests: eviction makes room and
    every request that fits without the cache finishes, with the same tokens."""
    path, _, _ = model
    prefixes = [_ids(64) for _ in range(4)]
    prompts = [prefixes[i // 4] + _ids(8) for i in range(16)]  # four groups, one after another
    results = {}
    for caching in (False, True):
        cfg = engine_config(
            path,
            runtime={"overlap": overlap, "check_mirrors": True},
            cache={
                "page_size": 4,
                "max_total_tokens": 192,
                "max_running_requests": 8,
                "prefix_caching": caching,
            },
            scheduler={"chunked_prefill_size": 32, "max_prefill_tokens": 64},
        )
        async with Engine(cfg) as engine:
            results[caching] = await run_greedy(engine, prompts, 16)  # asserts no error
            await engine.wait_idle()
            assert engine.pool_usage().all_free
            counters = engine.snapshot().counters
        if caching:
            assert counters.prefix_cache_evicted_tokens > 0
            assert counters.prefix_cache_hits > 0
    assert results[True] == results[False]


async def test_pool_usage_counts_cached_pages_apart_and_flush_is_refused_while_busy(model):
    path, _, _ = model
    cfg = engine_config(path, cache={"page_size": 4})
    async with Engine(cfg) as engine:
        params = SamplingParams(max_new_tokens=200, ignore_eos=True)
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate(SYSTEM, params):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        assert not engine.flush_cache()  # a request is running
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await engine.wait_idle()
        usage = engine.pool_usage()
        assert usage.all_free and usage.kv_tokens_cached > 0
        assert usage.kv_tokens_evictable == usage.kv_tokens_cached
        assert usage.kv_usage == 0 and usage.cache_usage > 0
        assert engine.flush_cache()
        assert engine.pool_usage().kv_tokens_free == usage.kv_tokens_total


def test_hisparse_and_prefix_caching_are_exclusive():
    both = engine_config("tiny", cache={"prefix_caching": True}, hisparse={"enabled": True})
    with pytest.raises(PrefixCacheConfigError, match="cannot both be on"):
        prefix_caching_enabled(both)
    with pytest.raises(PrefixCacheConfigError):
        Engine(both)  # refused before the model loads
    assert not prefix_caching_enabled(engine_config("tiny", hisparse={"enabled": True}))
    assert prefix_caching_enabled(engine_config("tiny"))
    assert not prefix_caching_enabled(engine_config("tiny", cache={"prefix_caching": False}))


async def test_metrics_export_prefix_cache_counters(model):
    from tests.metrics_util import samples, value

    path, _, _ = model
    cfg = engine_config(path, cache={"page_size": 4}, metrics={"enabled": True})
    async with Engine(cfg) as engine:
        assert engine.metrics is not None
        await run_greedy(engine, [[*SYSTEM, 1, 2]], 4)
        await run_greedy(engine, [[*SYSTEM, 3, 4]], 4)
        await engine.wait_idle()
        scrape = samples(engine.metrics.render())
        counters = engine.snapshot().counters
    assert value(scrape, "stallfree:prefix_cache_queries_total") == counters.prefix_cache_queries
    assert value(scrape, "stallfree:prefix_cache_hits_total") == counters.prefix_cache_hits == 48
    assert value(scrape, "stallfree:prefix_cache_evicted_tokens_total") == 0
    assert 0 < value(scrape, "stallfree:prefix_cache_usage_perc") < 1
    assert value(scrape, "stallfree:kv_cache_usage_perc") == 0


@pytest.mark.parametrize("kind", ["fail_step_rate", "fail_copy_rate"])
@pytest.mark.parametrize("overlap", [True, False])
async def test_failed_steps_leave_nothing_wrong_in_the_cache(model, kind, overlap):
    """Steps fail at random while requests share prefixes; later waves reuse what was cached.
    Every request that survives still equals transformers: no failed step's KV was cached."""
    path, _, _ = model
    cfg = engine_config(
        path,
        runtime={"overlap": overlap, "max_consecutive_step_failures": 1000},
        cache={"page_size": 4},
        faults={"enabled": True, "seed": 3, kind: 0.15},
    )
    waves = [[SYSTEM + _ids(_rng.randint(2, 9)) for _ in range(6)] for _ in range(3)]
    params = {"max_new_tokens": 12, "ignore_eos": True}
    async with Engine(cfg) as engine:
        survivors = failed = 0
        for prompts in waves:
            results = await asyncio.gather(*(engine.complete(p, params) for p in prompts))
            for prompt, r in zip(prompts, results, strict=True):
                if r.finish_reason == "error":
                    failed += 1
                else:
                    survivors += 1
                    assert r.token_ids == hf_greedy(path, prompt, 12)
        await engine.wait_idle()
        assert engine.pool_usage().all_free
        counters = engine.snapshot().counters
    assert failed and survivors and counters.prefix_cache_hits > 0
