"""Structured output on the stream: grammar state, next-token masks, and their advance.

Overlap-safe by construction, the same way the penalty counts are (`execution/penalties.py`):

- The host plans a batch from host facts only: which rows are constrained, their request
  slots, whose token is a kept output, and which rows (re)start their matcher (the first batch
  after an admission or a retraction, with the outputs the host knows then). It never reads a
  mask or a grammar state.
- The stream owns every matcher and a `[slots, ceil(vocab / 32)]` bitmask. A step applies its
  rows' masks to the logits, samples, then advances each row's matcher by the token it sampled
  and computes that row's mask for the next step, all in FIFO order. With overlap, batch N+1 is
  launched before the host has seen batch N's tokens, and the stream has N's masks in place
  before N+1's sampling reads them.
- What the host must learn (a grammar that completed, or one that reached a dead end) is
  written into the plan's `ended` map on the stream and read after the step's event, like the
  token ids themselves.
- A verify step (speculative decoding) scores `k + 1` positions of a request: position `j` is
  masked by the state the grammar reaches after the request's first `j` drafts (the matcher
  consumes them, computes each mask, and rolls them back), and after acceptance the matcher
  advances by the tokens the request keeps: the accepted drafts and the step's own token. A
  draft the grammar refuses cannot be accepted (the position before it is masked against it),
  so the positions after it are left unmasked.
- In worker processes each rank holds the matchers (`execution/remote.py` sends a grammar's
  text once, when its request starts) and every rank masks alike.

The mask work runs on the stream's thread (the CPU stream's worker), so on the CPU it overlaps
the scheduler's Python like the forward does; llguidance computes masks without the GIL.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from stallfree.runtime.execution.logits_processor import LogitsProcessor, StepRows, Uploads
from stallfree.runtime.text.grammar_compiler import RequestGrammar

_I32 = torch.int32


@dataclass(slots=True)
class GrammarPlan:
    """A batch's constrained rows, from host facts."""

    rows: list[int]
    slots: list[int]
    consume: list[bool]  # the row's token is an output its request keeps
    # (slot, grammar, outputs the host knows): matchers to (re)start before this step
    starts: list[tuple[int, RequestGrammar, list[int]]]
    rows_t: torch.Tensor  # rows, uploaded
    # (slot, first index into rows, count): a request's consecutive rows (more than one: the
    # positions a verify step scores for it)
    groups: list[tuple[int, int, int]]
    # stream side, a verify step's only: each scored position's input (a row's next input is
    # the draft that follows its position), set by the executor before the processors apply
    inputs: torch.Tensor | None = None
    # stream -> host, valid after the step's event: the first row of a request -> ("complete"
    # | "error", message, how many of its tokens the grammar took); tokens the matchers
    # consumed; stream time spent on the grammar
    ended: dict[int, tuple[str, str, int]] = field(default_factory=dict)
    tokens: int = 0
    seconds: float = 0.0


