"""The step watchdog: a worker that stops answering (SIGSTOP: a wedged driver or a deadlocked
kernel in practice) fails the engine closed within `runtime.step_timeout_s`, and shutdown then
terminates and kills the workers, leaving no process."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from contextlib import suppress

import pytest

from stallfree import Engine, SamplingParams
from stallfree.overlap.process_stream import ProcessStream
from tests.engine_util import engine_config

TIMEOUT_S = 2.0
# liveness bound: shutdown terminates, then kills, a lost group's stopped workers within this
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP"),
]


def _resume(pids: list[int]) -> None:
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("tp_size", [1, 2])
async def test_a_stopped_worker_fails_the_engine_closed_within_the_step_timeout(llama, tp_size):
    cfg = engine_config(
        llama,
        runtime={"worker": "process", "step_timeout_s": TIMEOUT_S},
        parallel={"tp_size": tp_size},
    )
    engine = Engine(cfg)
    stream = engine.core.stream
    assert isinstance(stream, ProcessStream) and stream.step_timeout_s == TIMEOUT_S
    pids = [p.pid for p in stream.processes if p.pid is not None]
    stopped = pids[-1]  # at tp 2, the rank that is not rank 0: rank 0 waits in a collective
    try:
        async with engine:
            ok = await engine.complete([1, 2, 3], SamplingParams(max_new_tokens=3))
            assert ok.finish_reason == "length" and engine.healthy
            long = SamplingParams(max_new_tokens=100_000, ignore_eos=True)
            task = asyncio.ensure_future(engine.complete([4, 5, 6], long))
            await asyncio.sleep(0.5)  # decoding now
            os.kill(stopped, signal.SIGSTOP)
            start = time.monotonic()
            result = await asyncio.wait_for(task, timeout=TIMEOUT_S + 10)
            noticed = time.monotonic() - start
            assert result.finish_reason == "error" and "hung" in (result.error or "")
            assert noticed >= TIMEOUT_S * 0.9  # a quiet worker is not declared hung early
            assert not engine.healthy  # /health answers 503
        # the group was lost: shutdown terminates, then kills, the stopped workers (a stopped
        # process keeps SIGTERM pending, so only the kill ends it; a shutdown that waited on
        # it instead would never return)
        assert all(not p.is_alive() for p in stream.processes)
        exits = {p.pid: p.exitcode for p in stream.processes}
        assert exits[stopped] == -signal.SIGKILL, exits
    finally:
        _resume(pids)


async def test_a_slow_but_answering_worker_is_not_taken_as_hung(llama):
    """Steps that each answer within the timeout never trip it, however long the request."""
    cfg = engine_config(llama, runtime={"worker": "process", "step_timeout_s": 1.0})
    async with Engine(cfg) as engine:
        stream = engine.core.stream
        assert isinstance(stream, ProcessStream)
        started = time.monotonic()
        result = await engine.complete(
            [1, 2, 3], SamplingParams(max_new_tokens=200, ignore_eos=True)
        )
        assert result.finish_reason == "length" and engine.healthy
        assert time.monotonic() - started > 0  # the request ran; the watchdog stayed quiet
        assert stream.fatal is None
        await asyncio.sleep(1.5)  # idle past the timeout: nothing pending, nothing hung
        assert engine.healthy and stream.fatal is None
