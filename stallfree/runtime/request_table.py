"""`RequestTable`: the engine's live requests by id, and every step of a request's life on the
engine's side: `register` (its output stream), `submit` (to the scheduler, rolled back if that
raises), `drain` (its chunks, with its deadline), `expire`, `abort` and `unregister`.

`Engine` and both KV handoffs (runtime/handoff.py) go through it; none of them repeats the
sequence. Used on the engine's loop only.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Iterator

from stallfree.runtime.core import EngineCore
from stallfree.runtime.request.outputs import GenerationChunk
from stallfree.runtime.request.req import FinishReason, Req
from stallfree.runtime.text.output_processor import RequestStream


class RequestTable:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._reqs: dict[str, Req] = {}

    def __contains__(self, rid: object) -> bool:
        return rid in self._reqs

    def __getitem__(self, rid: str) -> Req:
        return self._reqs[rid]

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self) -> Iterator[Req]:
        return iter(list(self._reqs.values()))

    def register(self, req: Req, wake_per_step: bool = True) -> RequestStream:
        """Give `req` its output stream and its id; the scheduler does not know it yet."""
        stream = self.core.output.add(req, wake_per_step)
        self._reqs[req.rid] = req
        self.core.observers.on_request_added(req)
        return stream

    def submit(
        self,
        req: Req,
        wake_per_step: bool = True,
        enqueue: Callable[[Req], None] | None = None,
    ) -> RequestStream:
        """Register `req` and hand it to the scheduler (`enqueue`, by default its waiting
        queue). If that raises, the request is unregistered: its id is free again."""
        stream = self.register(req, wake_per_step)
        try:
            (enqueue or self.core.scheduler.add_request)(req)
        except BaseException:
            self.unregister(req)
            raise
        self.core.loop.notify()
        return stream

    def unregister(self, req: Req) -> None:
        self._reqs.pop(req.rid, None)
        self.core.output.discard(req)

    def abort(
        self, rid: object, reason: FinishReason = FinishReason.ABORT, message: str | None = None
    ) -> bool:
        """Abort a request by id; False if it is unknown or already finished."""
        if not isinstance(rid, str):
            return False  # no request has such an id (and a list would not even hash)
        req = self._reqs.get(rid)
        if req is None or req.finished:
            return False
        self.core.scheduler.abort(req, reason, message)
        self.core.loop.notify()
        return True

    def abort_all(
        self, reason: FinishReason = FinishReason.ABORT, message: str | None = None
    ) -> None:
        """Finish every registered request that is not finished yet."""
        for req in list(self._reqs.values()):
            if not req.finished:
                self.core.scheduler.abort(req, reason, message)

    def expire(self, req: Req, timeout: float) -> None:
        # the reason stays `abort` (front ends map it); the message says it was the deadline
        if not req.finished:
            self.core.scheduler.abort(req, FinishReason.ABORT, f"deadline of {timeout}s exceeded")
            self.core.loop.notify()

    async def drain(
        self, req: Req, stream: RequestStream, timeout: float | None = None
    ) -> AsyncGenerator[GenerationChunk, None]:
        """`req`'s chunks until its last; then (or when the consumer stops early) it is aborted
        if unfinished and unregistered. Past `timeout` seconds it expires."""
        # one timer per request, not a timed wait per chunk
        deadline = (
            None
            if timeout is None
            else asyncio.get_running_loop().call_later(timeout, self.expire, req, timeout)
        )
        try:
            while True:
                chunk = await stream.next_chunk()
                yield chunk
                if chunk.finished:
                    return
        finally:
            if deadline is not None:
                deadline.cancel()
            if not req.finished:
                self.abort(req.rid)
            self.unregister(req)
