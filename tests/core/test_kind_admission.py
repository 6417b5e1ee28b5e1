"""The scheduler, driven by hand, with pooling (embedding) and generation requests in one queue:
a step holds one kind (the chunked request's, else the queue head's), the other kind keeps its
place and leads a later step, mixed steps never take pooling rows, and pooling requests neither
match nor feed the prefix cache."""

from __future__ import annotations

import pytest
import torch

from stallfree.runtime.execution.model_runner import StepOutput
from stallfree.runtime.model.forward_batch import ForwardMode
from stallfree.runtime.request.req import FinishReason, Req
from stallfree.runtime.request.sampling_params import SamplingParams
from stallfree.runtime.scheduling.schedule_batch import ScheduleBatch
from stallfree.runtime.scheduling.scheduler import Scheduler

Launched = tuple[int, ScheduleBatch, list[Req], list[bool]]
P = list(range(10, 50))  # a 40-token shared prefix


def _gen(rid: str, prompt: list[int], max_new_tokens: int = 3) -> Req:
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    return Req(rid=rid, origin_input_ids=list(prompt), sampling_params=params)


def _pool(rid: str, prompt: list[int]) -> Req:
    params = SamplingParams(max_new_tokens=1)
    return Req(rid=rid, origin_input_ids=list(prompt), sampling_params=params, pooling="mean")


def _launch(sched: Scheduler) -> Launched | None:
    batch = sched.get_next_batch()
    if batch is None:
        return None
    return sched.on_launched(), batch, list(batch.reqs), list(batch.output_rows)


def _process(sched: Scheduler, launched: Launched) -> None:
    seq, _, reqs, rows = launched
    pooled = None
    if any(r.pooling is not None for r in reqs):
        pooled = torch.ones(len(reqs), 4)
    sched.process(StepOutput(seq, reqs, rows, [7] * len(reqs), pooled=pooled))


def _run(sched: Scheduler) -> list[tuple[list[str], ForwardMode]]:
    """Drain as the overlap loop does (launch N+1, then process N); each step's rids, mode."""
    steps: list[tuple[list[str], ForwardMode]] = []
    in_flight: list[Launched] = []
    for _ in range(1000):
        nxt = _launch(sched)
        if nxt is not None:
            in_flight.append(nxt)
            steps.append(([r.rid for r in nxt[2]], nxt[1].forward_mode))
        if in_flight and (nxt is None or len(in_flight) > 1):
            _process(sched, in_flight.pop(0))
        if not in_flight and not sched.queues.has_work():
            return steps
    raise AssertionError("did not drain")


def _kinds(steps: list[tuple[list[str], ForwardMode]]) -> list[set[str]]:
    return [{rid[0] for rid in rids} for rids, _ in steps]


@pytest.mark.parametrize("mixed", [False, True])
def test_each_step_holds_one_kind_and_each_kind_keeps_its_order(make_scheduler, mixed):
    sched = make_scheduler(max_prefill_tokens=64, chunked_prefill_size=16, enable_mixed_chunk=mixed)
    reqs = [
        _gen("g0", range(1, 9)),
        _pool("p0", range(20, 60)),  # longer than a chunk
        _gen("g1", range(30, 36)),
        _pool("p1", range(40, 45)),
        _gen("g2", range(50, 54)),
    ]
    for req in reqs:
        sched.add_request(req)
    steps = _run(sched)
    assert all(len(kinds) == 1 for kinds in _kinds(steps))
    # the head (g0) leads: the generation prompts go first, the pooling inputs wait in order
    assert steps[0][0] == ["g0", "g1", "g2"]
    # p0 in three chunks of 16, 16 and 8; its last chunk's step takes p1 (of its kind)
    assert [rids for rids, _ in steps if rids[0][0] == "p"] == [["p0"], ["p0"], ["p0", "p1"]]
    # pooling rows only ever run in extend steps with no decode rows
    assert all(mode is ForwardMode.EXTEND for rids, mode in steps if rids[0][0] == "p")
    assert all(req.finished_reason is not None for req in reqs)
    assert [r.finished_reason for r in reqs if r.pooling] == [FinishReason.STOP] * 2
    assert sched.stats.mixed_batches == 0  # a pooling input always headed the queue
    pool = sched.ctx.req_to_token_pool
    assert pool.available_size() == pool.size
    assert sched.ctx.allocator.free_page_count() == sched.ctx.allocator.num_pages


