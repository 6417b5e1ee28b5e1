"""What a request produces, as its consumer sees it: chunks, the final result, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class TokenLogprobs:
    """One token's log-probability and the top alternatives at its position, highest first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class GenerationChunk:
    rid: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    # set when `error` is meant for the client, with the HTTP status it answers (a failed KV
    # hand-over between servers: 503); otherwise an error is the server's own, logged only
    error_status: int | None = None
    # with `logprobs` set: one entry per token of `token_ids`
    logprobs: list[TokenLogprobs] | None = None
    # with `prompt_logprobs` set, in the first chunk only: one per prompt token, the first None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    cached_tokens: int = 0  # prompt tokens the prefix cache served at the last admission


@dataclass(slots=True)
class GenerationResult:
    rid: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    cached_tokens: int = 0
