"""`logit_bias`, `allowed_token_ids`, `min_tokens` and single-token bad words: fixed per-row
changes to the logits, planned on the host at launch (no state on the stream)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stallfree.runtime.execution.logits_processor import LogitsProcessor, StepRows, Uploads
from stallfree.runtime.request.req import Req


@dataclass(slots=True)
class BiasPlan:
    # logit_bias and min_tokens, as (row, token, value) triples added to the logits
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # allowed_token_ids: (row, token) pairs; a listed row keeps only its pairs' tokens
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(slots=True)
class _BiasRows:
    """logit_bias, and min_tokens' ban on EOS and stop ids, as (row, token, value) triples."""

    rows: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    allowed_rows: list[int] = field(default_factory=list)
    allowed_tokens: list[int] = field(default_factory=list)

    def add(self, row: int, req: Req, output_step: int) -> None:
        params = req.sampling_params
        if params.allowed_token_ids is not None:
            self.allowed_rows.extend([row] * len(params.allowed_token_ids))
            self.allowed_tokens.extend(params.allowed_token_ids)
        for tok, value in params.logit_bias.items():
            self._put(row, tok, value)
        for word in params.bad_words_ids:
            if len(word) == 1:  # banned at every step
                self._put(row, word[0], float("-inf"))
        if output_step < params.min_tokens:
            stops = set(params.stop_token_ids)
            if not params.ignore_eos:
                stops |= req.eos_token_ids
            for tok in sorted(stops):
                self._put(row, tok, float("-inf"))

    def _put(self, row: int, tok: int, value: float) -> None:
        self.rows.append(row)
        self.tokens.append(tok)
        self.values.append(value)

    def plan(self, up: Uploads) -> BiasPlan | None:
        if not self.rows and not self.allowed_rows:
            return None
        plan = BiasPlan()
        if self.rows:
            plan.bias = (up.ints(self.rows), up.ints(self.tokens), up.floats(self.values))
        if self.allowed_rows:
            plan.allowed = (up.ints(self.allowed_rows), up.ints(self.allowed_tokens))
        return plan


class LogitBias(LogitsProcessor[BiasPlan]):
    """Bias and min_tokens masks (single-token bad words too), then the allowed tokens."""

    name = "bias"

    @classmethod
    def plan(cls, rows: StepRows, up: Uploads) -> BiasPlan | None:
        bias = _BiasRows()
        for row, req in enumerate(rows.reqs):
            if req.needs_logits_plan:
                bias.add(row, req, rows.output_steps[row])
        return bias.plan(up)

    def apply(self, logits: torch.Tensor, part: BiasPlan, raw: torch.Tensor) -> torch.Tensor:
        if part.bias is not None:
            rows, toks, values = part.bias
            logits = logits.index_put((rows, toks), values, accumulate=True)
        if part.allowed is not None:
            rows, toks = part.allowed
            keep = torch.zeros_like(logits, dtype=torch.bool).index_put_(
                (rows, toks), torch.ones_like(toks, dtype=torch.bool)
            )
            limited = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
            limited.index_fill_(0, rows, True)
            logits = logits.masked_fill(limited.unsqueeze(1) & ~keep, float("-inf"))
        return logits
