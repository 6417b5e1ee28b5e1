"""`POST /v1/completions` and `POST /v1/chat/completions`.

A request fans out into one engine request per prompt and choice (`n`): choice `i` of prompt `p`
is index `p * n + i`, and its engine request id ends in that index. The choices of a prompt
share its KV through the prefix cache: the scheduler holds back a request whose prompt another
request is prefilling, so the later ones start from the cached pages.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from stallfree.entrypoints.server.errors import ApiError
from stallfree.entrypoints.server.logprobs import (
    TokenPieces,
    chat_logprobs,
    completion_logprobs,
    merge_completion_logprobs,
    token_pieces,
)
from stallfree.entrypoints.server.protocol import ChatCompletionRequest, CompletionRequest
from stallfree.entrypoints.server.requests import (
    chat_prompt_ids,
    check_model,
    converting,
    prompt_ids,
    reject_unsupported,
    sampling_params,
)
from stallfree.entrypoints.server.responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatMessageOut,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    UsageInfo,
)
from stallfree.entrypoints.server.state import ServerState, server_state
from stallfree.entrypoints.server.streaming import DONE, Context, Generation, Result, respond, sse
from stallfree.runtime.request.outputs import GenerationChunk, TokenLogprobs
from stallfree.runtime.text.tokenizer import Tokenizer

# OpenAI clients parse only their own finish reasons. A request the engine aborted (past
# its deadline) was cut short by a server limit, as `length` is by max_tokens; `error` never
# reaches a choice (it is a 500, or an SSE error event). /generate keeps the engine's reasons.
_OPENAI_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "length"}


def openai_finish_reason(reason: str | None) -> str | None:
    """The OpenAI `finish_reason` for an engine finish reason (None while unfinished)."""
    if reason is None:
        return None
    return _OPENAI_FINISH_REASONS.get(reason, "stop")


class Usage:
    """Token counts of a fan-out: a prompt is counted once, however many choices it has."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.prompt = 0
        self.completion = 0
        self.cached = 0

    def add(self, index: int, last: GenerationChunk) -> None:
        if index % self.n == 0:
            self.prompt += last.prompt_tokens
            # the prompt's first choice; the others of `n` read it from the cache too
            self.cached += last.cached_tokens
        self.completion += last.completion_tokens

    def info(self) -> UsageInfo:
        return UsageInfo.of(self.prompt, self.completion, self.cached)


def _check_fanout(prompts: int, n: int, limit: int) -> None:
    if prompts * n > limit:
        raise ApiError(
            400,
            f"prompt: a request may ask for at most {limit} completions (prompts times n), "
            f"and this one asks for {prompts} x {n}",
            param="n" if prompts == 1 else "prompt",
            code="too_many_prompts",
        )


def _open(body: CompletionRequest | ChatCompletionRequest, request: Request) -> ServerState:
    """What both OpenAI routes check first: the model name and the unsupported fields."""
    state = server_state(request)
    check_model(state, body.model)
    reject_unsupported(body)
    return state


def _include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


