"""How the scheduler fails requests: one batch's (a failed step, or a batch that could not be
built or launched), or everything (the engine failed closed). A mix-in of `Scheduler`, which
owns the queues and the batches."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from stallfree.runtime.request.req import FinishReason, Req
from stallfree.runtime.scheduling.schedule_batch import ScheduleBatch

if TYPE_CHECKING:
    from stallfree.runtime.execution.context import BatchContext
    from stallfree.runtime.scheduling.backpressure import PausedRequests
    from stallfree.runtime.scheduling.speculation import ParkedRequests


class Failures:
    # the fields and methods it uses (`Scheduler` declares them)
    ctx: BatchContext
    waiting: deque[Req]
    running_batch: ScheduleBatch | None
    chunked_req: Req | None
    last_extend: ScheduleBatch | None
    stale_waiting: int
    building: list[Req] | None
    paused: PausedRequests
    parked: ParkedRequests
    importing: dict[str, Req]

    _leave_queues: Callable[[Req], None]
    _finish: Callable[[Req, FinishReason, str | None], None]

    def fail_batch(self, batch_reqs: list[Req], message: str) -> None:
        for req in batch_reqs:
            if not req.finished:
                self._leave_queues(req)
                self._finish(req, FinishReason.ERROR, message)

    def fail_unlaunched(self, message: str) -> list[Req]:
        """Building or launching the next batch raised: fail that batch's requests.

        Their memory goes on the deferred-free list as for any finish, tagged with the last
        batch that was launched. Returns the failed requests. If the failure came before any
        request was picked, nothing identifies a culprit, so everything fails (the engine must
        make progress rather than raise on every iteration).
        """
        reqs, self.building = self.building, None
        failed = [r for r in reqs or [] if not r.finished]
        if failed:
            self.fail_batch(failed, message)
            return failed
        everything = self._all_reqs()
        self.fail_all(message)
        return everything

    def _all_reqs(self) -> list[Req]:
        assert self.running_batch is not None
        reqs = list(self.waiting) + list(self.running_batch.reqs) + self.paused.reqs
        reqs += self.parked.reqs + list(self.importing.values())
        if self.last_extend is not None:
            reqs += self.last_extend.reqs
        if self.chunked_req is not None:
            reqs.append(self.chunked_req)
        return [r for r in dict.fromkeys(reqs) if not r.finished]

    def fail_all(self, message: str) -> None:
        """Finish every queued and running request with an error (the engine failed closed)."""
        assert self.running_batch is not None
        reqs = self._all_reqs()
        self.waiting.clear()
        self.stale_waiting = 0
        self.chunked_req = None
        self.last_extend = None
        self.building = None
        self.paused.reqs = []
        self.parked.reqs = []
        self.importing.clear()  # their slots and pages go with the finish, as for any request
        # NOTE: a fresh batch, not a filter of the old one, whose tensors a failure may have left
        # half-updated; a launched batch keeps the old tensors alive until it is processed.
        self.running_batch = ScheduleBatch.init_new([], self.ctx)
        self.running_batch.prepare_for_idle()
        for req in reqs:
            if not req.finished:
                self._finish(req, FinishReason.ERROR, message)
