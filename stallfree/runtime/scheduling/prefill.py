"""`PrefillManager`: the next extend batch. It admits waiting requests (and the chunked one)
within the round's budget through a `PrefillAdder`, starting each after its longest cached
prefix, all of one kind (pooling requests or generation ones: the chunked request's kind, else
the first admitted one's; the others keep their place in the queue), and keeps the prefix-cache
records of the extend batches in flight: the cache takes a batch's whole pages once it is
processed without failing. Host state only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from stallfree.config import SchedulerConfig
from stallfree.runtime.execution.context import BatchContext
from stallfree.runtime.memory.radix_cache import RadixCache
from stallfree.runtime.request.req import Req, ReqStatus
from stallfree.runtime.scheduling.admission import Admit, PrefillAdder, reserved_tokens
from stallfree.runtime.scheduling.prefix import (
    CacheRecord,
    PrefixMatch,
    cache_prefill,
    match_prefix,
    prefills_of,
    unlock_match,
)
from stallfree.runtime.scheduling.queues import RequestQueues
from stallfree.runtime.scheduling.schedule_batch import ScheduleBatch
from stallfree.runtime.telemetry.observer import EngineObserver
from stallfree.runtime.telemetry.stats import EngineCounters

# waiting requests of the other kind one round passes over before it stops looking further
MAX_OTHER_KIND = 64


@dataclass(slots=True)
class PrefillManager:
    config: SchedulerConfig
    ctx: BatchContext
    queues: RequestQueues
    max_running_requests: int
    stats: EngineCounters
    observer: EngineObserver
    cache: RadixCache | None = None
    spec_k: int = 0  # speculative decoding: drafts per verify step (0: off)
    # per launched extend batch: (request, its length after the batch, its retraction count);
    # the cache takes those pages once the batch is processed without failing
    cache_records: dict[int, list[CacheRecord]] = field(default_factory=dict)
    building_records: list[CacheRecord] | None = None

    def new_batch(
        self,
        retract: Callable[[Req], None],
        refuse: Callable[[Req, str], None],
        decode_rows: int = 0,
    ) -> ScheduleBatch | None:
        """The next extend batch (None: nothing to prefill now). `retract` frees what a paused
        request holds, for the queue's head; `refuse` fails a request that can never fit.
        `decode_rows`: decode rows the same step carries (a mixed step); each takes one token
        of the step's budget and of the chunk."""
        q = self.queues
        if q.num_waiting == 0:
            q.drop_finished_waiting()
            if q.chunked_req is None:
                return None
        adder = self.new_adder(decode_rows)
        q.building = adder.reqs  # the same list, filled below
        chunked = q.chunked_req
        if chunked is not None:
            if not adder.takes_kind(chunked):
                return None  # a mixed step's prefill is of generation requests only
            outcome = adder.add_chunked(chunked)
            if outcome is Admit.NO_ROOM:
                return None
            if outcome is Admit.ADDED:
                q.chunked_req = None
        self._admit_waiting(adder, refuse)
        while not adder.reqs and q.head_waits_for_room() and q.paused.evict(retract):
            adder = self.new_adder(decode_rows)  # a paused request gave up its KV for the head
            q.building = adder.reqs
            self._admit_waiting(adder, refuse)
        if not adder.reqs:
            return None
        batch = ScheduleBatch.init_new(adder.reqs, self.ctx)
        batch.prepare_for_extend(adder.extend_lens)
        self.stats.prefill_tokens += sum(adder.extend_lens)
        if self.cache is not None:
            ends = batch.seq_lens_cpu.tolist()
            self.building_records = [
                (r, end, r.num_retractions)
                for r, end in zip(batch.reqs, ends, strict=True)
                if r.pooling is None  # a pooling request's KV is never cached
            ]
        return batch

    def next_pools(self) -> bool:
        """Whether the next extend batch is of pooling requests: the chunked request's kind,
        else the waiting queue's head's."""
        q = self.queues
        head = q.chunked_req
        if head is None:
            head = next((r for r in q.waiting if not r.finished), None)
        return head is not None and head.pooling is not None

    def reserved_tokens(self) -> int:
        reqs = self.queues.holding()
        reserved = reserved_tokens(reqs, self.config.new_token_ratio)
        if self.spec_k:  # the next verify window of each running request
            reserved += sum(min(self.spec_k, r.remaining_outputs()) for r in reqs)
        return reserved

    def new_adder(self, decode_rows: int = 0) -> PrefillAdder:
        """The round's adder; a mixed step's (`decode_rows` > 0) admits generation requests
        only, as its decode rows are."""
        allocator, q = self.ctx.allocator, self.queues
        return PrefillAdder(
            allocator=allocator,
            budget=self.config.max_prefill_tokens - decode_rows,
            free_tokens=allocator.available_size() - self.reserved_tokens(),
            free_slots=self.ctx.req_to_token_pool.available_size(),
            running=q.num_running
            - (q.chunked_req is not None)
            - (len(q.paused) - len(q.paused.holding()))
            + len(q.imports),
            max_running=self.max_running_requests,
            chunk_size=self.config.chunked_prefill_size - decode_rows,
            new_token_ratio=self.config.new_token_ratio,
            pooling=False if decode_rows else None,
        )

    def _admit_waiting(self, adder: PrefillAdder, refuse: Callable[[Req, str], None]) -> None:
        """Offer the waiting queue's head to `adder` until it stops; start what it takes."""
        q, waiting = self.queues, self.queues.waiting
        lpm = self.cache is not None and self.config.policy == "lpm"
        if lpm and q.chunked_req is None:
            assert self.cache is not None
            q.order_lpm(self.cache, self.config.lpm_max_wait_s)
        # skipped this round (lpm: waiting for a prefix; either policy: of the other kind),
        # back at the head afterwards, in their order
        deferred: list[Req] = []
        other_kind = 0
        while waiting and adder.budget > 0 and q.chunked_req is None:
            if q.pop_finished_head():
                continue
            req = waiting[0]
            if not adder.takes_kind(req):
                # a step holds one kind: it waits for a step of its kind (the head's kind
                # leads the next step that admits from the queue, so neither kind starves)
                other_kind += 1
                if other_kind > MAX_OTHER_KIND:
                    break
                deferred.append(waiting.popleft())
                continue
            if req.in_flight_outputs:
                break  # a retracted request waits for its in-flight token before re-prefill
            if not adder.has_room():
                break
            prefills = prefills_of(adder.reqs, adder.extend_lens, self.cache_records)
            match = match_prefix(self.cache, req, adder.page_size, prefills)
            if match is None:  # it shares a prefix with a prefill that is not cached yet
                if not lpm:
                    break  # fcfs: the head waits one step for the prefix to be cached
                deferred.append(waiting.popleft())
                continue
            outcome = adder.try_add(req, match.tokens, match.locked * adder.page_size)
            if outcome in (Admit.NO_ROOM, Admit.NEVER_FITS):
                unlock_match(self.cache, match)
                if outcome is Admit.NO_ROOM:
                    break
                waiting.popleft()
                refuse(req, "request does not fit in the KV cache")
                continue
            waiting.popleft()
            self._start(req, match)
            if outcome is Admit.CHUNKED:
                q.chunked_req = req
        if deferred:
            waiting.extendleft(reversed(deferred))

    def _start(self, req: Req, match: PrefixMatch) -> None:
        req.status = ReqStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.perf_counter()
            self.stats.prompt_tokens += len(req.origin_input_ids)
            self.observer.on_request_scheduled(req)
        if self.cache is not None and req.pooling is None:  # pooling bypasses the cache
            self.stats.prefix_cache_queries += req.fill_len
            self.stats.prefix_cache_hits += match.tokens
            match.start(req)

    def launched(self, seq: int) -> None:
        """The batch being built was launched as batch `seq`."""
        if self.building_records is not None:
            self.cache_records[seq] = self.building_records
            self.building_records = None

    def processed(self, seq: int, ok: bool) -> None:
        """Batch `seq` is processed: the cache takes its pages if it succeeded; the records of
        earlier batches (not launched, or failed) are dropped."""
        if self.cache_records:
            for tag in [t for t in self.cache_records if t <= seq]:
                records = self.cache_records.pop(tag)
                if ok and tag == seq:
                    assert self.cache is not None
                    for req, end, retractions in records:
                        cache_prefill(self.cache, req, end, retractions)
