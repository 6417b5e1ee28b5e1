"""A request's host-side state. The host is authoritative for every field here."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stallfree.runtime.request.errors import InvalidRequestError
from stallfree.runtime.request.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from stallfree.runtime.memory.radix_cache import TreeNode
    from stallfree.runtime.request.outputs import TokenLogprobs


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_new_tokens or the context limit
    ABORT = "abort"  # cancelled by the client or a deadline
    ERROR = "error"  # the step that computed it failed


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_context_len: int = 1 << 30
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    finished_reason: FinishReason | None = None
    finish_message: str | None = None
    # an error that is the request's own doing (4xx), answered with this status; None: the
    # server's failure (500)
    error_status: int | None = None
    # memory: host-owned allocation
    req_pool_idx: int | None = None
    kv_pages: list[int] = field(default_factory=list)
    # prefix cache: the first `cached_pages` of `kv_pages` are the tree's, locked at `cache_node`
    # (shared, never freed by this request); the rest are the request's own
    cache_node: TreeNode | None = None
    cached_pages: int = 0
    cached_tokens: int = 0  # tokens its last admission found cached (0 without the cache)
    # progress
    num_computed_tokens: int = 0  # tokens whose KV is written or enqueued
    num_scheduled_outputs: int = 0  # outputs sampled or in flight
    num_retractions: int = 0
    # speculative decoding: positions of verify steps in flight (`k + 1` each), all counted
    # in `num_computed_tokens` and `num_scheduled_outputs` as if every draft were accepted;
    # the committed length is `num_computed_tokens - spec_window` (docs/overlap.md)
    spec_window: int = 0
    spec_drafts: int = 0  # drafts of verify steps in flight (0: its bounds are exact)
    # adaptive speculation (scheduling/spec_policy.py): running acceptance rate, drafted
    # steps, whether it stopped proposing, and normal steps since it stopped
    spec_rate: float = 1.0
    spec_steps: int = 0
    spec_off: bool = False
    spec_was_off: bool = False
    spec_idle: int = 0
    spec_probe_wait: int = 16
    paused: bool = False  # out of the decode batch until its reader catches up
    # disaggregation, prefill side: keep the slot and pages once finished, until released
    # (scheduling/deferred.py); `on_kv_held` is called when they are held and readable
    hold_kv: bool = False
    on_kv_held: Callable[[], None] | None = None
    # host bookkeeping for the consumer side, opaque to the scheduler
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    # logits processing (runtime/execution/logits.py): the retraction count the device penalty row was
    # last built for (-1: never), and the prompt tokens scored so far (token j at index j - 1)
    penalty_epoch: int = -1
    bad_words_epoch: int = -1  # the same, for the bad words' output history
    # structured output: the request's grammar and llguidance matcher (`text/grammar_compiler.py`'s
    # `RequestGrammar`; the stream's once queued; None: unconstrained) and the retraction count
    # it was last started for (execution/grammar_masks.py)
    grammar: Any = None
    grammar_epoch: int = -1
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # LoRA: the adapter slot its rows use (-1: the base model), and the adapter's load id,
    # which keys its prefix-cache entries apart from every other adapter's
    lora_slot: int = -1
    lora_id: int = 0
    # pooling (a prefill-only embedding input, runtime/embed_requests.py): how its prompt's
    # final hidden states are pooled, "last", "mean", "cls" or "mean_sqrt_len" (None: a
    # generation request; a step never carries both kinds, and pooling requests bypass the
    # prefix cache); and, once its chunks are processed, their sum (host float32; divided by the
    # prompt's length at the end for "mean"): the pooled vector once it has finished
    pooling: str | None = None
    pooled: torch.Tensor | None = None
    # read per row per step, so taken once from the (immutable) params
    needs_logits_plan: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.needs_logits_plan = self.sampling_params.needs_logits_plan

    @property
    def fill_len(self) -> int:
        """Tokens a (re)prefill must compute: the prompt and every known output."""
        return len(self.origin_input_ids) + len(self.output_ids)

    def fill_slice(self, start: int, end: int) -> list[int]:
        """`(prompt + outputs)[start:end]` without building the whole list."""
        prompt = self.origin_input_ids
        if end <= len(prompt):
            return prompt[start:end]
        head = prompt[start:] if start < len(prompt) else []
        return head + self.output_ids[max(start - len(prompt), 0) : end - len(prompt)]

    def cache_key(self, tokens: list[int]) -> list[int]:
        """`tokens` as the prefix cache keys them: as they are for the base model; under an
        adapter each id is offset by the adapter's load id, so two adapters (or an adapter and
        the base model) never share cached KV."""
        if not self.lora_id:
            return tokens
        offset = self.lora_id << 32
        return [t + offset for t in tokens]

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def in_flight_outputs(self) -> int:
        return self.num_scheduled_outputs - len(self.output_ids)

    def wants_more_decode(self) -> bool:
        """Host-known: another decode step may still produce a token this request keeps."""
        params = self.sampling_params
        if self.finished or self.num_scheduled_outputs >= params.max_new_tokens:
            return False
        return len(self.origin_input_ids) + self.num_scheduled_outputs < self.max_context_len

    def remaining_outputs(self) -> int:
        """Outputs this request may still schedule, by `max_new_tokens` and by the context."""
        by_params = self.sampling_params.max_new_tokens - self.num_scheduled_outputs
        by_context = self.max_context_len - len(self.origin_input_ids) - self.num_scheduled_outputs
        return max(0, min(by_params, by_context))

    def check_grammar(self) -> None:
        """A constrained request carries its compiled matcher: only `Engine.generate` and
        `Engine.complete` compile one, so the KV-import and disaggregated paths refuse it."""
        if self.grammar is None and self.sampling_params.structured_outputs is not None:
            raise InvalidRequestError(
                "structured outputs are not available for disaggregated or imported-KV requests",
                param="structured_outputs",
                code="unsupported",
            )

    def finish(
        self, reason: FinishReason, message: str | None = None, status: int | None = None
    ) -> None:
        if self.finished_reason is None:
            self.finished_reason = reason
            self.finish_message = message
            self.error_status = status
            self.status = ReqStatus.FINISHED

    @property
    def owned_pages(self) -> int:
        """KV pages that are this request's alone: freeing it returns them to the pool."""
        return len(self.kv_pages) - self.cached_pages

    def reset_for_retract(self) -> None:
        self.req_pool_idx = None
        self.kv_pages = []
        self.cache_node = None
        self.cached_pages = 0
        self.num_computed_tokens = 0
        self.spec_window = 0
        self.spec_drafts = 0
        self.num_retractions += 1
        self.status = ReqStatus.WAITING
