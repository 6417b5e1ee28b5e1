"""The presence, frequency and repetition penalties, on the stream, overlap-safe.

Penalty state lives on the device, owned by the stream like the KV cache: `PenaltyState` holds
one row per request slot, with each output token's count and a mask of the prompt's tokens.
- A request's row is (re)built by the first batch that carries it after an admission (its first
  prefill chunk, or its re-prefill after a retraction), from the tokens the host knows then.
- Every later step adds the token it sampled for the row on the stream, right after sampling.
  With overlap, batch N+1 is launched before the host has seen batch N's tokens, and the FIFO
  stream applies N's counts before N+1 reads them: the host never needs them.
- A slot's row is only read by a request that built it, so a freed slot needs no clearing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stallfree.runtime.execution.logits_processor import LogitsProcessor, StepRows, Uploads
from stallfree.runtime.request.req import Req


@dataclass(slots=True)
class PenaltyPlan:
    # penalised rows, their slots and factors [P]
    rows: torch.Tensor
    slots: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    # (re)built rows: slots to clear, then prompt (slot, token) marks and output (slot, token)
    init_slots: torch.Tensor | None = None
    init_prompt: tuple[torch.Tensor, torch.Tensor] | None = None
    init_output: tuple[torch.Tensor, torch.Tensor] | None = None
    # rows whose sampled token counts toward their penalties, and their slots
    count_rows: torch.Tensor | None = None
    count_slots: torch.Tensor | None = None


@dataclass(slots=True)
class _PenaltyRows:
    """Penalised rows and their factors; rows whose state is (re)built this step (new, or
    recomputed after a retraction); rows whose sampled token counts toward their penalties."""

    rows: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    presence: list[float] = field(default_factory=list)
    frequency: list[float] = field(default_factory=list)
    repetition: list[float] = field(default_factory=list)
    init_slots: list[int] = field(default_factory=list)
    prompt_marks: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))
    output_marks: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))
    count_rows: list[int] = field(default_factory=list)
    count_slots: list[int] = field(default_factory=list)

    def add(self, row: int, req: Req, real: bool) -> None:
        params = req.sampling_params
        slot = req.req_pool_idx
        assert slot is not None, "a batch row without a request slot"
        if req.penalty_epoch != req.num_retractions:
            req.penalty_epoch = req.num_retractions
            self._rebuild(slot, req)
        self.rows.append(row)
        self.slots.append(slot)
        self.presence.append(params.presence_penalty)
        self.frequency.append(params.frequency_penalty)
        self.repetition.append(params.repetition_penalty)
        if real:
            self.count_rows.append(row)
            self.count_slots.append(slot)

    def _rebuild(self, slot: int, req: Req) -> None:
        self.init_slots.append(slot)
        if req.sampling_params.repetition_penalty != 1.0:
            unique = set(req.origin_input_ids)
            self.prompt_marks[0].extend([slot] * len(unique))
            self.prompt_marks[1].extend(unique)
        self.output_marks[0].extend([slot] * len(req.output_ids))
        self.output_marks[1].extend(req.output_ids)

    def plan(self, up: Uploads) -> PenaltyPlan | None:
        if not self.rows:
            return None
        plan = PenaltyPlan(
            up.ints(self.rows),
            up.ints(self.slots),
            up.floats(self.presence),
            up.floats(self.frequency),
            up.floats(self.repetition),
        )
        if self.init_slots:
            plan.init_slots = up.ints(self.init_slots)
            if self.prompt_marks[0]:
                plan.init_prompt = (up.ints(self.prompt_marks[0]), up.ints(self.prompt_marks[1]))
            if self.output_marks[0]:
                plan.init_output = (up.ints(self.output_marks[0]), up.ints(self.output_marks[1]))
        if self.count_rows:
            plan.count_rows, plan.count_slots = up.ints(self.count_rows), up.ints(self.count_slots)
        return plan


class PenaltyState:
    """Per-slot output token counts and prompt token marks, on the device (the stream's)."""

    def __init__(self, num_slots: int, vocab: int, device: torch.device) -> None:
        self.counts = torch.zeros((num_slots, vocab), dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros((num_slots, vocab), dtype=torch.bool, device=device)

    def rebuild(self, plan: PenaltyPlan) -> None:
        """Stream side: clear and refill the rows of (re)admitted requests."""
        if plan.init_slots is None:
            return
        self.counts.index_fill_(0, plan.init_slots, 0)
        self.prompt_mask.index_fill_(0, plan.init_slots, False)
        if plan.init_prompt is not None:
            slots, toks = plan.init_prompt
            self.prompt_mask.index_put_((slots, toks), torch.ones_like(toks, dtype=torch.bool))
        if plan.init_output is not None:
            slots, toks = plan.init_output
            ones = torch.ones_like(toks, dtype=torch.int32)
            self.counts.index_put_((slots, toks), ones, accumulate=True)

    def apply(self, logits: torch.Tensor, plan: PenaltyPlan) -> torch.Tensor:
        """Stream side: repetition, then frequency and presence penalties (vLLM's order)."""
        counts = self.counts.index_select(0, plan.slots)
        rows = logits.index_select(0, plan.rows)
        present = counts > 0
        seen = present | self.prompt_mask.index_select(0, plan.slots)
        rep = plan.repetition.unsqueeze(1)
        rows = torch.where(seen, torch.where(rows > 0, rows / rep, rows * rep), rows)
        rows = rows - plan.frequency.unsqueeze(1) * counts.to(rows.dtype)
        rows = rows - plan.presence.unsqueeze(1) * present.to(rows.dtype)
        return logits.index_copy(0, plan.rows, rows)

    def record(self, plan: PenaltyPlan, next_ids: torch.Tensor) -> None:
        """Stream side: count the tokens this step sampled for penalised rows."""
        if plan.count_rows is None:
            return
        assert plan.count_slots is not None
        toks = next_ids.index_select(0, plan.count_rows)
        ones = torch.ones_like(toks, dtype=torch.int32)
        self.counts.index_put_((plan.count_slots, toks), ones, accumulate=True)


class Penalties(LogitsProcessor[PenaltyPlan]):
    """The penalties, with their `PenaltyState` (created by the first step that needs it)."""

    name = "penalties"

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self.state: PenaltyState | None = None

    @classmethod
    def plan(cls, rows: StepRows, up: Uploads) -> PenaltyPlan | None:
        penalties = _PenaltyRows()
        for row, req in enumerate(rows.reqs):
            if req.needs_logits_plan and req.sampling_params.has_penalties:
                penalties.add(row, req, rows.output_rows[row])
        return penalties.plan(up)

    def apply(self, logits: torch.Tensor, part: PenaltyPlan, raw: torch.Tensor) -> torch.Tensor:
        if self.state is None:
            self.state = PenaltyState(self.num_slots, logits.shape[1], logits.device)
        self.state.rebuild(part)
        return self.state.apply(logits, part)

    def record(self, part: PenaltyPlan, next_ids: torch.Tensor) -> None:
        assert self.state is not None
        self.state.record(part, next_ids)
