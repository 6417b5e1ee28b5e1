"""KV import (decode-side disaggregation): requests whose prompt KV was computed elsewhere.

`KVImports` owns the importing requests: one whose KV is on its way holds its slot and pages
(`reserve`), counts against admission like a running request, and cannot be retracted (it is
in no batch) until it joins the decode batch with its first token (`take`, then
`Scheduler.join_import`). The import itself comes in two steps:

1. `reserve_import`, on the host: a request slot and the prompt's pages, and the slot's
   `req_to_token` row, exactly as any other allocation (the host is authoritative).
2. On the stream: `write_import_layer` writes one layer's arriving pages into the KV cache, in
   runs of pages; `stash_first_token` puts the token the prefill sampled in the future map, so
   the request's first decode step resolves it like any other.

Then the request joins the decode batch through `prepare_for_import`. With worker processes the
layer writes and the stash are journaled (`BatchContext.import_journal`), and the next step
message carries them: each rank writes its own KV-head shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from stallfree.runtime.execution.context import BatchContext
from stallfree.runtime.request.errors import EngineOverloadedError, InvalidRequestError
from stallfree.runtime.request.req import FinishReason, Req, ReqStatus
from stallfree.runtime.scheduling.alloc import (
    free_req_memory,
    pages_for,
    token_slots,
    write_req_to_token,
)
from stallfree.runtime.scheduling.schedule_batch import ScheduleBatch

# a run of pages: (first page, number of pages), contiguous in the pool
PageRun = tuple[int, int]


def check_importable(ctx: BatchContext) -> None:
    if ctx.sparse is not None:
        raise InvalidRequestError("KV import is not supported with sparse attention")


def reserve_import(ctx: BatchContext, req: Req) -> bool:
    """Give `req` a slot and the pages of its prompt and write its `req_to_token` row. False,
    holding nothing, when there is no room now."""
    check_importable(ctx)
    n = len(req.origin_input_ids)
    allocator, pool = ctx.allocator, ctx.req_to_token_pool
    slots = pool.alloc(1)
    pages = allocator.alloc_pages(pages_for(n, allocator.page_size)) if slots else None
    if slots is None or pages is None:
        if slots is not None:
            pool.free(slots[0])
        return False
    req.req_pool_idx, req.kv_pages = slots[0], pages
    req.num_computed_tokens = n
    up = ctx.stream.upload
    row = torch.full((n,), slots[0], dtype=torch.int64)
    cols = torch.arange(n, dtype=torch.int64)
    write_req_to_token(ctx, up(row), up(cols), up(token_slots(req, 0, n, allocator.page_size)))
    return True


def release_import(ctx: BatchContext, req: Req) -> None:
    """Give back a reserved request that never joined. Its slot and pages are free at once:
    nothing launched reads them, and the stream runs the writes already submitted to them
    before any later owner's."""
    free_req_memory(ctx.req_to_token_pool, ctx.allocator, req)


def run_slots(runs: Sequence[PageRun], page_size: int) -> list[slice]:
    """The KV slots of each run of pages, as slices of the pool."""
    return [slice(p * page_size, (p + n) * page_size) for p, n in runs]


def write_import_layer(
    ctx: BatchContext,
    layer: int,
    runs: Sequence[PageRun],
    k_shards: Sequence[torch.Tensor],
    v_shards: Sequence[torch.Tensor],
) -> None:
    """Write one layer's KV for the pages in `runs` (the runs' pages back to back, whole pages:
    `[sum(n) * page_size, heads, head_dim]`, one tensor per tensor-parallel rank)."""
    slices = run_slots(runs, ctx.allocator.page_size)
    journal = ctx.import_journal
    if journal is not None:  # worker processes: the next step message carries them
        journal.append(("kv", layer, slices, list(k_shards), list(v_shards)))
        return
    (k,), (v,) = k_shards, v_shards
    stream = ctx.stream
    k_dev, v_dev = stream.upload(k), stream.upload(v)
    cache = ctx.kv_cache
    stream.submit(_write_runs, cache.k_buffers[layer], cache.v_buffers[layer], slices, k_dev, v_dev)


def _write_runs(
    k_buf: torch.Tensor, v_buf: torch.Tensor, slices: list[slice], k: torch.Tensor, v: torch.Tensor
) -> None:
    """Runs on the stream: each run's slots, one slice copy each."""
    at = 0
    for s in slices:
        n = s.stop - s.start
        k_buf[s].copy_(k[at : at + n])
        v_buf[s].copy_(v[at : at + n])
        at += n


def stash_first_token(ctx: BatchContext, req: Req, token_id: int) -> None:
    """The prefill's sampled token, into the future map at the request's slot (on the stream)."""
    assert req.req_pool_idx is not None
    stream = ctx.stream
    slot = torch.tensor([req.req_pool_idx], dtype=torch.int64)
    tok = torch.tensor([token_id], dtype=torch.int64)
    if ctx.import_journal is not None:
        ctx.import_journal.append(("stash", slot, tok))
    first_row = stream.upload(torch.zeros(1, dtype=torch.int64))
    stream.submit(ctx.future_map.stash, stream.upload(slot), first_row, stream.upload(tok))


