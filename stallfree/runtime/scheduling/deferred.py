"""Deferred free: what a finished request held goes back to the pools only once the batches
that may still read it are processed.

NOTE: a request that finishes while batch N-1 is processed may still be read by batch N, which
is already launched; its slot and pages wait here, tagged with the last launched batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from stallfree.runtime.execution.context import BatchContext
from stallfree.runtime.memory.radix_cache import RadixCache, TreeNode
from stallfree.runtime.request.req import Req
from stallfree.runtime.scheduling.alloc import release_req_memory
from stallfree.runtime.scheduling.prefix import cacheable_tokens

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DeferredFrees:
    ctx: BatchContext
    cache: RadixCache | None = None
    # (last batch launched when it was deferred, what waits for that batch)
    frees: list[tuple[int, Req]] = field(default_factory=list)
    unlocks: list[tuple[int, TreeNode]] = field(default_factory=list)
    # finished `hold_kv` requests whose KV a transfer still reads, by id (disaggregation)
    held: dict[str, Req] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.frees or self.unlocks)

    def release_held(self, rid: str) -> bool:
        req = self.held.pop(rid, None)
        if req is None:
            return False
        req.hold_kv = False
        self._release_finished(req)
        return True

    def free_after(self, seq: int, req: Req) -> None:
        self.frees.append((seq, req))

    def unlock_after(self, seq: int, node: TreeNode, processed_seq: int) -> None:
        """Unlock `node` once batch `seq` is processed: now, if it is already."""
        assert self.cache is not None
        if processed_seq >= seq:
            self.cache.unlock(node)
        else:
            self.unlocks.append((seq, node))

    def release_now(self, req: Req, cache_tokens: int) -> TreeNode | None:
        """Return `req`'s slot and pages (the cache may keep `cache_tokens` of them); returns
        the cache node it still locks, if any."""
        ctx = self.ctx
        return release_req_memory(
            ctx.req_to_token_pool, ctx.allocator, self.cache, req, cache_tokens
        )

    def release(self, processed_seq: int, everything: bool = False) -> None:
        """Release what waited for batches up to `processed_seq` (everything: all of it)."""
        if self.unlocks:
            assert self.cache is not None
            still = []
            for tag, node in self.unlocks:
                if everything or tag <= processed_seq:
                    self.cache.unlock(node)
                else:
                    still.append((tag, node))
            self.unlocks = still
        keep = []
        for tag, req in self.frees:
            if everything or tag <= processed_seq:
                self._release_finished(req)
            else:
                keep.append((tag, req))
        self.frees = keep
        if everything:
            for rid in list(self.held):
                self.release_held(rid)

    def _release_finished(self, req: Req) -> None:
        if req.hold_kv and req.req_pool_idx is not None:
            self.held[req.rid] = req  # its KV is readable now: nothing launched writes it
            if req.on_kv_held is not None:
                req.on_kv_held()
            return
        cache = self.cache
        locked = self.release_now(req, cacheable_tokens(req) if cache is not None else 0)
        if locked is not None:
            assert cache is not None
            cache.unlock(locked)
        sparse = self.ctx.sparse
        if sparse is not None:
            try:
                sparse.request_finished(req)
            except Exception as exc:  # a plug-in's bug; the slots are free already
                logger.error("sparse plug-in failed releasing request %s", req.rid, exc_info=exc)
