"""The HTTP server: OpenAI-compatible routes, native `/generate`, `/health` and `/metrics`.

Streaming is Server-Sent Events everywhere: `data: {json}` events, closed by `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import signal
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from stallfree.config import StallfreeConfig
from stallfree.runtime.engine import (
    Engine,
    EngineOverloadedError,
    EngineUnhealthyError,
    GenerationChunk,
    InvalidRequestError,
)
from stallfree.runtime.openai_protocol import (
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
    ErrorInfo,
    ErrorResponse,
    GenerateRequest,
    ModelCard,
    ModelList,
    UsageInfo,
)
from stallfree.runtime.sampling_params import SamplingParams
from stallfree.runtime.tokenizer import ChatTemplateError

T = TypeVar("T")
_DISCONNECT_POLL_S = 0.25


class ApiError(Exception):
    """A request the server refuses; rendered in the OpenAI error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)


class _ClientGone(Exception):
    """The client disconnected before a non-streaming answer was ready."""


def _error_json(status: int, info: ErrorInfo) -> JSONResponse:
    return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=status)


@dataclass(slots=True)
class _State:
    engine: Engine
    model_name: str
    api_key: str | None


# ---------------------------------------------------------------- app factory


def create_app(engine_or_config: Engine | StallfreeConfig) -> FastAPI:
    """An app serving `engine_or_config`; the lifespan starts the engine (and, when the app
    built it from a config, drains and shuts it down)."""
    owns = not isinstance(engine_or_config, Engine)
    engine = engine_or_config if isinstance(engine_or_config, Engine) else Engine(engine_or_config)
    cfg = engine.config

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            if owns:
                await engine.shutdown(drain=True)

    app = FastAPI(
        title="stallfree", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.sf = _State(engine, cfg.server.model_name(cfg.model.path), cfg.server.api_key)
    _install_error_handlers(app)
    app.include_router(_open_routes())
    app.include_router(_api_routes(), dependencies=[Depends(_check_api_key)])
    return app


def _state(request: Request) -> _State:
    return request.app.state.sf


def _install_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return _error_json(exc.status, exc.info)

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        message, param = _describe_validation(exc.errors())
        return _error_json(
            400, ErrorInfo(message=message, type="invalid_request_error", param=param)
        )

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        info = ErrorInfo(message=str(exc.detail), type="invalid_request_error")
        return _error_json(exc.status_code, info)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)


def _describe_validation(errors: Sequence[Any]) -> tuple[str, str | None]:
    parts: list[str] = []
    param: str | None = None
    for err in list(errors)[:3]:
        if err.get("type") == "json_invalid":
            return f"malformed JSON body: {err.get('ctx', {}).get('error', err['msg'])}", None
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        # union members show up as loc parts like 'str' or 'list[int]'; drop them
        loc = [p for p in loc if not p.startswith(("str", "list[", "int", "function-"))]
        field = ".".join(loc) or "body"
        param = param or field
        parts.append(f"{field}: {err['msg']}")
    return "; ".join(parts) or "invalid request", param


async def _check_api_key(request: Request) -> None:
    expected = _state(request).api_key
    if not expected:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise ApiError(
            401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
        )
    if not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise ApiError(401, "invalid API key", code="invalid_api_key")


# ---------------------------------------------------------------- routes


def _open_routes() -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health(request: Request) -> Response:
        engine = _state(request).engine
        # NOTE: an engine that failed closed after repeated step failures reports unhealthy.
        up = engine.healthy and not getattr(engine, "_closing", True)
        return JSONResponse(
            {"status": "ok" if up else "unavailable"}, status_code=200 if up else 503
        )

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        engine = _state(request).engine
        if engine.metrics is None:
            raise ApiError(404, "metrics are disabled (metrics.enabled = false)", code="not_found")
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router


def _api_routes() -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def models(request: Request) -> ModelList:
        state = _state(request)
        limit = getattr(state.engine, "max_context_len", None)
        return ModelList(data=[ModelCard(id=state.model_name, max_model_len=limit)])

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _completions(body, request)

    @router.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await _chat(body, request)

    @router.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        return await _generate(body, request)

    return router


