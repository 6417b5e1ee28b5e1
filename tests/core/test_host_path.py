"""The host path: cheap per token and per step, and linear in the number of requests."""

from __future__ import annotations

import asyncio
from collections import deque

import pytest

from stallfree import Engine, SamplingParams
from stallfree.entrypoints.cli import run_async
from stallfree.overlap.stream import CpuStream
from stallfree.runtime.execution.sampler import SamplingBatch
from stallfree.runtime.request.req import FinishReason
from tests.batch_harness import make_req
from tests.engine_util import engine_config


def test_an_import_error_inside_a_command_is_not_hidden():
    """It used to re-run the spent coroutine and report 'cannot reuse already awaited'."""

    async def command() -> int:
        import stallfree_no_such_module  # noqa: F401

        return 0

    with pytest.raises(ModuleNotFoundError, match="stallfree_no_such_module"):
        run_async(command())


def test_an_all_greedy_batch_uploads_nothing():
    uploads = []

    def upload(t):
        uploads.append(t)
        return t

    greedy = [SamplingParams(), SamplingParams(temperature=0.9, top_k=1)]
    sb = SamplingBatch.build(greedy, [0, 0], upload)
    assert sb.all_greedy and uploads == [] and sb.temperatures is None
    sb = SamplingBatch.build([*greedy, SamplingParams(temperature=0.5)], [0, 0, 0], upload)
    assert not sb.all_greedy and len(uploads) == 3
    assert sb.greedy_mask_cpu == [True, True, False]


def test_aborting_waiting_requests_is_constant_time_and_they_are_skipped(make_scheduler):
    sched = make_scheduler(num_tokens=4096)
    reqs = [make_req(f"r{i}", 4, 2) for i in range(2000)]
    for r in reqs:
        sched.add_request(r)
    for r in reqs[:-3]:
        sched.abort(r)
    # NOTE: aborted requests stay queued until they reach the head; they are not counted
    assert (
        len(sched.queues.waiting) == 2000
        and sched.queues.num_waiting == 3
        and sched.queues.has_work()
    )
    batch = sched.get_next_batch()
    assert batch is not None and [r.rid for r in batch.reqs] == ["r1997", "r1998", "r1999"]
    assert sched.queues.num_waiting == 0 and len(sched.queues.waiting) == 0
    assert all(r.finished_reason is FinishReason.ABORT for r in reqs[:-3])
    assert sched.stats.finished == {"abort": 1997}


class _NoScan(deque):
    """A queue that refuses the O(n) operations abort used to make."""

    def __contains__(self, item):
        raise AssertionError("waiting was scanned")

    def remove(self, item):
        raise AssertionError("waiting was scanned")


def test_abort_and_fail_batch_never_scan_the_queue(make_scheduler):
    sched = make_scheduler(num_tokens=4096)
    sched.queues.waiting = _NoScan()
    reqs = [make_req(f"r{i}", 4, 2) for i in range(50)]
    for r in reqs:
        sched.add_request(r)
    for r in reqs[:25]:
        sched.abort(r)
    sched.fail_batch(reqs[25:40], "step failed")
    assert sched.queues.num_waiting == 10 and sched.stats.finished == {"abort": 25, "error": 15}


def test_cpu_stream_hands_small_ops_over_with_the_next_submit():
    import torch

    stream = CpuStream()
    try:
        seen: list[int] = []
        start = torch.zeros(1)
        outs = [
            stream.compute(torch.add, start, i, shape=(1,), dtype=torch.float32) for i in range(5)
        ]
        assert stream._queue.qsize() == 0  # small ops wait for work to ride along with
        stream.submit(seen.append, 5)
        stream.record_event().synchronize()
        assert [int(o) for o in outs] == [0, 1, 2, 3, 4] and seen == [5]
        stream.compute(torch.add, start, 9, shape=(1,), dtype=torch.float32)
    finally:
        stream.close()  # hands over what is left
    assert stream._queue.qsize() == 0


async def test_complete_wakes_once_and_streams_merge_unread_tokens():
    async with Engine(engine_config("tiny")) as engine:
        params = {"max_new_tokens": 40, "ignore_eos": True}
        want = await engine.complete([1, 2, 3], params)
        # a consumer that does not read for a while gets the tokens merged, in order
        chunks = []
        gen = engine.generate([1, 2, 3], params)
        chunks.append(await gen.__anext__())
        await asyncio.sleep(0.2)  # many steps pass
        async for chunk in gen:
            chunks.append(chunk)
    ids = [t for c in chunks for t in c.token_ids]
    assert ids == want.token_ids and "".join(c.text for c in chunks) == want.text
    assert len(chunks) < 40  # merged, not one chunk per token
    assert chunks[-1].finished and chunks[-1].completion_tokens == 40


async def test_a_deadline_is_one_timer_and_still_aborts():
    async with Engine(engine_config("tiny", runtime={"request_timeout_s": 0.05})) as engine:
        params = {"max_new_tokens": 100_000 // 100, "ignore_eos": True}
        out = await engine.complete(list(range(1, 9)), params)
        assert out.finish_reason == "abort" and "deadline" in (out.error or "")
        await engine.wait_idle()
        assert engine.pool_usage().all_free


def test_stream_threads_auto_follows_model_width(monkeypatch):
    from stallfree.runtime.model.loader import PRESETS
    from stallfree.runtime.scheduling.sizing import auto_stream_threads

    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert auto_stream_threads(PRESETS["tiny"]) == 1
    assert auto_stream_threads(PRESETS["bench-cpu"]) == 8
    # worker processes of one node share its cores
    assert auto_stream_threads(PRESETS["bench-cpu"], ranks=2) == 4
    assert auto_stream_threads(PRESETS["bench-cpu"], ranks=16) == 1
