"""The routes: `/health` and `/metrics` (open), and behind the API key `/v1/models` and
`/v1/models/{id}`, `/v1/completions`, `/v1/chat/completions`, the native `/generate` and
`/flush_cache`."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from stallfree.entrypoints.server.errors import ApiError
from stallfree.entrypoints.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    GenerateRequest,
    ModelCard,
    ModelList,
    UsageInfo,
)
from stallfree.entrypoints.server.requests import (
    chat_prompt_ids,
    check_model,
    converting,
    native_sampling_params,
    prompt_ids,
    reject_unsupported,
    sampling_params,
)
from stallfree.entrypoints.server.state import server_state
from stallfree.entrypoints.server.streaming import (
    DONE,
    Context,
    Generation,
    Result,
    respond,
    sse,
)
from stallfree.runtime.output_processor import GenerationChunk
from stallfree.runtime.sampling_params import SamplingParams

# NOTE: OpenAI clients parse only their own finish reasons. A request the engine aborted (past
# its deadline) was cut short by a server limit, as `length` is by max_tokens; `error` never
# reaches a choice (it is a 500, or an SSE error event). /generate keeps the engine's reasons.
_OPENAI_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "length"}


def openai_finish_reason(reason: str | None) -> str | None:
    """The OpenAI `finish_reason` for an engine finish reason (None while unfinished)."""
    if reason is None:
        return None
    return _OPENAI_FINISH_REASONS.get(reason, "stop")


def open_routes() -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health(request: Request) -> Response:
        state = server_state(request)
        engine = state.engine
        if state.lifecycle.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        # NOTE: an engine that failed closed after repeated step failures reports unhealthy.
        up = engine.healthy and engine.accepting
        return JSONResponse(
            {"status": "ok" if up else "unavailable"}, status_code=200 if up else 503
        )

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        engine = server_state(request).engine
        if engine.metrics is None:
            raise ApiError(404, "metrics are disabled (metrics.enabled = false)", code="not_found")
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router


def api_routes() -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def models(request: Request) -> ModelList:
        return ModelList(data=[_model_card(request)])

    # NOTE: `:path`, so a served name with a slash (`org/model`) is one id
    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> ModelCard:
        check_model(server_state(request), model_id)
        return _model_card(request)

    router.add_api_route("/v1/completions", completions, methods=["POST"])
    router.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    router.add_api_route("/generate", generate, methods=["POST"])

    @router.post("/flush_cache")
    async def flush_cache(request: Request) -> Response:
        """Empty the prefix cache (SGLang's endpoint); refused while requests are in flight."""
        engine = server_state(request).engine
        if not engine.flush_cache():
            raise ApiError(
                400,
                "the prefix cache was not flushed: requests are queued or running; "
                "retry when the engine is idle",
                code="engine_busy",
            )
        return JSONResponse({"flushed": True})

    return router


def _model_card(request: Request) -> ModelCard:
    state = server_state(request)
    # NOTE: one creation time per app (its first model answer), so the list and the retrieved
    # card are equal
    app_state = request.app.state
    if getattr(app_state, "models_created", None) is None:
        app_state.models_created = int(time.time())
    return ModelCard(
        id=state.model_name,
        created=app_state.models_created,
        max_model_len=state.engine.max_context_len,
    )


def _add_usage(usage: UsageInfo, last: GenerationChunk) -> UsageInfo:
    return UsageInfo.of(
        usage.prompt_tokens + last.prompt_tokens, usage.completion_tokens + last.completion_tokens
    )


async def completions(body: CompletionRequest, request: Request) -> Response:
    state = server_state(request)
    engine = state.engine
    check_model(state, body.model)
    reject_unsupported(body)
    with converting():
        prompts = prompt_ids(engine, body.prompt, state.limits.max_prompts_per_request)
        for ids in prompts:
            engine.check_prompt(ids, body.max_tokens, param="prompt")
        params = sampling_params(body, body.max_tokens or 16)
    ctx = Context.of(request)
    rid = f"cmpl-{ctx.request_id}"
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def events(generation: Generation) -> AsyncIterator[str]:
        usage = UsageInfo()
        async for index, chunk in generation.stream():
            if (end := generation.ending_event(chunk)) is not None:
                yield end
                break
            if chunk.finished:
                usage = _add_usage(usage, chunk)
            elif not chunk.text:
                continue  # held back while it may still be a stop string
            choice = CompletionChoice(
                index=index,
                text=chunk.text,
                finish_reason=openai_finish_reason(chunk.finish_reason),
            )
            yield sse(CompletionResponse(id=rid, model=state.model_name, choices=[choice]))
        else:
            if include_usage:
                yield sse(
                    CompletionResponse(id=rid, model=state.model_name, choices=[], usage=usage)
                )
        yield DONE

    def whole(results: list[Result]) -> CompletionResponse:
        choices = [
            CompletionChoice(
                index=i, text=r.text, finish_reason=openai_finish_reason(r.last.finish_reason)
            )
            for i, r in enumerate(results)
        ]
        usage = UsageInfo()
        for r in results:
            usage = _add_usage(usage, r.last)
        return CompletionResponse(id=rid, model=state.model_name, choices=choices, usage=usage)

    rids = [f"{rid}-{i}" for i in range(len(prompts))]
    generation = await Generation.admit(ctx, prompts, params, rids)
    return await respond(request, generation, body.stream, events, whole)


async def chat(body: ChatCompletionRequest, request: Request) -> Response:
    state = server_state(request)
    engine = state.engine
    check_model(state, body.model)
    reject_unsupported(body)
    with converting():
        ids = chat_prompt_ids(engine, body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        engine.check_prompt(ids, max_tokens, param="messages")
        # NOTE: no max_tokens: as many as fit (the engine caps it to the context and KV cache)
        params = sampling_params(body, max_tokens or engine.max_context_len)
    ctx = Context.of(request)
    rid = f"chatcmpl-{ctx.request_id}"
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk_of(
        delta: DeltaMessage, finish: str | None = None, usage: UsageInfo | None = None
    ) -> str:
        choices = [] if usage else [ChatStreamChoice(index=0, delta=delta, finish_reason=finish)]
        return sse(
            ChatCompletionChunk(id=rid, model=state.model_name, choices=choices, usage=usage)
        )

    async def events(generation: Generation) -> AsyncIterator[str]:
        yield chunk_of(DeltaMessage(role="assistant", content=""))
        async for _, chunk in generation.stream():
            if (end := generation.ending_event(chunk)) is not None:
                yield end
                break
            if chunk.text:
                yield chunk_of(DeltaMessage(content=chunk.text))
            if chunk.finished:
                yield chunk_of(DeltaMessage(), openai_finish_reason(chunk.finish_reason))
                if include_usage:
                    yield chunk_of(DeltaMessage(), usage=_add_usage(UsageInfo(), chunk))
        yield DONE

    def whole(results: list[Result]) -> ChatCompletionResponse:
        text, last = results[0].text, results[0].last
        choice = ChatChoice(
            index=0,
            message=ChatMessageOut(content=text),
            finish_reason=openai_finish_reason(last.finish_reason),
        )
        usage = _add_usage(UsageInfo(), last)
        return ChatCompletionResponse(id=rid, model=state.model_name, choices=[choice], usage=usage)

    generation = await Generation.admit(ctx, [ids], params, [f"{rid}-0"])
    return await respond(request, generation, body.stream, events, whole)


async def generate(body: GenerateRequest, request: Request) -> Response:
    engine = server_state(request).engine
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(400, "send exactly one of text and input_ids", param="text")
    with converting():
        params = native_sampling_params(body.sampling_params)
        prompt = (
            engine.tokenizer.encode(body.text)
            if body.text is not None
            else list(body.input_ids or [])
        )
        engine.check_prompt(prompt, None, param="prompt")
    ctx = Context.of(request)
    rid = body.rid or f"gen-{ctx.request_id}"

    def meta(chunk: GenerationChunk) -> dict[str, Any]:
        return {
            "id": chunk.rid,
            "finish_reason": chunk.finish_reason,
            "prompt_tokens": chunk.prompt_tokens,
            "completion_tokens": chunk.completion_tokens,
            "error": chunk.error,
        }

    async def events(generation: Generation) -> AsyncIterator[str]:
        async for _, chunk in generation.stream():
            if (end := generation.ending_event(chunk)) is not None:
                yield end
                break
            yield sse(
                {
                    "text": chunk.text,
                    "output_ids": chunk.token_ids,
                    "finished": chunk.finished,
                    "meta_info": meta(chunk),
                }
            )
        yield DONE

    def whole(results: list[Result]) -> dict[str, Any]:
        r = results[0]
        return {"text": r.text, "output_ids": r.token_ids, "meta_info": meta(r.last)}

    try:
        generation = await Generation.admit(ctx, [prompt], params, [rid])
    except ApiError as err:
        # NOTE: the engine names a sampling field plainly; here it lives in sampling_params
        if err.info.param in SamplingParams.model_fields:
            err.info.param = f"sampling_params.{err.info.param}"
        raise
    return await respond(request, generation, body.stream, events, whole)
