from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from stallfree.overlap.future_map import FutureMap
from stallfree.overlap.host_read import ScheduleSyncError, SyncMonitor
from stallfree.overlap.stream import StreamError


def test_cpu_stream_runs_fifo_and_compute_matches_sync(cpu_stream):
    stream = cpu_stream
    order: list[int] = []
    gate = threading.Event()
    stream.submit(gate.wait)
    for i in range(5):
        stream.submit(order.append, i)
    a = torch.arange(6)
    out = stream.compute(torch.mul, a, 3, shape=(6,), dtype=torch.int64)
    assert order == []  # nothing ran yet: the worker is held at the gate
    gate.set()
    stream.synchronize()
    assert order == [0, 1, 2, 3, 4]
    assert out.equal(a * 3)


async def test_event_wait_does_not_block_the_event_loop(cpu_stream):
    stream = cpu_stream
    stream.submit(time.sleep, 0.2)
    event = stream.record_event()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while not event.query():
            ticks += 1
            await asyncio.sleep(0.01)

    task = asyncio.create_task(ticker())
    await event.wait()
    await task
    assert event.query()
    assert ticks >= 5  # the loop kept running while the stream worked


async def test_error_in_enqueued_work_reaches_the_next_event_only(cpu_stream):
    stream = cpu_stream

    def boom() -> None:
        raise ValueError("injected")

    stream.submit(boom)
    failed = stream.record_event()
    with pytest.raises(StreamError, match="injected"):
        await failed.wait()
    ok = stream.record_event()
    await ok.wait()  # the stream keeps serving after a failed step


def test_host_read_counts_stalls_and_strict_mode_raises_on_schedule_path(cpu_stream):
    stream = cpu_stream
    monitor = SyncMonitor(stream, strict=True)
    t = stream.compute(
        torch.add, torch.ones(3, dtype=torch.int64), 1, shape=(3,), dtype=torch.int64
    )
    assert monitor.host_read(t, "outside").tolist() == [2, 2, 2]  # allowed off the schedule path
    with monitor.schedule_path(), pytest.raises(ScheduleSyncError, match=r"schedule\.page_count"):
        monitor.host_read(t, "schedule.page_count")
    assert monitor.stall_counts == {"outside": 1}
    lax = SyncMonitor(stream, strict=False)
    with lax.schedule_path():
        lax.host_read(t, "schedule.page_count")
    assert lax.stall_counts["schedule.page_count"] == 1
    assert lax.schedule_path_reads == 1


def test_cpu_stream_overlaps_wall_clock_with_host_work(cpu_stream):
    """`submit` returns while its work runs on the worker: the device work makes progress while
    the host is busy with its own, and is still in flight when the host looks. (What the
    overlap is worth in wall time is benchmarks/bench_overlap.py's figure.)"""
    stream = cpu_stream
    a = torch.randn(128, 128)
    device_steps = 0
    host_done = threading.Event()

    def device_work() -> None:
        nonlocal device_steps
        give_up = time.monotonic() + 30  # a stream that ran this inline would deadlock
        while not host_done.is_set() and time.monotonic() < give_up:
            a @ a
            device_steps += 1

    stream.submit(device_work)
    in_flight = stream.record_event()
    host_steps = 0
    give_up = time.monotonic() + 30
    while device_steps < 3 and time.monotonic() < give_up:  # the host's own work, meanwhile
        a @ a
        host_steps += 1
    still_running = not in_flight.query()
    host_done.set()
    stream.synchronize()
    assert device_steps >= 3 and still_running, (device_steps, host_steps)
    assert in_flight.query()


def test_future_map_chunked_prefill_does_not_overwrite_pending_token(cpu_stream):
    stream = cpu_stream
    fmap = FutureMap(8, torch.device("cpu"))
    up = stream.upload
    # batch N: request in slot 2 finishes prefill (real row 0); slot 5 is an intermediate chunk
    next_ids = torch.tensor([41, 99])
    stream.submit(fmap.stash, up(torch.tensor([2])), up(torch.tensor([0])), next_ids)
    # batch N+1: slot 5 chunk again (no stash), slot 2 decodes from the map
    resolved = stream.compute(fmap.resolve, up(torch.tensor([2])), shape=(1,), dtype=torch.int64)
    stream.synchronize()
    assert resolved.tolist() == [41]
    assert fmap.tokens[5].item() == 0


def test_future_map_slot_reused_while_in_flight_gets_its_own_token(cpu_stream):
    stream = cpu_stream
    fmap = FutureMap(8, torch.device("cpu"))
    up = stream.upload
    gate = threading.Event()
    stream.submit(gate.wait)  # batch N is still in flight
    # batch N stashes old request's token into slot 3
    stream.submit(fmap.stash, up(torch.tensor([3])), up(torch.tensor([0])), up(torch.tensor([7])))
    # the slot is freed and reused: batch N+1 prefills a new request in slot 3
    stream.submit(fmap.stash, up(torch.tensor([3])), up(torch.tensor([0])), up(torch.tensor([123])))
    resolved = stream.compute(fmap.resolve, up(torch.tensor([3])), shape=(1,), dtype=torch.int64)
    gate.set()
    stream.synchronize()
    assert resolved.tolist() == [123]
