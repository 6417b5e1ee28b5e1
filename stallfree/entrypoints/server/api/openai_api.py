"""`POST /v1/completions` and `POST /v1/chat/completions`.

A request fans out into one engine request per prompt and choice (`n`): choice `i` of prompt `p`
is index `p * n + i`, and its engine request id ends in that index. The choices of a prompt
share its KV through the prefix cache: the scheduler holds back a request whose prompt another
request is prefilling, so the later ones start from the cached pages. An echoed prompt's logprobs
are computed by its first choice alone and shared by the others' answers.

Before anything is generated, a request's cost (`RequestCost`, budget.py) is held to
`server.max_request_cost`, and a chat's messages and content parts to their limits. A whole
(non-streaming) body is written off the event loop, one choice at a time (`json_pieces`).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response

from stallfree.entrypoints.server.base.protocol import ChatCompletionRequest, CompletionRequest
from stallfree.entrypoints.server.base.state import ServerState, server_state
from stallfree.entrypoints.server.intake.budget import RequestCost, check_fanout
from stallfree.entrypoints.server.intake.requests import (
    converting,
    prompt_ids_async,
    read_body,
    sampling_params,
    truncated,
)
from stallfree.entrypoints.server.intake.screening import (
    check_runner,
    model_adapter,
    reject_unsupported,
)
from stallfree.entrypoints.server.output.logprobs import (
    LegacyLists,
    SharedPromptLogprobs,
    TokenPieces,
    legacy_lists,
    token_pieces,
)
from stallfree.entrypoints.server.output.responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PiecesResponse,
    UsageInfo,
    json_pieces,
)
from stallfree.entrypoints.server.output.streaming import (
    DONE,
    Context,
    Generation,
    Result,
    respond,
    sse,
)
from stallfree.runtime.request.outputs import GenerationChunk, TokenLogprobs
from stallfree.runtime.text.tokenizer import Tokenizer

# OpenAI's finish reasons, and vLLM's `abort` for a request a client or an operator aborted
# (`/abort_request`, `/abort_requests`, the engine stopping). A request the engine aborted past
# its deadline (`runtime.request_timeout_s`) was cut short by a server limit, as `length` is by
# max_tokens. `error` never reaches a choice (it is a 500, or an SSE error event). /generate
# keeps the engine's reasons.
_OPENAI_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}
# NOTE: how the engine's request table words a deadline abort (`RequestTable.expire`)
_DEADLINE = "deadline of "


def openai_finish_reason(last: GenerationChunk) -> str | None:
    """The OpenAI `finish_reason` of a choice whose latest chunk is `last` (None while it is
    unfinished)."""
    reason = last.finish_reason
    if reason is None:
        return None
    if reason == "abort" and (last.error or "").startswith(_DEADLINE):
        return "length"
    return _OPENAI_FINISH_REASONS.get(reason, "stop")


class Usage:
    """Token counts of a fan-out as far as its chunks have come: each choice's latest chunk
    counts, and a prompt is counted once, however many choices it has."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.prompt: dict[int, int] = {}
        self.cached: dict[int, int] = {}
        self.completion: dict[int, int] = {}

    def add(self, index: int, latest: GenerationChunk) -> None:
        if index % self.n == 0:
            self.prompt[index // self.n] = latest.prompt_tokens
            # the prompt's first choice; the others of `n` read it from the cache too
            self.cached[index // self.n] = latest.cached_tokens
        self.completion[index] = latest.completion_tokens

    def info(self) -> UsageInfo:
        return UsageInfo.of(
            sum(self.prompt.values()), sum(self.completion.values()), sum(self.cached.values())
        )


# ---------------------------------------------------------------- answers


class Answer(Protocol):
    """A route's answer: its SSE events, or its whole body's JSON in pieces."""

    def events(self, generation: Generation) -> AsyncIterator[str]: ...

    def body(self, results: list[Result]) -> list[bytes]: ...


def open_request(body: CompletionRequest | ChatCompletionRequest, request: Request) -> ServerState:
    """What both OpenAI routes check first: the model name and the unsupported fields."""
    state = server_state(request)
    model_adapter(state.engine, state.model_name, body.model)
    check_runner(state.engine, "generate", request.url.path)
    reject_unsupported(body)
    return state


def wants_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    """A stream ends with a chunk of the request's usage (`include_usage`)."""
    return bool(body.stream_options and body.stream_options.include_usage)


def wants_usage_always(body: CompletionRequest | ChatCompletionRequest) -> bool:
    """Every chunk of a stream carries the usage so far (vLLM's `continuous_usage_stats`)."""
    return bool(body.stream_options and body.stream_options.continuous_usage_stats)


async def respond_answer(
    request: Request,
    generation: Generation,
    stream: bool,
    answer: Answer,
) -> Response:
    """`respond`, with a whole body written off the event loop, in a worker thread, a choice
    at a time: the loop (and `/health`) keeps answering while a large one is written, sharing
    the GIL with the thread instead of waiting for it."""
    kept: list[list[Result]] = []

    def keep(results: list[Result]) -> dict[str, str]:
        kept.append(results)
        return {}  # not sent: the body is written below

    answered = await respond(request, generation, stream, answer.events, keep)
    if not kept:
        return answered  # the stream, or the 499 of a client that left first
    pieces = await asyncio.to_thread(answer.body, kept.pop())
    return PiecesResponse(pieces)


def taken(results: list[Result]) -> Iterator[tuple[int, Result]]:
    """`results` with their indexes, each let go (the list emptied) as it is taken."""
    left = collections.deque(results)
    results.clear()
    index = 0
    while left:
        yield index, left.popleft()
        index += 1


@dataclass(slots=True)
class _CompletionAnswer:
    """One /v1/completions answer: choice `index` of prompt `index // n`, as SSE events or as
    one body; with `echoed`, each prompt's first chunk starts with the prompt.

    With echo and logprobs, or `prompt_logprobs`, only a prompt's first choice brings the
    prompt's logprobs (the others do not compute them): its part of the logprobs is made once
    (`echo_parts`, `prompt_logprobs`), and a stream holds back the other choices' chunks until it
    is known (`prompt_logprobs` is not streamed: `screening.reject_unsupported`).

    The events are response models; the whole body is written from plain values, the same
    JSON that `CompletionResponse.model_dump()` would give."""

    rid: str
    model: str
    prompts: list[list[int]]
    n: int
    echoed: list[str] | None
    pieces: TokenPieces | None
    include_usage: bool
    # prompt -> its echoed tokens' logprobs and the text offset after them
    echo_parts: dict[int, tuple[LegacyLists, int]] = field(default_factory=dict)
    prompt_logprobs: SharedPromptLogprobs | None = None  # vLLM's (None: not asked for)
    echo_k: int = 0  # the echoed prompt's top alternatives (`logprobs`)
    continuous_usage: bool = False  # every chunk carries the usage so far

    @property
    def echoes_logprobs(self) -> bool:
        return self.echoed is not None and self.pieces is not None

    def echo_part(
        self, prompt: int, entries: Sequence[TokenLogprobs | None] | None
    ) -> tuple[LegacyLists, int]:
        """The logprobs of `prompt`'s tokens, from its first choice's `entries` (one per
        token, the first None; a token without one, such as all of a prompt cut off before
        it was computed, has None)."""
        part = self.echo_parts.get(prompt)
        if part is None:
            assert self.pieces is not None
            ids = self.prompts[prompt]
            given = [
                None if e is None else TokenLogprobs(e.token_id, e.logprob, e.top[: self.echo_k])
                for e in list(entries or [])[: len(ids)]
            ]
            given += [None] * (len(ids) - len(given))
            part = self.echo_parts[prompt] = legacy_lists(self.pieces, given, ids, 0)
        return part

    def logprobs_of(
        self,
        index: int,
        entries: Sequence[TokenLogprobs] | None,
        token_ids: list[int],
        with_prompt: bool,
        offset: int,
    ) -> tuple[LegacyLists | None, int]:
        """The logprobs of `token_ids` (after the prompt's, `with_prompt`) from `offset`."""
        if self.pieces is None:
            return None, offset
        prompt = None
        if with_prompt:
            prompt, offset = self.echo_parts[index // self.n]
        lists, offset = legacy_lists(self.pieces, entries or [], token_ids, offset)
        return (lists if prompt is None else prompt + lists), offset

    def _ready(
        self, index: int, chunk: GenerationChunk, held: dict[int, list[GenerationChunk]]
    ) -> Iterator[tuple[int, GenerationChunk]]:
        """The chunks that may go out now, in order: with echoed logprobs, a choice's wait
        for its prompt's first choice, which brings the prompt's logprobs."""
        prompt = index // self.n
        if not self.echoes_logprobs or prompt in self.echo_parts:
            yield index, chunk
        elif index % self.n:
            held.setdefault(index, []).append(chunk)
        else:
            self.echo_part(prompt, chunk.prompt_logprobs)
            yield index, chunk
            for other in range(index + 1, index + self.n):
                for waited in held.pop(other, []):
                    yield other, waited

    async def events(self, generation: Generation) -> AsyncIterator[str]:
        usage = Usage(self.n)
        offsets = [0] * (len(self.prompts) * self.n)
        started = [False] * (len(self.prompts) * self.n)
        held: dict[int, list[GenerationChunk]] = {}
        async for arrived, first in generation.stream():
            if (end := generation.ending_event(first)) is not None:
                yield end
                break
            for index, chunk in self._ready(arrived, first, held):
                text, with_prompt = chunk.text, False
                if not started[index]:
                    started[index] = True
                    if self.echoed is not None:
                        text = self.echoed[index // self.n] + text
                        with_prompt = self.pieces is not None
                lists, offsets[index] = self.logprobs_of(
                    index, chunk.logprobs, chunk.token_ids, with_prompt, offsets[index]
                )
                usage.add(index, chunk)
                if not chunk.finished and not text and not (lists and lists.tokens):
                    continue  # held back while it may still be a stop string
                choice = CompletionChoice(
                    index=index,
                    text=text,
                    logprobs=None if lists is None else CompletionLogprobs(**lists.dump()),
                    finish_reason=openai_finish_reason(chunk),
                )
                so_far = usage.info() if self.continuous_usage else None
                yield sse(
                    CompletionResponse(
                        id=self.rid, model=self.model, choices=[choice], usage=so_far
                    )
                )
        else:
            if self.include_usage:
                info = usage.info()
                yield sse(CompletionResponse(id=self.rid, model=self.model, choices=[], usage=info))
        yield DONE

    def _choices(self, results: list[Result]) -> Iterator[dict[str, Any]]:
        """Each choice as `CompletionChoice.model_dump()` gives it."""
        for i, r in taken(results):
            text = r.text if self.echoed is None else self.echoed[i // self.n] + r.text
            if self.echoes_logprobs and i % self.n == 0:
                self.echo_part(i // self.n, r.prompt_logprobs)
            lists, _ = self.logprobs_of(i, r.logprobs, r.token_ids, self.echoes_logprobs, 0)
            choice = {
                "index": i,
                "text": text,
                "logprobs": None if lists is None else lists.dump(),
                "finish_reason": openai_finish_reason(r.last),
            }
            if self.prompt_logprobs is not None:
                first = r.prompt_logprobs if i % self.n == 0 else None
                choice["prompt_logprobs"] = self.prompt_logprobs.get(i // self.n, first)
            yield choice

    def body(self, results: list[Result]) -> list[bytes]:
        """The whole body's JSON, one choice at a time (each result let go once written)."""
        usage = Usage(self.n)
        for i, r in enumerate(results):
            usage.add(i, r.last)
        envelope = CompletionResponse(id=self.rid, model=self.model, choices=[], usage=usage.info())
        return json_pieces(envelope, "choices", self._choices(results))


async def completions(request: Request) -> Response:
    body = await read_body(request, CompletionRequest)
    state = open_request(body, request)
    engine, n, limits = state.engine, body.n, state.limits
    max_tokens = body.max_tokens or 16
    with converting():
        prompts = await prompt_ids_async(engine, body.prompt, limits.max_prompts_per_request)
        keep = body.truncate_prompt_tokens
        prompts = [truncated(p, keep, engine.max_context_len) for p in prompts]
        check_fanout(len(prompts), n, limits.max_prompts_per_request)
        for ids in prompts:
            engine.validator.check_prompt(ids, body.max_tokens, param="prompt")
        cost = RequestCost(
            len(prompts),
            sum(map(len, prompts)),
            n,
            max_tokens,
            body.logprobs,
            body.echo,
            prompt_logprobs=body.prompt_logprobs,
        )
        cost.check(limits.max_request_cost)
        params = sampling_params(body, max_tokens, state.defaults)
    if params[0].prompt_logprobs is not None:
        # the prompt's logprobs come from its first choice alone (`_CompletionAnswer`)
        params[1:] = [p.model_copy(update={"prompt_logprobs": None}) for p in params[1:]]
    # echo repeats what the model saw: a truncated prompt decoded from its kept tokens
    sent = body.prompt if body.truncate_prompt_tokens is None else prompts
    echoed = _prompt_texts(engine.tokenizer, sent, prompts) if body.echo else None
    pieces = token_pieces(engine.tokenizer) if body.logprobs is not None else None
    ctx = Context.of(request)
    if state.disagg is not None:
        ctx.source = state.disagg.source(body)
    ctx.lora_name = model_adapter(state.engine, state.model_name, body.model)
    rid = f"cmpl-{ctx.request_id}"
    shown = ctx.lora_name or state.model_name
    answer = _CompletionAnswer(rid, shown, prompts, n, echoed, pieces, wants_usage(body))
    answer.echo_k = body.logprobs or 0
    answer.continuous_usage = wants_usage_always(body)
    answer.prompt_logprobs = SharedPromptLogprobs.of(
        engine.tokenizer, body.prompt_logprobs, prompts
    )
    fanned = [prompts[i // n] for i in range(len(prompts) * n)]
    each = [params[i % n] for i in range(len(fanned))]
    rids = [f"{rid}-{i}" for i in range(len(fanned))]
    generation = await Generation.admit(ctx, fanned, each, rids)
    state.observe_params(n, max_tokens)
    return await respond_answer(request, generation, body.stream, answer)


def _prompt_texts(
    tokenizer: Tokenizer,
    prompt: str | list[str] | list[int] | list[list[int]],
    ids: list[list[int]],
) -> list[str]:
    """What `echo` repeats: each prompt as sent, or, sent as token ids, decoded."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [tokenizer.decode(ids[0])]
    return [
        p if isinstance(p, str) else tokenizer.decode(tokens)
        for p, tokens in zip(prompt, ids, strict=True)
    ]
