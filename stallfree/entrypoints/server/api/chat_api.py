"""`POST /v1/chat/completions`: `n` choices of one rendered chat.

The request's tools, documents and `chat_template_kwargs` reach the template, and its reply is
read by the configured parsers (`tools.plan_chat`): each choice's text goes through a
`chat_output.ChoiceText`, which splits it into reasoning, content and tool calls, in a stream
as deltas and in a whole body at once, the same way. A forced call (`tool_choice` required or
a named function) is a structured output, so the choices are constrained like any other.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from stallfree.entrypoints.server.api.openai_api import (
    Usage,
    open_request,
    openai_finish_reason,
    respond_answer,
    taken,
    wants_usage,
    wants_usage_always,
)
from stallfree.entrypoints.server.base.protocol import ChatCompletionRequest
from stallfree.entrypoints.server.chat.chat_output import ChatOutput, ChoiceText, Piece
from stallfree.entrypoints.server.chat.tools import plan_chat, template_ignores_tools
from stallfree.entrypoints.server.intake.budget import RequestCost, check_fanout
from stallfree.entrypoints.server.intake.requests import (
    chat_prompt_ids_async,
    converting,
    read_body,
    sampling_params,
    truncated,
)
from stallfree.entrypoints.server.intake.screening import check_chat_size, model_adapter
from stallfree.entrypoints.server.output.logprobs import (
    SharedPromptLogprobs,
    TokenPieces,
    chat_logprobs,
    chat_logprobs_dump,
    token_pieces,
)
from stallfree.entrypoints.server.output.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatStreamChoice,
    DeltaMessage,
    json_pieces,
)
from stallfree.entrypoints.server.output.streaming import DONE, Context, Generation, Result, sse
from stallfree.runtime.request.outputs import TokenLogprobs

logger = logging.getLogger("stallfree.server")


def _delta(piece: Piece) -> DeltaMessage:
    return DeltaMessage(
        content=piece.content or None,
        reasoning_content=piece.reasoning or None,
        tool_calls=piece.calls or None,
    )


@dataclass(slots=True)
class _ChatAnswer:
    """One /v1/chat/completions answer: `n` choices of one prompt, as SSE events (a role
    delta, content, reasoning and tool-call deltas, a finish delta per choice) or as one body."""

    rid: str
    model: str
    n: int
    pieces: TokenPieces | None
    top_k: int
    include_usage: bool
    output: ChatOutput
    # vLLM's prompt_logprobs: computed by the first choice, carried by all (not with stream)
    prompt_logprobs: SharedPromptLogprobs | None = None
    # every chunk carries the usage so far (the role chunks: the prompt's tokens)
    continuous_usage: bool = False
    prompt_tokens: int = 0
    usage: Usage = field(init=False)

    def __post_init__(self) -> None:
        self.usage = Usage(self.n)
        self.usage.prompt[0] = self.prompt_tokens  # known before the first chunk

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
        usage = self.usage.info() if self.continuous_usage else None
        return sse(
            ChatCompletionChunk(id=self.rid, model=self.model, choices=[choice], usage=usage)
        )

    async def events(self, generation: Generation) -> AsyncIterator[str]:
        usage = self.usage
        for index in range(self.n):
            yield self.chunk_of(index, DeltaMessage(role="assistant", content=""))
        texts = [self.output.choice() for _ in range(self.n)]
        async for index, chunk in generation.stream():
            if (end := generation.ending_event(chunk)) is not None:
                yield end
                break
            usage.add(index, chunk)
            entries = chunk.logprobs if self.pieces is not None else None
            if self.output.plain:
                if chunk.text or entries:
                    delta = DeltaMessage(content=chunk.text)
                    yield self.chunk_of(index, delta, entries=entries or [])
            else:
                cut = chunk.finished and chunk.finish_reason != "stop"
                piece = texts[index].feed(chunk.text, final=chunk.finished, cut=cut)
                if piece or entries:
                    yield self.chunk_of(index, _delta(piece), entries=entries or [])
            if chunk.finished:
                finish = texts[index].finish_reason(openai_finish_reason(chunk))
                yield self.chunk_of(index, DeltaMessage(), finish)
        else:
            if self.include_usage:
                last = ChatCompletionChunk(
                    id=self.rid, model=self.model, choices=[], usage=usage.info()
                )
                yield sse(last)
        yield DONE

    def _choices(self, results: list[Result]) -> Iterator[dict[str, Any]]:
        """Each choice as `ChatChoice.model_dump()` gives it."""
        for i, r in taken(results):
            logprobs = (
                None
                if self.pieces is None
                else chat_logprobs_dump(self.pieces, r.logprobs or [], self.top_k)
            )
            text: ChoiceText = self.output.choice()
            text.feed(r.text, final=True, cut=r.last.finish_reason != "stop")
            item = {
                "index": i,
                "message": text.message(),
                "logprobs": logprobs,
                "finish_reason": text.finish_reason(openai_finish_reason(r.last)),
            }
            if self.prompt_logprobs is not None:
                first = r.prompt_logprobs if i == 0 else None
                item["prompt_logprobs"] = self.prompt_logprobs.get(0, first)
            yield item

    def body(self, results: list[Result]) -> list[bytes]:
        """The whole body's JSON, one choice at a time (each result let go once written)."""
        usage = Usage(self.n)
        for i, r in enumerate(results):
            usage.add(i, r.last)
        envelope = ChatCompletionResponse(
            id=self.rid, model=self.model, choices=[], usage=usage.info()
        )
        return json_pieces(envelope, "choices", self._choices(results))


