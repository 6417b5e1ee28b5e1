"""How big the engine's queues and pools are, and how many threads its CPU stream gets, from
the configuration and the model's shape: the scheduler node and every worker node size theirs
with these, so that they agree."""

from __future__ import annotations

import math
import os

from stallfree.config import StallfreeConfig
from stallfree.runtime.memory.radix_cache import PrefixCacheConfigError
from stallfree.runtime.model.arch import ModelArchConfig
from stallfree.runtime.scheduling.alloc import pages_for

# Default bound of the waiting queue, per request slot: enough to keep every slot refilled
# several times over, small enough that a burst is refused quickly rather than queued for minutes.
WAITING_PER_REQUEST_SLOT = 4


def waiting_limit(config: StallfreeConfig) -> int:
    """`scheduler.max_waiting_requests`, or its default derived from the request slots."""
    explicit = config.scheduler.max_waiting_requests
    if explicit is not None:
        return explicit
    return WAITING_PER_REQUEST_SLOT * config.cache.max_running_requests


# measured by benchmarks/bench_stream_threads.py on 2 cores: `tiny` (hidden 64) runs 2x
# faster on 1 thread than on 2; `bench-cpu` (hidden 1024) 1.45x faster on 2 than on 1.
WIDE_MODEL_HIDDEN = 512


def auto_stream_threads(arch: ModelArchConfig, ranks: int = 1) -> int:
    """Threads for the CPU stream worker (or for each of a node's `ranks` worker processes,
    which share its cores) when `runtime.stream_threads` is 0."""
    if arch.hidden_size < WIDE_MODEL_HIDDEN:
        return 1
    return max(1, (os.cpu_count() or 1) // ranks)


def prefix_caching_enabled(config: StallfreeConfig) -> bool:
    """`cache.prefix_caching`, or its default: on, unless HiSparse is enabled.

    HiSparse keeps per-request host copies and device buffers of every token's KV, which a
    shared page would not have; asking for both is a configuration error.
    """
    wanted = config.cache.prefix_caching
    if wanted is None:
        return not config.hisparse.enabled
    if wanted and config.hisparse.enabled:
        raise PrefixCacheConfigError(
            "cache.prefix_caching and hisparse.enabled cannot both be on: HiSparse keeps "
            "per-request copies of the KV that shared cached pages would not have; turn one off"
        )
    return wanted


def pool_sizes(
    config: StallfreeConfig, arch: ModelArchConfig, capacity_ratio: float = 1.0
) -> tuple[int, int]:
    """`(max_context_len, num_kv_slots)`: the request table's row length and the KV pool's
    slots (whole pages, plus the reserved page) for `config` on `arch`. Every node of a
    tensor-parallel group sizes its pools from this, so that they agree with the scheduler's.

    `capacity_ratio` scales the KV tokens: sparse layers keep every token in the host pool, so
    with HiSparse the engine can hold more tokens than the device budget, and the logical slots
    follow the host pool."""
    max_context_len = min(
        config.model.max_context_len or arch.max_position_embeddings, arch.max_position_embeddings
    )
    total_tokens = math.ceil(config.cache.max_total_tokens * capacity_ratio)
    page_size = config.cache.page_size
    return max_context_len, (pages_for(total_tokens, page_size) + 1) * page_size