# ---------------------------------------------------------------- request → engine


def _check_model(state: _State, name: str) -> None:
    if name not in (state.model_name, state.engine.config.model.path):
        raise ApiError(
            404,
            f"the model {name!r} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )


def _reject_unsupported(body: CompletionRequest | ChatCompletionRequest) -> None:
    unsupported = {
        "n": body.n > 1,
        "presence_penalty": body.presence_penalty != 0.0,
        "frequency_penalty": body.frequency_penalty != 0.0,
        "logit_bias": bool(body.logit_bias),
    }
    if isinstance(body, CompletionRequest):
        unsupported |= {
            "echo": body.echo,
            "logprobs": body.logprobs is not None,
            "best_of": (body.best_of or 1) > 1,
            "suffix": body.suffix is not None,
        }
    else:
        unsupported |= {
            "logprobs": body.logprobs,
            "top_logprobs": body.top_logprobs is not None,
            "tools": bool(body.tools),
            "tool_choice": body.tool_choice not in (None, "none"),
            "response_format": (body.response_format or {}).get("type", "text") != "text",
        }
    for field, bad in unsupported.items():
        if bad:
            raise ApiError(400, f"{field} is not supported by this server", param=field)


def _sampling_params(
    body: CompletionRequest | ChatCompletionRequest, max_tokens: int
) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    try:
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=-1 if body.top_k is None else body.top_k,
            seed=body.seed,
            stop=stop,
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
        )
    except ValidationError as exc:
        raise _from_validation(exc) from exc


def _from_validation(exc: ValidationError) -> ApiError:
    message, param = _describe_validation(exc.errors())
    return ApiError(400, message, param=param)


def _check_lengths(engine: Engine, ids: list[int], max_tokens: int | None, param: str) -> None:
    limit = engine.max_context_len
    if not ids:
        raise ApiError(400, f"{param} is empty", param=param)
    if len(ids) >= limit:
        raise ApiError(
            400,
            f"this model's maximum context length is {limit} tokens, and the {param} has "
            f"{len(ids)} tokens (it must leave room for at least one new token)",
            param=param,
            code="context_length_exceeded",
        )
    if max_tokens is not None and len(ids) + max_tokens > limit:
        raise ApiError(
            400,
            f"max_tokens is too large: {max_tokens}. This model's maximum context length is "
            f"{limit} tokens and the {param} has {len(ids)} tokens, so at most "
            f"{limit - len(ids)} new tokens fit",
            param="max_tokens",
            code="context_length_exceeded",
        )


def _prompt_ids(
    engine: Engine, prompt: str | list[str] | list[int] | list[list[int]]
) -> list[list[int]]:
    if isinstance(prompt, str):
        return [engine.tokenizer.encode(prompt)]
    if not prompt:
        raise ApiError(400, "prompt is empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [[int(p) for p in prompt]]  # type: ignore[arg-type]
    return [
        engine.tokenizer.encode(p) if isinstance(p, str) else list(p)  # type: ignore[arg-type]
        for p in prompt
    ]


def _chat_prompt_ids(engine: Engine, body: ChatCompletionRequest) -> list[int]:
    messages = []
    for i, m in enumerate(body.messages):
        if isinstance(m.content, list):
            if any(p.type != "text" for p in m.content):
                raise ApiError(400, "only text content parts are supported", param=f"messages.{i}")
            content = "".join(p.text or "" for p in m.content)
        else:
            content = m.content or ""
        messages.append({"role": m.role, "content": content})
    try:
        text = engine.tokenizer.apply_chat_template(messages)
    except ChatTemplateError as exc:
        raise ApiError(
            400, f"chat is unavailable: {exc}", param="messages", code="no_chat_template"
        ) from exc
    return engine.tokenizer.encode(text)


# ---------------------------------------------------------------- running streams


@dataclass(slots=True)
class _Open:
    """An admitted request: its engine stream and the first chunk already read from it."""

    index: int
    gen: AsyncIterator[GenerationChunk]
    first: GenerationChunk

    async def chunks(self) -> AsyncIterator[GenerationChunk]:
        yield self.first
        if not self.first.finished:
            async for chunk in self.gen:
                yield chunk

    async def close(self) -> None:
        await self.gen.aclose()  # type: ignore[attr-defined]


async def _admit(
    engine: Engine, index: int, ids: list[int], params: SamplingParams, rid: str
) -> _Open:
    gen = engine.generate(ids, params, rid)
    try:
        # NOTE: read the first chunk before any header is sent, so admission errors get a 4xx.
        first = await gen.__anext__()
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc)) from exc
    except EngineOverloadedError as exc:
        raise ApiError(503, str(exc), type="service_unavailable", code="overloaded") from exc
    except EngineUnhealthyError as exc:
        raise ApiError(503, str(exc), type="service_unavailable", code="engine_unhealthy") from exc
    return _Open(index, gen, first)