async def chat(request: Request) -> Response:
    body = await read_body(request, ChatCompletionRequest)
    state = open_request(body, request)
    engine, n, limits = state.engine, body.n, state.limits
    check_chat_size(body, limits)
    plan = plan_chat(body, limits)
    with converting():
        check_fanout(1, n, limits.max_prompts_per_request)
        ids = await chat_prompt_ids_async(engine, body, template_kwargs=plan.template_kwargs)
        ids = truncated(ids, body.truncate_prompt_tokens, engine.max_context_len)
        max_tokens = body.max_completion_tokens or body.max_tokens
        engine.validator.check_prompt(ids, max_tokens, param="messages")
        # no max_tokens: as many as fit (the engine caps it to the context and KV cache)
        most = max_tokens or engine.max_context_len
        cost = RequestCost(
            1,
            len(ids),
            n,
            min(most, max(engine.max_context_len - len(ids), 0)),
            (body.top_logprobs or 0) if body.logprobs else None,
            logprobs_field="top_logprobs" if body.top_logprobs else "logprobs",
            max_tokens_field="max_tokens"
            if body.max_completion_tokens is None
            else "max_completion_tokens",
            max_tokens_unset=max_tokens is None,
            prompt_logprobs=body.prompt_logprobs,
        )
        cost.check(limits.max_request_cost)
        params = sampling_params(body, most, state.defaults, plan.overrides())
        if body.prompt_logprobs is not None:  # the first choice computes them; all n carry them
            params[1:] = [p.model_copy(update={"prompt_logprobs": None}) for p in params[1:]]
    pieces = token_pieces(engine.tokenizer) if body.logprobs else None
    ctx = Context.of(request)
    if body.tools and template_ignores_tools(engine.tokenizer):
        logger.warning(
            "request %s: its %d tools are not in the prompt: this model's chat template does "
            "not use `tools`, so the model never reads them",
            ctx.request_id,
            len(body.tools),
        )
    if state.disagg is not None:
        ctx.source = state.disagg.source(body)
    ctx.lora_name = model_adapter(state.engine, state.model_name, body.model)
    rid = f"chatcmpl-{ctx.request_id}"
    answer = _ChatAnswer(
        rid,
        ctx.lora_name or state.model_name,
        n,
        pieces,
        body.top_logprobs or 0,
        wants_usage(body),
        plan.output,
        SharedPromptLogprobs.of(engine.tokenizer, body.prompt_logprobs, [ids]),
        continuous_usage=wants_usage_always(body),
        prompt_tokens=len(ids),
    )
    rids = [f"{rid}-{i}" for i in range(n)]
    generation = await Generation.admit(ctx, [ids] * n, params, rids)
    state.observe_params(n, most)
    return await respond_answer(request, generation, body.stream, answer)
