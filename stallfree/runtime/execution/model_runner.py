"""The loop's handle on execution: plan a step on the host, hand it to an executor, and wait
for its result as one object (`StepOutput`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stallfree.overlap.faults import FaultInjector
from stallfree.overlap.stream import Event, StreamError
from stallfree.runtime.execution.context import BatchContext
from stallfree.runtime.execution.executor import Executor, adopt_device_state
from stallfree.runtime.execution.logits import LogitsPlan, LogprobBuffers
from stallfree.runtime.execution.planner import StepInput, StepPlanner
from stallfree.runtime.model.forward_batch import ForwardBatch, ForwardMode
from stallfree.runtime.request.req import Req


@dataclass(slots=True, eq=False)
class VerifyOutput:
    """What the host learns from a verify step's one copy."""

    ks: list[int]  # drafts each row was planned to carry
    rows: list[list[int]]  # per row: tokens [max_k + 1], accept count, drafts offered

    def tokens(self, row: int) -> list[int]:
        """The row's new tokens: its accepted drafts, then the target's token."""
        data = self.rows[row]
        return data[: data[-2] + 1]

    def accepted(self, row: int) -> int:
        return self.rows[row][-2]

    def offered(self, row: int) -> int:
        return self.rows[row][-1]


@dataclass(slots=True, eq=False)
class StepOutput:
    """A processed step, whole: the sampled ids (None when the step failed, with `error`), and
    the logprobs and the plan that says how to read them."""

    seq: int
    reqs: list[Req]
    output_rows: list[bool]
    token_ids: list[int] | None
    logprobs: LogprobBuffers | None = None
    plan: LogitsPlan | None = None
    error: str | None = None
    # a verify step: per row, its drafts' count as planned, and the copied row (the tokens
    # padded to `max_k + 1` with -1, then the accept count, then the drafts it carried)
    verify: VerifyOutput | None = None
    seconds: float | None = None  # the stream's time for the step, where it was measured
    mode: ForwardMode | None = None
    # a pooling step: each row's sum of pooled hidden states, [batch, width] float32 on the host
    pooled: torch.Tensor | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(slots=True, eq=False)
class LaunchedBatch:
    """A step whose tensors now belong to the stream; kept alive until its result is processed."""

    seq: int
    mode: ForwardMode
    reqs: list[Req]
    output_rows: list[bool]
    token_ids_cpu: torch.Tensor  # pinned; valid once `event` has fired
    event: Event
    forward_batch: ForwardBatch  # NOTE: holds the launched device tensors alive
    logits_plan: LogitsPlan | None = None
    logprobs: LogprobBuffers | None = None  # host; valid once `event` has fired
    timing: list[float] | None = None  # host; the step's time, once `event` has fired
    pooled_cpu: torch.Tensor | None = None  # host; a pooling step's sums, once `event` fired

    async def result(self) -> StepOutput:
        """Wait for the step without blocking the event loop; a failed step is an output too."""
        try:
            await self.event.wait()
        except StreamError as exc:
            return StepOutput(self.seq, self.reqs, self.output_rows, None, error=str(exc))
        seconds = self.timing[0] if self.timing else None
        if self.mode is ForwardMode.VERIFY:
            fb = self.forward_batch
            assert fb.verify is not None
            rows = self.token_ids_cpu.tolist()
            return StepOutput(
                self.seq,
                self.reqs,
                self.output_rows,
                [r[0] for r in rows],
                self.logprobs,
                self.logits_plan,
                verify=VerifyOutput(list(fb.verify.ks), rows),
                seconds=seconds,
                mode=self.mode,
            )
        return StepOutput(
            self.seq,
            self.reqs,
            self.output_rows,
            self.token_ids_cpu.tolist(),
            self.logprobs,
            self.logits_plan,
            seconds=seconds,
            mode=self.mode,
            pooled=self.pooled_cpu,
        )


class ModelRunner:
    """Launches steps: `StepPlanner` on the host, then an `Executor` (in process or remote)."""

    def __init__(
        self, ctx: BatchContext, executor: Executor, faults: FaultInjector | None = None
    ) -> None:
        self.ctx = ctx
        self.planner = StepPlanner(ctx, faults)
        self.executor = executor
        self.faults = faults
        if ctx.check_mirrors:  # the debug checks: mirror parity and the future map's stamps
            ctx.future_map.enable_debug()
        adopt_device_state(ctx)

    def enable_read_guard(self) -> None:
        """Strict mode's read guard without strict (tests of the legacy modes); before any batch."""
        self.ctx.monitor.enable_read_guard()
        adopt_device_state(self.ctx)

    def launch(self, step: StepInput, seq: int) -> LaunchedBatch:
        args = self.planner.plan(step)
        event = self.executor.dispatch(args)
        return LaunchedBatch(
            seq=seq,
            mode=step.forward_batch.mode,
            reqs=list(step.reqs),
            output_rows=list(step.output_rows),
            token_ids_cpu=args.token_ids_cpu,
            event=event,
            forward_batch=step.forward_batch,
            logits_plan=args.plan,
            logprobs=args.logprobs,
            timing=args.timing,
            pooled_cpu=args.pool.pooled_cpu if args.pool is not None else None,
        )
