"""A step's logits plan: each logits processor's part (`execution/processors.py`), and the
logprobs of outputs and prompts.

The host decides everything at launch, from host facts only (each request's params, its
`req_pool_idx`, the output index each row's token will get, and its host-known tokens), and
packs it into a `LogitsPlan` of uploaded tensors. The stream applies the plan. Nothing here
reads a device value on the host.

Logprobs are the log-softmax of the raw logits, before bias, penalties and temperature, as
vLLM reports them by default and as transformers' `log_softmax(logits)` gives them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from stallfree.runtime.execution.grammar_masks import GrammarPlan
from stallfree.runtime.execution.logits_processor import StepRows, Uploads
from stallfree.runtime.execution.processors import plan_parts
from stallfree.runtime.request.outputs import TokenLogprobs
from stallfree.runtime.request.req import Req

_I64 = torch.int64
# prompt logprobs are computed this many positions at a time, so a long prompt chunk never
# materialises a [chunk, vocab] log-softmax at once
PROMPT_LOGPROB_SLICE = 256


@dataclass(slots=True)
class PromptLogprobPlan:
    """Rows of a prefill chunk that want prompt logprobs: flat token offsets and targets."""

    positions_cpu: list[int]  # offsets into the step's flattened tokens
    positions: torch.Tensor  # the same, uploaded
    targets: torch.Tensor  # [N] int64 device: the prompt token each position predicts
    k: int  # top alternatives (max over the rows)
    # per batch row: (first prompt index the row's results cover, how many) — host bookkeeping
    spans: list[tuple[int, int, int]]  # (row, first_target_index, count)


@dataclass(slots=True)
class LogitsPlan:
    # each planned processor's part, by its name (`execution/processors.py`)
    parts: dict[str, Any] = field(default_factory=dict)
    # output logprobs: top alternatives per row (max over the rows that asked); None: none
    logprob_k: int | None = None
    prompt: PromptLogprobPlan | None = None

    @property
    def grammar(self) -> GrammarPlan | None:
        """What the stream tells the host of structured output (ends, time), after the event."""
        part: GrammarPlan | None = self.parts.get("grammar")
        return part


def build_logits_plan(
    rows: StepRows,
    extend: tuple[list[int], list[int]] | None,
    upload: Callable[[torch.Tensor], torch.Tensor],
) -> LogitsPlan | None:
    """The plan for one batch, from host facts; None when no row needs any of it (the common
    case costs one attribute check per row). `extend` is (prefix_lens, extend_lens) of an
    extend batch, None in decode."""
    if not any(r.needs_logits_plan for r in rows.reqs):
        return None
    plan = LogitsPlan(plan_parts(rows, Uploads(upload)))
    wanted = [
        k
        for req, real in zip(rows.reqs, rows.output_rows, strict=True)
        if real and req.needs_logits_plan and (k := req.sampling_params.logprobs) is not None
    ]
    if wanted:
        plan.logprob_k = max(wanted)
    if extend is not None:
        plan.prompt = _prompt_plan(rows.reqs, extend, upload)
    return plan


def _prompt_plan(
    reqs: list[Req],
    extend: tuple[list[int], list[int]],
    upload: Callable[[torch.Tensor], torch.Tensor],
) -> PromptLogprobPlan | None:
    """Positions of this chunk whose next token is a prompt token not yet scored.

    Position p predicts prompt token p + 1. A re-prefill after a retraction scores nothing
    again (`req.prompt_logprobs` already holds those)."""
    positions: list[int] = []
    targets: list[int] = []
    spans: list[tuple[int, int, int]] = []
    k = 0
    offset = 0
    for row, (req, prefix, ext) in enumerate(zip(reqs, *extend, strict=True)):
        want = req.sampling_params.prompt_logprobs
        if want is not None:
            prompt = req.origin_input_ids
            # targets prefix+1 .. prefix+ext, within the prompt, not scored before
            first = max(prefix + 1, len(req.prompt_logprobs) + 1)
            last = min(prefix + ext, len(prompt) - 1)
            if first <= last:
                spans.append((row, first, last - first + 1))
                positions.extend(range(offset + first - 1 - prefix, offset + last - prefix))
                targets.extend(prompt[first : last + 1])
                k = max(k, want)
        offset += ext
    if not positions:
        return None
    return PromptLogprobPlan(
        positions_cpu=positions,
        positions=upload(torch.tensor(positions, dtype=_I64)),
        targets=upload(torch.tensor(targets, dtype=_I64)),
        k=k,
        spans=spans,
    )


@dataclass(slots=True)
class LogprobBuffers:
    """Host (pinned) buffers a step fills with logprobs; valid once its event has fired."""

    chosen: torch.Tensor | None = None  # [B] float32
    top_values: torch.Tensor | None = None  # [B, k]
    top_ids: torch.Tensor | None = None  # [B, k]
    prompt_chosen: torch.Tensor | None = None  # [N]
    prompt_top_values: torch.Tensor | None = None  # [N, k]
    prompt_top_ids: torch.Tensor | None = None  # [N, k]
    # host lists of the above, converted once per batch on first use (after the event)
    _lists: dict[str, list[Any]] = field(default_factory=dict)

    def _list(self, name: str) -> list[Any]:
        cached = self._lists.get(name)
        if cached is None:
            tensor = getattr(self, name)
            cached = self._lists[name] = tensor.tolist() if tensor is not None else []
        return cached

    @classmethod
    def allocate(
        cls, plan: LogitsPlan, batch_size: int, host_buffer: Callable[..., torch.Tensor]
    ) -> LogprobBuffers:
        bufs = cls()
        if plan.logprob_k is not None:
            bufs.chosen = host_buffer((batch_size,), torch.float32)
            bufs.top_values = host_buffer((batch_size, plan.logprob_k), torch.float32)
            bufs.top_ids = host_buffer((batch_size, plan.logprob_k), _I64)
        if plan.prompt is not None:
            n, k = len(plan.prompt.positions_cpu), plan.prompt.k
            bufs.prompt_chosen = host_buffer((n,), torch.float32)
            bufs.prompt_top_values = host_buffer((n, k), torch.float32)
            bufs.prompt_top_ids = host_buffer((n, k), _I64)
        return bufs

    def fill_outputs(self, logits: torch.Tensor, next_ids: torch.Tensor) -> None:
        """Stream side: the sampled tokens' logprobs and the top alternatives."""
        if self.chosen is None:
            return
        assert self.top_values is not None and self.top_ids is not None
        _score(logits, next_ids, self.chosen, self.top_values, self.top_ids)

    def fill_prompt(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """Stream side: logits [N, vocab] at the planned positions -> the prompt's logprobs."""
        if self.prompt_chosen is None:
            return
        assert self.prompt_top_values is not None and self.prompt_top_ids is not None
        for start in range(0, logits.shape[0], PROMPT_LOGPROB_SLICE):
            end = start + PROMPT_LOGPROB_SLICE
            _score(
                logits[start:end],
                targets[start:end],
                self.prompt_chosen[start:end],
                self.prompt_top_values[start:end],
                self.prompt_top_ids[start:end],
            )

    def outputs(self, row: int, token_id: int, k: int) -> TokenLogprobs | None:
        """Host side, after the event: row `row`'s token and its top `k` alternatives."""
        if self.chosen is None:
            return None
        return self._entry("", token_id, row, k)

    def _entry(self, prefix: str, token_id: int, index: int, k: int) -> TokenLogprobs:
        chosen = self._list(f"{prefix}chosen")[index]
        top: list[tuple[int, float]] = []
        if k:
            ids = self._list(f"{prefix}top_ids")[index][:k]
            values = self._list(f"{prefix}top_values")[index][:k]
            top = list(zip(ids, values, strict=True))
        return TokenLogprobs(token_id, chosen, top)

    def take_prompt(self, reqs: list[Req], plan: LogitsPlan) -> None:
        """Host side, after the event: append each scored prompt token to its request."""
        prompt = plan.prompt
        if prompt is None or self.prompt_chosen is None:
            return
        index = 0
        for row, first, count in prompt.spans:
            req = reqs[row]
            k = req.sampling_params.prompt_logprobs or 0
            if len(req.prompt_logprobs) + 1 == first:  # never twice, never with a gap
                targets = req.origin_input_ids[first : first + count]
                req.prompt_logprobs.extend(
                    self._entry("prompt_", tok, index + i, k) for i, tok in enumerate(targets)
                )
            index += count


def _score(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    chosen: torch.Tensor,
    top_values: torch.Tensor,
    top_ids: torch.Tensor,
) -> None:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen.copy_(logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1), non_blocking=True)
    k = top_values.shape[1]
    if k:
        values, ids = logprobs.topk(k, dim=-1)
        top_values.copy_(values, non_blocking=True)
        top_ids.copy_(ids, non_blocking=True)
