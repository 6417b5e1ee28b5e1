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
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from stallfree.config import SchedulerConfig
from stallfree.runtime.execution.context import BatchContext
from stallfree.runtime.execution.logits import LogprobBuffers
from stallfree.runtime.execution.model_runner import StepOutput
from stallfree.runtime.memory.radix_cache import RadixCache
from stallfree.runtime.request.outputs import TokenLogprobs
from stallfree.runtime.request.req import FinishReason, Req, ReqStatus
from stallfree.runtime.scheduling.alloc import step_pages_needed
from stallfree.runtime.scheduling.backpressure import PausedRequests
from stallfree.runtime.scheduling.deferred import DeferredFrees
from stallfree.runtime.scheduling.prefill import PrefillManager
from stallfree.runtime.scheduling.queues import RequestQueues
from stallfree.runtime.scheduling.schedule_batch import ScheduleBatch
from stallfree.runtime.scheduling.spec_policy import SpecPolicy, count_verify_row
from stallfree.runtime.telemetry.observer import EngineObserver
from stallfree.runtime.telemetry.stats import EngineCounters
from stallfree.runtime.text.output_processor import OutputProcessor

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Scheduler:
    config: SchedulerConfig
    ctx: BatchContext
    max_running_requests: int
    output: OutputProcessor
    observer: EngineObserver = field(default_factory=EngineObserver)
    # where every request is (scheduling/queues.py)
    queues: RequestQueues = field(init=False)
    # the next extend batch, and the prefix-cache records of those in flight
    prefill: PrefillManager = field(init=False)
    launch_seq: int = 0
    processed_seq: int = 0
    stats: EngineCounters = field(default_factory=EngineCounters)
    cache: RadixCache | None = None
    # what finished or retracted requests hold until the batches that may read it are processed
    deferred: DeferredFrees = field(init=False)
    # speculative decoding: each decode step verifies drafts (None: off)
    spec: SpecPolicy | None = None
    last_processed_at: float | None = None  # when the last step was processed (speculation)
    # a mixed step's decode half once it is prepared, until the step is launched: if building
    # or launching the step raises, the decode half runs alone (`split_failed_mix`)
    prepared_decode: ScheduleBatch | None = None

    def __post_init__(self) -> None:
        self.deferred = DeferredFrees(self.ctx, self.cache)
        self.output.unread_bound = self.config.max_unread_tokens
        paused = PausedRequests(self.config.max_unread_tokens, self.output)
        self.queues = RequestQueues(self.ctx, paused)
        self.prefill = PrefillManager(
            self.config,
            self.ctx,
            self.queues,
            self.max_running_requests,
            self.stats,
            self.observer,
            self.cache,
            self.spec.k if self.spec is not None else 0,
        )

    # ------------------------------------------------------------------ intake

    def add_request(self, req: Req) -> None:
        req.check_grammar()
        self.queues.waiting.append(req)

    def abort(
        self, req: Req, reason: FinishReason = FinishReason.ABORT, message: str | None = None
    ) -> None:
        if req.finished:
            return
        self.queues.leave(req)
        self._finish(req, reason, message)

    # ------------------------------------------------------------------ schedule path

    def get_next_batch(self) -> ScheduleBatch | None:
        q = self.queues
        q.building = None
        self.prefill.building_records = None
        self.prepared_decode = None
        with self.ctx.monitor.schedule_path():
            q.merge_last_extend()
            q.filter_running()
            # backpressure: streaming requests whose readers are `max_unread_tokens` behind
            # leave the decode batch, and rejoin it (or the queue) once their readers catch up
            self.stats.backpressure_pauses += q.paused.pause_behind(q.running_batch)
            q.paused.resume_caught_up(q.running_batch, q.waiting)
            if self._may_mix():
                return self._mixed_or_decode()
            batch = self._extend_batch()
            if batch is not None:
                return batch
            running = q.running_batch
            if running.is_empty():
                return None
            q.building = list(running.reqs)
            seq_lens_cpu, ks, ready = self._make_room_for_decode(running)
            if running.is_empty() or not ready:
                return None
            q.building = list(running.reqs)
            # a plain decode step costs less than a verify step; it takes its positions from
            # the host, so only once no row has drafts in flight (every length is exact)
            if ks is not None and (any(ks) or any(r.spec_drafts for r in running.reqs)):
                running.prepare_for_verify(ks, seq_lens_cpu)
            else:
                running.prepare_for_decode(seq_lens_cpu)
            if self.spec is not None and ks is not None:
                self.spec.launched(running.reqs, ks)
            self.stats.decode_batches += 1
            return running

    def _extend_batch(self) -> ScheduleBatch | None:
        """The next extend batch alone (the decode batch waits for it), if there is one."""
        batch = self.prefill.new_batch(self._retract, self._refuse)
        if batch is not None:
            self.queues.last_extend = batch
            self.stats.prefill_batches += 1
        return batch

    def _may_mix(self) -> bool:
        """Whether the next step may carry the decode rows with a prefill chunk: mixing is on,
        both have work, the next prefill is of generation requests, and the decode rows leave
        room in the step's budget and chunk. Not with speculative decoding (verify steps, drafts
        in flight) or sparse attention."""
        cfg, q = self.config, self.queues
        if not cfg.enable_mixed_chunk or self.spec is not None or self.ctx.sparse is not None:
            return False
        if q.running_batch.is_empty() or (q.num_waiting == 0 and q.chunked_req is None):
            return False
        if self.prefill.next_pools():
            return False  # pooling requests run in steps of their own, never with decode rows
        return len(q.running_batch) < min(cfg.max_prefill_tokens, cfg.chunked_prefill_size)

    def _mixed_or_decode(self) -> ScheduleBatch | None:
        """A mixed step: the decode rows get their pages first (retracting as a decode step
        does), then a prefill chunk is admitted in what is left of the budget. Without one the
        step is a plain decode; without a decode step that fits, it is a plain extend."""
        q = self.queues
        running = q.running_batch
        q.building = list(running.reqs)
        seq_lens_cpu, _, ready = self._make_room_for_decode(running)
        if running.is_empty() or not ready:
            return self._extend_batch()
        q.building = list(running.reqs)
        running.prepare_for_decode(seq_lens_cpu)
        self.prepared_decode = running
        ext = self.prefill.new_batch(self._retract, self._refuse, len(running.reqs))
        if ext is None:
            self.prepared_decode = None  # the step is the decode batch itself
            q.building = list(running.reqs)
            self.stats.decode_batches += 1
            return running
        q.building = running.reqs + ext.reqs
        q.last_extend = ext
        self.stats.mixed_batches += 1
        return ScheduleBatch.mixed(ext, running)

    def split_failed_mix(self) -> ScheduleBatch | None:
        """Building or launching a mixed step raised. Its prefill half's requests are left in
        `building` to fail (`fail_unlaunched`); its decode half, already prepared for this step,
        is returned to run alone, so a bad prompt does not take the running streams with it.
        None when there is no decode half, or when the prefill half picked no request (nothing
        names a culprit: the decode half's requests fail)."""
        decode, self.prepared_decode = self.prepared_decode, None
        q = self.queues
        if decode is None or decode.is_empty():
            return None
        ids = {id(r) for r in decode.reqs}
        prefill = [r for r in q.building or [] if id(r) not in ids]
        if not prefill:
            # NOTE: rows prepared for a step that never runs cannot decode on: they fail
            q.building = list(decode.reqs)
            return None
        q.building = prefill
        self.prefill.building_records = None  # the prefill half is never launched
        self.stats.decode_batches += 1
        return decode

    # ------------------------------------------------------------------ prefix cache

    def flush_cache(self) -> bool:
        """Empty the prefix cache. Refused (False) unless the engine is idle."""
        if self.cache is None:
            return True
        if self.queues.all() or self.deferred:
            return False
        self.prefill.cache_records.clear()
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
        self.queues.paused.evict(self._retract, lambda: needed <= allocator.available_pages())
        if needed <= allocator.available_pages():
            return seq_lens_cpu, ks, True
        retracted, fits = running.retract_decode(None if ks is None else [k + 1 for k in ks])
        for req in reversed(retracted):
            self._retract(req)
            self.queues.waiting.appendleft(req)
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
        self.prepared_decode = None
        self.launch_seq += 1
        self.prefill.launched(self.launch_seq)
        return self.launch_seq

    def process(self, out: StepOutput) -> None:
        """Batch `out.seq` is done: apply its tokens, or fail its requests if its step failed;
        then release what waited for it (deferred frees, unlocks, the cache's new pages)."""
        if self.spec is not None and out.ok:
            now = time.perf_counter()
            last, self.last_processed_at = self.last_processed_at, now
            self.spec.observe_step(out, None if last is None else now - last)
        if out.ok:
            self._apply_rows(out)
        else:
            self.fail_batch(out.reqs, f"step failed: {out.error}")
        self.processed_seq = max(self.processed_seq, out.seq)
        self.prefill.processed(out.seq, out.ok)
        self.release_deferred()

    def _apply_rows(self, out: StepOutput) -> None:
        """Each row's new tokens, in order, through `_accept` (a stop inside a verify window
        ends the request there). A plain row is a verify row with k = 0 and one token; a verify
        row then gives back the drafts it rejected (`SpecPolicy.settle`)."""
        verify, logprobs, plan = out.verify, out.logprobs, out.plan
        grammar = plan.grammar if plan is not None else None
        if verify is None and logprobs is not None and plan is not None:
            logprobs.take_prompt(out.reqs, plan)
        if grammar is not None:
            self.stats.grammar_seconds += grammar.seconds
            self.stats.grammar_tokens += grammar.tokens
        now = time.perf_counter()
        flat_row = 0  # the row's first position in the flattened logprobs
        for row, req in enumerate(out.reqs):
            if req.pooling is not None:  # a pooling step's row: its sum, no token
                self._apply_pooled(req, out, row)
                flat_row += 1
                continue
            k = 0 if verify is None else verify.ks[row]
            if verify is not None:
                count_verify_row(self.stats, verify.offered(row), verify.accepted(row))
                tokens = verify.tokens(row)
            else:
                assert out.token_ids is not None
                tokens = [out.token_ids[row]] if out.output_rows[row] else []  # not a chunk
            # NOTE: a finished request is the one-step overlap lag; one with no output in
            # flight was retracted and recomputed since: its tokens are stale
            if tokens and not req.finished and req.in_flight_outputs > 0:
                # a request's grammar facts are keyed by its first scored position; a window
                # ends where its grammar did (the tokens after it are never outputs)
                ended = grammar.ended.get(flat_row) if grammar is not None else None
                how = None
                if ended is not None:
                    tokens, how = tokens[: ended[2]], (ended[0], ended[1])
                self._accept_row(req, tokens, now, flat_row, logprobs, how)
            flat_row += k + 1
            if verify is not None:
                assert self.spec is not None
                self.spec.settle(req, k, verify.accepted(row), self.stats)
        if verify is not None:
            self.queues.running_batch.settle_spec()

    def _apply_pooled(self, req: Req, out: StepOutput, row: int) -> None:
        """A pooling request's chunk: its sum added to the request's; after its final chunk it
        finishes (no token is sampled or kept), its pooled vector the mean or the last row."""
        if req.finished:
            return
        assert out.pooled is not None
        part = out.pooled[row]
        req.pooled = part.clone() if req.pooled is None else req.pooled + part
        if out.output_rows[row]:
            n = len(req.origin_input_ids)
            if req.pooling == "mean":
                req.pooled /= n
            elif req.pooling == "mean_sqrt_len":
                req.pooled /= n**0.5
            self._finish(req, FinishReason.STOP)

    def _accept_row(
        self,
        req: Req,
        tokens: Sequence[int],
        now: float,
        flat_row: int,
        logprobs: LogprobBuffers | None,
        grammar_ended: tuple[str, str] | None,
    ) -> None:
        try:
            for tok in tokens:
                lp = None
                if logprobs is not None and (n := req.sampling_params.logprobs) is not None:
                    lp = logprobs.outputs(flat_row, tok, n)  # NOTE: k is 0 for these rows
                self._accept(req, tok, now, lp)
                if req.finished:
                    return
            if grammar_ended is not None:
                self._grammar_ended(req, *grammar_ended)
        except Exception as exc:  # one request's output failed; the others go on
            logger.error("request %s failed processing its tokens", req.rid, exc_info=exc)
            self._fail_one(req, f"output processing failed: {exc!r}")

    def _grammar_ended(self, req: Req, how: str, message: str) -> None:
        """The stream found the request's grammar complete (nothing but EOS may follow: it is
        done) or at a dead end (it ends with an error saying so)."""
        if how == "complete":
            self._finish(req, FinishReason.STOP)
        else:
            # the request's grammar allows no output from here: its own doing, not the
            # server's (a schema no finite output satisfies), so a 422, not a 500
            self._fail_one(req, f"structured output reached a dead end: {message}", status=422)

    def _refuse(self, req: Req, message: str) -> None:
        """A request taken off `waiting` that can never run."""
        self._finish(req, FinishReason.ERROR, message)

    def _fail_one(self, req: Req, message: str, status: int | None = None) -> None:
        if not req.finished:
            self.queues.leave(req)
            self._finish(req, FinishReason.ERROR, message, status)

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

    def _finish(
        self, req: Req, reason: FinishReason, message: str | None = None, status: int | None = None
    ) -> None:
        req.finish(reason, message, status)
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
            self.prefill.cache_records.clear()
        self.deferred.release(self.processed_seq, everything)

    # ------------------------------------------------------------------ failures

    def fail_batch(self, batch_reqs: list[Req], message: str) -> None:
        for req in batch_reqs:
            self._fail_one(req, message)

    def fail_unlaunched(self, message: str) -> list[Req]:
        """Building or launching the next batch raised: fail that batch's requests.

        Their memory goes on the deferred-free list as for any finish, tagged with the last
        batch that was launched. Returns the failed requests. If the failure came before any
        request was picked, nothing identifies a culprit, so everything fails (the engine must
        make progress rather than raise on every iteration).
        """
        reqs, self.queues.building = self.queues.building, None
        failed = [r for r in reqs or [] if not r.finished]
        if failed:
            self.fail_batch(failed, message)
            return failed
        everything = self.queues.all()
        self.fail_all(message)
        return everything

    def fail_all(self, message: str) -> None:
        """Finish every queued and running request with an error (the engine failed closed)."""
        for req in self.queues.clear():
            if not req.finished:
                self._finish(req, FinishReason.ERROR, message)

    # ------------------------------------------------------------------ KV import

    def reserve_import(self, req: Req) -> bool:
        """Decode side, on the host: the slot and pages of a request whose KV is coming."""
        return self.queues.imports.reserve(req)

    def cancel_import(self, req: Req) -> None:
        self.queues.imports.cancel(req)

    def add_imported(
        self, req: Req, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], first_token_id: int
    ) -> None:
        """Join a request whose prompt KV was computed elsewhere, its first token with it, all
        at once. Raises with nothing left behind if it cannot join."""
        self._join(req, first_token_id, self.queues.imports.add(req, kv, first_token_id))

    def join_import(self, req: Req, first_token_id: int) -> None:
        """An importing request whose KV is written joins the decode batch with its first
        token. Raises with nothing left behind if it cannot join."""
        self._join(req, first_token_id, self.queues.imports.take(req, first_token_id))

    def _join(self, req: Req, first_token_id: int, batch: ScheduleBatch) -> None:
        try:
            req.status = ReqStatus.RUNNING
            req.num_scheduled_outputs = 1
            self._accept(req, first_token_id, time.perf_counter())
            if req.wants_more_decode():
                self.queues.running_batch.merge_batch(batch)
        except BaseException:
            self.queues.imports.fail(req)
            raise

    def release_held(self, rid: str) -> bool:
        """Prefill side: free what a finished `hold_kv` request kept for its transfer."""
        return self.deferred.release_held(rid)
