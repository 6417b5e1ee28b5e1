"""Planning a step on the host: from a batch's forward tensors and row lists to the `StepArgs`
that an executor runs (in process, or in worker processes). Nothing here reads the device."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stallfree.overlap.faults import Fault, FaultInjector
from stallfree.runtime.execution.context import BatchContext
from stallfree.runtime.execution.logits import LogitsPlan, LogprobBuffers, build_logits_plan
from stallfree.runtime.execution.logits_processor import StepRows
from stallfree.runtime.execution.sampler import SamplingBatch
from stallfree.runtime.execution.speculative import DraftPlan, SpecArgs
from stallfree.runtime.model.forward_batch import ForwardBatch, ForwardMode, LoraBatch
from stallfree.runtime.request.req import Req
from stallfree.runtime.request.sampling_params import SamplingParams

_I64 = torch.int64


@dataclass(slots=True, eq=False)
class StepInput:
    """What one step needs from the batch that scheduling built: its forward tensors and the
    per-row host lists (which rows make a real token, and that token's output index)."""

    forward_batch: ForwardBatch
    reqs: list[Req]
    output_rows: list[bool]
    output_steps: list[int]
    # a mixed step (an extend step that carries decode rows): its last rows' input ids are
    # placeholders, resolved from the future map on the stream
    mixed_rows: int = 0


@dataclass(slots=True, eq=False)
class PoolPlan:
    """A pooling step's rows to sum (docs/embeddings.md): the flat token rows whose final
    hidden state is added (`index`, device) into which batch row's vector (`segment`,
    device), and the host buffer the [batch, width] sums land in, valid once the step's event
    has fired. Mean pooling adds every token of each chunk; last-token pooling adds the
    prompt's last token, in its final chunk, and nothing before; CLS pooling its first."""

    index: torch.Tensor
    segment: torch.Tensor
    pooled_cpu: torch.Tensor


@dataclass(slots=True, eq=False)
class StepArgs:
    """What one step hands the stream side: built at launch from host facts, run by
    `LocalExecutor.run_step` (in process) or carried to the workers in a step message
    (`execution/worker.py`)."""

    fb: ForwardBatch
    sb: SamplingBatch
    stash_slots: torch.Tensor  # request slots whose sampled token goes to the future map
    stash_rows: torch.Tensor  # their rows in the batch
    token_ids_cpu: torch.Tensor  # pinned; the sampled ids land here
    fault: Fault = Fault.NONE
    expected: torch.Tensor | None = None  # future-map debug: generations a decode resolves
    generation: int | None = None  # future-map debug: this step's stash generation
    plan: LogitsPlan | None = None
    logprobs: LogprobBuffers | None = None
    spec: SpecArgs | None = None  # speculative decoding's host facts (None: off)
    mixed_rows: int = 0  # last rows of an extend step whose input id the future map holds
    pool: PoolPlan | None = None  # a pooling step: what it sums, instead of sampling
    # the stream's time for the step, appended by the in-process executor's worker when it
    # is done (a host list: read once the step's event fired)
    timing: list[float] = field(default_factory=list)


class StepPlanner:
    """Turns a `StepInput` into `StepArgs`: uploads, host buffers, the logits plan, faults."""

    def __init__(self, ctx: BatchContext, faults: FaultInjector | None = None) -> None:
        self.ctx = ctx
        self.faults = faults

    def plan(self, step: StepInput) -> StepArgs:
        ctx = self.ctx
        stream = ctx.stream
        fb = step.forward_batch
        with ctx.monitor.schedule_path():
            params = [r.sampling_params for r in step.reqs]
            fb.lora = LoraBatch.build(
                [r.lora_slot for r in step.reqs], fb.extend_lens_cpu, stream.upload
            )
            sb = SamplingBatch.build(params, step.output_steps, stream.upload)
            rows_cpu = torch.tensor(
                [i for i, real in enumerate(step.output_rows) if real], dtype=_I64
            )
            stash_rows = stream.upload(rows_cpu)
            slots_cpu = fb.req_pool_indices_cpu[rows_cpu]
            stash_slots = stream.upload(slots_cpu)
            spec: SpecArgs | None
            if fb.mode is ForwardMode.VERIFY:
                spec = self._plan_verify(fb, params, step.output_steps)
                rows = _scored_positions(step)
                assert fb.verify is not None
                # one copy: each row's tokens, its accept count, the drafts it carried
                token_ids_cpu = stream.host_buffer((len(step.reqs), fb.verify.max_k + 3), _I64)
            else:
                spec = self._plan_spec(fb)
                rows = StepRows(step.reqs, step.output_rows, step.output_steps)
                token_ids_cpu = stream.host_buffer((len(step.reqs),), _I64)
            plan, logprobs = self._plan_logits(fb, rows)
            expected, generation = self._plan_future_map(fb, slots_cpu, step.mixed_rows)
            pool = self._plan_pool(fb, step)
        fault = self.faults.plan() if self.faults is not None else Fault.NONE
        return StepArgs(
            fb,
            sb,
            stash_slots,
            stash_rows,
            token_ids_cpu,
            fault,
            expected,
            generation,
            plan,
            logprobs,
            spec,
            mixed_rows=step.mixed_rows,
            pool=pool,
        )

    def _plan_pool(self, fb: ForwardBatch, step: StepInput) -> PoolPlan | None:
        """A step of pooling requests: the rows each one sums (None: a generation step). A
        step is all pooling rows or none (admission keeps the kinds apart)."""
        modes = [r.pooling for r in step.reqs]
        if all(m is None for m in modes):
            return None
        if fb.mode is not ForwardMode.EXTEND or step.mixed_rows or None in modes:
            raise ValueError("a pooling step carries prompt chunks of pooling requests only")
        index: list[int] = []
        segment: list[int] = []
        start = 0
        for row, (mode, n) in enumerate(zip(modes, fb.extend_lens_cpu, strict=True)):
            if mode in ("mean", "mean_sqrt_len"):
                index.extend(range(start, start + n))
                segment.extend([row] * n)
            elif mode == "cls":  # the first token: the first chunk's first row
                if fb.prefix_lens_cpu[row] == 0:
                    index.append(start)
                    segment.append(row)
            elif step.output_rows[row]:  # last token: the final chunk's last row
                index.append(start + n - 1)
                segment.append(row)
            start += n
        stream = self.ctx.stream
        pooled_cpu = stream.host_buffer((len(modes), self.ctx.pool_width), torch.float32)
        return PoolPlan(
            stream.upload(torch.tensor(index, dtype=_I64)),
            stream.upload(torch.tensor(segment, dtype=_I64)),
            pooled_cpu,
        )

    def _plan_logits(
        self, fb: ForwardBatch, rows: StepRows
    ) -> tuple[LogitsPlan | None, LogprobBuffers | None]:
        """The logits processors' plan of the step's token rows, and its logprob buffers."""
        stream = self.ctx.stream
        extend = (fb.prefix_lens_cpu, fb.extend_lens_cpu) if fb.mode is ForwardMode.EXTEND else None
        plan = build_logits_plan(rows, extend, stream.upload)
        if plan is None:
            return None, None
        logprobs = LogprobBuffers.allocate(plan, len(rows.reqs), stream.host_buffer)
        if plan.prompt is not None:
            fb.logit_positions = plan.prompt.positions
        return plan, logprobs

    def _plan_spec(self, fb: ForwardBatch) -> SpecArgs | None:
        """A plain step's host facts for speculative decoding (None: off)."""
        if not self.ctx.spec_k:
            return None
        width = int(fb.seq_lens_cpu.max()) + 1 if len(fb.seq_lens_cpu) else 1
        spec = SpecArgs(width=width)
        if self.ctx.spec_draft_model and fb.mode is ForwardMode.DECODE:
            spec.draft = DraftPlan.build([0] * fb.batch_size, self.ctx.stream.upload)
        return spec

    def _plan_verify(
        self, fb: ForwardBatch, params: list[SamplingParams], output_steps: list[int]
    ) -> SpecArgs:
        """Host facts of a verify step: each row's draft count and mask, and the sampling of
        its padded positions (position j of a row is its output `output_steps[row] + j`)."""
        layout = fb.verify
        assert layout is not None
        up = self.ctx.stream.upload
        ks, max_k = layout.ks, layout.max_k
        mask = torch.arange(max_k)[None, :] < torch.tensor(ks, dtype=_I64)[:, None]
        pad_params = [p for p in params for _ in range(max_k + 1)]
        pad_steps = [s + j for s in output_steps for j in range(max_k + 1)]
        return SpecArgs(
            width=int(fb.seq_lens_cpu.max()) + 1,
            ks=up(torch.tensor(ks, dtype=_I64)),
            draft_mask=up(mask),
            sb_pad=SamplingBatch.build(pad_params, pad_steps, up),
            draft=DraftPlan.build(ks, up) if self.ctx.spec_draft_model else None,
        )

    def _plan_future_map(
        self, fb: ForwardBatch, slots_cpu: torch.Tensor, mixed_rows: int = 0
    ) -> tuple[torch.Tensor | None, int | None]:
        """Debug: the stash generations a decode step (or a mixed step's decode rows) must
        resolve, and this step's own."""
        fmap = self.ctx.future_map
        if not fmap.debug:
            return None, None
        rows: list[int] = fb.req_pool_indices_cpu.tolist()
        resolved: list[int] = []
        if fb.mode in (ForwardMode.DECODE, ForwardMode.VERIFY):
            resolved = rows
        else:
            split = len(rows) - mixed_rows
            fmap.plan_prefill(rows[:split])
            resolved = rows[split:]
        expected = None
        if resolved:
            expected = self.ctx.stream.upload(torch.tensor(fmap.plan_resolve(resolved), dtype=_I64))
        return expected, fmap.plan_stash(slots_cpu.tolist())


def _scored_positions(step: StepInput) -> StepRows:
    """A verify step's token rows, flattened: one per scored position, each its own output
    index."""
    ns = step.forward_batch.extend_lens_cpu
    reqs = [r for r, n in zip(step.reqs, ns, strict=True) for _ in range(n)]
    steps = [s + j for s, n in zip(step.output_steps, ns, strict=True) for j in range(n)]
    return StepRows(reqs, [True] * len(reqs), steps)
