"""Backpressure: streaming requests whose readers fell behind leave the decode batch (keeping
their slots and KV) and rejoin it once the readers catch up. When memory is needed (a decode
step, or a waiting request, that does not fit), paused requests give up their slots and KV,
the longest paused first (`evict`), and are prefilled again once their readers catch up.
Host state only."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from stallfree.runtime.request.req import Req, ReqStatus
from stallfree.runtime.scheduling.schedule_batch import ScheduleBatch
from stallfree.runtime.text.output_processor import OutputProcessor


@dataclass(slots=True)
class PausedRequests:
    bound: int  # unread tokens that pause a request; it resumes at half
    # what each request's reader has not read yet (`unread`: 0 when it reads only the end), and
    # the requests that reached `bound` since they were last looked at (`behind`)
    output: OutputProcessor
    reqs: list[Req] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.reqs)

    def pause_behind(self, running: ScheduleBatch) -> int:
        """Take out of `running` every request `bound` tokens ahead of its reader. Only the
        candidates the output processor noted are checked: nothing per running request."""
        behind_set = self.output.behind
        if not behind_set:
            return 0
        candidates = {r for r in behind_set if self.output.unread(r) >= self.bound}
        behind_set.clear()  # the rest caught up; a request that falls behind again is re-noted
        behind = [i for i, r in enumerate(running.reqs) if r in candidates] if candidates else []
        if not behind:
            return 0
        for i in behind:
            running.reqs[i].paused = True
            self.reqs.append(running.reqs[i])
        gone = set(behind)
        running.filter_batch([i for i in range(len(running.reqs)) if i not in gone])
        return len(behind)

    def holding(self) -> list[Req]:
        """The paused requests that still hold their slots and KV."""
        return [r for r in self.reqs if r.req_pool_idx is not None]

    def evict(
        self, release: Callable[[Req], None], enough: Callable[[], bool] | None = None
    ) -> int:
        """Paused requests give up their slots and KV, the longest paused first, until
        `enough()` (without it, one). `release` frees what a request holds as a retraction
        does; the request stays paused, off the waiting queue, until `take_caught_up`. How many
        gave them up."""
        evicted = 0
        done = enough if enough is not None else lambda: evicted > 0
        for req in self.reqs:
            if done():
                break
            if req.finished or req.req_pool_idx is None:
                continue
            release(req)
            req.status = ReqStatus.RUNNING  # still paused: not in the waiting queue
            evicted += 1
        return evicted

    def _caught_up(self, req: Req) -> bool:
        return self.output.unread(req) <= self.bound // 2

    def resumable(self) -> bool:
        return any(r.finished or self._caught_up(r) for r in self.reqs)

    def take_caught_up(self) -> list[Req]:
        """Requests whose readers are back to half the bound, unpaused (those that gave up their
        KV, with no `req_pool_idx`, are to be prefilled again); finished ones (aborted while
        paused) just leave the list."""
        back = [r for r in self.reqs if not r.finished and self._caught_up(r)]
        self.reqs = [r for r in self.reqs if not r.finished and r not in back]
        for req in back:
            req.paused = False
        return back

    def resume_caught_up(self, running: ScheduleBatch, waiting: deque[Req]) -> None:
        """Requests whose readers caught up rejoin `running`; those that gave up their KV go
        to the head of `waiting`, to be prefilled again first."""
        if not self.resumable():
            return
        back = [r for r in self.take_caught_up() if r.wants_more_decode()]
        for req in reversed([r for r in back if r.req_pool_idx is None]):
            req.status = ReqStatus.WAITING
            waiting.appendleft(req)
        # NOTE: a verify step of a paused request is processed before it can resume (pausing and
        # resuming never meet in one round), so its lengths are exact: no window in flight
        held = [r for r in back if r.req_pool_idx is not None]
        assert not any(r.spec_window for r in held), "resuming a request with drafts in flight"
        if held:
            batch = ScheduleBatch.init_new(held, running.ctx)
            batch.prepare_for_import(imported=False)
            running.merge_batch(batch)