def test_a_chunked_pooling_request_keeps_generation_waiting_until_its_last_chunk(
    make_scheduler,
):
    sched = make_scheduler(max_prefill_tokens=64, chunked_prefill_size=16)
    long_pool = _pool("p0", range(1, 41))
    sched.add_request(long_pool)
    first = _launch(sched)
    assert first is not None and first[2] == [long_pool]
    sched.add_request(_gen("g0", range(5, 9)))
    sched.add_request(_pool("p1", range(60, 64)))
    # the chunk goes on; its last chunk takes p1 (its kind) and passes over g0
    second = _launch(sched)
    assert second is not None and second[2] == [long_pool]
    _process(sched, first)
    third = _launch(sched)
    assert third is not None and [r.rid for r in third[2]] == ["p0", "p1"]
    _process(sched, second)
    fourth = _launch(sched)
    assert fourth is not None and [r.rid for r in fourth[2]] == ["g0"]
    _process(sched, third)
    _process(sched, fourth)
    assert long_pool.finished_reason is FinishReason.STOP and long_pool.pooled is not None
    _run(sched)
    assert sched.ctx.allocator.free_page_count() == sched.ctx.allocator.num_pages


def test_mixed_steps_take_generation_prompts_only(make_scheduler):
    sched = make_scheduler(max_prefill_tokens=64, chunked_prefill_size=32, enable_mixed_chunk=True)
    g0 = _gen("g0", range(1, 6), max_new_tokens=8)
    sched.add_request(g0)
    launched = _launch(sched)
    assert launched is not None
    _process(sched, launched)
    # g0 decodes; a pooling input heads the queue, a generation prompt behind it
    sched.add_request(_pool("p0", range(10, 20)))
    sched.add_request(_gen("g1", range(30, 36)))
    alone = _launch(sched)
    assert alone is not None and [r.rid for r in alone[2]] == ["p0"]
    assert alone[1].mixed_rows == 0
    _process(sched, alone)
    mixed = _launch(sched)  # then the decode row joins g1's prompt
    assert mixed is not None and [r.rid for r in mixed[2]] == ["g1", "g0"]
    assert mixed[1].mixed_rows == 1 and sched.stats.mixed_batches == 1
    _process(sched, mixed)


def test_pooling_requests_neither_match_nor_feed_the_prefix_cache(make_scheduler):
    sched = make_scheduler(prefix_cache=True, max_context=256, new_token_ratio=0.0)
    cache = sched.cache
    assert cache is not None
    # a pooling input first: nothing of it is cached, so a prompt sharing it matches nothing
    sched.add_request(_pool("p0", [*P, 1, 2]))
    _run(sched)
    assert cache.cached_pages == 0
    g0 = _gen("g0", [*P, 3, 4])
    sched.add_request(g0)
    launched = _launch(sched)
    assert launched is not None and launched[1].prefix_lens_cpu == [0]
    _process(sched, launched)
    _run(sched)
    cached = cache.cached_pages
    assert cached >= len(P)  # generation still feeds the cache
    # a pooling input sharing the cached prompt starts from its first token, caches nothing
    p1 = _pool("p1", [*P, 5, 6])
    sched.add_request(p1)
    launched = _launch(sched)
    assert launched is not None and launched[1].prefix_lens_cpu == [0]
    assert p1.cached_tokens == 0 and sched.stats.prefix_cache_hits == 0
    _process(sched, launched)
    _run(sched)
    assert cache.cached_pages == cached and cache.locked_pages == 0
    # at once: the prompt neither waits for the pooling prefill nor reads its pages
    assert sched.flush_cache()
    sched.add_request(_pool("p2", [*P, 7, 8]))
    sched.add_request(_gen("g1", [*P, 9, 10]))
    steps = _run(sched)
    assert [rids for rids, _ in steps[:2]] == [["p2"], ["g1"]]
    assert sched.stats.prefix_cache_hits == 0
