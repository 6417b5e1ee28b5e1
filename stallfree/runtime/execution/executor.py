"""Running a planned step: the `Executor` seam, and `LocalExecutor`, which runs the model on this
process's stream (`execution/worker.py` has the one that sends the step to worker processes)."""

from __future__ import annotations

import time
from typing import Protocol

import torch

from stallfree.overlap.faults import Fault, FaultInjector
from stallfree.overlap.stream import Event
from stallfree.runtime.execution.context import BatchContext
from stallfree.runtime.execution.planner import StepArgs
from stallfree.runtime.execution.sampler import Sampler
from stallfree.runtime.execution.speculative import SpecDecoder
from stallfree.runtime.execution.step_sampler import StepSampler
from stallfree.runtime.model.decoder_embedder import pooled_sums
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
    """The model on this process's stream: forward, logits to token ids (`StepSampler`), stash,
    copy."""

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
        self.sampler = StepSampler(sampler, ctx.req_to_token_pool.req_to_token.shape[0])
        self.faults = faults
        self.spec = spec  # speculative decoding's stream side (None: off)

    def dispatch(self, args: StepArgs) -> Event:
        """Enqueue the step on the stream; its event fires when the token ids are on the host."""
        stream = self.ctx.stream
        stream.submit(self.run_step, args)
        return stream.record_event()

    def run_step(self, args: StepArgs) -> None:
        """Runs on the stream, in order after every earlier enqueued write."""
        start = time.perf_counter()
        fb, fmap = args.fb, self.ctx.future_map
        stashed = False
        try:
            self._resolve_inputs(args)
            if args.pool is not None:  # a pooling step: sums of hidden states, no sampling
                host_out = self._pool(args)
                fmap.stash(args.stash_slots, args.stash_rows, host_out, args.generation)
                stashed = True
            else:
                host_out = self._sample(args)
                stashed = True
                if fb.mode is not ForwardMode.VERIFY:
                    self._propose(fb, host_out, args)
        finally:
            if not stashed:
                fmap.mark(args.stash_slots, args.generation)
        if args.fault is Fault.FAIL_COPY:
            assert self.faults is not None
            self.faults.before_copy(args.fault)
        args.token_ids_cpu.copy_(host_out, non_blocking=True)
        args.timing.append(time.perf_counter() - start)

    def _sample(self, args: StepArgs) -> torch.Tensor:
        """A generation step's forward, then its sampling (or verifying) and stash."""
        fb, fmap = args.fb, self.ctx.future_map
        logits = self.model(fb)
        if fb.mode is ForwardMode.VERIFY:
            # the verify step stashes its own last tokens (by slot), and its drafts
            host_out = self._verify(fb, logits, args)
            fmap.mark(args.stash_slots, args.generation)
            return host_out
        host_out = self.sampler.sample(logits, args.sb, args.plan, args.logprobs, fb.batch_size)
        fmap.stash(args.stash_slots, args.stash_rows, host_out, args.generation)
        return host_out

    def _pool(self, args: StepArgs) -> torch.Tensor:
        """A pooling step's forward: each row's sum into the plan's host buffer (copied with
        the step's token ids, read after its event); its token ids are zeros, never kept."""
        pool, fb = args.pool, args.fb
        assert pool is not None
        sums = pooled_sums(self.model, fb, pool.index, pool.segment)
        pool.pooled_cpu.copy_(sums, non_blocking=True)
        return torch.zeros(fb.batch_size, dtype=torch.int64, device=sums.device)

    def _resolve_inputs(self, args: StepArgs) -> None:
        """Before the forward: an injected fault, then the input ids the future map holds."""
        fb, fmap = args.fb, self.ctx.future_map
        if args.fault is not Fault.NONE:
            assert self.faults is not None
            self.faults.before_forward(args.fault)
        if fb.mode is ForwardMode.DECODE:
            fb.input_ids = fmap.resolve(fb.req_pool_indices, args.expected)
        elif args.mixed_rows:  # a mixed step: its decode rows' ids, after the prompt tokens
            m = args.mixed_rows
            last = fmap.resolve(fb.req_pool_indices[-m:], args.expected)
            fb.input_ids = torch.cat([fb.input_ids[:-m], last])
        elif fb.mode is ForwardMode.VERIFY:
            fmap.resolve(fb.req_pool_indices, args.expected)  # debug: the stash check
            assert fb.verify is not None and self.spec is not None and args.spec is not None
            self.spec.before_verify(fb, args.spec)
            fb.input_ids = fmap.verify_inputs(
                fb.req_pool_indices, fb.verify.rows, fb.verify.offsets
            )

    def _verify(self, fb: ForwardBatch, logits: torch.Tensor, args: StepArgs) -> torch.Tensor:
        """A verify step after its forward: the logits processors on every scored position,
        then acceptance; returns the one buffer the host copies (tokens, accept counts,
        drafts)."""
        assert self.spec is not None and args.spec is not None
        plan = args.plan
        grammar = plan.grammar if plan is not None else None
        if grammar is not None:
            # NOTE: the grammar masks each draft position at the state its drafts reach; the
            # drafts are the verify inputs, resolved on the stream just now
            grammar.inputs = fb.input_ids
        processed = self.sampler.process(logits, plan)
        tokens, accepted, offered = self.spec.verify(fb, processed, args.spec)
        if plan is not None:
            assert fb.verify is not None
            # each scored position's own token: the draft it accepted, or the step's token
            flat = tokens.reshape(-1)[fb.verify.flat_pos].clamp(min=0)
            self.sampler.record(logits, flat, plan, args.logprobs)
        return torch.cat([tokens, accepted[:, None], offered[:, None]], dim=1)

    def _propose(self, fb: ForwardBatch, next_ids: torch.Tensor, args: StepArgs) -> None:
        """After a plain step's stash: speculative decoding's next drafts (when on)."""
        if self.spec is None or args.spec is None:
            return
        if fb.mode is ForwardMode.DECODE:
            self.spec.after_decode(fb, next_ids, args.spec)
        else:
            self.spec.after_extend(fb, args.stash_slots, args.stash_rows, next_ids, args.spec)
