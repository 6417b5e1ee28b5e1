"""The routes: `/health` and `/metrics` (open), and behind the API key `/v1/models` and
`/v1/models/{id}`, `/v1/completions`, `/v1/chat/completions`, the native `/generate` and
`/flush_cache`; the LoRA adapter routes come from `api/lora.py`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from stallfree.entrypoints.server.api.chat_api import chat
from stallfree.entrypoints.server.api.embeddings import embeddings, pooling
from stallfree.entrypoints.server.api.lora import adapter_cards, created_time, lora_routes
from stallfree.entrypoints.server.api.openai_api import completions
from stallfree.entrypoints.server.api.score import rerank, score
from stallfree.entrypoints.server.base.errors import ApiError
from stallfree.entrypoints.server.base.protocol import GenerateRequest
from stallfree.entrypoints.server.base.state import ServerState, server_state
from stallfree.entrypoints.server.intake.requests import (
    converting,
    encode_async,
    native_sampling_params,
    read_body,
)
from stallfree.entrypoints.server.intake.screening import check_runner, model_adapter
from stallfree.entrypoints.server.output.logprobs import native_logprobs
from stallfree.entrypoints.server.output.responses import ModelCard, ModelList
from stallfree.entrypoints.server.output.streaming import (
    DONE,
    Context,
    Generation,
    Result,
    respond,
    sse,
)
from stallfree.runtime.engine import Engine
from stallfree.runtime.request.outputs import GenerationChunk
from stallfree.runtime.request.sampling_params import SamplingParams


def open_routes() -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health(request: Request) -> Response:
        state = server_state(request)
        engine = state.engine
        if state.lifecycle.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        # an engine that failed closed after repeated step failures reports unhealthy.
        up = engine.healthy and engine.accepting
        return JSONResponse(
            {"status": "ok" if up else "unavailable"}, status_code=200 if up else 503
        )

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        engine = server_state(request).engine
        if engine.metrics is None:
            raise ApiError(404, "metrics are disabled (metrics.enabled = false)", code="not_found")
        text = engine.metrics.render()
        disagg = server_state(request).disagg
        if disagg is not None:
            text += disagg.render_metrics()
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return router


def api_routes() -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def models(request: Request) -> ModelList:
        cards = adapter_cards(request, created_time(request))
        return ModelList(data=[_model_card(request), *cards])

    # `:path`, so a served name with a slash (`org/model`) is one id
    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> ModelCard:
        state = server_state(request)
        if model_adapter(state.engine, state.model_name, model_id) is not None:
            cards = adapter_cards(request, created_time(request))
            return next(c for c in cards if c.id == model_id)
        return _model_card(request)

    router.add_api_route("/v1/completions", completions, methods=["POST"])
    router.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    router.add_api_route("/generate", generate, methods=["POST"])
    router.include_router(lora_routes())
    router.add_api_route("/v1/embeddings", embeddings, methods=["POST"])
    router.add_api_route("/pooling", pooling, methods=["POST"])
    for path in ("/v1/score", "/score"):
        router.add_api_route(path, score, methods=["POST"])
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        router.add_api_route(path, rerank, methods=["POST"])

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
    return ModelCard(
        id=state.model_name,
        created=created_time(request),
        max_model_len=state.engine.max_context_len,
    )


async def generate(request: Request) -> Response:
    # read as the OpenAI routes read theirs (`read_body`): the same 400s, naming the field
    body = await read_body(request, GenerateRequest)
    state = server_state(request)
    _check_generate(state, body)
    params, prompt = await _native_prompt(state.engine, body)
    ctx = Context.of(request)
    rid = body.rid or f"gen-{ctx.request_id}"
    try:
        generation = await Generation.admit(ctx, [prompt], params, [rid])
    except ApiError as err:
        # the engine names a sampling field plainly; here it lives in sampling_params
        if err.info.param in SamplingParams.model_fields:
            err.info.param = f"sampling_params.{err.info.param}"
        raise
    state.observe_params(1, params.max_new_tokens)
    answer = _NativeAnswer(logprobs=params.logprobs is not None)
    return await respond(request, generation, body.stream, answer.events, answer.whole)


def _check_generate(state: ServerState, body: GenerateRequest) -> None:
    """What `/generate` refuses before it reads the prompt: a runner that does not generate, a
    disaggregated server, and a body with both or neither of `text` and `input_ids`."""
    check_runner(state.engine, "generate", "/generate")
    if state.disagg is not None:
        raise ApiError(
            400,
            "a disaggregated server serves /v1/completions and /v1/chat/completions, "
            "through its router",
        )
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(400, "send exactly one of text and input_ids", param="text")


async def _native_prompt(engine: Engine, body: GenerateRequest) -> tuple[SamplingParams, list[int]]:
    """The request's sampling parameters and its prompt's token ids, checked by the engine."""
    with converting():
        params = native_sampling_params(body.sampling_params)
        prompt = (
            await encode_async(engine, body.text)
            if body.text is not None
            else list(body.input_ids or [])
        )
        engine.validator.check_prompt(prompt, None, param="prompt")
    return params, prompt


class _NativeAnswer:
    """`/generate`'s answer in SGLang's native shape: one event per chunk when streamed, or
    the whole result; each with its `meta_info`, and logprobs when they were asked for."""

    def __init__(self, logprobs: bool) -> None:
        self.logprobs = logprobs

    async def events(self, generation: Generation) -> AsyncIterator[str]:
        async for _, chunk in generation.stream():
            if (end := generation.ending_event(chunk)) is not None:
                yield end
                break
            event = {
                "text": chunk.text,
                "output_ids": chunk.token_ids,
                "finished": chunk.finished,
                "meta_info": _meta(chunk),
            }
            yield sse(self._with_logprobs(event, chunk.logprobs, chunk.prompt_logprobs))
        yield DONE

    def whole(self, results: list[Result]) -> dict[str, Any]:
        r = results[0]
        out = {"text": r.text, "output_ids": r.token_ids, "meta_info": _meta(r.last)}
        return self._with_logprobs(out, r.logprobs, r.prompt_logprobs)

    def _with_logprobs(
        self, out: dict[str, Any], logprobs: Any, prompt_logprobs: Any
    ) -> dict[str, Any]:
        """`logprobs` (and `prompt_logprobs`, in the first event) when they were asked for."""
        if self.logprobs:
            out["logprobs"] = native_logprobs(logprobs or [])
        if prompt_logprobs is not None:
            out["prompt_logprobs"] = native_logprobs(prompt_logprobs)
        return out


def _meta(chunk: GenerationChunk) -> dict[str, Any]:
    return {
        "id": chunk.rid,
        "finish_reason": chunk.finish_reason,
        "prompt_tokens": chunk.prompt_tokens,
        "completion_tokens": chunk.completion_tokens,
        "error": chunk.error,
    }
