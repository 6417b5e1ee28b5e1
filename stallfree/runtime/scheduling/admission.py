"""Admission: which waiting requests join the next prefill batch, and how much of each.

A `PrefillAdder` holds one round's budget (prefill tokens), the KV tokens free after what the
running requests may still need, the free request slots, the number running, and the batch's
kind (pooling or generation requests: a step never mixes them). Each request it
is offered gets one named outcome; the scheduler acts on it (start the request, stop admitting,
or fail a request that can never fit). Nothing here reads a device tensor or changes a request.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from stallfree.runtime.memory.pool import TokenToKVPoolAllocator
from stallfree.runtime.request.req import Req
from stallfree.runtime.scheduling.alloc import new_pages_needed, pages_for


def reserved_tokens(running: list[Req], new_token_ratio: float) -> int:
    """KV the running requests may still need, scaled by `new_token_ratio`."""
    return math.ceil(sum(r.remaining_outputs() for r in running) * new_token_ratio)


class Admit(enum.Enum):
    ADDED = "added"  # the whole remaining prompt is in this batch
    CHUNKED = "chunked"  # a chunk is in this batch; the request goes on in the next ones
    NO_ROOM = "no_room"  # not now: stop admitting this round
    NEVER_FITS = "never_fits"  # the KV cache can never hold it, even alone


@dataclass(slots=True)
class PrefillAdder:
    allocator: TokenToKVPoolAllocator
    budget: int  # prefill tokens left this round
    free_tokens: int  # KV tokens free after the running requests' reservations
    free_slots: int  # request slots free
    running: int  # requests running, not counting the one being chunked
    max_running: int
    chunk_size: int
    new_token_ratio: float
    reqs: list[Req] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    # the batch's kind: pooling requests (True) or generation ones (False); None until the
    # first request joins. A step holds one kind only (docs/embeddings.md)
    pooling: bool | None = None

    @property
    def page_size(self) -> int:
        return self.allocator.page_size

    def has_room(self) -> bool:
        """Whether another request could join at all (budget, request cap, slots)."""
        return (
            self.budget > 0
            and self.running + len(self.reqs) < self.max_running
            and self.free_slots > 0
        )

    def takes_kind(self, req: Req) -> bool:
        """Whether `req` is of the batch's kind (any kind, while nothing has set it)."""
        return self.pooling is None or self.pooling == (req.pooling is not None)

    def add_chunked(self, req: Req) -> Admit:
        """The next chunk of the request being chunked; it holds its slot already."""
        ext = min(req.fill_len - req.num_computed_tokens, self.chunk_size, self.budget)
        end = req.num_computed_tokens + ext
        cost = new_pages_needed(req, end, self.page_size) * self.page_size
        if cost > self.allocator.available_size():
            return Admit.NO_ROOM
        self._add(req, ext, cost)
        return Admit.ADDED if end == req.fill_len else Admit.CHUNKED

    def try_add(self, req: Req, cached_tokens: int = 0, locked_tokens: int = 0) -> Admit:
        """A waiting request whose first `cached_tokens` the prefix cache serves; admitting it
        locked `locked_tokens` of cached pages, which are no longer evictable."""
        free = self.free_tokens - locked_tokens
        remaining = req.fill_len - cached_tokens
        ext = min(remaining, self.chunk_size, self.budget)
        # at most what the request can ever use: its outputs are capped by the context
        reserve = math.ceil((remaining - ext + req.remaining_outputs()) * self.new_token_ratio)
        pages = pages_for(ext, self.page_size)
        cost = pages * self.page_size + reserve
        if cost > free:
            alone = not self.reqs and self.running == 0
            if alone and self.never_fits(req):
                return Admit.NEVER_FITS
            # alone, it may start on what is free now and grow by retraction later
            if not (alone and pages <= self.allocator.available_pages()):
                return Admit.NO_ROOM
        self.free_tokens = free
        self._add(req, ext, cost)
        self.free_slots -= 1
        return Admit.CHUNKED if ext < remaining else Admit.ADDED

    def never_fits(self, req: Req) -> bool:
        """Its prompt and one output token need more pages than the cache has."""
        return pages_for(req.fill_len + 1, self.page_size) > self.allocator.num_pages

    def _add(self, req: Req, ext: int, cost: int) -> None:
        if self.pooling is None:
            self.pooling = req.pooling is not None
        self.reqs.append(req)
        self.extend_lens.append(ext)
        self.budget -= ext
        self.free_tokens -= cost
