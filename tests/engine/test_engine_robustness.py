"""No request can hurt the engine: bounded inputs, failure isolation, fair and bounded admission,
clear errors for misuse, and logging (issue 12, engine side)."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections import deque
from collections.abc import Iterator

import pytest
import torch
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from stallfree import Engine, EngineOverloadedError, InvalidRequestError, SamplingParams
from stallfree.runtime.execution.sampler import SamplingBatch
from stallfree.runtime.request.req import Req
from stallfree.runtime.request.sampling_params import (
    INT64_MAX,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from stallfree.runtime.scheduling.schedule_batch import ScheduleBatch
from stallfree.runtime.telemetry.observer import EngineObserver, ObserverFanout
from stallfree.runtime.text.output_processor import OutputProcessor
from stallfree.runtime.text.tokenizer import ByteTokenizer
from tests.engine_util import calls_made, engine_config, random_prompts
from tests.hf_models import VOCAB_SIZE, hf_greedy

NO_EOS = {"ignore_eos": True}
POISON_SEED = 4242


async def still_serves(engine: Engine) -> None:
    ok = await engine.complete("still serving", {"max_new_tokens": 4, **NO_EOS})
    assert ok.finish_reason == "length" and len(ok.token_ids) == 4
    await asyncio.wait_for(engine.wait_idle(), 10)
    assert engine.healthy
    assert engine.pool_usage().all_free


# ---------------------------------------------------------------- every field is bounded


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"top_k": 2**63}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"max_new_tokens": 10**309}, "max_new_tokens"),
        ({"max_new_tokens": 2**31}, "max_new_tokens"),
        ({"max_new_tokens": math.inf}, "max_new_tokens"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": 1e6}, "temperature"),
        ({"top_p": math.nan}, "top_p"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -1}, "seed"),
        ({"stop_token_ids": [2**63]}, "stop_token_ids"),
        ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, f"at most {MAX_STOP_STRINGS} items"),
        ({"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, f"at most {MAX_STOP_STRING_CHARS}"),
        ({"stop": ["ok", "\ud800"]}, "lone surrogate"),
    ],
)
def test_sampling_params_bound_every_field(fields, match):
    with pytest.raises(ValidationError, match=match):
        SamplingParams(**fields)


def test_the_bounds_themselves_are_accepted():
    p = SamplingParams(
        max_new_tokens=10**9,
        temperature=100.0,
        top_k=INT64_MAX,
        seed=INT64_MAX,
        stop=["s" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
        stop_token_ids=[INT64_MAX] * MAX_STOP_TOKEN_IDS,
    )
    assert p.max_new_tokens == 10**9


@pytest.mark.parametrize("temperature", [1e-300, 1e-40, 1e-6])
async def test_underflowing_temperatures_are_greedy(llama, temperature):
    assert SamplingParams(temperature=temperature).greedy
    prompt = list(b"tiny temperature")
    async with Engine(engine_config(llama)) as engine:
        out = await engine.complete(
            prompt, {"temperature": temperature, "seed": 1, "max_new_tokens": 8, **NO_EOS}
        )
    assert out.token_ids == hf_greedy(llama, prompt, 8)


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"top_k": VOCAB_SIZE + 1}, "top_k"),
        ({"top_k": 2**63 - 1, "temperature": 0.0}, "top_k"),
        ({"stop_token_ids": [VOCAB_SIZE]}, "stop_token_ids"),
        ({"stop_token_ids": [2**63 - 1]}, "stop_token_ids"),
    ],
)
async def test_model_dependent_bounds_are_checked_at_admission(llama, params, param):
    async with Engine(engine_config(llama)) as engine:
        with pytest.raises(InvalidRequestError) as err:
            await engine.complete("hi", {"max_new_tokens": 2, **params})
        assert err.value.param == param
        with pytest.raises(InvalidRequestError):
            engine.validator.check_prompt([1, 2], 2, params=SamplingParams(**params))
        engine.validator.check_prompt([1, 2], 2, params=SamplingParams(top_k=VOCAB_SIZE))
        await still_serves(engine)


async def test_huge_max_new_tokens_is_capped_by_the_context(llama):
    cfg = engine_config(llama, model={"max_context_len": 48})
    prompt = list(b"ten tokens")
    async with Engine(cfg) as engine:
        assert engine.validator.max_new_tokens_limit(len(prompt)) == 38
        # the explicit check refuses it, as the OpenAI routes want
        with pytest.raises(InvalidRequestError, match="at most 38 new tokens") as err:
            engine.validator.check_prompt(prompt, 10**9)
        assert err.value.code == "context_length_exceeded"
        # generate reads it as "as many as fit"
        out = await engine.complete(prompt, {"max_new_tokens": 10**9, **NO_EOS})
        assert out.finish_reason == "length" and out.completion_tokens == 38
        await still_serves(engine)


async def test_one_huge_request_does_not_starve_admission(llama):
    cfg = engine_config(llama, model={"max_context_len": 300})
    async with Engine(cfg) as engine:
        huge = asyncio.create_task(
            engine.complete("huge", {"max_new_tokens": 10**9, **NO_EOS}, rid="huge")
        )
        while engine.core.scheduler.queues.num_running == 0:
            await asyncio.sleep(0.001)
        # capped when the request was made: admission never sees 10**9
        assert engine.requests["huge"].sampling_params.max_new_tokens == 300 - 4
        small = await asyncio.wait_for(
            asyncio.gather(
                *(engine.complete(p, {"max_new_tokens": 4, **NO_EOS}) for p in random_prompts(4))
            ),
            timeout=30,
        )
        assert all(len(r.token_ids) == 4 for r in small)
        assert not huge.done(), "the small requests waited for the huge one"
        result = await huge
        assert result.finish_reason == "length" and result.completion_tokens == 300 - 4
        await still_serves(engine)


def test_admission_reserves_at_most_what_a_request_can_use():
    # a request built without the engine's cap still reserves no more than its context allows
    req = Req(
        rid="r",
        origin_input_ids=[1, 2, 3, 4],
        sampling_params=SamplingParams(max_new_tokens=10**9),
        max_context_len=300,
    )
    assert req.remaining_outputs() == 296
    req.num_scheduled_outputs = 10
    assert req.remaining_outputs() == 286
    small = Req(rid="s", origin_input_ids=[1], sampling_params=SamplingParams(max_new_tokens=5))
    assert small.remaining_outputs() == 5


async def test_a_request_the_kv_cache_can_never_hold_is_refused_at_admission(llama):
    cfg = engine_config(llama, cache={"max_total_tokens": 64})
    prompt = list(b"ten tokens")
    async with Engine(cfg) as engine:
        assert engine.validator.max_new_tokens_limit(len(prompt)) == 54
        with pytest.raises(InvalidRequestError, match="KV cache holds 64 tokens") as err:
            engine.validator.check_prompt(prompt, 100)
        assert (err.value.code, err.value.param) == ("kv_capacity_exceeded", "max_tokens")
        with pytest.raises(InvalidRequestError, match="KV cache holds 64 tokens") as err:
            await engine.complete(prompt, {"max_new_tokens": 100, **NO_EOS})
        assert (err.value.code, err.value.param) == ("kv_capacity_exceeded", "max_tokens")
        with pytest.raises(InvalidRequestError, match="KV cache") as err:
            engine.validator.check_prompt([1] * 70)
        assert err.value.code == "kv_capacity_exceeded"
        # what fits runs to its end; more than the context asks for all that fits
        fits = await engine.complete(prompt, {"max_new_tokens": 54, **NO_EOS})
        assert fits.finish_reason == "length" and fits.completion_tokens == 54
        most = await engine.complete(prompt, {"max_new_tokens": 10**9, **NO_EOS})
        assert most.finish_reason == "length" and most.completion_tokens == 54
        await still_serves(engine)


async def test_asking_for_the_whole_context_gets_what_the_kv_cache_holds(llama):
    # a context longer than the KV cache, as with many real models and the default pool
    cfg = engine_config(llama, model={"max_context_len": 100}, cache={"max_total_tokens": 64})
    prompt = list(b"ten tokens")
    async with Engine(cfg) as engine:
        assert engine.validator.max_new_tokens_limit(len(prompt)) == 54
        whole = await engine.complete(prompt, {"max_new_tokens": 90, **NO_EOS})
        assert whole.finish_reason == "length" and whole.completion_tokens == 54
        with pytest.raises(InvalidRequestError) as err:
            await engine.complete(prompt, {"max_new_tokens": 89, **NO_EOS})
        assert err.value.code == "kv_capacity_exceeded"
        await still_serves(engine)


# ---------------------------------------------------------------- failure isolation


def poison_sampling(monkeypatch) -> None:
    original = SamplingBatch.build.__func__  # type: ignore[attr-defined]

    def build(cls, params, steps, upload):
        if any(p.seed == POISON_SEED for p in params):
            raise OverflowError("poisoned sampling params")
        return original(cls, params, steps, upload)

    monkeypatch.setattr(SamplingBatch, "build", classmethod(build))


def poison_extend(monkeypatch) -> None:
    original = ScheduleBatch.prepare_for_extend

    def prepare_for_extend(self, extend_lens):
        original(self, extend_lens)  # slots and pages are taken: they must come back
        if any(r.sampling_params.seed == POISON_SEED for r in self.reqs):
            raise RuntimeError("poisoned extend")

    monkeypatch.setattr(ScheduleBatch, "prepare_for_extend", prepare_for_extend)


def poison_forward_batch(monkeypatch) -> None:
    original = ScheduleBatch.to_forward_batch

    def to_forward_batch(self):
        if any(r.sampling_params.seed == POISON_SEED for r in self.reqs):
            raise RuntimeError("poisoned plug-in hook")
        return original(self)

    monkeypatch.setattr(ScheduleBatch, "to_forward_batch", to_forward_batch)


@pytest.mark.parametrize("poison", [poison_sampling, poison_extend, poison_forward_batch])
@pytest.mark.parametrize("overlap", [True, False])
async def test_a_batch_that_fails_to_launch_fails_alone(
    llama, monkeypatch, caplog, poison, overlap
):
    poison(monkeypatch)
    prompts = random_prompts(3, seed=5)
    cfg = engine_config(llama, runtime={"overlap": overlap, "max_consecutive_step_failures": 2})
    async with Engine(cfg) as engine:
        survivors = [
            asyncio.create_task(engine.complete(p, {"max_new_tokens": 40, **NO_EOS}))
            for p in prompts
        ]
        while engine.snapshot().counters.generation_tokens < 6:
            await asyncio.sleep(0.001)
        # more poisoned batches than the consecutive failures that would fail a device closed
        poisoned = []
        for i in range(4):
            poisoned.append(
                await engine.complete(
                    "poison", {"seed": POISON_SEED, "max_new_tokens": 5, **NO_EOS}, rid=f"bad-{i}"
                )
            )
            assert engine.healthy
        results = await asyncio.wait_for(asyncio.gather(*survivors), 60)
        for r in poisoned:
            assert r.finish_reason == "error"
            assert "could not run this request's batch" in r.error and "poisoned" in r.error
        for prompt, r in zip(prompts, results, strict=True):
            assert r.finish_reason == "length", r.error
            assert r.token_ids == hf_greedy(llama, prompt, 40)
        counters = engine.snapshot().counters
        assert counters.launch_failures == 4 and counters.step_failures == 0
        await still_serves(engine)
    failures = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert any("bad-0" in r.getMessage() for r in failures)


async def test_a_failing_decode_batch_fails_its_requests_and_the_engine_serves_on(
    llama, monkeypatch
):
    original = ScheduleBatch.to_forward_batch

    def to_forward_batch(self):
        if any(r.sampling_params.seed == POISON_SEED and len(r.output_ids) >= 3 for r in self.reqs):
            raise RuntimeError("poisoned decode")
        return original(self)

    monkeypatch.setattr(ScheduleBatch, "to_forward_batch", to_forward_batch)
    async with Engine(engine_config(llama)) as engine:
        r = await engine.complete("poison", {"seed": POISON_SEED, "max_new_tokens": 20, **NO_EOS})
        assert r.finish_reason == "error" and "poisoned decode" in r.error
        assert 3 <= r.completion_tokens < 20
        await still_serves(engine)


async def test_an_observer_that_raises_harms_nothing(llama, caplog):
    class Broken(EngineObserver):
        def on_request_added(self, req: Req) -> None:
            raise ValueError("broken observer")

        def on_tokens(self, req: Req, count: int, now: float) -> None:
            raise ValueError("broken observer")

        def on_step(self, num_reqs: int, decode: bool, overlapped: bool) -> None:
            raise ValueError("broken observer")

    prompts = random_prompts(3, seed=8)
    async with Engine(engine_config(llama)) as engine:
        engine.add_observer(Broken())
        results = await asyncio.gather(
            *(engine.complete(p, {"max_new_tokens": 6, **NO_EOS}) for p in prompts)
        )
        assert [r.token_ids for r in results] == [hf_greedy(llama, p, 6) for p in prompts]
        await still_serves(engine)
    assert sum("broken observer" in str(r.exc_info) for r in caplog.records) == 3  # once a hook
    assert isinstance(engine.core.observers, ObserverFanout)


# ---------------------------------------------------------------- the waiting queue


async def test_the_waiting_queue_is_bounded_by_default(llama):
    cfg = engine_config(llama, cache={"max_running_requests": 2})
    assert cfg.scheduler.max_waiting_requests is None
    async with Engine(cfg) as engine:
        assert engine.max_waiting_requests == 8  # 4 per request slot
        hogs = [
            asyncio.create_task(engine.complete(f"hog {i}", {"max_new_tokens": 900, **NO_EOS}))
            for i in range(2)
        ]
        while engine.core.scheduler.queues.num_running < 2:
            await asyncio.sleep(0.001)
        queued = [
            asyncio.create_task(engine.complete(p, {"max_new_tokens": 3, **NO_EOS}))
            for p in random_prompts(8)
        ]
        while engine.core.scheduler.queues.num_waiting < 8:
            await asyncio.sleep(0.001)
        with pytest.raises(EngineOverloadedError, match=r"waiting queue is full \(8 requests\)"):
            await engine.complete("one too many", {"max_new_tokens": 3})
        for hog in hogs:
            hog.cancel()
        results = await asyncio.gather(*queued)
        assert all(len(r.token_ids) == 3 for r in results)
        await still_serves(engine)
    explicit = engine_config(llama, scheduler={"max_waiting_requests": 3})
    async with Engine(explicit) as engine:
        assert engine.max_waiting_requests == 3


class _NoScan(deque):
    """A waiting queue that fails the test when anything walks it."""

    def _scanned(self, *args: object) -> None:
        raise AssertionError("the waiting queue was scanned")

    __iter__ = __reversed__ = __contains__ = count = index = copy = _scanned  # type: ignore


async def test_health_and_snapshot_stay_cheap_with_thousands_queued(llama):
    """O(1) in the queue: a health check and a snapshot make as many calls with 3000 requests
    waiting as with none, and never walk the waiting queue."""
    n = 3000
    cfg = engine_config(
        llama,
        cache={"max_running_requests": 1},
        scheduler={"max_waiting_requests": n},
        # the hog's steps are slow, so nothing queued is admitted while this test counts
        faults={"enabled": True, "slow_step_rate": 1.0, "slow_step_seconds": 0.05},
    )

    def probe() -> None:
        assert engine.healthy and engine.accepting
        engine.snapshot()

    async with Engine(cfg) as engine:
        scheduler = engine.core.scheduler
        hog = asyncio.create_task(engine.complete("hog", {"max_new_tokens": 900, **NO_EOS}))
        while scheduler.queues.num_running == 0:
            await asyncio.sleep(0.001)
        idle = min(calls_made(probe) for _ in range(5))
        queued = [
            asyncio.create_task(engine.complete([1, 2, 3], {"max_new_tokens": 1})) for _ in range(n)
        ]
        try:
            while scheduler.queues.num_waiting < n:
                await asyncio.sleep(0.01)
            # no await from here to the restore: the scheduler cannot touch the swapped queue
            waiting, scheduler.queues.waiting = (
                scheduler.queues.waiting,
                _NoScan(scheduler.queues.waiting),
            )
            try:
                busy = [calls_made(probe) for _ in range(200)]
                assert engine.snapshot().waiting == n
            finally:
                scheduler.queues.waiting = waiting
            # a walk over the queue would cost thousands of calls; the margin is for the hog's
            # state (prefill or decode) differing between the two counts
            assert max(busy) <= idle + 16, (idle, max(busy))
        finally:
            hog.cancel()
            for task in queued:
                task.cancel()
            await asyncio.gather(hog, *queued, return_exceptions=True)
        await asyncio.wait_for(engine.wait_idle(), 30)
        assert engine.pool_usage().all_free


# ---------------------------------------------------------------- misuse


async def test_use_from_another_thread_or_loop_is_a_clear_error(llama):
    async with Engine(engine_config(llama)) as engine:
        assert engine.loop is asyncio.get_running_loop()

        def elsewhere(make):
            async def run():
                # NOTE: without the check this would hang; the timeout makes that a failure
                return await asyncio.wait_for(make(), 5)

            try:
                return uvloop.run(run())
            except BaseException as exc:
                return exc

        async def consume_generate():
            return [c async for c in engine.generate("x", {"max_new_tokens": 2})]

        async def consume_imported():
            return [c async for c in engine.generate_imported([1, 2], [], 3)]

        async def call_abort():
            return engine.abort("nope")

        for make in (
            lambda: engine.complete("x", {"max_new_tokens": 2}),
            consume_generate,
            consume_imported,
            call_abort,
        ):
            exc = await asyncio.to_thread(elsewhere, make)
            assert isinstance(exc, RuntimeError) and "another event loop or thread" in str(exc)
        with pytest.raises(RuntimeError, match="another event loop or thread"):
            await asyncio.to_thread(engine.abort, "nope")

        # the way that works: hand the coroutine to the engine's loop
        def submit() -> int:
            coro = engine.complete("x", {"max_new_tokens": 2, **NO_EOS})
            return len(asyncio.run_coroutine_threadsafe(coro, engine.loop).result(30).token_ids)

        assert await asyncio.to_thread(submit) == 2
        await still_serves(engine)


async def test_a_refused_kv_import_leaves_nothing_behind(llama):
    async with Engine(engine_config(llama, cache={"page_size": 4})) as engine:
        shape = engine.core.ctx.kv_cache.shape
        prompt = list(b"imported")

        def kv(
            n: int = len(prompt), layers: int = shape.num_layers, heads: int = shape.num_kv_heads
        ):
            t = torch.zeros(n, heads, shape.head_dim)
            return [(t, t.clone()) for _ in range(layers)]

        bad = [
            (kv(layers=1), 3),
            (kv(n=len(prompt) + 1), 3),
            (kv(heads=shape.num_kv_heads + 1), 3),
            ([("k", "v")] * shape.num_layers, 3),
            (kv(), VOCAB_SIZE),
            (kv(), -1),
        ]
        for layers, first in bad:
            with pytest.raises(InvalidRequestError):
                async for _ in engine.generate_imported(prompt, layers, first, rid="pb"):
                    pass
            assert not engine.requests
            assert engine.pool_usage().all_free
        ids = [
            t
            for c in [
                c
                async for c in engine.generate_imported(
                    prompt, kv(), 3, {"max_new_tokens": 4, **NO_EOS}, rid="pb"
                )
            ]
            for t in c.token_ids
        ]
        assert len(ids) == 4 and ids[0] == 3
        await still_serves(engine)


async def test_start_after_shutdown_raises_and_is_not_healthy(llama):
    engine = Engine(engine_config(llama))
    await engine.start()
    assert engine.healthy
    await engine.shutdown()
    assert not engine.healthy and not engine.accepting
    with pytest.raises(RuntimeError, match="shut down; build a new one"):
        await engine.start()
    assert not engine.healthy and not engine.accepting


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        (123, "not int"),
        (None, "not NoneType"),
        (1.5, "not float"),
        (b"bytes", "not bytes"),
        ({"a": 1}, "not dict"),
        ([1, "a"], "item 1 is str"),
        ([1, 2.0], "item 1 is float"),
        ([True, 1], "item 0 is bool"),
        ([[1, 2]], "item 0 is list"),
        ([1, 10**30], "out of range"),
        ([1, 10**5000], "out of range"),
        ([1, -1], "out of range"),
        ("a\ud800b", "lone surrogate"),
        (torch.tensor([1.0, 2.0]), "integer dtype"),
    ],
)
async def test_a_bad_prompt_is_an_invalid_request(llama, prompt, match):
    async with Engine(engine_config(llama)) as engine:
        with pytest.raises(InvalidRequestError, match=match):
            await engine.complete(prompt, {"max_new_tokens": 2})
        if isinstance(prompt, list):
            with pytest.raises(InvalidRequestError, match=match):
                engine.validator.check_prompt(prompt)
        if isinstance(prompt, str):
            with pytest.raises(InvalidRequestError, match=match) as err:
                engine.validator.encode(prompt)
            assert err.value.param == "prompt"
        await still_serves(engine)


async def test_bad_rids_and_timeouts_are_invalid_requests(llama):
    async with Engine(engine_config(llama)) as engine:
        for rid in (123, "", "r" * 257):
            with pytest.raises(InvalidRequestError, match="rid"):
                await engine.complete("x", {"max_new_tokens": 2}, rid=rid)
        for timeout in (math.nan, math.inf, -1.0, 0, "1"):
            with pytest.raises(InvalidRequestError, match="timeout"):
                await engine.complete("x", {"max_new_tokens": 2}, timeout=timeout)
        with pytest.raises(InvalidRequestError, match="params"):
            await engine.complete("x", [1, 2])
        await still_serves(engine)


# ---------------------------------------------------------------- stop strings stay cheap


def test_the_most_stop_strings_keep_the_per_token_cost_bounded(monkeypatch):
    """The stop-string search per token is bounded by the stop strings, not by the output: one
    search per token, over a window that does not grow however long the output gets."""
    from stallfree.runtime.text import output_processor

    searched: list[int] = []  # characters each token's search looks at, over every stop string
    real_find_stop = output_processor.find_stop

    def counting_find_stop(text: str, stops: list[str], start: int) -> int | None:
        searched.append(sum(len(text) - max(0, start - len(s) + 1) for s in stops))
        return real_find_stop(text, stops, start)

    monkeypatch.setattr(output_processor, "find_stop", counting_find_stop)
    processor = OutputProcessor(ByteTokenizer(), EngineObserver())
    n = 3000
    most = [f"{i:03d}" + "#" * (MAX_STOP_STRING_CHARS - 3) for i in range(MAX_STOP_STRINGS)]
    params = SamplingParams(max_new_tokens=n, stop=most)
    req = Req(rid="r", origin_input_ids=[1], sampling_params=params)
    processor.add(req)
    text = b"abcdefghijklmnopqrstuvwxyz " * (n // 27 + 1)
    for tok in text[:n]:
        assert not processor.on_token(req, tok, 0.0)
        assert processor.held_text_len(req) <= MAX_STOP_STRING_CHARS
    processor.discard(req)
    assert len(searched) == n
    # each stop string is looked for where it could end in the new character: its own length
    bound = MAX_STOP_STRINGS * MAX_STOP_STRING_CHARS
    assert max(searched) <= bound, max(searched)
    # and the window is as wide at the end of the output as once the held text is full
    assert max(searched[-100:]) == max(
        searched[MAX_STOP_STRING_CHARS : MAX_STOP_STRING_CHARS + 100]
    )


# ---------------------------------------------------------------- logging


async def test_start_up_and_request_logs(llama, caplog):
    caplog.set_level(logging.INFO, logger="stallfree")
    cfg = engine_config(llama, runtime={"log_requests": True})
    async with Engine(cfg) as engine:
        await engine.complete("logged", {"max_new_tokens": 3, **NO_EOS}, rid="rid-logged")
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("stallfree.runtime")]
    start = next(line for line in lines if line.startswith("engine started"))
    for part in (f"model={llama}", "device=cpu", "dtype=float32", "overlap=on", "cpu_mirrors=on"):
        assert part in start
    assert "kv_slots=16384" in start and "request_slots=256" in start
    arrived = next(line for line in lines if "rid-logged arrived" in line)
    assert "6 prompt tokens" in arrived
    finished = next(line for line in lines if "rid-logged finished" in line)
    assert "length" in finished and "3 output tokens" in finished and "6 prompt tokens" in finished

    caplog.clear()
    async with Engine(engine_config(llama)) as engine:
        await engine.complete("quiet", {"max_new_tokens": 2}, rid="rid-quiet")
    assert not any("rid-quiet" in r.getMessage() for r in caplog.records)


async def test_failing_closed_is_logged_at_error(llama, caplog):
    cfg = engine_config(
        llama,
        runtime={"max_consecutive_step_failures": 2},
        faults={"enabled": True, "fail_step_rate": 1.0},
    )
    async with Engine(cfg) as engine:
        await asyncio.wait_for(engine.complete("doomed", {"max_new_tokens": 3}, rid="doomed"), 30)
        await asyncio.sleep(0.05)
        assert not engine.healthy
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("failed closed" in m for m in errors)
    assert any("doomed" in m for m in errors)


# ---------------------------------------------------------------- fuzzed fields


class EngineThread:
    """An engine on its own loop thread, so a synchronous hypothesis test can call it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(engine.start())

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.call(self.engine.shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def fuzz_engine(llama) -> Iterator[EngineThread]:
    engine = Engine(engine_config(llama, model={"max_context_len": 64}))
    runner = EngineThread(engine)
    yield runner
    runner.close()


def anything() -> st.SearchStrategy:
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.integers(min_value=2**62, max_value=2**70),
        st.integers(min_value=-(2**70), max_value=-1),
        st.floats(allow_nan=True, allow_infinity=True),
        st.floats(min_value=0, max_value=1e-30),
        st.text(max_size=8),
        st.sampled_from(["\ud800", "a\udfffb"]),
    )
    return st.one_of(scalars, st.lists(scalars, max_size=4))


FIELDS = ["max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "stop"]


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    fields=st.dictionaries(st.sampled_from(FIELDS), anything(), max_size=4),
    prompt=st.one_of(anything(), st.lists(st.integers(), min_size=1, max_size=6)),
)
def test_fuzzed_fields_are_refused_or_served_and_the_engine_stays_whole(
    fuzz_engine, fields, prompt
):
    engine = fuzz_engine.engine

    async def one():
        try:
            r = await engine.complete(prompt, {**fields, "ignore_eos": True})
        except (ValidationError, InvalidRequestError):
            return
        assert r.finish_reason in ("stop", "length"), r.error

    fuzz_engine.call(one())

    async def after():
        assert engine.healthy
        await still_serves(engine)

    fuzz_engine.call(after())
