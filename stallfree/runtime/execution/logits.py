"""Logit processing between the forward and the sampler: logit bias, `min_tokens`, the
presence/frequency/repetition penalties, and logprobs of outputs and prompts.

The host decides everything at launch, from host facts only (each request's params, its
`req_pool_idx`, the output index each row's token will get, and its host-known tokens), and
packs it into a `LogitsPlan` of uploaded tensors. The stream applies the plan. Nothing here
reads a device value on the host.

Penalty state lives on the device, owned by the stream like the KV cache: `PenaltyState` holds
one row per request slot, with each output token's count and a mask of the prompt's tokens.
- A request's row is (re)built by the first batch that carries it after an admission (its first
  prefill chunk, or its re-prefill after a retraction), from the tokens the host knows then.
- Every later step adds the token it sampled for the row on the stream, right after sampling.
  With overlap, batch N+1 is launched before the host has seen batch N's tokens, and the FIFO
  stream applies N's counts before N+1 reads them: the host never needs them.
- A slot's row is only read by a request that built it, so a freed slot needs no clearing.

Logprobs are the log-softmax of the raw logits, before bias, penalties and temperature, as
vLLM reports them by default and as transformers' `log_softmax(logits)` gives them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from stallfree.runtime.execution.bad_words import BadWordsPlan, BadWordsRows, BadWordsState
from stallfree.runtime.execution.grammar import GrammarPlan, GrammarState
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
    # logit_bias and min_tokens, as (row, token, value) triples added to the logits
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # allowed_token_ids: (row, token) pairs; a listed row keeps only its pairs' tokens
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    # penalties: rows, their slots and factors [P]
    pen_rows: torch.Tensor | None = None
    pen_slots: torch.Tensor | None = None
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    # (re)built rows: slots to clear, then prompt (slot, token) marks and output (slot, token)
    init_slots: torch.Tensor | None = None
    init_prompt: tuple[torch.Tensor, torch.Tensor] | None = None
    init_output: tuple[torch.Tensor, torch.Tensor] | None = None
    # rows whose sampled token counts toward their penalties, and their slots
    count_rows: torch.Tensor | None = None
    count_slots: torch.Tensor | None = None
    # output logprobs: top alternatives per row (max over the rows that asked); None: none
    logprob_k: int | None = None
    prompt: PromptLogprobPlan | None = None
    grammar: GrammarPlan | None = None  # structured output (execution/grammar.py)
    bad_words: BadWordsPlan | None = None  # words of 2+ tokens (execution/bad_words.py)

    @property
    def processes_logits(self) -> bool:
        return (
            self.bias is not None
            or self.allowed is not None
            or self.pen_rows is not None
            or self.grammar is not None
            or self.bad_words is not None
        )

    @property
    def needs_state(self) -> bool:
        return self.pen_rows is not None or self.init_slots is not None


@dataclass(slots=True)
class _Uploads:
    """Host lists to device tensors through the stream's `upload`."""

    upload: Callable[[torch.Tensor], torch.Tensor]

    def ints(self, values: list[int]) -> torch.Tensor:
        return self.upload(torch.tensor(values, dtype=_I64))

    def floats(self, values: list[float]) -> torch.Tensor:
        return self.upload(torch.tensor(values, dtype=torch.float32))


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

    def apply(self, plan: LogitsPlan, up: _Uploads) -> None:
        if self.rows:
            plan.bias = (up.ints(self.rows), up.ints(self.tokens), up.floats(self.values))
        if self.allowed_rows:
            plan.allowed = (up.ints(self.allowed_rows), up.ints(self.allowed_tokens))


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

    def apply(self, plan: LogitsPlan, up: _Uploads) -> None:
        if self.rows:
            plan.pen_rows, plan.pen_slots = up.ints(self.rows), up.ints(self.slots)
            plan.presence, plan.frequency = up.floats(self.presence), up.floats(self.frequency)
            plan.repetition = up.floats(self.repetition)
        if self.init_slots:
            plan.init_slots = up.ints(self.init_slots)
            if self.prompt_marks[0]:
                plan.init_prompt = (up.ints(self.prompt_marks[0]), up.ints(self.prompt_marks[1]))
            if self.output_marks[0]:
                plan.init_output = (up.ints(self.output_marks[0]), up.ints(self.output_marks[1]))
        if self.count_rows:
            plan.count_rows, plan.count_slots = up.ints(self.count_rows), up.ints(self.count_slots)


