"""Running a planned step: the `Executor` seam, and `LocalExecutor`, which runs the model on this
process's stream (`execution/worker.py` has the one that sends the step to worker processes)."""

from __future__ import annotations

import time
from typing import Protocol

import torch

from stallfree.overlap.faults import Fault, FaultInjector
from stallfree.overlap.stream import Event
from stallfree.runtime.execution.bad_words import BadWordsState
from stallfree.runtime.execution.context import BatchContext
from stallfree.runtime.execution.grammar import GrammarState
from stallfree.runtime.execution.logits import (
    LogitsPlan,
    LogprobBuffers,
    PenaltyState,
    process_logits,
)
from stallfree.runtime.execution.planner import StepArgs
from stallfree.runtime.execution.sampler import Sampler, SamplingBatch
from stallfree.runtime.execution.speculative import SpecDecoder
from stallfree.runtime.model.forward_batch import ForwardBatch, ForwardMode


class Executor(Protocol):
    """Runs planned steps in launch order; `dispatch` returns the event that fires once the
    step's token ids (and logprobs) are in its host buffers."""

    def dispatch(self, args: StepArgs) -> Event: ...


def adopt_device_state(ctx: BatchContext) -> None:
    """Device-resident state is the stream's: the read guard knows it."""
    fmap, cache = ctx.future_map, ctx.kv_cache
    state = [ctx.req_to_token_pool.req_to_token, *fmap.state()]
    state += [t for t in (*cache.k_buffers, *cache.v_buffers) if t is not None]
    ctx.stream.adopt(*state)


