"""The scheduler's use of the prefix cache: matching a waiting request, deferring it behind a
prefill that will cache what it shares, longest-prefix ordering, and what the cache takes once
a batch is processed or a request is released. Host state only."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from stallfree.runtime.memory.radix_cache import RadixCache, TreeNode
from stallfree.runtime.request.req import FinishReason, Req

# A waiting request that shares at least this many more tokens with a prefill in flight (or in
# the batch being built) than with the cache waits until that prefill is cached, rather than
# compute the same tokens again.
DEFER_SHARED_TOKENS = 32
# lpm sorts the waiting queue by cached prefix; past this many waiting it falls back to fcfs.
LPM_MAX_QUEUE = 128

# per launched extend batch: (request, its length after the batch, its retraction count)
CacheRecord = tuple[Req, int, int]


@dataclass(slots=True)
class PrefixMatch:
    """A waiting request's cached prefix: its pages, the node they end at, how many tokens they
    hold, and how many pages admitting it locked."""

    pages: list[int] = field(default_factory=list)
    node: TreeNode | None = None
    tokens: int = 0
    locked: int = 0

    def start(self, req: Req) -> None:
        """Admitted: `req` starts after its cached prefix, holding those pages."""
        req.cached_tokens = self.tokens
        if self.pages:
            req.kv_pages = self.pages
            req.cache_node = self.node
            req.cached_pages = len(self.pages)
            req.num_computed_tokens = self.tokens


def _tokens(req: Req, n: int) -> list[int]:
    """A list whose first `n` tokens are `req`'s prompt and outputs (no copy when it can)."""
    return req.origin_input_ids if n <= len(req.origin_input_ids) else req.fill_slice(0, n)


def matchable(req: Req) -> list[int]:
    """The tokens a cached prefix may cover: all but the last, whose logits are needed."""
    return req.cache_key(req.fill_slice(0, req.fill_len - 1))


def shares_with_prefill(
    req: Req, cached: int, page_size: int, prefills: Iterable[tuple[Req, int]]
) -> bool:
    """Whether `req` shares `DEFER_SHARED_TOKENS` more tokens than `cached` with one of
    `prefills` (request, length once its batch is processed), in flight or in this batch: their
    pages reach the cache once that batch is processed, so waiting a step saves computing them
    twice."""
    upto = cached + max(DEFER_SHARED_TOKENS, page_size)
    if req.fill_len - 1 < upto:
        return False
    mine = _tokens(req, upto)
    first = mine[cached]
    for other, end in prefills:
        if end < upto or other is req or other.lora_id != req.lora_id:
            continue
        if other.pooling is not None:
            continue  # a pooling request's pages never reach the cache
        theirs = _tokens(other, upto)
        if (
            theirs[cached] == first  # one int first; most prompts differ right here
            and theirs[cached:upto] == mine[cached:upto]
            and theirs[:cached] == mine[:cached]
        ):
            return True
    return False


def prefills_of(
    reqs: list[Req], extend_lens: list[int], in_flight: dict[int, list[CacheRecord]]
) -> Iterable[tuple[Req, int]]:
    """The prefills whose pages the cache will take: this batch's and those in flight."""
    in_batch = ((r, r.num_computed_tokens + n) for r, n in zip(reqs, extend_lens, strict=True))
    launched = ((r, end) for records in in_flight.values() for r, end, _ in records)
    return itertools.chain(in_batch, launched)


def match_prefix(
    cache: RadixCache | None, req: Req, page_size: int, prefills: Iterable[tuple[Req, int]]
) -> PrefixMatch | None:
    """The cached prefix `req` may start after, locked; None when it should wait for one of
    `prefills` that shares more with it (`shares_with_prefill`)."""
    if cache is None or req.sampling_params.prompt_logprobs is not None:
        # prompt logprobs need every prompt position computed: no cached prefix
        return PrefixMatch()
    if req.pooling is not None:
        # pooling needs every prompt position's hidden state (a mean), and a pooling request
        # shares no KV with anyone: no cached prefix
        return PrefixMatch()
    pages, node = cache.match_prefix(matchable(req))
    tokens = len(pages) * page_size
    if shares_with_prefill(req, tokens, page_size, prefills):
        return None
    locked = cache.lock(node) if pages else 0
    return PrefixMatch(pages, node, tokens, locked)


def unlock_match(cache: RadixCache | None, match: PrefixMatch) -> None:
    """Admission refused the request after all: its cached prefix is no longer locked by it."""
    if match.pages:
        assert cache is not None and match.node is not None
        cache.unlock(match.node)


def order_lpm(live: list[Req], cache: RadixCache, max_wait_s: float) -> list[Req]:
    """lpm: requests by longest cached prefix, after requests that ran before (retracted) and
    requests waiting past `max_wait_s` (starvation), both by arrival. Past `LPM_MAX_QUEUE`
    requests, arrival order (fcfs)."""
    if len(live) > LPM_MAX_QUEUE:
        return live
    now = time.perf_counter()

    def key(item: tuple[int, Req]) -> tuple[int, int, int]:
        i, r = item
        if r.first_scheduled_time is not None:
            return (0, 0, i)
        if now - r.arrival_time > max_wait_s:
            return (1, 0, i)
        return (2, 0 if r.pooling is not None else -cache.match_len(matchable(r)), i)

    return [r for _, r in sorted(enumerate(live), key=key)]


def cache_prefill(cache: RadixCache, req: Req, end: int, retractions: int) -> None:
    """An extend batch was processed: the cache takes the whole pages `req` now has up to
    `end`, and the request's lock moves to where they end."""
    if (
        req.num_retractions != retractions
        or req.req_pool_idx is None
        or req.finished_reason is FinishReason.ERROR
        or req.pooling is not None
    ):
        # its pages changed hands since, or their content is in doubt, or they are a pooling
        # request's (its KV is its own: never shared)
        return
    page_size = cache.page_size
    keep = min(end // page_size, len(req.kv_pages))
    shared = req.cached_pages
    if keep <= shared:
        return
    tokens = req.cache_key(req.fill_slice(0, keep * page_size))
    if cache.match_len(tokens) > shared * page_size:
        # another request cached some of these tokens first: its copy stays, and this
        # request keeps its own pages until it finishes (its table row points at them)
        return
    node, _ = cache.insert(tokens, req.kv_pages[:keep])
    cache.lock(node)
    if req.cache_node is not None:
        cache.unlock(req.cache_node)
    req.cache_node = node
    req.cached_pages = keep


def cacheable_tokens(req: Req) -> int:
    """Tokens of a finished request whose KV the cache may take at release.

    Only a generation request that finished through a token it accepted (stop or length): every
    step before that token succeeded. The last token's KV is left out: at most the batch that was in
    flight computed it, and that batch may have failed.
    """
    if req.pooling is not None:
        return 0  # a pooling request's KV is its own: never shared
    if req.finished_reason not in (FinishReason.STOP, FinishReason.LENGTH):
        return 0
    return min(req.num_computed_tokens, req.fill_len - 1)
