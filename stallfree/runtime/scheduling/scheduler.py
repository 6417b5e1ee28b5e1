"""Host-side scheduling: admission, chunked prefill, decode, retraction and deferred free.

Nothing here reads a device tensor when `cpu_mirrors` is on. `get_next_batch` builds batch N+1
while batch N may still be running; `process` applies batch N's result afterwards.

With a prefix cache (`cache`), admission starts a request after its longest cached prefix, and
the cache takes a request's pages at two points, both once the step that computed them is
known to have succeeded: when an extend batch is processed (the whole pages it computed), and
when a finished request's memory is released (prompt and outputs).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from stallfree.config import SchedulerConfig
from stallfree.runtime.execution.context import BatchContext
from stallfree.runtime.execution.model_runner import StepOutput
from stallfree.runtime.memory.radix_cache import RadixCache
from stallfree.runtime.request.outputs import TokenLogprobs
from stallfree.runtime.request.req import FinishReason, Req, ReqStatus
from stallfree.runtime.scheduling.admission import Admit, PrefillAdder, reserved_tokens
from stallfree.runtime.scheduling.alloc import step_pages_needed
from stallfree.runtime.scheduling.backpressure import PausedRequests
from stallfree.runtime.scheduling.deferred import DeferredFrees
from stallfree.runtime.scheduling.failures import Failures
from stallfree.runtime.scheduling.imports import Imports
from stallfree.runtime.scheduling.prefix import (
    CacheRecord,
    PrefixMatch,
    cache_prefill,
    match_prefix,
    order_lpm,
    prefills_of,
    unlock_match,
)
from stallfree.runtime.scheduling.schedule_batch import ScheduleBatch
from stallfree.runtime.scheduling.speculation import ParkedRequests, SpecPolicy, apply_verify
from stallfree.runtime.telemetry.observer import EngineObserver
from stallfree.runtime.telemetry.stats import EngineCounters
from stallfree.runtime.text.output_processor import OutputProcessor

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Scheduler(Failures, Imports):
    config: SchedulerConfig
    ctx: BatchContext
    max_running_requests: int
    output: OutputProcessor
    observer: EngineObserver = field(default_factory=EngineObserver)
    waiting: deque[Req] = field(default_factory=deque)
    running_batch: ScheduleBatch | None = None
    chunked_req: Req | None = None
    last_extend: ScheduleBatch | None = None
    launch_seq: int = 0
    processed_seq: int = 0
    # finished requests stay in `waiting` until they reach its head (O(1) abort)
    stale_waiting: int = 0
    stats: EngineCounters = field(default_factory=EngineCounters)
    # the requests of the batch being built and launched, until it is launched; if building or
    # launching raises, these are the requests that fail (`fail_unlaunched`)
    building: list[Req] | None = None
    # streaming requests out of the decode batch until their readers catch up (backpressure)
    paused: PausedRequests = field(init=False)
    cache: RadixCache | None = None
    # per launched extend batch: (request, its length after the batch, its retraction count);
    # the cache takes those pages once the batch is processed without failing
    cache_records: dict[int, list[CacheRecord]] = field(default_factory=dict)
    _building_records: list[CacheRecord] | None = None
    # what finished or retracted requests hold until the batches that may read it are processed
    deferred: DeferredFrees = field(init=False)
    # speculative decoding: each decode step verifies drafts (None: off); requests waiting for
    # a verify step in flight to learn whether they are done
    spec: SpecPolicy | None = None
    parked: ParkedRequests = field(default_factory=lambda: ParkedRequests([]))
    last_processed_at: float | None = None  # when the last step was processed (speculation)
    # disaggregation: requests whose KV is on its way, by id (scheduling/imports.py)
    importing: dict[str, Req] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.deferred = DeferredFrees(self.ctx, self.cache)
        self.output.unread_bound = self.config.max_unread_tokens
        self.paused = PausedRequests(
            self.config.max_unread_tokens, self.output.unread, self.output.behind
        )
        self.running_batch = ScheduleBatch.init_new([], self.ctx)
        self.running_batch.prepare_for_idle()

    # ------------------------------------------------------------------ intake

    def add_request(self, req: Req) -> None:
        req.check_grammar()
        self.waiting.append(req)

    def abort(
        self, req: Req, reason: FinishReason = FinishReason.ABORT, message: str | None = None
    ) -> None:
        if req.finished:
            return
        self._leave_queues(req)
        self._finish(req, reason, message)

    def _leave_queues(self, req: Req) -> None:
        """Before finishing `req`: it will be skipped in `waiting`, and stops being chunked."""
        if req.status is ReqStatus.WAITING:
            self.stale_waiting += 1
        self.importing.pop(req.rid, None)
        if req is self.chunked_req:
            self.chunked_req = None

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) - self.stale_waiting

    @property
    def num_running(self) -> int:
        assert self.running_batch is not None
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

    # ------------------------------------------------------------------ schedule path

    def get_next_batch(self) -> ScheduleBatch | None:
        self.building = None
        self._building_records = None
        with self.ctx.monitor.schedule_path():
            self._merge_last_extend()
            self._filter_running()
            # backpressure: streaming requests whose readers are `max_unread_tokens` behind
            # leave the decode batch, and rejoin it (or the queue) once their readers catch up
            assert self.running_batch is not None
            self.stats.backpressure_pauses += self.paused.pause_behind(self.running_batch)
            self.paused.resume_caught_up(self.running_batch, self.waiting)
            batch = self._new_prefill_batch()
            if batch is not None:
                self.last_extend = batch
                self.stats.prefill_batches += 1
                return batch
            running = self.running_batch
            assert running is not None
            if running.is_empty():
                return None
            self.building = list(running.reqs)
            seq_lens_cpu, ks, ready = self._make_room_for_decode(running)
            if running.is_empty() or not ready:
                return None
            self.building = list(running.reqs)
            # a plain decode step costs less than a verify step; it takes its positions from
            # the host, so only once no row has drafts in flight (every length is exact)
            if ks is not None and (any(ks) or any(r.spec_drafts for r in running.reqs)):
                running.prepare_for_verify(ks, seq_lens_cpu)
            else:
                running.prepare_for_decode(seq_lens_cpu)
            if ks is not None:
                assert self.spec is not None
                self.spec.launched(running.reqs, ks)
            self.stats.decode_batches += 1
            return running

    def _merge_last_extend(self) -> None:
        batch, self.last_extend = self.last_extend, None
        if batch is None:
            return
        chunked = self.chunked_req
        keep = [i for i, r in enumerate(batch.reqs) if r is not chunked and r.wants_more_decode()]
        if keep:
            batch.filter_batch(keep)
            assert self.running_batch is not None
            self.running_batch.merge_batch(batch)

    def _filter_running(self) -> None:
        running = self.running_batch
        assert running is not None
        keep = []
        for i, r in enumerate(running.reqs):
            if r.wants_more_decode():
                keep.append(i)
            elif not r.finished and r.spec_window:
                self.parked.park(r)  # done only if the step in flight accepts every draft
        if len(keep) != len(running.reqs):
            running.filter_batch(keep)
        self.parked.rejoin(running)

    def _new_prefill_batch(self) -> ScheduleBatch | None:
        if self.num_waiting == 0:
            self.waiting.clear()  # only finished requests were left
            self.stale_waiting = 0
            if self.chunked_req is None:
                return None
        adder = self._new_adder()
        self.building = adder.reqs  # the same list, filled below
        chunked = self.chunked_req
        if chunked is not None:
            outcome = adder.add_chunked(chunked)
            if outcome is Admit.NO_ROOM:
                return None
            if outcome is Admit.ADDED:
                self.chunked_req = None
        self._admit_waiting(adder)
        while not adder.reqs and self._waits_for_room() and self.paused.evict(self._retract):
            adder = self._new_adder()  # a paused request gave up its KV for the queue's head
            self.building = adder.reqs
            self._admit_waiting(adder)
        if not adder.reqs:
            return None
        batch = ScheduleBatch.init_new(adder.reqs, self.ctx)
        batch.prepare_for_extend(adder.extend_lens)
        self.stats.prefill_tokens += sum(adder.extend_lens)
        if self.cache is not None:
            ends = batch.seq_lens_cpu.tolist()
            self._building_records = [
                (r, end, r.num_retractions) for r, end in zip(batch.reqs, ends, strict=True)
            ]
        return batch

    def _reserved_tokens(self) -> int:
        assert self.running_batch is not None
        reqs = self.running_batch.reqs + (self.last_extend.reqs if self.last_extend else [])
        reqs = reqs + self.paused.holding() + self.parked.reqs + list(self.importing.values())
        reserved = reserved_tokens(reqs, self.config.new_token_ratio)
        if self.spec is not None:  # the next verify window of each running request
            reserved += sum(min(self.spec.k, r.remaining_outputs()) for r in reqs)
        return reserved

    def _new_adder(self) -> PrefillAdder:
        allocator = self.ctx.allocator
        return PrefillAdder(
            allocator=allocator,
            budget=self.config.max_prefill_tokens,
            free_tokens=allocator.available_size() - self._reserved_tokens(),
            free_slots=self.ctx.req_to_token_pool.available_size(),
            running=self.num_running
            - (self.chunked_req is not None)
            - (len(self.paused) - len(self.paused.holding()))
            + len(self.importing),
            max_running=self.max_running_requests,
            chunk_size=self.config.chunked_prefill_size,
            new_token_ratio=self.config.new_token_ratio,
        )

    def _admit_waiting(self, adder: PrefillAdder) -> None:
        """Offer the waiting queue's head to `adder` until it stops; start what it takes."""
        lpm = self.cache is not None and self.config.policy == "lpm"
        if lpm and self.chunked_req is None:
            self._order_lpm()
        deferred: list[Req] = []  # lpm: skipped this round, back at the head afterwards
        while self.waiting and adder.budget > 0 and self.chunked_req is None:
            req = self.waiting[0]
            if req.finished:
                self.waiting.popleft()
                self.stale_waiting -= 1
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
                deferred.append(self.waiting.popleft())
                continue
            outcome = adder.try_add(req, match.tokens, match.locked * adder.page_size)
            if outcome in (Admit.NO_ROOM, Admit.NEVER_FITS):
                unlock_match(self.cache, match)
                if outcome is Admit.NO_ROOM:
                    break
                self.waiting.popleft()
                self._finish(req, FinishReason.ERROR, "request does not fit in the KV cache")
                continue
            self.waiting.popleft()
            self._start(req, match)
            if outcome is Admit.CHUNKED:
                self.chunked_req = req
        if deferred:
            self.waiting.extendleft(reversed(deferred))

    def _waits_for_room(self) -> bool:
        head = next((r for r in self.waiting if not r.finished), None)
        return head is not None and not head.in_flight_outputs

    def _start(self, req: Req, match: PrefixMatch) -> None:
        req.status = ReqStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.perf_counter()
            self.stats.prompt_tokens += len(req.origin_input_ids)
            self.observer.on_request_scheduled(req)
        if self.cache is not None:
            self.stats.prefix_cache_queries += req.fill_len
            self.stats.prefix_cache_hits += match.tokens
            match.start(req)

    # ------------------------------------------------------------------ prefix cache

    def _order_lpm(self) -> None:
        assert self.cache is not None
        live = [r for r in self.waiting if not r.finished]
        self.waiting.clear()
        self.stale_waiting = 0
        self.waiting.extend(order_lpm(live, self.cache, self.config.lpm_max_wait_s))

    def flush_cache(self) -> bool:
        """Empty the prefix cache. Refused (False) unless the engine is idle."""
        if self.cache is None:
            return True
        if self._all_reqs() or self.deferred:
            return False
        self.cache_records.clear()
        return self.cache.flush()

    def _make_room_for_decode(
        self, running: ScheduleBatch
    ) -> tuple[torch.Tensor | None, list[int] | None, bool]:
        """Retract until one decode step fits (evicting unused cached pages comes first: they
        count as available). With speculation, the drafts' windows come next: when they do not
        fit, the step carries no drafts before anything is retracted. Returns the lengths read,
        if the batch kept them, the rows' draft counts (None: a plain decode step), and whether
        a step can be built now."""
        allocator = self.ctx.allocator
        seq_lens_cpu = running.host_seq_lens("schedule.page_count")
        ks = self.spec.plan(running.reqs) if self.spec is not None else None
        needed = step_pages_needed(running.reqs, seq_lens_cpu, ks, allocator.page_size)
        if ks is not None and any(ks) and needed > allocator.available_pages():
            ks = [0] * len(ks)  # speculation never costs a retraction
            needed = step_pages_needed(running.reqs, seq_lens_cpu, ks, allocator.page_size)
        # paused requests give up their KV first: they make no progress meanwhile
        self.paused.evict(self._retract, lambda: needed <= allocator.available_pages())
        if needed <= allocator.available_pages():
            return seq_lens_cpu, ks, True
        retracted, fits = running.retract_decode(None if ks is None else [k + 1 for k in ks])
        for req in reversed(retracted):
            self._retract(req)
            self.waiting.appendleft(req)
        if not fits:
            if self.processed_seq < self.launch_seq:
                # NOTE: processing the batch in flight may free what is missing (requests that
                # finish with it, deferred frees, cached pages a retracted request still locks);
                # only with nothing in flight is the last request truly too big
                return None, None, False
            victim = running.reqs[0]
            running.filter_batch([])
            self._finish(victim, FinishReason.ERROR, "KV cache too small for this request")
        ks = self.spec.plan(running.reqs) if self.spec is not None else None
        return None, None if ks is None else [0] * len(ks), True

    def _retract(self, req: Req) -> None:
        # NOTE: its own pages are freed at once, not deferred: the launched batch reads them
        # before any later batch can write them, because both are ordered on the same stream.
        # Cached pages it shared stay locked until the batch in flight is processed.
        node = self.deferred.release_now(req, 0)
        if node is not None:
            self.deferred.unlock_after(self.launch_seq, node, self.processed_seq)
        if self.ctx.sparse is not None:
            self.ctx.sparse.request_retracted(req)
        req.reset_for_retract()
        self.stats.retractions += 1

    # ------------------------------------------------------------------ results

    def on_launched(self) -> int:
        self.launch_seq += 1
        if self._building_records is not None:
            self.cache_records[self.launch_seq] = self._building_records
            self._building_records = None
        return self.launch_seq

    def process(self, out: StepOutput) -> None:
        """Batch `out.seq` is done: apply its tokens, or fail its requests if its step failed;
        then release what waited for it (deferred frees, unlocks, the cache's new pages)."""
        if self.spec is not None and out.ok:
            now = time.perf_counter()
            last, self.last_processed_at = self.last_processed_at, now
            self.spec.observe_step(out, None if last is None else now - last)
        if out.ok and out.verify is not None:
            self._apply_verify(out)
        elif out.ok:
            self._apply_tokens(out)
        else:
            self.fail_batch(out.reqs, f"step failed: {out.error}")
        self.processed_seq = max(self.processed_seq, out.seq)
        if self.cache_records:
            for tag in [t for t in self.cache_records if t <= out.seq]:
                records = self.cache_records.pop(tag)
                if out.ok and tag == out.seq:
                    assert self.cache is not None
                    for req, end, retractions in records:
                        cache_prefill(self.cache, req, end, retractions)
        self.release_deferred()

    def _apply_tokens(self, out: StepOutput) -> None:
        assert out.token_ids is not None
        now = time.perf_counter()
        logprobs = out.logprobs
        if logprobs is not None and out.plan is not None:
            logprobs.take_prompt(out.reqs, out.plan)
        grammar = out.plan.grammar if out.plan is not None else None
        if grammar is not None:
            self.stats.grammar_seconds += grammar.seconds
            self.stats.grammar_tokens += sum(grammar.consume)
        for row, (req, real, tok) in enumerate(
            zip(out.reqs, out.output_rows, out.token_ids, strict=True)
        ):
            if not real or req.finished:
                continue  # an intermediate chunk, or the one-step overlap lag after finishing
            if req.in_flight_outputs <= 0:
                continue  # retracted and recomputed since; this token is stale
            try:
                lp = None
                if logprobs is not None and (k := req.sampling_params.logprobs) is not None:
                    lp = logprobs.outputs(row, tok, k)
                self._accept(req, tok, now, lp)
                if grammar is not None and not req.finished and row in grammar.ended:
                    self._grammar_ended(req, *grammar.ended[row])
            except Exception as exc:  # one request's output failed; the others go on
                logger.error("request %s failed processing token %d", req.rid, tok, exc_info=exc)
                self._fail_one(req, f"output processing failed: {exc!r}")

    def _grammar_ended(self, req: Req, how: str, message: str) -> None:
        """The stream found the request's grammar complete (nothing but EOS may follow: it is
        done) or at a dead end (it ends with an error saying so)."""
        if how == "complete":
            self._finish(req, FinishReason.STOP)
        else:
            self._fail_one(req, f"structured output reached a dead end: {message}")

    def _apply_verify(self, out: StepOutput) -> None:
        assert self.spec is not None and self.running_batch is not None
        apply_verify(out, self.spec, self.stats, self._accept, self._fail_one)
        self.running_batch.settle_spec()

    def _fail_one(self, req: Req, message: str) -> None:
        if not req.finished:
            self._leave_queues(req)
            self._finish(req, FinishReason.ERROR, message)

    def _accept(
        self, req: Req, tok: int, now: float, logprobs: TokenLogprobs | None = None
    ) -> None:
        req.output_ids.append(tok)
        self.stats.generation_tokens += 1
        params = req.sampling_params
        stop_string = self.output.on_token(req, tok, now, logprobs)
        # below min_tokens the sampler masked EOS and stop ids; stop strings wait too
        if len(req.output_ids) >= params.min_tokens and (
            stop_string
            or (not params.ignore_eos and tok in req.eos_token_ids)
            or tok in params.stop_token_ids
        ):
            self._finish(req, FinishReason.STOP)
        elif len(req.output_ids) >= params.max_new_tokens or (
            len(req.origin_input_ids) + len(req.output_ids) >= req.max_context_len
        ):
            self._finish(req, FinishReason.LENGTH)

    def _finish(self, req: Req, reason: FinishReason, message: str | None = None) -> None:
        req.finish(reason, message)
        if req.req_pool_idx is not None or req.kv_pages:
            # NOTE: deferred: the launched batch N+1 may still read this request's slots.
            self.deferred.free_after(self.launch_seq, req)
            if self.processed_seq == self.launch_seq:
                self.release_deferred()  # nothing in flight can read it
        key = (req.finished_reason or reason).value
        self.stats.finished[key] = self.stats.finished.get(key, 0) + 1
        self.output.on_finish(req)

    def release_deferred(self, everything: bool = False) -> None:
        if everything:
            self.cache_records.clear()
        self.deferred.release(self.processed_seq, everything)
