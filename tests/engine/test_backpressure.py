"""Backpressure: a streaming request whose reader stops reading stops being decoded once
`scheduler.max_unread_tokens` tokens wait for it (keeping its KV), and goes on, with the same
tokens, when the reader catches up. Memory per reader is bounded by the bound, not by
max_new_tokens."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from stallfree import Engine, SamplingParams
from tests.engine_util import MODES, engine_config, random_prompts, run_greedy

BOUND = 8
LONG = SamplingParams(max_new_tokens=120, ignore_eos=True)


async def _settle(engine: Engine, steps: int = 30) -> None:
    """Let the loop run a while (it makes no step for a paused request)."""
    for _ in range(steps):
        await asyncio.sleep(0.01)


@pytest.mark.parametrize(("overlap", "mirrors"), MODES)
async def test_a_reader_that_stops_pauses_its_request_and_resumes_it_unchanged(
    llama, overlap, mirrors
):
    prompts = random_prompts(3, seed=4)
    cfg = engine_config(
        llama,
        runtime={"overlap": overlap, "cpu_mirrors": mirrors, "check_mirrors": True},
        scheduler={"max_unread_tokens": BOUND},
    )
    async with Engine(cfg) as engine:
        want = await run_greedy(engine, prompts, LONG.max_new_tokens)
        slow = engine.generate(prompts[0], LONG)
        first = await slow.__anext__()  # then the reader stops reading
        others = [engine.complete(p, LONG) for p in prompts[1:]]  # readers of the end only
        done = await asyncio.gather(*others)
        await _settle(engine)
        req = next(r for r in engine.requests if r.origin_input_ids == prompts[0])
        made = len(req.output_ids)
        assert req.paused and made <= len(first.token_ids) + BOUND + 2  # the lag of overlap
        snap = engine.snapshot()
        assert snap.counters.backpressure_pauses >= 1
        assert snap.running == 1  # it keeps its slot and KV while paused
        assert not engine.pool_usage().all_free
        await _settle(engine)
        assert len(req.output_ids) == made  # nothing decoded for it while nobody reads
        ids = list(first.token_ids)
        async for chunk in slow:  # the reader catches up; the request goes on
            ids.extend(chunk.token_ids)
        assert ids == want[0]
        assert [r.token_ids for r in done] == want[1:]
        await engine.wait_idle()
        assert engine.pool_usage().all_free


async def test_complete_is_never_paused_however_long_its_output(llama):
    cfg = engine_config(llama, scheduler={"max_unread_tokens": BOUND})
    async with Engine(cfg) as engine:
        result = await engine.complete([1, 2, 3], LONG)
        assert len(result.token_ids) == LONG.max_new_tokens
        assert engine.snapshot().counters.backpressure_pauses == 0


async def test_aborting_a_paused_request_frees_it(llama):
    cfg = engine_config(llama, scheduler={"max_unread_tokens": BOUND})
    async with Engine(cfg) as engine:
        slow = engine.generate([1, 2, 3], LONG, rid="slow")
        await slow.__anext__()
        await _settle(engine)
        assert engine.requests["slow"].paused
        assert engine.abort("slow")
        with contextlib.suppress(StopAsyncIteration):
            async for _ in slow:
                pass
        await engine.wait_idle()
        assert engine.pool_usage().all_free
        ok = await engine.complete([4, 5, 6], {"max_new_tokens": 4})
        assert ok.finish_reason == "length"


@pytest.mark.parametrize(("overlap", "mirrors"), MODES)
async def test_paused_requests_give_up_their_kv_when_the_queue_needs_it(llama, overlap, mirrors):
    """Twelve readers that stop after their first chunk, on a pool that holds three of their
    requests: paused requests give up their KV for the queue's head, so every request starts
    (without it, the first three held the pool until their readers came back), and each ends
    with the tokens it makes alone once its reader catches up."""
    prompts = random_prompts(12, seed=9, lo=3, hi=20)
    cfg = engine_config(
        llama,
        runtime={"overlap": overlap, "cpu_mirrors": mirrors, "check_mirrors": True},
        cache={"page_size": 4, "max_total_tokens": 256, "max_running_requests": 16},
        scheduler={"max_unread_tokens": BOUND},
    )
    async with Engine(cfg) as engine:
        want = await run_greedy(engine, prompts, LONG.max_new_tokens)
        streams = [engine.generate(p, LONG, rid=f"r{i}") for i, p in enumerate(prompts)]
        try:
            firsts = await asyncio.wait_for(
                asyncio.gather(*(s.__anext__() for s in streams)), timeout=30
            )
        except TimeoutError:
            for i in range(len(prompts)):  # so that the engine can stop
                engine.abort(f"r{i}")
            pytest.fail("requests behind paused ones never started")
        await _settle(engine)
        counters = engine.snapshot().counters
        assert counters.backpressure_pauses >= len(prompts) - 3
        assert counters.retractions > 0
        got = []
        for first, stream in zip(firsts, streams, strict=True):
            ids = list(first.token_ids)
            async for chunk in stream:
                ids.extend(chunk.token_ids)
            got.append(ids)
        assert got == want
        await engine.wait_idle()
        assert engine.pool_usage().all_free
