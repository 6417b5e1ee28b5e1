"""A request's KV handed from one engine to another (prefill/decode disaggregation), as the
engine's two sides of it.

- `KVExport` (prefill side): the request runs with one output token and keeps its slot and
  pages when it finishes (`Req.hold_kv`), so its prompt KV can be read, page runs at a time, on
  the stream; `release` frees them as any finished request's (the prefix cache may keep them).
- `KVImport` (decode side): `reserve` takes the slot and pages and writes the `req_to_token`
  row on the host; `write_layer` writes one arriving layer on the stream; `join` stashes the
  first token and joins the decode batch, then streams the request's chunks; `cancel` gives
  everything back if it never joins.

Both are built by `Engine.open_export` / `Engine.open_import` and used on the engine's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

import torch

from stallfree.runtime.request.errors import EngineUnhealthyError, InvalidRequestError
from stallfree.runtime.request.outputs import GenerationChunk
from stallfree.runtime.request.req import FinishReason, Req
from stallfree.runtime.request_table import RequestTable
from stallfree.runtime.scheduling.kv_import import PageRun, run_slots, write_import_layer
from stallfree.runtime.text.output_processor import RequestStream

# how long a finished prefill may take to reach its held state (the batches that may still
# read it are processed first): a bound on a wait that normally lasts one step
HOLD_WAIT_S = 60.0


# (first page, pages) runs and the KV-head range [h0, h1) of each destination rank
HeadRange = tuple[int, int]


class KVExport:
    """Prefill side: run the prompt for its first token and hold its KV for the transfer."""

    def __init__(self, requests: RequestTable, req: Req) -> None:
        self.requests, self.core, self.req = requests, requests.core, req
        self._held = asyncio.Event()
        req.hold_kv = True
        req.on_kv_held = self._held.set
        self._released = False
        self.token_ids: list[int] = []  # what the prefill sampled (one token)

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def pages(self) -> list[int]:
        return list(self.req.kv_pages)

    @property
    def num_tokens(self) -> int:
        return len(self.req.origin_input_ids)

    async def run(self) -> GenerationChunk:
        """Prefill the prompt; returns the last chunk (its one token) once the KV is held.
        A request that fails or is aborted returns its failing chunk, and holds nothing."""
        req = self.req
        stream = self.requests.submit(req, wake_per_step=False)
        last: GenerationChunk | None = None
        try:
            async with contextlib.aclosing(self.requests.drain(req, stream)) as chunks:
                async for chunk in chunks:
                    self.token_ids.extend(chunk.token_ids)
                    last = chunk
            assert last is not None
            if last.finish_reason in (FinishReason.STOP.value, FinishReason.LENGTH.value):
                await asyncio.wait_for(self._held.wait(), HOLD_WAIT_S)
            else:
                self.release()
        except BaseException:
            self.release()  # nothing will read it: freed as soon as nothing launched reads it
            raise
        return last

    @property
    def held(self) -> bool:
        return self._held.is_set() and not self._released

    async def read(
        self, runs: Sequence[PageRun], shards: Sequence[HeadRange]
    ) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """The held KV of the pages in `runs`, per layer and per destination rank: host tensors
        `[pages * page_size, h1 - h0, head_dim]`, read on the stream (one slice copy per run
        and layer), awaited without blocking the loop."""
        if not self.held:
            raise RuntimeError(f"{self.rid}: its KV is not held")
        ctx = self.core.ctx
        stream, cache = ctx.stream, ctx.kv_cache
        slices = run_slots(runs, ctx.allocator.page_size)
        n = sum(s.stop - s.start for s in slices)
        dim = cache.row_width  # stored rows: a quantized row carries its scale along
        out = [
            [
                (
                    stream.host_buffer((n, h1 - h0, dim), cache.dtype),
                    stream.host_buffer((n, h1 - h0, dim), cache.dtype),
                )
                for h0, h1 in shards
            ]
            for _ in range(cache.shape.num_layers)
        ]

        def gather() -> None:
            for layer, per_rank in enumerate(out):
                k = torch.cat([cache.k_buffers[layer][s] for s in slices])
                v = torch.cat([cache.v_buffers[layer][s] for s in slices])
                for (h0, h1), (k_out, v_out) in zip(shards, per_rank, strict=True):
                    k_out.copy_(k[:, h0:h1], non_blocking=True)
                    v_out.copy_(v[:, h0:h1], non_blocking=True)

        stream.submit(gather)
        await stream.record_event().wait()
        return out

    def release(self) -> None:
        """Free the held slot and pages (idempotent); before it is held, it will not be."""
        if self._released:
            return
        self._released = True
        self._held.set()  # wakes a `run` still waiting for the hold
        req = self.req
        req.hold_kv = False
        if self.core.scheduler.release_held(req.rid):
            self.core.loop.notify()


class KVImport:
    """Decode side: a request whose prompt KV arrives from a prefill server."""

    def __init__(self, requests: RequestTable, req: Req) -> None:
        self.requests, self.core, self.req = requests, requests.core, req
        self._stream: RequestStream | None = requests.register(req)
        self.reserved = False
        self.joined = False

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def pages(self) -> list[int]:
        return list(self.req.kv_pages)

    @property
    def page_size(self) -> int:
        return self.core.ctx.allocator.page_size

    def reserve(self) -> bool:
        """The slot, the prompt's pages and the `req_to_token` row; False when there is no
        room now (try again later)."""
        if self.req.finished:
            raise EngineUnhealthyError(self.req.finish_message or "request finished")
        self.reserved = self.core.scheduler.reserve_import(self.req)
        return self.reserved

    def write_layer(
        self,
        layer: int,
        runs: Sequence[PageRun],
        k_shards: Sequence[torch.Tensor],
        v_shards: Sequence[torch.Tensor],
    ) -> None:
        """One arriving layer, for runs of this request's own pages (checked)."""
        own = set(self.req.kv_pages)
        if not self.reserved or any(p + i not in own for p, n in runs for i in range(n)):
            raise InvalidRequestError(f"{self.rid}: KV for pages it does not hold")
        write_import_layer(self.core.ctx, layer, runs, k_shards, v_shards)

    async def join(self, first_token_id: int) -> AsyncIterator[GenerationChunk]:
        """Stash the first token, join the decode batch and stream the request's chunks
        (the first is the prefill's token). Cancelling the consumer aborts the request."""
        core, req, stream = self.core, self.req, self._stream
        if not 0 <= first_token_id < core.arch.vocab_size:
            raise InvalidRequestError(f"first token {first_token_id} is not in the vocabulary")
        if req.finished or stream is None:
            raise EngineUnhealthyError(req.finish_message or "request finished before it joined")
        core.scheduler.join_import(req, first_token_id)
        self.joined = True
        core.loop.notify()
        self._stream = None
        async with contextlib.aclosing(self.requests.drain(req, stream)) as chunks:
            async for chunk in chunks:
                yield chunk

    def cancel(self) -> None:
        """Give back what it holds, if it never joined (idempotent)."""
        if self.joined:
            return
        self.core.scheduler.cancel_import(self.req)
        if self._stream is not None:
            self._stream = None
            self.requests.unregister(self.req)
        self.core.loop.notify()