async def _open_all(
    engine: Engine, prompts: list[list[int]], params: SamplingParams, rid: str
) -> list[_Open]:
    results = await asyncio.gather(
        *(_admit(engine, i, ids, params, f"{rid}-{i}") for i, ids in enumerate(prompts)),
        return_exceptions=True,
    )
    opened = [r for r in results if isinstance(r, _Open)]
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    if failure is not None:
        for o in opened:
            await o.close()
        raise failure
    return opened


async def _merged(opened: list[_Open]) -> AsyncIterator[tuple[int, GenerationChunk]]:
    """Chunks of several requests as they come; closing it aborts whatever is unfinished."""
    if len(opened) == 1:
        try:
            async for chunk in opened[0].chunks():
                yield 0, chunk
        finally:
            await opened[0].close()
        return
    queue: asyncio.Queue[tuple[int, GenerationChunk]] = asyncio.Queue()

    async def pump(o: _Open) -> None:
        async for chunk in o.chunks():
            queue.put_nowait((o.index, chunk))

    tasks = [asyncio.create_task(pump(o)) for o in opened]
    try:
        remaining = len(opened)
        while remaining:
            index, chunk = await queue.get()
            yield index, chunk
            remaining -= chunk.finished
    finally:
        for t in tasks:
            t.cancel()
        for o in opened:
            await o.close()


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client goes away first, cancel it (aborting its requests)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise _ClientGone
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


@dataclass(slots=True)
class _Result:
    text: str
    token_ids: list[int]
    last: GenerationChunk


async def _collect(opened: list[_Open]) -> list[_Result]:
    texts: list[list[str]] = [[] for _ in opened]
    ids: list[list[int]] = [[] for _ in opened]
    lasts: list[GenerationChunk | None] = [None for _ in opened]
    async for index, chunk in _merged(opened):
        texts[index].append(chunk.text)
        ids[index].extend(chunk.token_ids)
        if chunk.finished:
            lasts[index] = chunk
    results = []
    for text, token_ids, last in zip(texts, ids, lasts, strict=True):
        assert last is not None
        if last.error is not None and last.finish_reason == "error":
            raise ApiError(500, f"generation failed: {last.error}", type="internal_error")
        results.append(_Result("".join(text), token_ids, last))
    return results


