"""Output processing: incremental detokenisation, stop strings and chunk assembly.

The scheduler hands each accepted token to `OutputProcessor.on_token`, which says whether a stop
string ended; a finished request's last chunk comes from `on_finish`. Consumers read chunks from
the request's queue. Nothing here touches a device tensor or the scheduler's state.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from stallfree.runtime.observer import EngineObserver
from stallfree.runtime.req import Req
from stallfree.runtime.tokenizer import Detokenizer, Tokenizer, find_stop


@dataclass(slots=True)
class GenerationChunk:
    rid: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@dataclass(slots=True)
class GenerationResult:
    rid: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None


@dataclass(slots=True, eq=False)
class _RequestOutput:
    queue: asyncio.Queue[GenerationChunk]
    detok: Detokenizer
    stops: list[str]
    longest_stop: int
    # NOTE: only text not yet streamed is kept (bounded by the longest stop string), so the
    # work per token does not grow with the output.
    pending: str = ""
    held_ids: list[int] = field(default_factory=list)
    stop_at: int | None = None  # index into `pending` where a stop string begins


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, observer: EngineObserver) -> None:
        self.tokenizer = tokenizer
        self.observer = observer
        self._outputs: dict[Req, _RequestOutput] = {}

    def add(self, req: Req) -> asyncio.Queue[GenerationChunk]:
        """Start streaming `req`; its chunks arrive on the returned queue."""
        stops = list(req.sampling_params.stop)
        out = _RequestOutput(
            queue=asyncio.Queue(),
            detok=self.tokenizer.detokenizer(req.origin_input_ids),
            stops=stops,
            longest_stop=max((len(s) for s in stops), default=0),
        )
        self._outputs[req] = out
        return out.queue

    def discard(self, req: Req) -> None:
        """The consumer is gone; drop what is held for it."""
        self._outputs.pop(req, None)

    def held_text_len(self, req: Req) -> int:
        """Characters decoded but not yet streamed (held back for stop strings)."""
        out = self._outputs.get(req)
        return len(out.pending) if out is not None else 0

    def on_token(self, req: Req, tok: int) -> bool:
        """Decode and stream one accepted token. Returns True when a stop string ended in it."""
        self.observer.on_tokens(req, 1, time.perf_counter())
        out = self._outputs.get(req)
        if out is None:
            return False
        delta = out.detok.step([tok])
        out.held_ids.append(tok)
        if not out.stops:
            self._push(req, out, delta)
            return False
        # a stop string ending in `delta` starts inside `pending`, which holds back enough text
        out.pending += delta
        idx = find_stop(out.pending, out.stops, len(out.pending) - len(delta))
        if idx is not None:
            out.stop_at = idx
            return True
        safe = len(out.pending) - (out.longest_stop - 1)
        if safe > 0:
            self._push(req, out, out.pending[:safe])
            out.pending = out.pending[safe:]
        return False

    def on_finish(self, req: Req) -> None:
        """Stream the request's last chunk: held text up to a stop string, and the reason."""
        self.observer.on_request_finished(req, time.perf_counter())
        out = self._outputs.get(req)
        if out is None:
            return
        if out.stop_at is not None:
            tail = out.pending[: out.stop_at]
        else:
            tail = out.pending + out.detok.flush()
        out.pending = ""
        self._push(req, out, tail, final=True)

    def _push(self, req: Req, out: _RequestOutput, text: str, final: bool = False) -> None:
        ids, out.held_ids = out.held_ids, []
        out.queue.put_nowait(
            GenerationChunk(
                rid=req.rid,
                token_ids=ids,
                text=text,
                finished=final,
                finish_reason=req.finished_reason.value if final and req.finished_reason else None,
                prompt_tokens=len(req.origin_input_ids),
                completion_tokens=len(req.output_ids),
                error=req.finish_message if final else None,
            )
        )
