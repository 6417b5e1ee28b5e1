"""The overlap scheduler: one step ahead, zero schedule-path syncs, deferred free, no leaks."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
import torch

from stallfree import Engine
from stallfree.runtime.execution.model_runner import StepOutput
from stallfree.runtime.request.req import FinishReason
from stallfree.runtime.scheduling.scheduler import Scheduler
from tests.batch_harness import make_req
from tests.engine_util import engine_config, random_prompts, run_greedy


def _launch(sched: Scheduler, computed: Counter) -> tuple | None:
    batch = sched.get_next_batch()
    if batch is None:
        return None
    for req, n in zip(batch.reqs, batch.extend_lens_cpu, strict=True):
        computed[req.rid] += n
    return sched.on_launched(), list(batch.reqs), list(batch.output_rows)


def _process(sched: Scheduler, launched: tuple, token: int = 1) -> None:
    seq, reqs, rows = launched
    sched.process(StepOutput(seq, reqs, rows, [token] * len(reqs)))


def test_scheduler_runs_one_step_ahead_without_over_scheduling(make_scheduler):
    sched = make_scheduler(num_tokens=512, chunked_prefill_size=4)
    reqs = [
        make_req(f"r{i}", n, max_new_tokens=m) for i, (n, m) in enumerate([(3, 5), (9, 2), (5, 1)])
    ]
    for r in reqs:
        sched.add_request(r)
    computed: Counter = Counter()
    first = _launch(sched, computed)
    second = _launch(sched, computed)  # scheduled before any result arrived
    assert first is not None and second is not None
    in_flight = [first, second]
    while in_flight:
        _process(sched, in_flight.pop(0))
        nxt = _launch(sched, computed)
        if nxt is not None:
            in_flight.append(nxt)
    for r in reqs:
        assert r.finished_reason is FinishReason.LENGTH
        assert len(r.output_ids) == r.sampling_params.max_new_tokens
        # prompt + one decode input per output after the first; no lag token is needed when the
        # limit is known on the host
        assert computed[r.rid] == len(r.origin_input_ids) + r.sampling_params.max_new_tokens - 1
    sched.ctx.stream.synchronize()
    assert sched.ctx.allocator.available_pages() == sched.ctx.allocator.num_pages
    assert sched.ctx.req_to_token_pool.available_size() == sched.ctx.req_to_token_pool.size


def test_eos_costs_at_most_one_dropped_lag_token_and_aborts_land_in_order(make_scheduler):
    sched = make_scheduler(num_tokens=512)
    eos = 99
    a = make_req("a", 4, max_new_tokens=50)
    a.eos_token_ids = frozenset({eos})
    b = make_req("b", 4, max_new_tokens=50)
    for r in (a, b):
        sched.add_request(r)
    computed: Counter = Counter()
    launched = [_launch(sched, computed), _launch(sched, computed)]  # prefill, then first decode
    _process(sched, launched.pop(0))  # first tokens
    launched.append(_launch(sched, computed))
    # batch 2's result: `a` emits EOS while batch 3 (which still holds `a`) is in flight
    seq, reqs, rows = launched.pop(0)
    sched.process(StepOutput(seq, reqs, rows, [eos if r is a else 1 for r in reqs]))
    assert a.finished_reason is FinishReason.STOP
    assert a.req_pool_idx is not None  # deferred: batch 3 may still read its slots
    # abort `b` while batch 3 is in flight and batch 4 is launched
    launched.append(_launch(sched, computed))
    sched.abort(b)
    assert b.finished_reason is FinishReason.ABORT and b.req_pool_idx is not None
    outputs_before = (list(a.output_ids), list(b.output_ids))
    while launched:
        _process(sched, launched.pop(0))
        nxt = _launch(sched, computed)
        assert nxt is None  # nothing schedules a finished or aborted request again
    assert (list(a.output_ids), list(b.output_ids)) == outputs_before  # lag tokens dropped
    assert a.req_pool_idx is None and b.req_pool_idx is None
    assert computed["a"] <= len(a.origin_input_ids) + len(a.output_ids) - 1 + 1
    assert sched.ctx.allocator.available_pages() == sched.ctx.allocator.num_pages


async def test_zero_schedule_path_reads_over_200_decode_steps_with_mirrors(llama):
    cfg = engine_config(llama, runtime={"strict": True, "overlap": True, "cpu_mirrors": True})
    async with Engine(cfg) as engine:
        await run_greedy(engine, random_prompts(4, seed=3), 200)
        assert engine.snapshot().counters.decode_batches >= 199
        assert engine.core.monitor.schedule_path_reads == 0
        assert engine.core.monitor.total_stalls() == 0
        # one read of the lengths mirror per decode step, where legacy would sync once
        decode_steps = engine.snapshot().counters.decode_batches
        assert engine.core.monitor.mirror_reads["seq_lens_cpu"] == decode_steps
        assert engine.snapshot().counters.overlap_steps >= 199


async def test_legacy_mode_stalls_at_every_mirror_site(llama):
    cfg = engine_config(
        llama,
        runtime={"overlap": True, "cpu_mirrors": False},
        cache={"page_size": 4, "max_total_tokens": 160, "max_running_requests": 8},
    )
    async with Engine(cfg) as engine:
        await run_greedy(engine, random_prompts(8, seed=4), 40)
        assert engine.snapshot().counters.retractions > 0
        for site in ("schedule.page_count", "schedule.retract"):
            assert engine.core.monitor.stall_counts[site] > 0, site
        assert engine.core.monitor.mirror_reads == {}


@pytest.mark.parametrize("overlap", [True, False])
async def test_no_leaks_after_random_cancellations(llama, overlap):
    rng = random.Random(5)
    cfg = engine_config(
        llama,
        runtime={"overlap": overlap, "check_mirrors": True},
        cache={"page_size": 2, "max_total_tokens": 256, "max_running_requests": 12},
        scheduler={"chunked_prefill_size": 16},
    )
    async with Engine(cfg) as engine:
        prompts = random_prompts(24, seed=6)

        async def one(p: list[int]) -> int:
            n = 0
            async for chunk in engine.generate(p, {"max_new_tokens": 30, "ignore_eos": True}):
                n += len(chunk.token_ids)
            return n

        tasks = [asyncio.create_task(one(p)) for p in prompts]
        for _ in range(10):
            await asyncio.sleep(rng.uniform(0.001, 0.02))
            rng.choice(tasks).cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        cancelled = sum(isinstance(r, asyncio.CancelledError) for r in results)
        assert 0 < cancelled <= 10
        assert all(r == 30 for r in results if isinstance(r, int))
        await engine.wait_idle()
        assert engine.pool_usage().all_free


# ---------------------------------------------------------------------------- debug checks


def test_abort_between_steps_is_not_a_parity_mismatch(make_scheduler):
    """Overlap off: an abort between steps frees the request at once; the next schedule merges
    the last prefill into the running batch that still holds it. The checker must not fire."""
    sched = make_scheduler(num_tokens=512)
    assert sched.ctx.check_mirrors
    a, b, c = make_req("a", 4, 20), make_req("b", 5, 20), make_req("c", 3, 20)
    sched.add_request(a)
    sched.add_request(b)
    computed: Counter = Counter()
    _process(sched, _launch(sched, computed))  # prefill a, b
    _process(sched, _launch(sched, computed))  # decode a, b
    sched.add_request(c)
    _process(sched, _launch(sched, computed))  # prefill c
    sched.abort(a)
    assert a.req_pool_idx is None  # nothing in flight: released at once
    launched = _launch(sched, computed)
    assert launched is not None and [r.rid for r in launched[1]] == ["b", "c"]
    _process(sched, launched)


async def test_a_failing_debug_check_fails_its_batch_not_the_engine(llama, monkeypatch):
    from stallfree.runtime.scheduling import schedule_batch

    real = schedule_batch.alloc_for_extend

    def wrong_mirror(ctx, reqs, lens):
        out, device, host = real(ctx, reqs, lens)
        return out, device, host + 1

    cfg = engine_config(llama, runtime={"overlap": False, "check_mirrors": True})
    async with Engine(cfg) as engine:
        assert engine.core.ctx.check_mirrors and engine.core.ctx.future_map.debug
        monkeypatch.setattr(schedule_batch, "alloc_for_extend", wrong_mirror)
        bad = await engine.complete([1, 2, 3], {"max_new_tokens": 3, "ignore_eos": True})
        assert bad.finish_reason == "error" and "MirrorParityError" in bad.error
        monkeypatch.undo()
        assert engine.healthy
        ok = await engine.complete([1, 2, 3], {"max_new_tokens": 3, "ignore_eos": True})
        assert ok.error is None
        await engine.wait_idle()
        assert engine.pool_usage().all_free
    async with Engine(engine_config(llama, runtime={"check_mirrors": False})) as engine:
        assert not engine.core.ctx.check_mirrors and not engine.core.ctx.future_map.debug


async def test_wait_idle_raises_once_the_scheduler_loop_is_dead(llama, monkeypatch):
    from stallfree.runtime.request.errors import EngineUnhealthyError
    from stallfree.runtime.scheduling.scheduler import Scheduler

    async with Engine(engine_config(llama)) as engine:
        real = Scheduler.process
        calls = 0

        def dies_on_the_fifth_call(self, out):
            nonlocal calls
            calls += 1
            if calls == 5:
                raise RuntimeError("scheduler bug")  # escapes the loop: nothing catches it
            return real(self, out)

        monkeypatch.setattr(Scheduler, "process", dies_on_the_fifth_call)
        result = await engine.complete([1, 2, 3], {"max_new_tokens": 50, "ignore_eos": True})
        assert result.finish_reason == "error" and "scheduler bug" in result.error
        assert not engine.healthy
        with pytest.raises(EngineUnhealthyError, match="scheduler bug"):
            await asyncio.wait_for(engine.wait_idle(), timeout=10)
        with pytest.raises(RuntimeError, match="scheduler bug"):
            await engine.shutdown()


def test_future_map_refuses_a_slot_never_stashed():
    from stallfree.overlap.future_map import FutureMap, FutureMapError

    fmap = FutureMap(8, torch.device("cpu"))
    fmap.enable_debug()
    gen = fmap.plan_stash([3, 5])
    fmap.stash(torch.tensor([3, 5]), torch.tensor([0, 1]), torch.tensor([41, 42]), gen)
    expected = fmap.plan_resolve([5, 3])
    assert fmap.resolve(torch.tensor([5, 3]), torch.tensor(expected)).tolist() == [42, 41]
    with pytest.raises(FutureMapError, match=r"slot\(s\) \[3\]"):
        fmap.plan_resolve([3])  # consumed already, and not stashed again
    with pytest.raises(FutureMapError, match=r"\[6\]"):
        fmap.plan_resolve([6])  # never stashed
    # on the device: a resolve by row (0, 1) instead of by slot (3, 5) reads no stash of its step
    gen = fmap.plan_stash([3, 5])
    fmap.stash(torch.tensor([3, 5]), torch.tensor([0, 1]), torch.tensor([7, 8]), gen)
    expected = torch.tensor(fmap.plan_resolve([3, 5]))
    with pytest.raises(FutureMapError, match="slot 0 holds stash -1, wants"):
        fmap.resolve(torch.tensor([0, 1]), expected)
    # a prefill of a reused slot drops the stale stash of its earlier owner
    fmap.plan_stash([2])
    fmap.plan_prefill([2])
    with pytest.raises(FutureMapError):
        fmap.plan_resolve([2])


async def test_future_map_debug_catches_a_lost_stash_in_the_engine(llama, monkeypatch):
    from stallfree.overlap.future_map import FutureMap

    real = FutureMap.stash
    calls = 0

    def loses_the_third(self, slots, rows, next_ids, generation=None):
        nonlocal calls
        calls += 1
        if calls != 3:
            real(self, slots, rows, next_ids, generation)

    monkeypatch.setattr(FutureMap, "stash", loses_the_third)
    cfg = engine_config(llama, runtime={"check_mirrors": True})
    async with Engine(cfg) as engine:
        result = await engine.complete([1, 2, 3], {"max_new_tokens": 8, "ignore_eos": True})
        assert result.finish_reason == "error"
        assert "not stashed for this step" in result.error
        await engine.wait_idle()
        assert engine.pool_usage().all_free and engine.healthy
