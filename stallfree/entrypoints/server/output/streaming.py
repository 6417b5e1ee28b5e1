"""Running admitted requests: engine streams merged, collected or sent as Server-Sent Events,
and aborted when the client goes away or the server's grace period runs out.

- Admission is separate from the first token: the engine admits or refuses a request in the
  first step of its generator, so a refusal is a 4xx/503 before any header is sent, and an
  admitted stream sends its headers at once, however long the request then waits in the queue.
- A client that leaves is seen on the ASGI receive channel (`http.disconnect`), never polled.
- One HTTP request may hold several engine requests (a batch of prompts, `n` choices each). Each of those is then
  driven by its own task, and only that task ever touches its generator: leaving early cancels
  the tasks, which aborts the requests, instead of closing generators another task is running.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Message, Receive, Scope, Send

from stallfree.entrypoints.server.base.errors import (
    CONVERSION_ERRORS,
    ENGINE_ERRORS,
    ApiError,
    from_conversion_error,
    from_engine_error,
    internal_error,
    shutting_down,
)
from stallfree.entrypoints.server.base.protocol import ErrorResponse
from stallfree.entrypoints.server.base.state import Lifecycle, request_id, server_state
from stallfree.runtime.engine import Engine
from stallfree.runtime.request.errors import EngineOverloadedError
from stallfree.runtime.request.outputs import GenerationChunk, TokenLogprobs
from stallfree.runtime.request.sampling_params import SamplingParams

logger = logging.getLogger("stallfree.server")
DONE = "data: [DONE]\n\n"
# the line breaks JSON leaves unescaped (it escapes every control character below U+0020):
# clients that split a stream with `str.splitlines` (or JavaScript's line terminators) break
# an event at them, so each is written as its JSON escape, which reads back as the same text
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})
CLIENT_CLOSED_REQUEST = 499


@dataclass(slots=True)
class Context:
    """What running one HTTP request's generation needs from the server."""

    engine: Engine
    lifecycle: Lifecycle
    request_id: str
    retry_after_s: int
    # where the engine requests come from: `Engine.generate`, or a disaggregated role's
    # (prompt ids, params, rid, choice index) -> chunks (entrypoints/server/api/disagg.py)
    source: (
        Callable[[list[int], SamplingParams, str, int], AsyncIterator[GenerationChunk]] | None
    ) = None
    # with tracing on: the tracer, and the request's headers (a `traceparent` continues)
    tracer: Any = None
    headers: Any = None
    lora_name: str | None = None  # the LoRA adapter the request runs under (None: the base)

    @classmethod
    def of(cls, request: Request) -> Context:
        state = server_state(request)
        ctx = cls(state.engine, state.lifecycle, request_id(request), state.limits.retry_after_s)
        if state.tracer is not None:
            ctx.tracer, ctx.headers = state.tracer, request.headers
        return ctx

    def expired_abort(self, chunk: GenerationChunk) -> bool:
        """True for the last chunk of a request the server aborted at its shutdown deadline."""
        return chunk.finish_reason == "abort" and self.lifecycle.expired


@dataclass(slots=True)
class Result:
    """A request run to the end: its whole text and token ids, and its final chunk; with
    logprobs asked for, one entry per token id, and the prompt's (the first None)."""

    text: str
    token_ids: list[int]
    last: GenerationChunk
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


async def _first(gen: AsyncIterator[GenerationChunk]) -> GenerationChunk:
    return await gen.__anext__()


