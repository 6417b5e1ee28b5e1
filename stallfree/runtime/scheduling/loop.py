"""The scheduler loops. Overlap: build and launch N+1, then process N. Plain: one at a time.

Failures are isolated per batch. If building or launching a batch raises (a bad request that got
past validation, a plug-in hook), that batch's requests fail and the loop goes on. If a launched
step fails on the device, its requests fail; only `max_consecutive_failures` failed steps in a
row fail the engine closed.
"""

from __future__ import annotations

import asyncio
import logging
import time

from stallfree.runtime.execution.model_runner import LaunchedBatch, ModelRunner
from stallfree.runtime.model.forward_batch import ForwardMode
from stallfree.runtime.scheduling.schedule_batch import ScheduleBatch
from stallfree.runtime.scheduling.scheduler import Scheduler
from stallfree.runtime.telemetry.observer import EngineObserver
from stallfree.runtime.telemetry.request_log import describe_reqs
from stallfree.runtime.telemetry.stats import EngineCounters

logger = logging.getLogger(__name__)


class SchedulerLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        overlap: bool,
        observer: EngineObserver | None = None,
        max_consecutive_failures: int = 3,
    ) -> None:
        self.max_consecutive_failures = max_consecutive_failures
        self.consecutive_failures = 0
        self.failed_closed = False
        self.closed_because = ""  # why it failed closed: step failures, or a lost worker
        self.scheduler = scheduler
        self.observer = observer or EngineObserver()
        self.runner = runner
        self.overlap = overlap
        self.stats: EngineCounters = scheduler.stats  # one set of counters, shared
        self.wake = asyncio.Event()
        self.stopping = False
        self._aio_loop: asyncio.AbstractEventLoop | None = None

    def fail_closed_from_thread(self, error: BaseException) -> None:
        """Another thread found the device lost (a worker process died): fail closed now,
        waking the loop if it is idle. Safe to call from any thread."""
        logger.error("device lost: %s", error)
        self.closed_because = f"the device was lost: {error}"
        self.failed_closed = True
        aio = self._aio_loop
        if aio is not None and not aio.is_closed():
            aio.call_soon_threadsafe(self.wake.set)

    def _schedule_and_launch(self, in_flight: bool) -> LaunchedBatch | None:
        start = time.perf_counter()
        scheduler = self.scheduler
        launched = None
        try:
            batch = scheduler.get_next_batch()
            if batch is not None:
                launched = self._launch(batch)
            scheduler.queues.building = None
        except Exception as exc:
            decode_half = scheduler.split_failed_mix()
            self._launch_failed(exc)
            if decode_half is None:
                return None
            launched = self._relaunch(decode_half)
            if launched is None:
                return None
        elapsed = time.perf_counter() - start
        if launched is not None:
            self.stats.schedule_seconds += elapsed
            overlapped = self.overlap and in_flight
            self.observer.on_schedule(elapsed)
            mode = launched.mode
            decode = mode in (ForwardMode.DECODE, ForwardMode.VERIFY)
            self.observer.on_step(len(launched.reqs), decode, overlapped)
            fb = launched.forward_batch
            plain = mode is ForwardMode.DECODE
            self.observer.on_step_tokens(len(launched.reqs) if plain else sum(fb.extend_lens_cpu))
        return launched

    def _launch(self, batch: ScheduleBatch) -> LaunchedBatch:
        # NOTE: the sequence number is taken only once the launch succeeded, so a failed
        # launch leaves no number that no processed batch will ever release
        launched = self.runner.launch(batch.step_input(), self.scheduler.launch_seq + 1)
        self.scheduler.on_launched()
        self.stats.steps += 1
        return launched

    def _relaunch(self, decode: ScheduleBatch) -> LaunchedBatch | None:
        """A mixed step failed to build or launch, and its prefill half's requests failed: its
        decode half runs alone. If that raises too, its requests fail as well."""
        queues = self.scheduler.queues
        queues.building = list(decode.reqs)  # if this launch raises, these are what fail
        try:
            launched = self._launch(decode)
            queues.building = None
        except Exception as exc:
            self._launch_failed(exc)
            return None
        return launched

    def _launch_failed(self, exc: Exception) -> None:
        """Building or launching a batch raised: fail its requests, keep serving."""
        self.stats.launch_failures += 1
        message = f"the engine could not run this request's batch: {exc!r}"
        failed = self.scheduler.fail_unlaunched(message)
        logger.error(
            "building or launching a batch failed; failed %d requests (%s); serving on",
            len(failed),
            describe_reqs(failed),
            exc_info=exc,
        )

    async def _process(self, launched: LaunchedBatch) -> None:
        out = await launched.result()
        if out.ok:
            self.consecutive_failures = 0
        else:
            self.stats.step_failures += 1
            self.consecutive_failures += 1
            logger.error(
                "step %d failed (%d in a row): %s; failing requests %s",
                out.seq,
                self.consecutive_failures,
                out.error,
                describe_reqs(out.reqs),
            )
            if (
                self.consecutive_failures >= self.max_consecutive_failures
                and not self.failed_closed
            ):
                self.failed_closed = True
                self.closed_because = (
                    f"{self.consecutive_failures} consecutive step failures, the last: {out.error}"
                )
        self.scheduler.process(out)

    async def run(self) -> None:
        self._aio_loop = asyncio.get_running_loop()
        in_flight: LaunchedBatch | None = None
        tick = time.perf_counter()
        while True:
            now = time.perf_counter()
            self.stats.max_iteration_gap = max(self.stats.max_iteration_gap, now - tick)
            tick = now
            if self.failed_closed:
                await self._fail_closed(in_flight)
                return
            launched = self._schedule_and_launch(in_flight is not None)
            if self.overlap:
                if in_flight is not None:
                    if launched is not None:
                        self.stats.overlap_steps += 1
                    await self._process(in_flight)
                in_flight = launched
            elif launched is not None:
                await self._process(launched)
            if in_flight is None and launched is None:
                if self.stopping and not self.scheduler.queues.has_work():
                    return
                if self.scheduler.queues.has_schedulable_work():
                    await asyncio.sleep(0.001)  # nothing fit this round; never spin hot
                else:
                    self.wake.clear()
                    await self.wake.wait()
                    tick = time.perf_counter()  # idle time is not a stall
            else:
                # NOTE: yield so consumers stream tokens while the next step runs on the stream.
                await asyncio.sleep(0)

    async def _fail_closed(self, in_flight: LaunchedBatch | None) -> None:
        """Too many failed steps in a row, or a lost worker: drain what is launched, fail
        everything else."""
        if in_flight is not None:
            await self._process(in_flight)
        why = self.closed_because or "an unknown cause"
        logger.error("engine failed closed after %s; failing every request", why)
        self.scheduler.fail_all(f"engine failed closed after {why}")

    def notify(self) -> None:
        self.wake.set()
