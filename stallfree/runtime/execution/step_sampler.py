"""A step's logits to its token ids, on the stream: the logits processors, sampling, then the
logprobs (of the raw logits) and what the processors record of the sampled ids. A verify step
uses the same parts around its acceptance (`process`, then `record`)."""

from __future__ import annotations

import torch

from stallfree.runtime.execution.logits import LogitsPlan, LogprobBuffers
from stallfree.runtime.execution.processors import LogitsProcessors
from stallfree.runtime.execution.sampler import Sampler, SamplingBatch


class StepSampler:
    """The sampler and the list of logits processors, each processor with the state it owns."""

    def __init__(self, sampler: Sampler, num_slots: int) -> None:
        self.sampler = sampler
        # NOTE: each processor's state is created on the stream by the first step that needs
        # it; the host never reads it
        self.processors = LogitsProcessors(num_slots)

    def sample(
        self,
        logits: torch.Tensor,
        sb: SamplingBatch,
        plan: LogitsPlan | None,
        logprobs: LogprobBuffers | None,
        batch_size: int,
    ) -> torch.Tensor:
        """The step's token ids; logits past `batch_size` are the planned prompt positions."""
        if plan is None:
            return self.sampler.sample(logits, sb)
        extra = None
        if plan.prompt is not None:
            logits, extra = logits[:batch_size], logits[batch_size:]
        next_ids = self.sampler.sample(self.process(logits, plan), sb)
        self.record(logits, next_ids, plan, logprobs)
        if extra is not None and logprobs is not None:
            assert plan.prompt is not None
            logprobs.fill_prompt(extra, plan.prompt.targets)
        return next_ids

    def process(self, logits: torch.Tensor, plan: LogitsPlan | None) -> torch.Tensor:
        """The planned processors applied, out of place (the raw logits stay, for logprobs)."""
        return logits if plan is None else self.processors.apply(logits, plan.parts)

    def record(
        self,
        logits: torch.Tensor,
        next_ids: torch.Tensor,
        plan: LogitsPlan,
        logprobs: LogprobBuffers | None,
    ) -> None:
        """After sampling (or acceptance): the ids' logprobs of the raw `logits`, and what each
        planned processor keeps of them."""
        if logprobs is not None:
            logprobs.fill_outputs(logits, next_ids)
        self.processors.record(plan.parts, next_ids)
