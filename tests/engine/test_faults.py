"""Defined behaviour under faults: failed steps, fail-closed, slow steps, deadlines, bounded queue."""

from __future__ import annotations

import asyncio

import pytest

from stallfree import Engine, EngineOverloadedError
from stallfree.runtime.engine import EngineUnhealthyError
from tests.engine_util import engine_config, random_prompts, run_greedy
from tests.hf_models import hf_greedy

PARAMS = {"max_new_tokens": 12, "ignore_eos": True}


@pytest.mark.parametrize("kind", ["fail_step_rate", "fail_copy_rate"])
@pytest.mark.parametrize("overlap", [True, False])
async def test_failed_steps_fail_their_requests_and_the_engine_serves_on(llama, kind, overlap):
    cfg = engine_config(
        llama,
        runtime={"overlap": overlap, "max_consecutive_step_failures": 1000},
        faults={"enabled": True, "seed": 3, kind: 0.15},
    )
    prompts = random_prompts(16, seed=9)
    async with Engine(cfg) as engine:
        results = await asyncio.gather(*(engine.complete(p, PARAMS) for p in prompts))
        injected = sum(engine.core.runner.faults.injected.values())
        failed = [r for r in results if r.finish_reason == "error"]
        assert injected > 0 and failed, "the schedule should have injected a failure"
        assert all("injected" in r.error for r in failed)
        for prompt, r in zip(prompts, results, strict=True):
            if r.finish_reason != "error":  # survivors are untouched by their neighbours' faults
                assert r.token_ids == hf_greedy(llama, prompt, 12)
        await engine.wait_idle()
        assert engine.pool_usage().all_free
        assert engine.healthy
        assert engine.snapshot().counters.step_failures == injected


async def test_repeated_failures_fail_closed_without_hanging(llama):
    cfg = engine_config(
        llama,
        runtime={"max_consecutive_step_failures": 2},
        faults={"enabled": True, "fail_step_rate": 1.0},
    )
    async with Engine(cfg) as engine:
        results = await asyncio.wait_for(
            asyncio.gather(*(engine.complete(p, PARAMS) for p in random_prompts(6))), timeout=30
        )
        assert all(r.finish_reason == "error" for r in results)
        await asyncio.sleep(0.05)
        assert not engine.healthy
        with pytest.raises(EngineUnhealthyError, match="failed closed"):
            await engine.complete("new work", PARAMS)
        assert engine.pool_usage().all_free


async def test_slow_steps_change_nothing_but_time(llama):
    cfg = engine_config(
        llama, faults={"enabled": True, "slow_step_rate": 0.3, "slow_step_seconds": 0.01}
    )
    prompts = random_prompts(6, seed=2)
    async with Engine(cfg) as engine:
        outputs = await run_greedy(engine, prompts, 12)
        assert engine.core.runner.faults.injected  # some steps were slowed
    assert outputs == [hf_greedy(llama, p, 12) for p in prompts]


async def test_deadline_aborts_and_frees(llama):
    cfg = engine_config(
        llama, faults={"enabled": True, "slow_step_rate": 1.0, "slow_step_seconds": 0.02}
    )
    async with Engine(cfg) as engine:
        result = await engine.complete(
            "slow", {"max_new_tokens": 500, "ignore_eos": True}, timeout=0.2
        )
        assert result.finish_reason == "abort"
        assert "deadline" in result.error
        assert 0 < result.completion_tokens < 500
        await engine.wait_idle()
        assert engine.pool_usage().all_free


async def test_waiting_queue_is_bounded(llama):
    cfg = engine_config(
        llama, cache={"max_running_requests": 1}, scheduler={"max_waiting_requests": 2}
    )
    async with Engine(cfg) as engine:
        long = asyncio.create_task(
            engine.complete("hog", {"max_new_tokens": 400, "ignore_eos": True})
        )
        while engine.core.scheduler.queues.num_running == 0:
            await asyncio.sleep(0.001)
        queued = [asyncio.create_task(engine.complete(p, PARAMS)) for p in random_prompts(2)]
        while len(engine.core.scheduler.queues.waiting) < 2:
            await asyncio.sleep(0.001)
        with pytest.raises(EngineOverloadedError, match="waiting queue is full"):
            await engine.complete("one too many", PARAMS)
        long.cancel()
        results = await asyncio.gather(*queued)
        assert all(len(r.token_ids) == 12 for r in results)
        await engine.wait_idle()
        assert engine.pool_usage().all_free