class _SseResponse(StreamingResponse):
    """Closes its body on the way out, so a client that left mid-stream aborts its request."""

    def __init__(self, body: AsyncIterator[str], opened: list[_Open]) -> None:
        super().__init__(
            body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._body = body
        self._opened = opened

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._body.aclose()  # type: ignore[attr-defined]
            # NOTE: a body that never started never reached its own cleanup
            for o in self._opened:
                await o.close()


def _sse(payload: BaseModel | dict[str, Any]) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else _json(payload)
    return f"data: {data}\n\n"


def _json(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False)


_DONE = "data: [DONE]\n\n"


def _error_event(chunk: GenerationChunk) -> str:
    info = ErrorInfo(message=f"generation failed: {chunk.error}", type="internal_error")
    return _sse(ErrorResponse(error=info))


async def _stream_or_collect(
    request: Request,
    opened_work: Awaitable[list[_Open]],
    stream: bool,
    to_events: Callable[[list[_Open]], AsyncIterator[str]],
    to_body: Callable[[list[_Result]], BaseModel | dict[str, Any]],
) -> Response:
    try:
        opened = await _unless_disconnected(request, opened_work)
        if stream:
            return _SseResponse(to_events(opened), opened)
        results = await _unless_disconnected(request, _collect(opened))
    except _ClientGone:
        return Response(status_code=499)
    body = to_body(results)
    return JSONResponse(body.model_dump() if isinstance(body, BaseModel) else body)


# ---------------------------------------------------------------- /v1/completions


async def _completions(body: CompletionRequest, request: Request) -> Response:
    state = _state(request)
    engine = state.engine
    _check_model(state, body.model)
    _reject_unsupported(body)
    prompts = _prompt_ids(engine, body.prompt)
    for ids in prompts:
        _check_lengths(engine, ids, body.max_tokens, "prompt")
    params = _sampling_params(body, body.max_tokens or 16)
    rid = f"cmpl-{uuid.uuid4().hex}"
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def events(opened: list[_Open]) -> AsyncIterator[str]:
        usage = UsageInfo()
        async for index, chunk in _merged(opened):
            if chunk.finished and chunk.finish_reason == "error":
                yield _error_event(chunk)
                break
            if chunk.finished:
                usage = _add_usage(usage, chunk)
            elif not chunk.text:
                continue  # held back while it may still be a stop string
            choice = CompletionChoice(
                index=index, text=chunk.text, finish_reason=chunk.finish_reason
            )
            yield _sse(CompletionResponse(id=rid, model=state.model_name, choices=[choice]))
        else:
            if include_usage:
                yield _sse(
                    CompletionResponse(id=rid, model=state.model_name, choices=[], usage=usage)
                )
        yield _DONE

    def whole(results: list[_Result]) -> CompletionResponse:
        choices = [
            CompletionChoice(index=i, text=r.text, finish_reason=r.last.finish_reason)
            for i, r in enumerate(results)
        ]
        usage = UsageInfo()
        for r in results:
            usage = _add_usage(usage, r.last)
        return CompletionResponse(id=rid, model=state.model_name, choices=choices, usage=usage)

    work = _open_all(engine, prompts, params, rid)
    return await _stream_or_collect(request, work, body.stream, events, whole)


def _add_usage(usage: UsageInfo, last: GenerationChunk) -> UsageInfo:
    return UsageInfo.of(
        usage.prompt_tokens + last.prompt_tokens, usage.completion_tokens + last.completion_tokens
    )


# ---------------------------------------------------------------- /v1/chat/completions


async def _chat(body: ChatCompletionRequest, request: Request) -> Response:
    state = _state(request)
    engine = state.engine
    _check_model(state, body.model)
    _reject_unsupported(body)
    ids = _chat_prompt_ids(engine, body)
    max_tokens = body.max_completion_tokens or body.max_tokens
    _check_lengths(engine, ids, max_tokens, "messages")
    params = _sampling_params(body, max_tokens or engine.max_context_len - len(ids))
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk_of(
        delta: DeltaMessage, finish: str | None = None, usage: UsageInfo | None = None
    ) -> str:
        choices = [] if usage else [ChatStreamChoice(index=0, delta=delta, finish_reason=finish)]
        return _sse(
            ChatCompletionChunk(id=rid, model=state.model_name, choices=choices, usage=usage)
        )

    async def events(opened: list[_Open]) -> AsyncIterator[str]:
        yield chunk_of(DeltaMessage(role="assistant", content=""))
        async for _, chunk in _merged(opened):
            if chunk.finished and chunk.finish_reason == "error":
                yield _error_event(chunk)
                break
            if chunk.text:
                yield chunk_of(DeltaMessage(content=chunk.text))
            if chunk.finished:
                yield chunk_of(DeltaMessage(), chunk.finish_reason)
                if include_usage:
                    yield chunk_of(DeltaMessage(), usage=_add_usage(UsageInfo(), chunk))
        yield _DONE

    def whole(results: list[_Result]) -> ChatCompletionResponse:
        text, last = results[0].text, results[0].last
        choice = ChatChoice(
            index=0, message=ChatMessageOut(content=text), finish_reason=last.finish_reason
        )
        usage = _add_usage(UsageInfo(), last)
        return ChatCompletionResponse(id=rid, model=state.model_name, choices=[choice], usage=usage)

    work = _open_all(engine, [ids], params, rid)
    return await _stream_or_collect(request, work, body.stream, events, whole)


# ---------------------------------------------------------------- /generate (native)


async def _generate(body: GenerateRequest, request: Request) -> Response:
    engine = _state(request).engine
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(400, "send exactly one of text and input_ids", param="text")
    try:
        params = SamplingParams(**body.sampling_params)
    except ValidationError as exc:
        err = _from_validation(exc)
        err.info.param = f"sampling_params.{err.info.param}"
        err.info.message = f"sampling_params.{err.info.message}"
        raise err from exc
    prompt = (
        engine.tokenizer.encode(body.text) if body.text is not None else list(body.input_ids or [])
    )
    _check_lengths(engine, prompt, None, "prompt")
    rid = body.rid or f"gen-{uuid.uuid4().hex}"

    def meta(chunk: GenerationChunk) -> dict[str, Any]:
        return {
            "id": chunk.rid,
            "finish_reason": chunk.finish_reason,
            "prompt_tokens": chunk.prompt_tokens,
            "completion_tokens": chunk.completion_tokens,
            "error": chunk.error,
        }

    async def events(opened: list[_Open]) -> AsyncIterator[str]:
        async for _, chunk in _merged(opened):
            yield _sse(
                {
                    "text": chunk.text,
                    "output_ids": chunk.token_ids,
                    "finished": chunk.finished,
                    "meta_info": meta(chunk),
                }
            )
        yield _DONE

    async def admit_one() -> list[_Open]:
        return [await _admit(engine, 0, prompt, params, rid)]

    def whole(results: list[_Result]) -> dict[str, Any]:
        r = results[0]
        return {"text": r.text, "output_ids": r.token_ids, "meta_info": meta(r.last)}

    return await _stream_or_collect(request, admit_one(), body.stream, events, whole)


# ---------------------------------------------------------------- running it


def _loop_name() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:  # pragma: no cover
        return "asyncio"
    return "uvloop"


def uvicorn_config(app: FastAPI, config: StallfreeConfig, **overrides: Any) -> uvicorn.Config:
    """uvicorn settings for `app`: uvloop, and SIGTERM drains in-flight requests first."""
    options: dict[str, Any] = {
        "host": config.server.host,
        "port": config.server.port,
        "loop": _loop_name(),
        "timeout_graceful_shutdown": config.server.graceful_shutdown_s,
        "log_level": "info",
        "lifespan": "on",
    }
    return uvicorn.Config(app, **(options | overrides))


def serve(config: StallfreeConfig) -> None:
    """Serve until SIGINT/SIGTERM; in-flight requests finish, then the engine drains."""
    app = create_app(config)
    # NOTE: uvicorn re-raises SIGTERM once it has drained; a drained shutdown exits 0 instead
    previous = signal.signal(signal.SIGTERM, _ignore_signal)
    try:
        uvicorn.Server(uvicorn_config(app, config)).run()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _ignore_signal(signum: int, frame: object) -> None:
    return None


@dataclass(slots=True)
class RunningServer:
    """A server running as a task on the current event loop (tests, benchmarks)."""

    server: uvicorn.Server
    task: asyncio.Task[None]
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def start_server(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> RunningServer:
    """Start `app` on `host:port` (0: a free port) in this event loop; returns once it listens."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("server exited during startup")
        await asyncio.sleep(0.01)
    return RunningServer(server, task, host, sock.getsockname()[1])
