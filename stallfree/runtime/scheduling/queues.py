"""`RequestQueues`: where every request the scheduler knows is, and the moves between places.

A request is in one place at a time: `waiting` (to be prefilled), `chunked_req` (prefilled a
chunk at a time), `last_extend` (the extend batch launched last, until it joins the decode
batch), `running_batch` (decoding), `paused` (its reader fell behind), `parked` (a verify
step of its is in flight) or `imports` (its KV is on its way from another server). `all()`
lists them; `holding()` lists those that hold KV now. Host state only.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from stallfree.runtime.execution.context import BatchContext
from stallfree.runtime.memory.radix_cache import RadixCache
from stallfree.runtime.request.req import Req, ReqStatus
from stallfree.runtime.scheduling.backpressure import PausedRequests
from stallfree.runtime.scheduling.kv_import import KVImports
from stallfree.runtime.scheduling.prefix import order_lpm
from stallfree.runtime.scheduling.schedule_batch import ScheduleBatch
from stallfree.runtime.scheduling.spec_policy import ParkedRequests


def idle_batch(ctx: BatchContext) -> ScheduleBatch:
    batch = ScheduleBatch.init_new([], ctx)
    batch.prepare_for_idle()
    return batch


@dataclass(slots=True)
class RequestQueues:
    ctx: BatchContext
    # streaming requests out of the decode batch until their readers catch up (backpressure)
    paused: PausedRequests
    waiting: deque[Req] = field(default_factory=deque)
    # finished requests stay in `waiting` until they reach its head (O(1) abort)
    stale_waiting: int = 0
    running_batch: ScheduleBatch = field(init=False)
    chunked_req: Req | None = None
    last_extend: ScheduleBatch | None = None
    # speculative decoding: requests waiting for a verify step in flight to learn whether
    # they are done
    parked: ParkedRequests = field(default_factory=lambda: ParkedRequests([]))
    imports: KVImports = field(init=False)
    # the requests of the batch being built and launched, until it is launched; if building or
    # launching raises, these are the requests that fail (`Scheduler.fail_unlaunched`)
    building: list[Req] | None = None

    def __post_init__(self) -> None:
        self.running_batch = idle_batch(self.ctx)
        self.imports = KVImports(self.ctx)

    def leave(self, req: Req) -> None:
        """Before finishing `req`: it will be skipped in `waiting`, and stops being chunked or
        imported."""
        if req.status is ReqStatus.WAITING:
            self.stale_waiting += 1
        self.imports.forget(req)
        if req is self.chunked_req:
            self.chunked_req = None

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) - self.stale_waiting

    @property
    def num_running(self) -> int:
        n = len(self.running_batch.reqs) + (self.chunked_req is not None) + len(self.paused)
        n += len(self.parked.reqs)
        if self.last_extend is not None:
            n += sum(1 for r in self.last_extend.reqs if r is not self.chunked_req)
        return n

    def has_work(self) -> bool:
        return self.num_waiting > 0 or self.chunked_req is not None or self.num_running > 0

    def has_schedulable_work(self) -> bool:
        """Work a step could be built for now: not only requests paused for their readers."""
        return self.has_work() and (
            self.num_waiting > 0 or self.num_running > len(self.paused) or self.paused.resumable()
        )

    def all(self) -> list[Req]:
        """Every unfinished request, wherever it is, once."""
        reqs = list(self.waiting) + list(self.running_batch.reqs) + self.paused.reqs
        reqs += self.parked.reqs + self.imports.reqs()
        if self.last_extend is not None:
            reqs += self.last_extend.reqs
        if self.chunked_req is not None:
            reqs.append(self.chunked_req)
        return [r for r in dict.fromkeys(reqs) if not r.finished]

    def holding(self) -> list[Req]:
        """The requests that hold KV and will decode on: their outputs are reserved."""
        reqs = self.running_batch.reqs + (self.last_extend.reqs if self.last_extend else [])
        return reqs + self.paused.holding() + self.parked.reqs + self.imports.reqs()

    def clear(self) -> list[Req]:
        """Empty every place (the engine failed closed); returns what was in them."""
        reqs = self.all()
        self.waiting.clear()
        self.stale_waiting = 0
        self.chunked_req = None
        self.last_extend = None
        self.building = None
        self.paused.reqs = []
        self.parked.reqs = []
        self.imports.clear()  # their slots and pages go with the finish, as for any request
        # NOTE: a fresh batch, not a filter of the old one, whose tensors a failure may have left
        # half-updated; a launched batch keeps the old tensors alive until it is processed.
        self.running_batch = idle_batch(self.ctx)
        return reqs

    def merge_last_extend(self) -> None:
        """The extend batch launched last joins the decode batch (its rows that decode on)."""
        batch, self.last_extend = self.last_extend, None
        if batch is None:
            return
        chunked = self.chunked_req
        keep = [i for i, r in enumerate(batch.reqs) if r is not chunked and r.wants_more_decode()]
        if keep:
            batch.filter_batch(keep)
            self.running_batch.merge_batch(batch)

    def filter_running(self) -> None:
        """Rows that are done leave the decode batch; parked requests that are ready rejoin."""
        running = self.running_batch
        keep = []
        for i, r in enumerate(running.reqs):
            if r.wants_more_decode():
                keep.append(i)
            elif not r.finished and r.spec_window:
                self.parked.park(r)  # done only if the step in flight accepts every draft
        if len(keep) != len(running.reqs):
            running.filter_batch(keep)
        self.parked.rejoin(running)

    def drop_finished_waiting(self) -> None:
        """Only finished requests are left in `waiting`."""
        self.waiting.clear()
        self.stale_waiting = 0

    def pop_finished_head(self) -> bool:
        """Drop `waiting`'s head if it finished (an abort left it there); whether it did."""
        if not self.waiting[0].finished:
            return False
        self.waiting.popleft()
        self.stale_waiting -= 1
        return True

    def head_waits_for_room(self) -> bool:
        head = next((r for r in self.waiting if not r.finished), None)
        return head is not None and not head.in_flight_outputs

    def order_lpm(self, cache: RadixCache, max_wait_s: float) -> None:
        live = [r for r in self.waiting if not r.finished]
        self.waiting.clear()
        self.stale_waiting = 0
        self.waiting.extend(order_lpm(live, cache, max_wait_s))
