"""Output processing: incremental detokenisation, stop strings and chunk assembly.

The scheduler hands each accepted token to `OutputProcessor.on_token`, which says whether a stop
string ended; a finished request's last chunk comes from `on_finish`. Nothing here touches a
device tensor or the scheduler's state.

A consumer reads its request's `RequestStream`. Tokens that arrive before the consumer reads
are merged into one chunk, so a consumer wakes at most once per step however many requests the
step served, and one that only wants the result (`Engine.complete`) wakes once, at the end.
Without stop strings the text is decoded when the consumer reads, not per token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from stallfree.runtime.request.outputs import GenerationChunk, TokenLogprobs
from stallfree.runtime.request.req import Req
from stallfree.runtime.telemetry.observer import EngineObserver
from stallfree.runtime.text.detokenizer import Detokenizer
from stallfree.runtime.text.tokenizer import Tokenizer


def find_stop(text: str, stops: list[str], start: int) -> int | None:
    """Earliest index of a stop string in `text` that ends in the new text `text[start:]`."""
    best: int | None = None
    for s in stops:
        idx = text.find(s, max(0, start - len(s) + 1))
        if idx != -1 and (best is None or idx < best):
            best = idx
    return best


@dataclass(slots=True, eq=False)
class RequestStream:
    """What one request has produced and its consumer has not read yet."""

    req: Req
    detok: Detokenizer
    stops: list[str]
    longest_stop: int
    wake_per_step: bool  # False: wake the consumer only when the request finishes
    ids: list[int] = field(default_factory=list)  # accepted, not yet read
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # for `ids`, when asked for
    sent_prompt_logprobs: bool = False
    undecoded: list[int] = field(default_factory=list)  # not yet run through `detok`
    text: list[str] = field(default_factory=list)  # decoded, not yet read
    # with stop strings, decoded text that might begin one is held back here; it is
    # bounded by the longest stop string, so the work per token does not grow with the output.
    held: str = ""
    stop_at: int | None = None  # index into `held` where a stop string begins
    finished: bool = False
    read_final: bool = False
    waiter: asyncio.Future[None] | None = None
    on_read: Callable[[], None] | None = None  # a paused request's reader caught up

    def _ready(self) -> bool:
        if self.finished:
            return not self.read_final
        return bool(self.ids) and self.wake_per_step

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done() and self._ready():
            waiter.set_result(None)

    async def next_chunk(self) -> GenerationChunk:
        """The tokens and text since the last read; waits until there is something to read."""
        while not self._ready():
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self._take()

    def _take(self) -> GenerationChunk:
        req = self.req
        if self.undecoded:
            self.text.append(self.detok.step(self.undecoded))
            self.undecoded = []
        final = self.finished
        if final:
            self.read_final = True
            self.text.append(self._tail())
        ids, self.ids = self.ids, []
        if req.paused and self.on_read is not None:
            self.on_read()  # the scheduler resumes it
        text = "".join(self.text)
        self.text = []
        params = req.sampling_params
        logprobs = None
        if params.logprobs is not None:
            logprobs, self.logprobs = self.logprobs, []
        prompt_logprobs: list[TokenLogprobs | None] | None = None
        if params.prompt_logprobs is not None and not self.sent_prompt_logprobs:
            self.sent_prompt_logprobs = True
            prompt_logprobs = [None, *req.prompt_logprobs]
        return GenerationChunk(
            rid=req.rid,
            token_ids=ids,
            text=text,
            finished=final,
            finish_reason=req.finished_reason.value if final and req.finished_reason else None,
            prompt_tokens=len(req.origin_input_ids),
            completion_tokens=len(req.output_ids),
            error=req.finish_message if final else None,
            error_status=req.error_status if final else None,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            cached_tokens=req.cached_tokens,
        )

    def _tail(self) -> str:
        if self.stop_at is not None:
            return self.held[: self.stop_at]
        return self.held + self.detok.flush()


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, observer: EngineObserver) -> None:
        self.tokenizer = tokenizer
        self.observer = observer
        self._streams: dict[Req, RequestStream] = {}
        self.on_read: Callable[[], None] | None = None  # wakes the scheduler (backpressure)
        # backpressure: streaming requests whose unread tokens reached `unread_bound`, so the
        # scheduler looks at these, not at every running request, each step (may hold stale
        # entries: readers that caught up since; `unread` says)
        self.unread_bound: int | None = None
        self.behind: set[Req] = set()

    def unread(self, req: Req) -> int:
        """Tokens a streaming consumer has not read yet; 0 for one that reads only the end
        (`wake_per_step=False`: its output is the result it waits for)."""
        stream = self._streams.get(req)
        if stream is None or not stream.wake_per_step:
            return 0
        return len(stream.ids)

    def add(self, req: Req, wake_per_step: bool = True) -> RequestStream:
        """Start collecting `req`'s output. `wake_per_step=False` wakes only at the end."""
        params = req.sampling_params
        stops = list(params.stop)
        detok = self.tokenizer.detokenizer(
            req.origin_input_ids,
            params.skip_special_tokens,
            params.spaces_between_special_tokens,
        )
        stream = RequestStream(
            req=req,
            detok=detok,
            stops=stops,
            longest_stop=max((len(s) for s in stops), default=0),
            wake_per_step=wake_per_step,
            on_read=self.on_read,
        )
        self._streams[req] = stream
        return stream

    def discard(self, req: Req) -> None:
        """The consumer is gone; drop what is held for it."""
        self._streams.pop(req, None)
        self.behind.discard(req)

    def held_text_len(self, req: Req) -> int:
        """Characters decoded but held back for stop strings."""
        stream = self._streams.get(req)
        return len(stream.held) if stream is not None else 0

    def on_token(
        self, req: Req, tok: int, now: float, logprobs: TokenLogprobs | None = None
    ) -> bool:
        """Take one accepted token. Returns True when a stop string ended in it."""
        self.observer.on_tokens(req, 1, now)
        stream = self._streams.get(req)
        if stream is None:
            return False
        stream.ids.append(tok)
        bound = self.unread_bound
        if bound is not None and len(stream.ids) >= bound and stream.wake_per_step:
            self.behind.add(req)
        if logprobs is not None:
            stream.logprobs.append(logprobs)
        if not stream.stops:
            stream.undecoded.append(tok)
            stream.wake()
            return False
        delta = stream.detok.step([tok])
        # a stop string ending in `delta` starts inside `held`, which holds back enough text
        stream.held += delta
        idx = None
        if len(req.output_ids) >= req.sampling_params.min_tokens:
            idx = find_stop(stream.held, stream.stops, len(stream.held) - len(delta))
        if idx is not None:
            if req.sampling_params.include_stop_str_in_output:
                # through the end of the stop string found there (the first listed, as vLLM)
                idx += next(len(s) for s in stream.stops if stream.held.startswith(s, idx))
            stream.stop_at = idx
            return True
        safe = len(stream.held) - (stream.longest_stop - 1)
        if safe > 0:
            stream.text.append(stream.held[:safe])
            stream.held = stream.held[safe:]
        stream.wake()
        return False

    def on_finish(self, req: Req) -> None:
        """The request is done: its consumer reads the rest and the reason."""
        self.observer.on_request_finished(req, time.perf_counter())
        stream = self._streams.get(req)
        if stream is None:
            return
        stream.finished = True
        stream.wake()