class LocalExecutor:
    """The model on this process's stream: forward, logits processing, sampling, stash, copy."""

    def __init__(
        self,
        model: torch.nn.Module,
        ctx: BatchContext,
        sampler: Sampler,
        faults: FaultInjector | None = None,
        spec: SpecDecoder | None = None,
    ) -> None:
        self.model = model
        self.ctx = ctx
        self.sampler = sampler
        self.faults = faults
        self.spec = spec  # speculative decoding's stream side (None: off)
        # NOTE: created on the stream by the first step that needs it; the host never reads it
        self.penalties: PenaltyState | None = None
        self.grammar: GrammarState | None = None  # the same, for structured output
        self.bad_words: BadWordsState | None = None  # the same, for bad words

    def dispatch(self, args: StepArgs) -> Event:
        """Enqueue the step on the stream; its event fires when the token ids are on the host."""
        stream = self.ctx.stream
        stream.submit(self.run_step, args)
        return stream.record_event()

    def _sample_planned(
        self,
        logits: torch.Tensor,
        batch_size: int,
        sb: SamplingBatch,
        plan: LogitsPlan,
        logprobs: LogprobBuffers | None,
    ) -> torch.Tensor:
        """Stream side: bias, masks and penalties, then sampling, then the logprobs (of the raw
        logits) and this step's penalty counts."""
        extra = None
        if plan.prompt is not None:
            logits, extra = logits[:batch_size], logits[batch_size:]
        grammar = plan.grammar
        if grammar is not None:
            if self.grammar is None:
                slots = self.ctx.req_to_token_pool.req_to_token.shape[0]
                self.grammar = GrammarState(slots, logits.shape[1])
            self.grammar.start(grammar)
        processed = (
            process_logits(logits, plan, self.penalties, self.grammar, self.bad_words)
            if plan.processes_logits
            else logits
        )
        next_ids = self.sampler.sample(processed, sb)
        if grammar is not None:
            assert self.grammar is not None
            self.grammar.advance(grammar, next_ids)
        if logprobs is not None:
            logprobs.fill_outputs(logits, next_ids)
            if extra is not None:
                assert plan.prompt is not None
                logprobs.fill_prompt(extra, plan.prompt.targets)
        if self.penalties is not None:
            self.penalties.record(plan, next_ids)
        if plan.bad_words is not None and self.bad_words is not None:
            self.bad_words.record(plan.bad_words, next_ids)
        return next_ids

    def _verify(self, fb: ForwardBatch, logits: torch.Tensor, args: StepArgs) -> torch.Tensor:
        """A verify step after its forward: logits processing on every scored position, then
        acceptance; returns the one buffer the host copies (tokens, accept counts, drafts)."""
        assert self.spec is not None and args.spec is not None
        plan = args.plan
        if plan is not None and plan.needs_state:
            assert self.penalties is not None
        processed = logits
        if plan is not None and plan.processes_logits:
            processed = process_logits(logits, plan, self.penalties, bad_words=self.bad_words)
        tokens, accepted, offered = self.spec.verify(fb, processed, args.spec)
        if plan is not None:
            assert fb.verify is not None
            # each scored position's own token: the draft it accepted, or the step's token
            flat = tokens.reshape(-1)[fb.verify.flat_pos].clamp(min=0)
            if args.logprobs is not None:
                args.logprobs.fill_outputs(logits, flat)
            if self.penalties is not None:
                self.penalties.record(plan, flat)
            if plan.bad_words is not None and self.bad_words is not None:
                self.bad_words.record(plan.bad_words, flat)
        return torch.cat([tokens, accepted[:, None], offered[:, None]], dim=1)

    def run_step(self, args: StepArgs) -> None:
        """Runs on the stream, in order after every earlier enqueued write."""
        start = time.perf_counter()
        fb, sb, fault, plan = args.fb, args.sb, args.fault, args.plan
        stash_slots, generation = args.stash_slots, args.generation
        fmap = self.ctx.future_map
        stashed = False
        try:
            if fault is not Fault.NONE:
                assert self.faults is not None
                self.faults.before_forward(fault)
            if fb.mode is ForwardMode.DECODE:
                fb.input_ids = fmap.resolve(fb.req_pool_indices, args.expected)
            elif fb.mode is ForwardMode.VERIFY:
                fmap.resolve(fb.req_pool_indices, args.expected)  # debug: the stash check
                assert fb.verify is not None and self.spec is not None and args.spec is not None
                self.spec.before_verify(fb, args.spec)
                fb.input_ids = fmap.verify_inputs(
                    fb.req_pool_indices, fb.verify.rows, fb.verify.offsets
                )
            logits = self.model(fb)
            if plan is not None and plan.needs_state:
                if self.penalties is None:
                    slots = self.ctx.req_to_token_pool.req_to_token.shape[0]
                    self.penalties = PenaltyState(slots, logits.shape[1], logits.device)
                self.penalties.rebuild(plan)
            if plan is not None and plan.bad_words is not None:
                if self.bad_words is None:
                    slots = self.ctx.req_to_token_pool.req_to_token.shape[0]
                    self.bad_words = BadWordsState(slots, logits.device)
                self.bad_words.rebuild(plan.bad_words)
            if fb.mode is ForwardMode.VERIFY:
                # the verify step stashes its own last tokens (by slot), and its drafts
                host_out = self._verify(fb, logits, args)
                fmap.mark(stash_slots, generation)
                stashed = True
            else:
                if plan is None:
                    host_out = self.sampler.sample(logits, sb)
                else:
                    host_out = self._sample_planned(logits, fb.batch_size, sb, plan, args.logprobs)
                fmap.stash(stash_slots, args.stash_rows, host_out, generation)
                stashed = True
                if self.spec is not None and args.spec is not None:
                    if fb.mode is ForwardMode.DECODE:
                        self.spec.after_decode(fb, host_out, args.spec)
                    else:
                        self.spec.after_extend(
                            fb, stash_slots, args.stash_rows, host_out, args.spec
                        )
        finally:
            if not stashed:
                fmap.mark(stash_slots, generation)
        if fault is Fault.FAIL_COPY:
            assert self.faults is not None
            self.faults.before_copy(fault)
        args.token_ids_cpu.copy_(host_out, non_blocking=True)
        args.timing.append(time.perf_counter() - start)