class Generation:
    """The engine requests of one HTTP request (one per prompt and choice), admitted
    together."""

    def __init__(
        self,
        ctx: Context,
        rids: list[str],
        gens: list[AsyncIterator[GenerationChunk]],
        firsts: list[asyncio.Task[GenerationChunk]],
    ) -> None:
        self.ctx = ctx
        self._rids = rids
        self._gens = gens
        # each task runs its generator's first step: admission, then the first chunk
        self._firsts = firsts
        self._drivers: list[asyncio.Task[None]] = []
        # a request that finished, or was never admitted: nothing of it is left to abort
        self._done = [False] * len(rids)
        self._closed = False

    @classmethod
    async def admit(
        cls,
        ctx: Context,
        prompts: Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams],
        rids: list[str],
    ) -> Generation:
        """Admit one engine request per prompt (with its own params, when a list is given),
        or none: a refusal aborts the admitted ones and raises the `ApiError` to answer with."""
        if ctx.lifecycle.expired:
            raise shutting_down()
        engine = ctx.engine
        each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if ctx.tracer is not None:
            ctx.tracer.expect(rids, ctx.headers)
        source = ctx.source
        gens = [
            engine.generate(ids, p, rid, lora_name=ctx.lora_name)
            if source is None
            else source(list(ids), p, rid, i)
            for i, (ids, p, rid) in enumerate(zip(prompts, each, rids, strict=True))
        ]
        firsts = [asyncio.ensure_future(_first(gen)) for gen in gens]
        generation = cls(ctx, rids, gens, firsts)
        ctx.lifecycle.admitted.add(generation)
        # one turn of the loop runs each first step. The engine admits or refuses a
        # request synchronously in it, before it waits for a token.
        await asyncio.sleep(0)
        refusal = None
        for i, first in enumerate(firsts):
            if first.done() and not first.cancelled() and first.exception() is not None:
                generation._done[i] = True  # refused: its id may be another request's
                refusal = refusal or first.exception()
                if ctx.tracer is not None:
                    ctx.tracer.forget([rids[i]])
        if refusal is not None:
            await generation.aclose()
            raise generation._refusal(refusal)
        return generation

    def _refusal(self, exc: BaseException) -> BaseException:
        ctx = self.ctx
        if isinstance(exc, EngineOverloadedError) and not ctx.engine.accepting:
            return shutting_down()
        if isinstance(exc, ENGINE_ERRORS):
            return from_engine_error(exc, ctx.retry_after_s, ctx.request_id)
        if isinstance(exc, CONVERSION_ERRORS):
            return from_conversion_error(exc)
        return exc

    async def stream(self) -> AsyncIterator[tuple[int, GenerationChunk]]:
        """(prompt index, chunk) as they come, until every request has finished. Leaving early
        (break, close, cancellation) aborts the unfinished requests."""
        try:
            if len(self._gens) == 1:
                chunk = await self._firsts[0]
                self._done[0] = chunk.finished
                yield 0, chunk
                if not chunk.finished:
                    async for chunk in self._gens[0]:
                        self._done[0] = chunk.finished
                        yield 0, chunk
                return
            # bounded: a driver waits while the reader is behind, so it stops reading its
            # engine stream, and the engine's backpressure pauses that request (an unbounded
            # queue would hold everything the engine makes for a client that does not read)
            queue: asyncio.Queue[tuple[int, GenerationChunk | Exception]] = asyncio.Queue(
                len(self._gens)
            )
            self._drivers = [
                asyncio.create_task(_drive(i, first, gen, queue))
                for i, (first, gen) in enumerate(zip(self._firsts, self._gens, strict=True))
            ]
            remaining = len(self._gens)
            while remaining:
                index, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                self._done[index] = item.finished
                yield index, item
                remaining -= item.finished
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Abort whatever is unfinished. Never suspends, so it completes even in a cancelled
        task: tasks are cancelled, a generator is closed only while it is parked at a `yield`
        (closing one then runs its cleanup synchronously), and every unfinished request is
        aborted by id as well. (Closing `Engine.generate` at a `yield` leaves the request's
        own cleanup to the generator's finalizer, which may wait for the garbage collector.)"""
        if self._closed:
            return
        self._closed = True
        self.ctx.lifecycle.admitted.discard(self)
        for task in self._drivers:
            task.cancel()
        for first, gen in zip(self._firsts, self._gens, strict=True):
            if not first.done():
                first.cancel()  # the generator runs in it: the cancellation aborts the request
            elif not self._drivers:
                await gen.aclose()  # type: ignore[attr-defined]
        self.abort()

    def names(self) -> tuple[str, ...]:
        return (self.ctx.request_id, *self._rids)

    def abort(self) -> None:
        """Abort the unfinished requests; each stream then ends with its last chunk."""
        for rid, done in zip(self._rids, self._done, strict=True):
            if not done:
                self.ctx.engine.abort(rid)

    async def collect(self) -> list[Result]:
        """Run every request to its end; an engine failure is a 500, a request the shutdown
        deadline cut off is a 503."""
        texts: list[list[str]] = [[] for _ in self._gens]
        results = [Result("", [], GenerationChunk("", [], "")) for _ in self._gens]
        lasts: list[GenerationChunk | None] = [None for _ in self._gens]
        async for index, chunk in self.stream():
            result = results[index]
            texts[index].append(chunk.text)
            result.token_ids.extend(chunk.token_ids)
            if chunk.logprobs is not None:
                if result.logprobs is None:
                    result.logprobs = []
                result.logprobs.extend(chunk.logprobs)
            if chunk.prompt_logprobs is not None:
                result.prompt_logprobs = chunk.prompt_logprobs
            if chunk.finished:
                lasts[index] = chunk
        for text, result, last in zip(texts, results, lasts, strict=True):
            assert last is not None
            if last.finish_reason == "error":
                raise self.failed(last)
            if self.ctx.expired_abort(last):
                raise shutting_down("the server shut down before this request finished")
            result.text = "".join(text)
            result.last = last
        return results

    def failed(self, chunk: GenerationChunk) -> ApiError:
        """The 500 for a request the engine failed; its details go to the log only. An error
        meant for the client (`error_status`) is answered as it is."""
        if chunk.error_status is not None:
            logger.warning("request %s (%s): %s", self.ctx.request_id, chunk.rid, chunk.error)
            client = 400 <= chunk.error_status < 500  # the request's own doing
            return ApiError(
                chunk.error_status,
                chunk.error or "request failed",
                type="invalid_request_error" if client else "server_error",
            )
        logger.error(
            "request %s (%s): generation failed: %s", self.ctx.request_id, chunk.rid, chunk.error
        )
        return internal_error(self.ctx.request_id)

    def ending_event(self, chunk: GenerationChunk) -> str | None:
        """The SSE error event that ends a stream in place of `chunk`, if it must."""
        if not chunk.finished:
            return None
        if chunk.finish_reason == "error":
            return sse(ErrorResponse(error=self.failed(chunk).info))
        if self.ctx.expired_abort(chunk):
            err = shutting_down("the server shut down before this request finished")
            return sse(ErrorResponse(error=err.info))
        return None


async def _drive(
    index: int,
    first: asyncio.Task[GenerationChunk],
    gen: AsyncIterator[GenerationChunk],
    queue: asyncio.Queue[tuple[int, GenerationChunk | Exception]],
) -> None:
    """Run one engine request to its end, passing its chunks on; the only user of `gen`."""
    try:
        chunk = await first
        await queue.put((index, chunk))
        if not chunk.finished:
            async for chunk in gen:
                await queue.put((index, chunk))
    except Exception as exc:
        await queue.put((index, exc))


class _SseResponse(StreamingResponse):
    """An SSE response; on the way out, however it ends, the generation is closed (aborting
    what a client that left mid-stream no longer reads)."""

    def __init__(self, body: AsyncIterator[str], generation: Generation) -> None:
        super().__init__(
            body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._body = body
        self._generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        generation = self._generation

        async def receive_or_abort() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect":
                # abort at once. Starlette also cancels the body's task, but that
                # cancellation can miss a consumer that the engine wakes every step.
                generation.abort()
            return message

        try:
            await super().__call__(scope, receive_or_abort, send)
        finally:
            await self._body.aclose()  # type: ignore[attr-defined]
            await self._generation.aclose()


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One SSE event carrying `payload` as JSON, on one line by every reader's rules: U+0085,
    U+2028 and U+2029 escaped (`_LINE_BREAKS`)."""
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json()
    else:
        data = json.dumps(payload, ensure_ascii=False)
    if not data.isascii():
        data = data.translate(_LINE_BREAKS)
    return f"data: {data}\n\n"


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def respond(
    request: Request,
    generation: Generation,
    stream: bool,
    to_events: Callable[[Generation], AsyncIterator[str]],
    to_body: Callable[[list[Result]], BaseModel | dict[str, Any]],
) -> Response:
    """Answer with the SSE `to_events` (headers go out now) or, once every request has
    finished, with the JSON `to_body`. A client that leaves first gets its requests aborted."""
    if stream:
        return _SseResponse(to_events(generation), generation)
    work = asyncio.ensure_future(generation.collect())
    gone = asyncio.ensure_future(_until_disconnect(request.receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if gone.done():
            generation.abort()
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            await asyncio.wait({work})
    if work.cancelled():
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    body = to_body(work.result())
    return JSONResponse(body.model_dump() if isinstance(body, BaseModel) else body)