def build_logits_plan(
    reqs: list[Req],
    output_rows: list[bool],
    output_steps: list[int],
    extend: tuple[list[int], list[int]] | None,
    upload: Callable[[torch.Tensor], torch.Tensor],
) -> LogitsPlan | None:
    """The plan for one batch, from host facts; None when no row needs any of it (the common
    case costs one attribute check per row). `extend` is (prefix_lens, extend_lens) of an
    extend batch, None in decode."""
    if not any(r.needs_logits_plan for r in reqs):
        return None
    bias, penalties, bad_words = _BiasRows(), _PenaltyRows(), BadWordsRows()
    grammar: list[int] = []
    logprob_k = -1
    for row, req in enumerate(reqs):
        if not req.needs_logits_plan:
            continue
        params = req.sampling_params
        bias.add(row, req, output_steps[row])
        if params.logprobs is not None and output_rows[row]:
            logprob_k = max(logprob_k, params.logprobs)
        if params.has_penalties:
            penalties.add(row, req, output_rows[row])
        if req.grammar is not None:
            grammar.append(row)
        if params.bad_words:
            bad_words.add(row, req, output_rows[row])
    plan = LogitsPlan()
    up = _Uploads(upload)
    bias.apply(plan, up)
    penalties.apply(plan, up)
    plan.bad_words = bad_words.plan(upload)
    if grammar:
        plan.grammar = _grammar_plan(reqs, grammar, output_rows, up)
    if logprob_k >= 0:
        plan.logprob_k = logprob_k
    if extend is not None:
        plan.prompt = _prompt_plan(reqs, extend, upload)
    return plan


def _grammar_plan(
    reqs: list[Req], rows: list[int], output_rows: list[bool], up: _Uploads
) -> GrammarPlan:
    """Constrained rows; a request's matcher (re)starts on its first batch after an admission
    or a retraction, at the outputs the host knows then (as its penalty row is rebuilt)."""
    slots: list[int] = []
    starts: list[tuple[int, object, list[int]]] = []
    for row in rows:
        req = reqs[row]
        slot = req.req_pool_idx
        assert slot is not None, "a batch row without a request slot"
        slots.append(slot)
        if req.grammar_epoch != req.num_retractions:
            req.grammar_epoch = req.num_retractions
            starts.append((slot, req.grammar, list(req.output_ids)))
    consume = [output_rows[r] for r in rows]
    return GrammarPlan(rows, slots, consume, starts, up.ints(rows))


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


class PenaltyState:
    """Per-slot output token counts and prompt token marks, on the device (the stream's)."""

    def __init__(self, num_slots: int, vocab: int, device: torch.device) -> None:
        self.counts = torch.zeros((num_slots, vocab), dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros((num_slots, vocab), dtype=torch.bool, device=device)

    def rebuild(self, plan: LogitsPlan) -> None:
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

    def apply(self, logits: torch.Tensor, plan: LogitsPlan) -> torch.Tensor:
        """Stream side: repetition, then frequency and presence penalties (vLLM's order)."""
        assert plan.pen_rows is not None and plan.pen_slots is not None
        assert plan.repetition is not None and plan.frequency is not None
        assert plan.presence is not None
        counts = self.counts.index_select(0, plan.pen_slots)
        rows = logits.index_select(0, plan.pen_rows)
        present = counts > 0
        seen = present | self.prompt_mask.index_select(0, plan.pen_slots)
        rep = plan.repetition.unsqueeze(1)
        rows = torch.where(seen, torch.where(rows > 0, rows / rep, rows * rep), rows)
        rows = rows - plan.frequency.unsqueeze(1) * counts.to(rows.dtype)
        rows = rows - plan.presence.unsqueeze(1) * present.to(rows.dtype)
        return logits.index_copy(0, plan.pen_rows, rows)

    def record(self, plan: LogitsPlan, next_ids: torch.Tensor) -> None:
        """Stream side: count the tokens this step sampled for penalised rows."""
        if plan.count_rows is None:
            return
        assert plan.count_slots is not None
        toks = next_ids.index_select(0, plan.count_rows)
        ones = torch.ones_like(toks, dtype=torch.int32)
        self.counts.index_put_((plan.count_slots, toks), ones, accumulate=True)


def process_logits(
    logits: torch.Tensor,
    plan: LogitsPlan,
    state: PenaltyState | None,
    grammar: GrammarState | None = None,
    bad_words: BadWordsState | None = None,
) -> torch.Tensor:
    """Stream side: bias and min_tokens masks (single-token bad words too), the allowed tokens,
    the longer bad words, penalties, then the grammar's mask. Out of place: the raw logits stay
    as they were for logprobs."""
    raw = logits
    if plan.bias is not None:
        rows, toks, values = plan.bias
        logits = logits.index_put((rows, toks), values, accumulate=True)
    if plan.allowed is not None:
        rows, toks = plan.allowed
        keep = torch.zeros_like(logits, dtype=torch.bool).index_put_(
            (rows, toks), torch.ones_like(toks, dtype=torch.bool)
        )
        limited = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
        limited.index_fill_(0, rows, True)
        logits = logits.masked_fill(limited.unsqueeze(1) & ~keep, float("-inf"))
    if plan.bad_words is not None:
        assert bad_words is not None
        logits = bad_words.apply(logits, plan.bad_words)
    if plan.pen_rows is not None:
        assert state is not None
        logits = state.apply(logits, plan)
    if plan.grammar is not None and grammar is not None:
        logits = grammar.apply(logits, plan.grammar, raw)
    return logits


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
