"""vLLM's `bad_words` on the stream, overlap-safe.

A single-token word is a plain ban, put in the logit bias (`execution/logit_bias.py`). A word of more
tokens bans its last token at a step when the output so far ends with its other tokens. With
overlap the host does not know the latest output tokens when it plans a step, so the comparison
is made on the device, against `BadWordsState`: each request slot's last `HISTORY` output
tokens, kept by the stream as `PenaltyState` keeps its counts (`execution/penalties.py`).
- A request's row is (re)built by the first batch that carries it after an admission (its first
  prefill chunk, or its re-prefill after a retraction), from the outputs the host knows then.
- Every later step shifts the token it sampled for the row in, right after sampling; the FIFO
  stream applies batch N's shift before batch N+1 compares.
- Unknown history is -1, which no word's token equals, so a short output never matches a
  longer prefix.

The host plans, per (row, word) pair, the word's prefix (right-aligned, -2 where the prefix is
shorter than the plan's width: "any token") and its last token. Nothing here reads the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from stallfree.runtime.execution.logits_processor import LogitsProcessor, StepRows, Uploads
from stallfree.runtime.request.req import Req
from stallfree.runtime.request.sampling_params import MAX_BAD_WORD_TOKENS

_I64 = torch.int64
HISTORY = MAX_BAD_WORD_TOKENS - 1  # output tokens kept per slot: the longest word's prefix
_UNKNOWN = -1  # history not (yet) generated
_ANY = -2  # a prefix position that matches whatever the history holds


@dataclass(slots=True)
class BadWordsPlan:
    """One step's bad words of more than one token, uploaded; rows index the step's rows."""

    rows: torch.Tensor | None = None  # [M] the batch row of each (row, word) pair
    slots: torch.Tensor | None = None  # [M] its request slot
    prefixes: torch.Tensor | None = None  # [M, W] right-aligned, _ANY-padded
    banned: torch.Tensor | None = None  # [M] the word's last token
    init_slots: torch.Tensor | None = None  # [R] slots whose history is (re)built
    init_history: torch.Tensor | None = None  # [R, HISTORY]
    record_rows: torch.Tensor | None = None  # rows whose sampled token joins the history
    record_slots: torch.Tensor | None = None


@dataclass(slots=True)
class BadWordsRows:
    """Host side: the (row, word) pairs of one step, built from host facts only."""

    rows: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    words: list[tuple[int, ...]] = field(default_factory=list)
    init_slots: list[int] = field(default_factory=list)
    init_history: list[list[int]] = field(default_factory=list)
    record_rows: list[int] = field(default_factory=list)
    record_slots: list[int] = field(default_factory=list)

    def add(self, row: int, req: Req, real: bool) -> None:
        """Row `row` carries `req`; `real`: its sampled token is its next output."""
        long = [w for w in req.sampling_params.bad_words_ids if len(w) > 1]
        if not long:
            return
        slot = req.req_pool_idx
        assert slot is not None, "a batch row without a request slot"
        if req.bad_words_epoch != req.num_retractions:
            req.bad_words_epoch = req.num_retractions
            known = req.output_ids[-HISTORY:]
            self.init_slots.append(slot)
            self.init_history.append([_UNKNOWN] * (HISTORY - len(known)) + list(known))
        for word in long:
            self.rows.append(row)
            self.slots.append(slot)
            self.words.append(word)
        if real:
            self.record_rows.append(row)
            self.record_slots.append(slot)

    def plan(self, upload: Callable[[torch.Tensor], torch.Tensor]) -> BadWordsPlan | None:
        if not self.rows:
            return None
        width = max(len(w) for w in self.words) - 1
        prefixes = [[_ANY] * (width + 1 - len(w)) + list(w[:-1]) for w in self.words]

        def ints(values: list[int] | list[list[int]]) -> torch.Tensor:
            return upload(torch.tensor(values, dtype=_I64))

        plan = BadWordsPlan(
            rows=ints(self.rows),
            slots=ints(self.slots),
            prefixes=ints(prefixes),
            banned=ints([w[-1] for w in self.words]),
        )
        if self.init_slots:
            plan.init_slots, plan.init_history = ints(self.init_slots), ints(self.init_history)
        if self.record_rows:
            plan.record_rows, plan.record_slots = ints(self.record_rows), ints(self.record_slots)
        return plan


class BadWordsState:
    """Each request slot's last `HISTORY` output tokens, on the device (the stream's)."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.history = torch.full((num_slots, HISTORY), _UNKNOWN, dtype=_I64, device=device)

    def rebuild(self, plan: BadWordsPlan) -> None:
        """Stream side: the rows of (re)admitted requests, from the host's known outputs."""
        if plan.init_slots is not None:
            assert plan.init_history is not None
            self.history.index_copy_(0, plan.init_slots, plan.init_history)

    def apply(self, logits: torch.Tensor, plan: BadWordsPlan) -> torch.Tensor:
        """Stream side: -inf on each word's last token where the output ends with the rest."""
        assert plan.rows is not None and plan.slots is not None
        assert plan.prefixes is not None and plan.banned is not None
        width = plan.prefixes.shape[1]
        recent = self.history.index_select(0, plan.slots)[:, HISTORY - width :]
        match = ((recent == plan.prefixes) | (plan.prefixes == _ANY)).all(dim=1)
        values = torch.zeros(match.shape, dtype=logits.dtype, device=logits.device)
        values = values.masked_fill(match, float("-inf"))
        return logits.index_put((plan.rows, plan.banned), values, accumulate=True)

    def record(self, plan: BadWordsPlan, next_ids: torch.Tensor) -> None:
        """Stream side: shift this step's sampled tokens into their rows' history."""
        if plan.record_rows is None:
            return
        assert plan.record_slots is not None
        toks = next_ids.index_select(0, plan.record_rows).to(_I64)
        rows = self.history.index_select(0, plan.record_slots)
        shifted = torch.cat([rows[:, 1:], toks.unsqueeze(1)], dim=1)
        self.history.index_copy_(0, plan.record_slots, shifted)


class BadWords(LogitsProcessor[BadWordsPlan]):
    """Words of 2+ tokens, with their `BadWordsState` (created by the first step that needs it)."""

    name = "bad_words"

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self.state: BadWordsState | None = None

    @classmethod
    def plan(cls, rows: StepRows, up: Uploads) -> BadWordsPlan | None:
        words = BadWordsRows()
        for row, req in enumerate(rows.reqs):
            if req.needs_logits_plan and req.sampling_params.bad_words:
                words.add(row, req, rows.output_rows[row])
        return words.plan(up.upload)

    def apply(self, logits: torch.Tensor, part: BadWordsPlan, raw: torch.Tensor) -> torch.Tensor:
        if self.state is None:
            self.state = BadWordsState(self.num_slots, logits.device)
        self.state.rebuild(part)
        return self.state.apply(logits, part)

    def record(self, part: BadWordsPlan, next_ids: torch.Tensor) -> None:
        assert self.state is not None
        self.state.record(part, next_ids)