@dataclass(slots=True)
class _CompletionAnswer:
    """One /v1/completions answer: choice `index` of prompt `index // n`, as SSE events or as
    one body; with `echoed`, each prompt's first chunk starts with the prompt."""

    rid: str
    model: str
    prompts: list[list[int]]
    n: int
    echoed: list[str] | None
    pieces: TokenPieces | None
    include_usage: bool

    def logprobs_of(
        self,
        index: int,
        entries: Sequence[TokenLogprobs] | None,
        token_ids: list[int],
        prompt_entries: Sequence[TokenLogprobs | None] | None,
        offset: int,
    ) -> tuple[CompletionLogprobs | None, int]:
        """The logprobs of `token_ids` (after the prompt's, when echoed) from `offset`."""
        if self.pieces is None:
            return None, offset
        parts = []
        if prompt_entries is not None:
            prompt = self.prompts[index // self.n]
            part, offset = completion_logprobs(self.pieces, prompt_entries, prompt, offset)
            parts.append(part)
        part, offset = completion_logprobs(self.pieces, entries or [], token_ids, offset)
        return merge_completion_logprobs([*parts, part]), offset

    def prompt_entries_of(
        self, index: int, chunk_entries: object
    ) -> list[TokenLogprobs | None] | None:
        if self.echoed is None or self.pieces is None:
            return None
        if isinstance(chunk_entries, list):
            return chunk_entries
        return [None] * len(self.prompts[index // self.n])

    async def events(self, generation: Generation) -> AsyncIterator[str]:
        usage = Usage(self.n)
        offsets = [0] * (len(self.prompts) * self.n)
        started = [False] * (len(self.prompts) * self.n)
        async for index, chunk in generation.stream():
            if (end := generation.ending_event(chunk)) is not None:
                yield end
                break
            text, prompt_entries = chunk.text, None
            if not started[index]:
                started[index] = True
                if self.echoed is not None:
                    text = self.echoed[index // self.n] + text
                    prompt_entries = self.prompt_entries_of(index, chunk.prompt_logprobs)
            logprobs, offsets[index] = self.logprobs_of(
                index, chunk.logprobs, chunk.token_ids, prompt_entries, offsets[index]
            )
            if chunk.finished:
                usage.add(index, chunk)
            elif not text and not (logprobs and logprobs.tokens):
                continue  # held back while it may still be a stop string
            choice = CompletionChoice(
                index=index,
                text=text,
                logprobs=logprobs,
                finish_reason=openai_finish_reason(chunk.finish_reason),
            )
            yield sse(CompletionResponse(id=self.rid, model=self.model, choices=[choice]))
        else:
            if self.include_usage:
                info = usage.info()
                yield sse(CompletionResponse(id=self.rid, model=self.model, choices=[], usage=info))
        yield DONE

    def whole(self, results: list[Result]) -> CompletionResponse:
        usage = Usage(self.n)
        choices = []
        for i, r in enumerate(results):
            usage.add(i, r.last)
            text = r.text if self.echoed is None else self.echoed[i // self.n] + r.text
            prompt_entries = self.prompt_entries_of(i, r.prompt_logprobs)
            logprobs, _ = self.logprobs_of(i, r.logprobs, r.token_ids, prompt_entries, 0)
            reason = openai_finish_reason(r.last.finish_reason)
            choices.append(
                CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=reason)
            )
        return CompletionResponse(
            id=self.rid, model=self.model, choices=choices, usage=usage.info()
        )


async def completions(body: CompletionRequest, request: Request) -> Response:
    state = _open(body, request)
    engine, n = state.engine, body.n
    with converting():
        prompts = prompt_ids(engine, body.prompt, state.limits.max_prompts_per_request)
        _check_fanout(len(prompts), n, state.limits.max_prompts_per_request)
        for ids in prompts:
            engine.check_prompt(ids, body.max_tokens, param="prompt")
        params = sampling_params(body, body.max_tokens or 16)
    echoed = _prompt_texts(engine.tokenizer, body.prompt, prompts) if body.echo else None
    pieces = token_pieces(engine.tokenizer) if body.logprobs is not None else None
    ctx = Context.of(request)
    rid = f"cmpl-{ctx.request_id}"
    answer = _CompletionAnswer(
        rid, state.model_name, prompts, n, echoed, pieces, _include_usage(body)
    )
    fanned = [prompts[i // n] for i in range(len(prompts) * n)]
    each = [params[i % n] for i in range(len(fanned))]
    rids = [f"{rid}-{i}" for i in range(len(fanned))]
    generation = await Generation.admit(ctx, fanned, each, rids)
    return await respond(request, generation, body.stream, answer.events, answer.whole)


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


@dataclass(slots=True)
class _ChatAnswer:
    """One /v1/chat/completions answer: `n` choices of one prompt, as SSE events (a role
    delta, content deltas, a finish delta per choice) or as one body."""

    rid: str
    model: str
    n: int
    pieces: TokenPieces | None
    top_k: int
    include_usage: bool

    def chunk_of(
        self,
        index: int,
        delta: DeltaMessage,
        finish: str | None = None,
        entries: list[TokenLogprobs] | None = None,
    ) -> str:
        # only deltas that carry tokens carry logprobs (not the role or finish deltas)
        logprobs = (
            None
            if self.pieces is None or entries is None
            else chat_logprobs(self.pieces, entries, self.top_k)
        )
        choice = ChatStreamChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish)
        return sse(ChatCompletionChunk(id=self.rid, model=self.model, choices=[choice]))

    async def events(self, generation: Generation) -> AsyncIterator[str]:
        for index in range(self.n):
            yield self.chunk_of(index, DeltaMessage(role="assistant", content=""))
        usage = Usage(self.n)
        async for index, chunk in generation.stream():
            if (end := generation.ending_event(chunk)) is not None:
                yield end
                break
            if chunk.text or (self.pieces is not None and chunk.logprobs):
                entries = chunk.logprobs if self.pieces is not None else None
                yield self.chunk_of(index, DeltaMessage(content=chunk.text), entries=entries or [])
            if chunk.finished:
                usage.add(index, chunk)
                finish = openai_finish_reason(chunk.finish_reason)
                yield self.chunk_of(index, DeltaMessage(), finish)
        else:
            if self.include_usage:
                last = ChatCompletionChunk(
                    id=self.rid, model=self.model, choices=[], usage=usage.info()
                )
                yield sse(last)
        yield DONE

    def whole(self, results: list[Result]) -> ChatCompletionResponse:
        usage = Usage(self.n)
        choices = []
        for i, r in enumerate(results):
            usage.add(i, r.last)
            logprobs = (
                None
                if self.pieces is None
                else chat_logprobs(self.pieces, r.logprobs or [], self.top_k)
            )
            choices.append(
                ChatChoice(
                    index=i,
                    message=ChatMessageOut(content=r.text),
                    logprobs=logprobs,
                    finish_reason=openai_finish_reason(r.last.finish_reason),
                )
            )
        return ChatCompletionResponse(
            id=self.rid, model=self.model, choices=choices, usage=usage.info()
        )


async def chat(body: ChatCompletionRequest, request: Request) -> Response:
    state = _open(body, request)
    engine, n = state.engine, body.n
    with converting():
        _check_fanout(1, n, state.limits.max_prompts_per_request)
        ids = chat_prompt_ids(engine, body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        engine.check_prompt(ids, max_tokens, param="messages")
        # no max_tokens: as many as fit (the engine caps it to the context and KV cache)
        params = sampling_params(body, max_tokens or engine.max_context_len)
    pieces = token_pieces(engine.tokenizer) if body.logprobs else None
    ctx = Context.of(request)
    rid = f"chatcmpl-{ctx.request_id}"
    answer = _ChatAnswer(
        rid, state.model_name, n, pieces, body.top_logprobs or 0, _include_usage(body)
    )
    rids = [f"{rid}-{i}" for i in range(n)]
    generation = await Generation.admit(ctx, [ids] * n, params, rids)
    return await respond(request, generation, body.stream, answer.events, answer.whole)
