"""Host-side allocation for a batch. Every index is decided here, on the host, then uploaded."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from stallfree.runtime.execution.context import BatchContext
    from stallfree.runtime.memory.pool import ReqToTokenPool, TokenToKVPoolAllocator
    from stallfree.runtime.memory.radix_cache import RadixCache, TreeNode
    from stallfree.runtime.request.req import Req


class KVPoolExhaustedError(RuntimeError):
    """The pool cannot hold what admission promised; a scheduling bug, not a user error."""


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def new_pages_needed(req: Req, end: int, page_size: int) -> int:
    return max(0, pages_for(end, page_size) - len(req.kv_pages))


def alloc_req_slots(pool: ReqToTokenPool, reqs: list[Req]) -> None:
    missing = [r for r in reqs if r.req_pool_idx is None]
    slots = pool.alloc(len(missing))
    if slots is None:
        raise KVPoolExhaustedError(f"no free request slot for {len(missing)} requests")
    for req, slot in zip(missing, slots, strict=True):
        req.req_pool_idx = slot


def token_slots(req: Req, start: int, end: int, page_size: int) -> torch.Tensor:
    pages = torch.tensor(req.kv_pages, dtype=torch.int64)
    pos = torch.arange(start, end, dtype=torch.int64)
    return pages[pos // page_size] * page_size + pos % page_size


def _grow_pages(allocator: TokenToKVPoolAllocator, req: Req, end: int) -> None:
    n = new_pages_needed(req, end, allocator.page_size)
    if n:
        pages = allocator.alloc_pages(n)
        if pages is None:
            raise KVPoolExhaustedError(
                f"KV pool exhausted growing request {req.rid} to {end} tokens"
            )
        req.kv_pages.extend(pages)


def alloc_for_extend(
    ctx: BatchContext, reqs: list[Req], extend_lens: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (out_cache_loc, req_pool_indices_device, req_pool_indices_cpu).

    The CPU tensor is built from the host allocation; the device one is a non-blocking copy.
    The new `req_to_token` entries are written on the stream. A request that gets its slot now
    with a cached prefix (`num_computed_tokens > 0`, its first pages the prefix cache's) also
    gets the prefix's slots written into its row, from the host page table.
    """
    fresh = [r.req_pool_idx is None for r in reqs]
    alloc_req_slots(ctx.req_to_token_pool, reqs)
    page_size = ctx.allocator.page_size
    locs, rows, cols, table_locs = [], [], [], []
    with_prefix = False
    for req, ext, new_slot in zip(reqs, extend_lens, fresh, strict=True):
        assert req.req_pool_idx is not None
        start = req.num_computed_tokens
        _grow_pages(ctx.allocator, req, start + ext)
        loc = token_slots(req, start, start + ext, page_size)
        locs.append(loc)
        first = 0 if new_slot else start  # a new row needs its cached prefix written too
        if first < start:
            with_prefix = True
            table_locs.append(token_slots(req, first, start, page_size))
        table_locs.append(loc)
        rows.append(torch.full((start + ext - first,), req.req_pool_idx, dtype=torch.int64))
        cols.append(torch.arange(first, start + ext, dtype=torch.int64))
    out_cache_loc_cpu = torch.cat(locs) if locs else torch.empty(0, dtype=torch.int64)
    req_pool_indices_cpu = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
    stream = ctx.stream
    out_cache_loc = stream.upload(out_cache_loc_cpu)
    if locs:
        table = stream.upload(torch.cat(table_locs)) if with_prefix else out_cache_loc
        write_req_to_token(
            ctx, stream.upload(torch.cat(rows)), stream.upload(torch.cat(cols)), table
        )
    return out_cache_loc, stream.upload(req_pool_indices_cpu), req_pool_indices_cpu


def decode_pages_needed(seq_lens_cpu: torch.Tensor, page_size: int) -> int:
    """Pages one decode step needs: one per request whose next token starts a page."""
    if page_size == 1:
        return int(seq_lens_cpu.numel())  # every new token starts a page
    return int((seq_lens_cpu % page_size == 0).sum())


