"""Running admitted requests: engine streams merged, collected or sent as Server-Sent Events,
and aborted when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from stallfree.entrypoints.server.errors import ENGINE_ERRORS, ApiError, from_engine_error
from stallfree.entrypoints.server.protocol import ErrorInfo, ErrorResponse
from stallfree.runtime.engine import Engine
from stallfree.runtime.output_processor import GenerationChunk
from stallfree.runtime.sampling_params import SamplingParams

T = TypeVar("T")
_DISCONNECT_POLL_S = 0.25
DONE = "data: [DONE]\n\n"


class _ClientGone(Exception):
    """The client disconnected before a non-streaming answer was ready."""


@dataclass(slots=True)
class Opened:
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


@dataclass(slots=True)
class Result:
    """A request run to the end: its whole text and token ids, and its final chunk."""

    text: str
    token_ids: list[int]
    last: GenerationChunk


async def admit(
    engine: Engine, index: int, ids: list[int], params: SamplingParams, rid: str
) -> Opened:
    gen = engine.generate(ids, params, rid)
    try:
        # NOTE: read the first chunk before any header is sent, so admission errors get a 4xx.
        first = await gen.__anext__()
    except ENGINE_ERRORS as exc:
        raise from_engine_error(exc) from exc
    return Opened(index, gen, first)


async def open_all(
    engine: Engine, prompts: list[list[int]], params: SamplingParams, rid: str
) -> list[Opened]:
    """Admit one request per prompt; if any is refused, the admitted ones are aborted."""
    results = await asyncio.gather(
        *(admit(engine, i, ids, params, f"{rid}-{i}") for i, ids in enumerate(prompts)),
        return_exceptions=True,
    )
    opened = [r for r in results if isinstance(r, Opened)]
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    if failure is not None:
        for o in opened:
            await o.close()
        raise failure
    return opened


async def merged(opened: list[Opened]) -> AsyncIterator[tuple[int, GenerationChunk]]:
    """Chunks of several requests as they come; closing it aborts whatever is unfinished."""
    if len(opened) == 1:
        try:
            async for chunk in opened[0].chunks():
                yield 0, chunk
        finally:
            await opened[0].close()
        return
    queue: asyncio.Queue[tuple[int, GenerationChunk]] = asyncio.Queue()

    async def pump(o: Opened) -> None:
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


async def _collect(opened: list[Opened]) -> list[Result]:
    texts: list[list[str]] = [[] for _ in opened]
    ids: list[list[int]] = [[] for _ in opened]
    lasts: list[GenerationChunk | None] = [None for _ in opened]
    async for index, chunk in merged(opened):
        texts[index].append(chunk.text)
        ids[index].extend(chunk.token_ids)
        if chunk.finished:
            lasts[index] = chunk
    results = []
    for text, token_ids, last in zip(texts, ids, lasts, strict=True):
        assert last is not None
        if last.error is not None and last.finish_reason == "error":
            raise ApiError(500, f"generation failed: {last.error}", type="internal_error")
        results.append(Result("".join(text), token_ids, last))
    return results


class _SseResponse(StreamingResponse):
    """Closes its body on the way out, so a client that left mid-stream aborts its request."""

    def __init__(self, body: AsyncIterator[str], opened: list[Opened]) -> None:
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


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One SSE event carrying `payload` as JSON."""
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json()
    else:
        data = json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def error_event(chunk: GenerationChunk) -> str:
    """The event that ends a stream whose generation failed."""
    info = ErrorInfo(message=f"generation failed: {chunk.error}", type="internal_error")
    return sse(ErrorResponse(error=info))


async def stream_or_collect(
    request: Request,
    opened_work: Awaitable[list[Opened]],
    stream: bool,
    to_events: Callable[[list[Opened]], AsyncIterator[str]],
    to_body: Callable[[list[Result]], BaseModel | dict[str, Any]],
) -> Response:
    """Admit (`opened_work`), then answer with the SSE `to_events` or the JSON `to_body`; a
    client that leaves before the answer is ready gets a 499 and its requests are aborted."""
    try:
        opened = await _unless_disconnected(request, opened_work)
        if stream:
            return _SseResponse(to_events(opened), opened)
        results = await _unless_disconnected(request, _collect(opened))
    except _ClientGone:
        return Response(status_code=499)
    body = to_body(results)
    return JSONResponse(body.model_dump() if isinstance(body, BaseModel) else body)
