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
    # requests that reached `bound` since they were last looked at (the output processor's)
    behind: set[Req] = field(default_factory=set)
    reqs: list[Req] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.reqs)

    def pause_behind(self, running: ScheduleBatch) -> int:
        """Take out of `running` every request `bound` tokens ahead of its reader. Only the
        candidates the output processor noted are checked: nothing per running request."""
        if not self.behind:
            return 0
        candidates = {r for r in self.behind if self.unread(r) >= self.bound}
        self.behind.clear()  # the rest caught up; a request that falls behind again is re-noted
        behind = [i for i, r in enumerate(running.reqs) if r in candidates] if candidates else []
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
