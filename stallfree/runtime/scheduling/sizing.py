"""How big the engine's queues and pools are, and how many threads its CPU stream gets, from
the configuration and the model's shape: the scheduler node and every worker node size theirs
with these, so that they agree."""

from __future__ import annotations

import math
import os

import torch

from stallfree.config import StallfreeConfig
from stallfree.runtime.memory.kv_format import kv_format
from stallfree.runtime.memory.pool import KVCacheShape, bytes_per_token
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
    config: StallfreeConfig,
    arch: ModelArchConfig,
    capacity_ratio: float = 1.0,
    memory_tokens: int | None = None,
) -> tuple[int, int]:
    """`(max_context_len, num_kv_slots)`: the request table's row length and the KV pool's
    slots (whole pages, plus the reserved page) for `config` on `arch`. Every node of a
    tensor-parallel group sizes its pools from this, so that they agree with the scheduler's.

    The KV tokens are `default_kv_tokens` unless `memory_tokens` is given. `capacity_ratio`
    scales the KV tokens: sparse layers keep every token in the host pool, so
    with HiSparse the engine can hold more tokens than the device budget, and the logical slots
    follow the host pool. `memory_tokens` (`memory_kv_tokens`) replaces
    `cache.max_total_tokens` when the pool is sized from memory."""
    max_context_len = context_len(config, arch)
    budget = default_kv_tokens(config, arch) if memory_tokens is None else memory_tokens
    total_tokens = math.ceil(budget * capacity_ratio)
    page_size = config.cache.page_size
    return max_context_len, (pages_for(total_tokens, page_size) + 1) * page_size


def kv_shape(arch: ModelArchConfig) -> KVCacheShape:
    return KVCacheShape(arch.num_layers, arch.num_kv_heads, arch.head_dim)


def default_kv_tokens(config: StallfreeConfig, arch: ModelArchConfig) -> int:
    """`cache.max_total_tokens`; left at its default with a quantized `kv_cache_dtype`, the
    tokens that fit in the bytes the default's tokens take in bfloat16, so that the smaller
    rows buy more tokens in the same memory (every node computes the same from the config)."""
    cache = config.cache
    if "max_total_tokens" in cache.model_fields_set or cache.kv_cache_dtype == "auto":
        return cache.max_total_tokens
    shape = kv_shape(arch)
    bf16 = bytes_per_token(kv_format("auto", torch.bfloat16), shape)
    mine = bytes_per_token(kv_format(cache.kv_cache_dtype, torch.bfloat16), shape)
    return cache.max_total_tokens * bf16 // mine


def context_len(config: StallfreeConfig, arch: ModelArchConfig) -> int:
    """The longest prompt + output of one request: `model.max_context_len`, capped by the
    model's own."""
    own = arch.max_position_embeddings
    return min(config.model.max_context_len or own, own)


# a step's activations held beside the KV, per prefill token: float32 hidden states, the
# attention's q/k/v/out and the MLP's gate/up/down (with room for a temporary copy of each)
ACTIVATION_COPIES = 2


def memory_kv_tokens(
    config: StallfreeConfig, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device
) -> int | None:
    """The KV tokens `cache.gpu_memory_utilization` leaves room for (None when it is unset),
    as vLLM sizes its pool: that share of the device's memory, less what is already in use
    (this process's weights included) and a step's activations. On a CPU the share is of the
    memory available now. At most every request slot's full context; ValueError if it cannot
    hold one full-length request."""
    share = config.cache.gpu_memory_utilization
    if share is None:
        return None
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget, of = share * total - (total - free), "the device's memory"
    else:
        budget, of = share * available_memory(), "the memory available"
    per_token = bytes_per_token(kv_format(config.cache.kv_cache_dtype, dtype), kv_shape(arch))
    tokens = int(max(0.0, budget - activation_bytes(config, arch)) // per_token)
    longest = context_len(config, arch)
    if tokens < max(longest, 2 * config.cache.page_size):
        raise ValueError(
            f"cache.gpu_memory_utilization={share} leaves room for {tokens} KV tokens "
            f"({per_token} bytes each) in {share:g} of {of}, fewer than one request of "
            f"{longest} tokens; raise it, lower --max-model-len, or give --max-total-tokens"
        )
    return min(tokens, config.cache.max_running_requests * longest)


def activation_bytes(config: StallfreeConfig, arch: ModelArchConfig) -> int:
    """What one step's activations may take: the prefill budget's hidden states through one
    layer (attention and MLP) and the logits of every running request, in float32."""
    per_token = 4 * arch.hidden_size + 3 * arch.intermediate_size
    prefill = config.scheduler.max_prefill_tokens * per_token * 4 * ACTIVATION_COPIES
    return prefill + config.cache.max_running_requests * arch.vocab_size * 4


def available_memory() -> int:
    """Bytes of memory the OS can give this process now (Linux's MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