def import_kv(
    ctx: BatchContext,
    req: Req,
    kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
    first_token_id: int,
) -> None:
    """All at once (`Engine.generate_imported`): reserve, write every layer, stash the token.

    `kv[layer]` is (k, v), each [len(prompt), num_kv_heads, head_dim] with RoPE applied, as
    `RequestValidator.check_import` checked it. Raises `EngineOverloadedError`, holding
    nothing, when there is no room.
    """
    check_importable(ctx)
    if ctx.table_journal is not None:
        raise InvalidRequestError(
            "whole-tensor KV import is not supported with worker processes "
            "(runtime.worker=process or parallel.tp_size > 1); disaggregated decode is"
        )
    if not reserve_import(ctx, req):
        raise EngineOverloadedError("no room to import the KV")
    n, ps = len(req.origin_input_ids), ctx.allocator.page_size
    runs = [(p, 1) for p in req.kv_pages]
    padded = len(req.kv_pages) * ps
    for layer, (k, v) in enumerate(kv):
        k_pad = torch.zeros((padded, *k.shape[1:]), dtype=ctx.kv_cache.dtype)
        v_pad = torch.zeros_like(k_pad)
        k_pad[:n], v_pad[:n] = k.detach().cpu(), v.detach().cpu()
        write_import_layer(ctx, layer, runs, [k_pad], [v_pad])
    if ctx.spec_k:
        _import_history(ctx, req, [*req.origin_input_ids, first_token_id])
    stash_first_token(ctx, req, first_token_id)


def _import_history(ctx: BatchContext, req: Req, tokens: list[int]) -> None:
    """Speculative decoding: an imported request's history is its prompt and first token; its
    first verify step carries no drafts (whatever the slot's last user left is cleared)."""
    fmap = ctx.future_map
    history, drafts = fmap.history, fmap.drafts
    assert history is not None and drafts is not None and req.req_pool_idx is not None
    row = req.req_pool_idx
    vals = ctx.stream.upload(torch.tensor(tokens, dtype=torch.int64))

    def write() -> None:
        history[row, : len(tokens)] = vals
        drafts[row] = -1

    ctx.stream.submit(write)


@dataclass(slots=True)
class KVImports:
    """The requests whose KV is being imported, by id."""

    ctx: BatchContext
    importing: dict[str, Req] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.importing)

    def reqs(self) -> list[Req]:
        return list(self.importing.values())

    def forget(self, req: Req) -> None:
        """`req` is finishing where it is: its memory goes with the finish."""
        self.importing.pop(req.rid, None)

    def clear(self) -> None:
        self.importing.clear()

    def reserve(self, req: Req) -> bool:
        """A slot, the prompt's pages and the `req_to_token` row for a request whose KV is
        coming. False, holding nothing, when there is no room now."""
        if not reserve_import(self.ctx, req):
            return False
        self.importing[req.rid] = req
        req.status = ReqStatus.RUNNING  # in no queue: an abort finishes it where it is
        return True

    def cancel(self, req: Req) -> None:
        """An importing request that will not join (its transfer failed, or it was aborted)."""
        if self.importing.pop(req.rid, None) is not None:
            if not req.finished:
                req.finish(FinishReason.ABORT, "KV import cancelled")
            release_import(self.ctx, req)

    def add(
        self, req: Req, kv: Sequence[tuple[torch.Tensor, torch.Tensor]], first_token_id: int
    ) -> ScheduleBatch:
        """All at once (`Engine.generate_imported`): import `kv` (checked already) and the
        first token; returns the request's batch, to join. Raises with nothing left behind."""
        req.check_grammar()
        import_kv(self.ctx, req, kv, first_token_id)
        self.importing[req.rid] = req
        return self.take(req, first_token_id, stash=False)

    def take(self, req: Req, first_token_id: int, stash: bool = True) -> ScheduleBatch:
        """An importing request whose KV is written (or submitted to the stream): stash its
        first token and build its one-row batch through `prepare_for_import`, its slot and
        length taken from host facts; it is importing no more. Raises with nothing left
        behind if it cannot join."""
        assert self.importing.get(req.rid) is req, f"{req.rid} is not importing"
        try:
            if stash:
                stash_first_token(self.ctx, req, first_token_id)
            batch = ScheduleBatch.init_new([req], self.ctx)
            batch.prepare_for_import()
            del self.importing[req.rid]
            return batch
        except BaseException:
            self.fail(req)
            raise

    def fail(self, req: Req) -> None:
        """`req` could not join: it fails, and what it holds is free at once."""
        self.importing.pop(req.rid, None)
        if not req.finished:
            req.finish(FinishReason.ERROR, "KV import failed")
            # NOTE: nothing launched reads these fresh slots: free at once
            release_import(self.ctx, req)
