"""Backpressure: streaming requests whose readers fell behind leave the decode batch (keeping
their slots and KV) and rejoin it once the readers catch up. Host state only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from stallfree.runtime.request.req import Req
from stallfree.runtime.scheduling.schedule_batch import ScheduleBatch


@dataclass(slots=True)
class PausedRequests:
    bound: int  # unread tokens that pause a request; it resumes at half
    unread: Callable[[Req], int]  # tokens its reader has not read (0: it reads only the end)
    reqs: list[Req] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.reqs)

    def pause_behind(self, running: ScheduleBatch) -> int:
        """Take out of `running` every request `bound` tokens ahead of its reader."""
        behind = [i for i, r in enumerate(running.reqs) if self.unread(r) >= self.bound]
        if not behind:
            return 0
        for i in behind:
            running.reqs[i].paused = True
            self.reqs.append(running.reqs[i])
        gone = set(behind)
        running.filter_batch([i for i in range(len(running.reqs)) if i not in gone])
        return len(behind)

    def _caught_up(self, req: Req) -> bool:
        return self.unread(req) <= self.bound // 2

    def resumable(self) -> bool:
        return any(r.finished or self._caught_up(r) for r in self.reqs)

    def take_caught_up(self) -> list[Req]:
        """Requests whose readers are back to half the bound, unpaused; finished ones (aborted
        while paused) just leave the list."""
        back = [r for r in self.reqs if not r.finished and self._caught_up(r)]
        self.reqs = [r for r in self.reqs if not r.finished and r not in back]
        for req in back:
            req.paused = False
        return back
