"""Launch a `ScheduleBatch` on the stream: forward, sample, stash, copy ids to pinned host memory."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stallfree.overlap.faults import Fault, FaultInjector
from stallfree.overlap.stream import Event
from stallfree.runtime.context import BatchContext
from stallfree.runtime.forward_batch import ForwardBatch, ForwardMode
from stallfree.runtime.logits import (
    LogitsPlan,
    LogprobBuffers,
    PenaltyState,
    build_logits_plan,
    process_logits,
)
from stallfree.runtime.req import Req
from stallfree.runtime.sampler import Sampler, SamplingBatch
from stallfree.runtime.schedule_batch import ScheduleBatch

_I64 = torch.int64


@dataclass(slots=True, eq=False)
class LaunchedBatch:
    """A batch whose tensors now belong to the stream; kept alive until its result is processed."""

    seq: int
    mode: ForwardMode
    reqs: list[Req]
    output_rows: list[bool]
    token_ids_host: torch.Tensor  # pinned; valid once `event` has fired
    event: Event
    forward_batch: ForwardBatch  # NOTE: holds the launched device tensors alive
    logits_plan: LogitsPlan | None = None
    logprobs: LogprobBuffers | None = None  # host; valid once `event` has fired

    async def wait_token_ids(self) -> list[int]:
        await self.event.wait()
        return self.token_ids_host.tolist()


@dataclass(slots=True, eq=False)
class StepArgs:
    """What one step hands the stream side: built at launch from host facts, run by `_step`
    (in process) or carried to the workers in a step message (`runtime/worker.py`)."""

    fb: ForwardBatch
    sb: SamplingBatch
    stash_slots: torch.Tensor  # request slots whose sampled token goes to the future map
    stash_rows: torch.Tensor  # their rows in the batch
    token_ids_host: torch.Tensor  # the sampled ids land here
    fault: Fault = Fault.NONE
    expected: torch.Tensor | None = None  # future-map debug: generations a decode resolves
    generation: int | None = None  # future-map debug: this step's stash generation
    plan: LogitsPlan | None = None
    logprobs: LogprobBuffers | None = None


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        ctx: BatchContext,
        sampler: Sampler,
        faults: FaultInjector | None = None,
    ) -> None:
        self.model = model
        self.ctx = ctx
        self.sampler = sampler
        self.faults = faults
        # NOTE: created on the stream by the first step that needs it; the host never reads it
        self.penalties: PenaltyState | None = None
        if ctx.check_mirrors:  # the debug checks: mirror parity and the future map's stamps
            ctx.future_map.enable_debug()
        self._adopt_device_state()

    def enable_read_guard(self) -> None:
        """Strict mode's read guard without strict (tests of the legacy modes); before any batch."""
        self.ctx.monitor.enable_read_guard()
        self._adopt_device_state()

    def _adopt_device_state(self) -> None:
        """Device-resident state is the stream's too: the read guard knows it."""
        ctx = self.ctx
        fmap, cache = ctx.future_map, ctx.kv_cache
        state = [ctx.req_to_token_pool.req_to_token, fmap.tokens]
        state += [t for t in (*cache.k_buffers, *cache.v_buffers) if t is not None]
        if fmap.stamps is not None:
            state.append(fmap.stamps)
        ctx.stream.adopt(*state)

    def launch(self, batch: ScheduleBatch, seq: int) -> LaunchedBatch:
        ctx = self.ctx
        stream = ctx.stream
        with ctx.monitor.schedule_path():
            fb = batch.to_forward_batch()
            params = [r.sampling_params for r in batch.reqs]
            sb = SamplingBatch.build(params, batch.output_steps, stream.upload)
            rows_cpu = torch.tensor(
                [i for i, real in enumerate(batch.output_rows) if real], dtype=_I64
            )
            stash_rows = stream.upload(rows_cpu)
            slots_cpu = fb.req_pool_indices_cpu[rows_cpu]
            stash_slots = stream.upload(slots_cpu)
            token_ids_host = stream.host_buffer((len(batch.reqs),), _I64)
            plan = build_logits_plan(
                batch.reqs,
                batch.output_rows,
                batch.output_steps,
                (fb.prefix_lens_cpu, fb.extend_lens_cpu) if fb.mode is ForwardMode.EXTEND else None,
                stream.upload,
            )
            logprobs = None
            if plan is not None:
                logprobs = LogprobBuffers.allocate(plan, len(batch.reqs), stream.host_buffer)
                if plan.prompt is not None:
                    fb.logit_positions = plan.prompt.positions
            expected, generation = self._plan_future_map(fb, slots_cpu)
        fault = self.faults.plan() if self.faults is not None else Fault.NONE
        args = StepArgs(
            fb,
            sb,
            stash_slots,
            stash_rows,
            token_ids_host,
            fault,
            expected,
            generation,
            plan,
            logprobs,
        )
        event = self._dispatch(args)
        return LaunchedBatch(
            seq=seq,
            mode=batch.forward_mode,
            reqs=list(batch.reqs),
            output_rows=list(batch.output_rows),
            token_ids_host=token_ids_host,
            event=event,
            forward_batch=fb,
            logits_plan=plan,
            logprobs=logprobs,
        )

    def _dispatch(self, args: StepArgs) -> Event:
        """Enqueue the step on the stream; its event fires when the token ids are on the host.
        (`runtime/worker.py` sends it to worker processes instead.)"""
        stream = self.ctx.stream
        stream.submit(self._step, args)
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
        processed = (
            process_logits(logits, plan, self.penalties) if plan.processes_logits else logits
        )
        next_ids = self.sampler.sample(processed, sb)
        if logprobs is not None:
            logprobs.fill_outputs(logits, next_ids)
            if extra is not None:
                assert plan.prompt is not None
                logprobs.fill_prompt(extra, plan.prompt.targets)
        if self.penalties is not None:
            self.penalties.record(plan, next_ids)
        return next_ids

    def _plan_future_map(
        self, fb: ForwardBatch, slots_cpu: torch.Tensor
    ) -> tuple[torch.Tensor | None, int | None]:
        """Debug: the stash generations a decode step must resolve, and this step's own."""
        fmap = self.ctx.future_map
        if not fmap.debug:
            return None, None
        rows: list[int] = fb.req_pool_indices_cpu.tolist()
        expected = None
        if fb.mode is ForwardMode.DECODE:
            expected = self.ctx.stream.upload(torch.tensor(fmap.plan_resolve(rows), dtype=_I64))
        else:
            fmap.plan_prefill(rows)
        return expected, fmap.plan_stash(slots_cpu.tolist())

    def _step(self, args: StepArgs) -> None:
        """Runs on the stream, in order after every earlier enqueued write."""
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
            logits = self.model(fb)
            if plan is not None and plan.needs_state:
                if self.penalties is None:
                    slots = self.ctx.req_to_token_pool.req_to_token.shape[0]
                    self.penalties = PenaltyState(slots, logits.shape[1], logits.device)
                self.penalties.rebuild(plan)
            if plan is None:
                next_ids = self.sampler.sample(logits, sb)
            else:
                next_ids = self._sample_planned(logits, fb.batch_size, sb, plan, args.logprobs)
            fmap.stash(stash_slots, args.stash_rows, next_ids, generation)
            stashed = True
        finally:
            if not stashed:
                fmap.mark(stash_slots, generation)
        if fault is Fault.FAIL_COPY:
            assert self.faults is not None
            self.faults.before_copy(fault)
        args.token_ids_host.copy_(next_ids, non_blocking=True)
