"""The scheduler with a prefix cache, driven by hand: admission after a cached prefix, exact
table rows and prefix lengths, deferred unlock and eviction while batches are in flight,
failed steps, chunk inserts, lpm, and waiting for a prefill that is in flight."""

from __future__ import annotations

import pytest
import torch

from stallfree.runtime.execution.model_runner import StepOutput
from stallfree.runtime.request.req import FinishReason, Req
from stallfree.runtime.request.sampling_params import SamplingParams
from stallfree.runtime.scheduling.schedule_batch import ScheduleBatch
from stallfree.runtime.scheduling.scheduler import Scheduler

Launched = tuple[int, list[Req], list[bool], ScheduleBatch]


def _scheduler(
    make_scheduler, page_size: int = 1, num_tokens: int = 256, num_reqs: int = 8, **config
) -> Scheduler:
    config.setdefault("new_token_ratio", 0.0)
    return make_scheduler(
        page_size=page_size,
        num_tokens=num_tokens,
        num_reqs=num_reqs,
        max_context=256,
        prefix_cache=True,
        **config,
    )


def _req(rid: str, prompt: list[int], max_new_tokens: int = 4) -> Req:
    return Req(
        rid=rid,
        origin_input_ids=list(prompt),
        sampling_params=SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
    )


def _launch(sched: Scheduler) -> Launched | None:
    batch = sched.get_next_batch()
    if batch is None:
        return None
    return sched.on_launched(), list(batch.reqs), list(batch.output_rows), batch


def _process(sched: Scheduler, launched: Launched, token: int = 7) -> None:
    seq, reqs, rows, _ = launched
    sched.process(StepOutput(seq, reqs, rows, [token] * len(reqs)))


def _drain(sched: Scheduler, in_flight: list[Launched] | None = None) -> None:
    """Run like the overlap loop: launch the next batch, then process the oldest."""
    in_flight = list(in_flight or [])
    for _ in range(10_000):
        nxt = _launch(sched)
        if nxt is not None:
            in_flight.append(nxt)
        if in_flight and (nxt is None or len(in_flight) > 1):
            _process(sched, in_flight.pop(0))
        if not in_flight and not sched.queues.has_work():
            return
    raise AssertionError("did not drain")


def _whole_pool(sched: Scheduler) -> None:
    """Nothing held by requests: free + cached == pool, and a flush returns every page."""
    cache, allocator = sched.cache, sched.ctx.allocator
    assert cache is not None
    cache.check()
    assert cache.locked_pages == 0
    assert allocator.free_page_count() + cache.cached_pages == allocator.num_pages
    assert sched.flush_cache()
    assert allocator.free_page_count() == allocator.num_pages
    assert sched.ctx.req_to_token_pool.available_size() == sched.ctx.req_to_token_pool.size


def _row(sched: Scheduler, req: Req, n: int) -> list[int]:
    sched.ctx.stream.synchronize()
    assert req.req_pool_idx is not None
    return sched.ctx.req_to_token_pool.req_to_token[req.req_pool_idx, :n].tolist()