class GrammarState:
    """Per-slot matchers and their next-token bitmasks (host memory the stream owns)."""

    def __init__(self, num_slots: int, vocab: int) -> None:
        import llguidance

        self.vocab = vocab
        self.width = (vocab + 31) // 32
        self.bitmask = torch.full((num_slots, self.width), -1, dtype=_I32)
        self.matchers: dict[int, Any] = {}
        self._shifts = torch.arange(32, dtype=_I32)
        self._executor = llguidance.LLExecutor(num_threads=max(1, min(4, torch.get_num_threads())))

    def start(self, plan: GrammarPlan) -> None:
        """Stream side: (re)start matchers at the outputs the host knows, and their masks."""
        if not plan.starts:
            return
        begin = time.perf_counter()
        for slot, grammar, outputs in plan.starts:
            matcher = grammar.matcher
            matcher.reset()
            if outputs:
                matcher.consume_tokens(outputs)
            self.matchers[slot] = matcher
        self._fill([(g.matcher, slot) for slot, g, _ in plan.starts])
        plan.seconds += time.perf_counter() - begin

    def apply(self, logits: torch.Tensor, plan: GrammarPlan, raw: torch.Tensor) -> torch.Tensor:
        """Stream side: tokens a row's grammar does not allow next get -inf.

        Where the other processing left none of the allowed tokens finite (min_tokens banning
        the EOS a complete grammar needs, an `allowed_token_ids` outside the grammar), the row
        samples from the grammar's tokens by their raw logits instead: the grammar wins, and
        the sampler never sees a row with nothing to sample."""
        begin = time.perf_counter()
        bits = self.bitmask[plan.slots]
        if plan.inputs is not None:
            self._draft_masks(plan, bits)
        bits = bits.to(logits.device)
        allowed = ((bits.unsqueeze(-1) >> self._shifts.to(logits.device)) & 1).bool()
        allowed = allowed.reshape(bits.shape[0], -1)[:, : logits.shape[1]]
        rows = logits.index_select(0, plan.rows_t).masked_fill(~allowed, float("-inf"))
        fallback = raw.index_select(0, plan.rows_t).masked_fill(~allowed, float("-inf"))
        rows = torch.where(torch.isneginf(rows).all(dim=1, keepdim=True), fallback, rows)
        out = logits.index_copy(0, plan.rows_t, rows)
        plan.seconds += time.perf_counter() - begin  # the stream is the CPU's: timed as it runs
        return out

    def _draft_masks(self, plan: GrammarPlan, bits: torch.Tensor) -> None:
        """A verify step: the mask of each draft position, at the state its drafts reach."""
        assert plan.inputs is not None
        inputs = plan.inputs.index_select(0, plan.rows_t.to(plan.inputs.device)).tolist()
        row_bytes = self.width * 4
        for slot, at, n in plan.groups:
            matcher = self.matchers[slot]
            taken = 0
            for j in range(1, n):
                draft = inputs[at + j]
                if draft < 0 or matcher.is_stopped() or matcher.try_consume_tokens([draft]) != 1:
                    bits[at + j : at + n] = -1  # never accepted: any mask will do
                    break
                taken += 1
                matcher.unsafe_compute_mask_ptr(bits[at + j].data_ptr(), row_bytes)
            if taken:
                matcher.rollback(taken)

    def advance(self, plan: GrammarPlan, next_ids: torch.Tensor) -> None:
        """Stream side: each kept token advances its matcher; then the next step's masks. A
        verify position's token is kept while the one before it is the draft that followed
        (accepted); the first that is not ends the request's tokens."""
        begin = time.perf_counter()
        tokens = next_ids.index_select(0, plan.rows_t.to(next_ids.device)).tolist()
        inputs = None
        if plan.inputs is not None:
            inputs = plan.inputs.index_select(0, plan.rows_t.to(plan.inputs.device)).tolist()
        moved: list[tuple[Any, int]] = []
        for slot, at, n in plan.groups:
            if not plan.consume[at]:
                continue
            matcher = self.matchers[slot]
            taken = 0
            for j in range(n):
                if j and (inputs is None or tokens[at + j - 1] != inputs[at + j]):
                    break  # the draft at this position was rejected
                if matcher.is_stopped():
                    break
                matcher.consume_token(tokens[at + j])
                taken += 1
            plan.tokens += taken
            if taken:  # a stopped matcher's mask (EOS alone) is in place already
                moved.append((matcher, slot))
            row = plan.rows[at]
            if matcher.is_error():
                message = matcher.get_error().strip().split("\n")[0][:300]
                plan.ended[row] = ("error", message, taken)
            elif matcher.is_stopped():
                plan.ended[row] = ("complete", "", taken)
        self._fill(moved)
        plan.seconds += time.perf_counter() - begin

    def _fill(self, matchers: list[tuple[Any, int]]) -> None:
        """The next-token masks of `matchers` (with their slots). A completed or dead grammar's
        mask allows only EOS (llguidance's), so the step already in flight samples a defined
        token and the request ends."""
        if not matchers:
            return
        out = self.bitmask
        row_bytes = self.width * 4
        if len(matchers) == 1:
            matcher, slot = matchers[0]
            matcher.unsafe_compute_mask_ptr(out[slot].data_ptr(), row_bytes)
        else:
            self._executor.unsafe_compute_mask_ptr(
                matchers, out.data_ptr(), row_bytes, out.shape[0]
            )


class Grammar(LogitsProcessor[GrammarPlan]):
    """Structured output, with its `GrammarState` (created by the first step that needs it)."""

    name = "grammar"

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self.state: GrammarState | None = None

    @classmethod
    def plan(cls, rows: StepRows, up: Uploads) -> GrammarPlan | None:
        """Constrained rows; a request's matcher (re)starts on its first batch after an
        admission or a retraction, at the outputs the host knows then (as its penalty row is
        rebuilt)."""
        constrained = [
            r
            for r, req in enumerate(rows.reqs)
            if req.needs_logits_plan and req.grammar is not None
        ]
        if not constrained:
            return None
        slots: list[int] = []
        starts: list[tuple[int, RequestGrammar, list[int]]] = []
        for row in constrained:
            req = rows.reqs[row]
            slot = req.req_pool_idx
            assert slot is not None, "a batch row without a request slot"
            slots.append(slot)
            if req.grammar_epoch != req.num_retractions:
                req.grammar_epoch = req.num_retractions
                starts.append((slot, req.grammar, list(req.output_ids)))
        consume = [rows.output_rows[r] for r in constrained]
        groups: list[tuple[int, int, int]] = []
        for i, slot in enumerate(slots):
            if groups and groups[-1][0] == slot and constrained[i] == constrained[i - 1] + 1:
                groups[-1] = (slot, groups[-1][1], groups[-1][2] + 1)
            else:
                groups.append((slot, i, 1))
        return GrammarPlan(constrained, slots, consume, starts, up.ints(constrained), groups)

    def apply(self, logits: torch.Tensor, part: GrammarPlan, raw: torch.Tensor) -> torch.Tensor:
        if self.state is None:
            self.state = GrammarState(self.num_slots, logits.shape[1])
        self.state.start(part)
        return self.state.apply(logits, part, raw)

    def record(self, part: GrammarPlan, next_ids: torch.Tensor) -> None:
        assert self.state is not None
        self.state.advance(part, next_ids)