def alloc_for_decode(
    ctx: BatchContext,
    reqs: list[Req],
    seq_lens_cpu: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
) -> torch.Tensor:
    """KV slots for one new token per request, at position `seq_lens_cpu` (the length so far).

    `req_pool_indices` and `seq_lens` are the batch's device tensors: the new `req_to_token`
    entries are written at those rows and columns on the stream.
    """
    allocator = ctx.allocator
    page_size = allocator.page_size
    lens: list[int] = seq_lens_cpu.tolist()
    # one allocation for the whole step, in plain ints
    wants = [pages_for(n + 1, page_size) - len(r.kv_pages) for r, n in zip(reqs, lens, strict=True)]
    total = sum(w for w in wants if w > 0)
    if total:
        pages = allocator.alloc_pages(total)
        if pages is None:
            raise KVPoolExhaustedError(f"KV pool exhausted by a decode step needing {total} pages")
        taken = 0
        for req, want in zip(reqs, wants, strict=True):
            if want > 0:
                req.kv_pages.extend(pages[taken : taken + want])
                taken += want
    if page_size == 1:
        locs = [r.kv_pages[n] for r, n in zip(reqs, lens, strict=True)]
    else:
        locs = [
            r.kv_pages[n // page_size] * page_size + n % page_size
            for r, n in zip(reqs, lens, strict=True)
        ]
    out_cache_loc = ctx.stream.upload(torch.tensor(locs, dtype=torch.int64))
    # NOTE: not journaled for worker processes: its columns are the device's lengths, which a
    # worker holds itself (speculation lowers them on its stream), so each worker writes a
    # decode step's entries at its own positions (execution/worker_lengths.py)
    write_req_to_token(ctx, req_pool_indices, seq_lens, out_cache_loc, journal=False)
    return out_cache_loc


def verify_pages_needed(reqs: list[Req], base: list[int], ns: list[int], page_size: int) -> int:
    """Pages a verify step needs: each row's window grown to `base + k + 1` tokens."""
    return sum(
        new_pages_needed(r, b + n, page_size) for r, b, n in zip(reqs, base, ns, strict=True)
    )


def step_pages_needed(
    reqs: list[Req], seq_lens_cpu: torch.Tensor, ks: list[int] | None, page_size: int
) -> int:
    """Pages the next step needs: a decode step (`ks` None), or a verify step of `ks` drafts."""
    if ks is None:
        return decode_pages_needed(seq_lens_cpu, page_size)
    return verify_pages_needed(reqs, seq_lens_cpu.tolist(), [k + 1 for k in ks], page_size)


def alloc_for_verify(
    ctx: BatchContext,
    reqs: list[Req],
    base: list[int],
    ns: list[int],
    req_pool_indices: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """The window of a verify step, decided on the host: each row's pages grow to cover
    `base + n` tokens (`base` its upper bound), and its `req_to_token` row is written for
    positions `base .. base + n - 1`. Earlier windows wrote the positions below, and a
    position's slot never changes while the request holds its pages, so wherever inside the
    window the device's length is, its `n` positions have slots. Returns `out_cache_loc`,
    gathered on the stream at the device's `positions` (flat, by batch `rows`)."""
    page_size = ctx.allocator.page_size
    for req, b, n in zip(reqs, base, ns, strict=True):
        _grow_pages(ctx.allocator, req, b + n)
    if reqs:
        slots = [r.req_pool_idx for r in reqs]
        t_rows = torch.repeat_interleave(torch.tensor(slots, dtype=torch.int64), torch.tensor(ns))
        cols = torch.cat(
            [torch.arange(b, b + n, dtype=torch.int64) for b, n in zip(base, ns, strict=False)]
        )
        locs = torch.cat(
            [token_slots(r, b, b + n, page_size) for r, b, n in zip(reqs, base, ns, strict=True)]
        )
        up = ctx.stream.upload
        write_req_to_token(ctx, up(t_rows), up(cols), up(locs))
    table = ctx.req_to_token_pool.req_to_token
    return ctx.stream.compute(
        lambda rpi, r, p: table[rpi[r], p],
        req_pool_indices,
        rows,
        positions,
        shape=tuple(positions.shape),
        dtype=torch.int64,
    )


def write_history(
    ctx: BatchContext,
    reqs: list[Req],
    prefix_lens: list[int],
    extend_lens: list[int],
    fresh: list[bool],
) -> None:
    """Speculative decoding: an extend step's tokens go into each slot's token history (the
    proposer's input) on the stream; a slot new to its request gets its cached prefix too.
    With worker processes the write travels in the next step message (the workers hold the
    histories)."""
    rows, cols, vals = [], [], []
    for req, prefix, ext, new in zip(reqs, prefix_lens, extend_lens, fresh, strict=True):
        first = 0 if new else prefix
        assert req.req_pool_idx is not None
        rows.append(torch.full((prefix + ext - first,), req.req_pool_idx, dtype=torch.int64))
        cols.append(torch.arange(first, prefix + ext, dtype=torch.int64))
        vals.append(torch.tensor(req.fill_slice(first, prefix + ext), dtype=torch.int64))
    if not rows:
        return
    up = ctx.stream.upload
    r, c, v = up(torch.cat(rows)), up(torch.cat(cols)), up(torch.cat(vals))
    if ctx.import_journal is not None:
        ctx.import_journal.append(("history", r, c, v))
        return
    history = ctx.future_map.history
    assert history is not None

    def write() -> None:
        history[r, c] = v

    ctx.stream.submit(write)


def write_req_to_token(
    ctx: BatchContext,
    rows: torch.Tensor,
    cols: torch.Tensor,
    locs: torch.Tensor,
    journal: bool = True,
) -> None:
    table = ctx.req_to_token_pool.req_to_token

    def write() -> None:
        table[rows, cols] = locs

    ctx.stream.submit(write)
    if journal and ctx.table_journal is not None:
        ctx.table_journal.append((rows, cols, locs))


def free_req_memory(pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator, req: Req) -> None:
    """Return a request's slot and KV pages. Idempotent: overlap may free a request twice.

    Only for a request that holds nothing of the prefix cache (see `release_req_memory`).
    """
    assert req.cache_node is None, "a request with a cached prefix is released by the cache"
    release_req_memory(pool, allocator, None, req, 0)


def release_req_memory(
    pool: ReqToTokenPool,
    allocator: TokenToKVPoolAllocator,
    cache: RadixCache | None,
    req: Req,
    cache_tokens: int,
) -> TreeNode | None:
    """Return the slot and the pages `req` owns; its cached prefix stays with the cache.

    With a cache, the whole pages of its first `cache_tokens` tokens (prompt and outputs) are
    inserted first, so they stay cached; where the tree already held the same tokens under
    other pages, the request's copies are freed. A partial last page is freed. Returns the
    node the request had locked: the caller unlocks it, now or once no launched batch can
    read it. Idempotent.
    """
    if req.req_pool_idx is not None:
        pool.free(req.req_pool_idx)
    pages, shared, node = req.kv_pages, req.cached_pages, req.cache_node
    free = pages[shared:]
    if cache is not None:
        page_size = allocator.page_size
        keep = min(cache_tokens // page_size, len(pages))
        if keep > shared:
            _, tree_pages = cache.insert(
                req.cache_key(req.fill_slice(0, keep * page_size)), pages[:keep]
            )
            free = [
                p
                for p, t in zip(pages[shared:keep], tree_pages[shared:keep], strict=True)
                if p != t
            ]
            free += pages[keep:]
    if free:
        allocator.free_pages(free)
    req.req_pool_idx = None
    req.kv_pages = []
    req.cache_node = None
    req.cached_pages = 0
    return node