def _slots(req: Req, n: int, page_size: int) -> list[int]:
    return [req.kv_pages[i // page_size] * page_size + i % page_size for i in range(n)]


P = list(range(10, 50))  # a 40-token shared prefix


@pytest.mark.parametrize("page_size", [1, 4])
def test_admission_starts_after_the_cached_prefix_with_exact_rows(page_size, make_scheduler):
    sched = _scheduler(make_scheduler, page_size=page_size)
    first = _req("first", [*P, 1, 2, 3], max_new_tokens=3)
    sched.add_request(first)
    _drain(sched)
    assert first.finished_reason is FinishReason.LENGTH
    # prompt and outputs but the last, in whole pages, stay cached
    cached_len = (len(P) + 3 + 3 - 1) // page_size * page_size
    assert sched.cache is not None and sched.cache.cached_pages * page_size == cached_len

    # diverges at token 38, inside a page when page_size is 4: only whole shared pages match
    second = _req("second", [*P[:38], 99, 98, 97, 96])
    sched.add_request(second)
    launched = _launch(sched)
    assert launched is not None
    batch = launched[3]
    hit = 38 // page_size * page_size
    assert batch.prefix_lens_cpu == [hit]
    assert batch.extend_lens_cpu == [len(second.origin_input_ids) - hit]
    assert batch.seq_lens_cpu.tolist() == [len(second.origin_input_ids)]
    assert second.cached_tokens == hit and second.cached_pages == hit // page_size
    n = len(second.origin_input_ids)
    assert _row(sched, second, n) == _slots(second, n, page_size)  # prefix slots uploaded too
    assert sched.stats.prefix_cache_hits == hit
    _drain(sched, [launched])
    _whole_pool(sched)


def test_two_schedules_in_flight_under_eviction_pressure(make_scheduler):
    """Batches 1 and 2 are both launched before any result: the eviction that batch 2 needs
    takes only unlocked pages, never a page batch 1 reads or writes."""
    sched = _scheduler(make_scheduler, num_tokens=64)
    warm = _req("warm", P[:30], max_new_tokens=1)
    sched.add_request(warm)
    _drain(sched)
    cache = sched.cache
    assert cache is not None and cache.cached_pages == 30  # fill 31, the last token left out

    x = _req("x", [*P[:24], 1, 2, 3, 4], max_new_tokens=8)
    y = _req("y", list(range(100, 130)), max_new_tokens=8)
    for r in (x, y):
        sched.add_request(r)
    first = _launch(sched)
    assert first is not None and first[1] == [x, y]
    assert first[3].prefix_lens_cpu == [24, 0]
    read_by_first = set(x.kv_pages) | set(y.kv_pages)
    assert sched.ctx.allocator.free_page_count() == 0  # 34 free pages went to x and y
    assert cache.evictable_pages() == 6 and cache.locked_pages == 24

    second = _launch(sched)  # decode, built while batch 1 is in flight: needs 2 pages
    assert second is not None and second[3].forward_mode.value == "decode"
    assert cache.evicted_pages == 2
    new_pages = {x.kv_pages[-1], y.kv_pages[-1]}
    assert not new_pages & read_by_first
    assert cache.match_len(P[:24]) == 24  # the locked prefix stayed
    out_first = set(first[3].out_cache_loc.tolist()) | set(_row(sched, x, 24))
    assert not set(second[3].out_cache_loc.tolist()) & out_first

    _drain(sched, [first, second])
    for r in (x, y):
        assert r.finished_reason is FinishReason.LENGTH and len(r.output_ids) == 8
    _whole_pool(sched)


def test_retraction_frees_only_what_it_owns_and_unlocks_after_the_batch_in_flight(make_scheduler):
    sched = _scheduler(make_scheduler, num_tokens=48)
    warm = _req("warm", P[:21], max_new_tokens=1)
    sched.add_request(warm)
    _drain(sched)
    cache = sched.cache
    assert cache is not None and cache.cached_pages == 21

    x = _req("x", [*P[:20], 1, 2], max_new_tokens=12)  # shares 20 cached tokens, alone
    y = _req("y", list(range(100, 120)), max_new_tokens=12)
    for r in (x, y):
        sched.add_request(r)
    in_flight: list[Launched] = []
    retracted_at = None
    for _ in range(40):
        launched = _launch(sched)
        assert launched is not None
        in_flight.append(launched)
        if sched.stats.retractions:
            retracted_at = launched
            break
        if len(in_flight) > 1:
            _process(sched, in_flight.pop(0))
    assert retracted_at is not None
    assert x.status.value == "waiting" and not x.kv_pages  # x had the longer prompt
    # x's own pages went back at once; the shared prefix stays locked while batches that read
    # it are in flight
    assert sched.deferred.unlocks
    assert cache.match_len(P[:20]) == 20 and cache.locked_pages >= 20
    while in_flight:
        _process(sched, in_flight.pop(0))
    assert not sched.deferred.unlocks
    hits = sched.stats.prefix_cache_hits
    _drain(sched)
    assert sched.stats.prefix_cache_hits > hits  # the re-prefill found its prefix again
    for r in (x, y):
        assert r.finished_reason is FinishReason.LENGTH and len(r.output_ids) == 12
    _whole_pool(sched)


def test_a_failed_step_caches_nothing(make_scheduler):
    sched = _scheduler(make_scheduler)
    r = _req("r", P, max_new_tokens=4)
    sched.add_request(r)
    launched = _launch(sched)
    assert launched is not None
    seq, reqs, rows, _ = launched
    sched.process(StepOutput(seq, reqs, rows, None, error="injected"))  # the step failed
    assert r.finished_reason is FinishReason.ERROR
    assert sched.cache is not None and sched.cache.cached_pages == 0
    _whole_pool(sched)


def test_an_aborted_request_keeps_only_what_was_processed(make_scheduler):
    sched = _scheduler(make_scheduler)
    r = _req("r", P, max_new_tokens=4)
    sched.add_request(r)
    first = _launch(sched)
    assert first is not None
    second = _launch(sched)  # its first decode
    sched.abort(r)
    assert sched.cache is not None and sched.cache.cached_pages == 0
    _process(sched, first)  # the prefill succeeded: its pages are cached
    assert sched.cache.cached_pages == len(P)
    assert second is not None
    _process(sched, second)
    assert sched.cache.cached_pages == len(P)  # an abort inserts nothing more
    _whole_pool(sched)


def test_each_processed_chunk_is_cached_and_reused(make_scheduler):
    sched = _scheduler(make_scheduler, chunked_prefill_size=8, max_prefill_tokens=8)
    long = _req("long", list(range(60, 90)), max_new_tokens=2)  # 30 tokens: 4 chunks
    sched.add_request(long)
    first = _launch(sched)
    assert first is not None and first[3].extend_lens_cpu == [8]
    second = _launch(sched)
    assert second is not None and second[3].prefix_lens_cpu == [8]
    cache = sched.cache
    assert cache is not None and cache.cached_pages == 0  # nothing is cached before processing
    _process(sched, first)
    assert cache.cached_pages == 8 and long.cached_pages == 8 and cache.locked_pages == 8
    # another request reuses the processed chunk while the long prompt is still prefilling
    other = _req("other", [*list(range(60, 68)), 1, 2])
    sched.add_request(other)
    _drain(sched, [second])
    assert other.cached_tokens == 8
    assert long.finished_reason is FinishReason.LENGTH
    _whole_pool(sched)


def test_a_request_waits_for_a_shared_prefill_in_flight(make_scheduler):
    sched = _scheduler(make_scheduler)
    reqs = [_req(f"r{i}", [*P, i, i + 1]) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    first = _launch(sched)
    assert first is not None and first[1] == reqs[:1]  # the others share 40 tokens with it
    second = _launch(sched)  # built before the first is processed: still only a decode
    assert second is not None and second[1] == reqs[:1]
    _process(sched, first)
    third = _launch(sched)
    assert third is not None and third[1] == reqs[1:]
    assert third[3].prefix_lens_cpu == [len(P), len(P)]
    _drain(sched, [second, third])
    assert sched.stats.prefill_tokens == len(P) + 2 + 2 * 2  # the prefix computed once
    _whole_pool(sched)


def test_lpm_admits_the_longest_cached_prefix_first_unless_one_starves(make_scheduler):
    for starving in (False, True):
        sched = _scheduler(make_scheduler, num_reqs=1, policy="lpm", lpm_max_wait_s=5.0)
        sched.add_request(_req("warm", P, max_new_tokens=1))
        _drain(sched)
        cold = _req("cold", list(range(100, 140)), max_new_tokens=1)
        hot = _req("hot", [*P, 1], max_new_tokens=1)
        if starving:
            cold.arrival_time -= 10.0
        sched.add_request(cold)
        sched.add_request(hot)
        launched = _launch(sched)
        assert launched is not None
        assert launched[1] == ([cold] if starving else [hot])
        _drain(sched, [launched])
        _whole_pool(sched)


def test_fcfs_keeps_arrival_order(make_scheduler):
    sched = _scheduler(make_scheduler, num_reqs=1)
    sched.add_request(_req("warm", P, max_new_tokens=1))
    _drain(sched)
    cold = _req("cold", list(range(100, 140)), max_new_tokens=1)
    hot = _req("hot", [*P, 1], max_new_tokens=1)
    sched.add_request(cold)
    sched.add_request(hot)
    launched = _launch(sched)
    assert launched is not None and launched[1] == [cold]
    _drain(sched, [launched])
    _whole_pool(sched)


def test_flush_is_refused_while_anything_runs(make_scheduler):
    sched = _scheduler(make_scheduler)
    sched.add_request(_req("a", P, max_new_tokens=3))
    launched = _launch(sched)
    assert not sched.flush_cache()
    _drain(sched, [launched] if launched else [])
    assert sched.cache is not None and sched.cache.cached_pages > 0
    _whole_pool(sched)  # flushes


def test_identical_prompts_share_all_but_the_last_token(make_scheduler):
    sched = _scheduler(make_scheduler, page_size=4)
    a = _req("a", P, max_new_tokens=2)
    sched.add_request(a)
    _drain(sched)
    b = _req("b", P, max_new_tokens=2)
    sched.add_request(b)
    launched = _launch(sched)
    assert launched is not None
    # 39 matchable tokens, in whole pages of 4: 36 cached, 4 computed (one logit needed)
    assert launched[3].prefix_lens_cpu == [36] and launched[3].extend_lens_cpu == [4]
    _drain(sched, [launched])
    assert b.output_ids == a.output_ids == [7, 7]
    _whole_pool(sched)


def test_table_row_of_a_cached_request_is_uploaded_not_read(make_scheduler):
    """Nothing on the schedule path reads the device: the cached slots come from host pages."""
    sched = _scheduler(make_scheduler)
    sched.add_request(_req("warm", P, max_new_tokens=1))
    _drain(sched)
    r = _req("r", [*P, 1])
    sched.add_request(r)
    monitor = sched.ctx.monitor
    monitor.strict = True
    launched = _launch(sched)
    assert launched is not None and monitor.schedule_path_reads == 0
    table = sched.ctx.req_to_token_pool.req_to_token
    sched.ctx.stream.synchronize()
    assert r.req_pool_idx is not None
    assert torch.equal(table[r.req_pool_idx, : len(P) + 1], torch.tensor(_slots(r, len(P) + 1, 1)))
    _drain(sched, [launched])
    _whole_pool(sched)
