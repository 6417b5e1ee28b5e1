"""The proxy indexer: scores earlier tokens from the layer's own queries and keys.

No extra weights, so it runs on any loaded model:
- indexer key of a token = mean over KV heads of its post-RoPE key, float32 `[head_dim]`;
- query proxy of a step = mean over query heads of the post-RoPE query, float32 `[head_dim]`;
- score(token) = query_proxy · indexer_key(token).

The top-k tokens by score (ties broken by `torch.topk`, deterministic for a given input) are
returned as ascending positions. HiSparse and the oracle call the same functions one request at
a time, so their selections agree exactly given the same queries and keys.
"""

from __future__ import annotations

import torch

from stallfree.runtime.memory.kv_format import KVFormat


def index_keys(k: torch.Tensor, fmt: KVFormat | None = None) -> torch.Tensor:
    """k [T, KVH, D] -> [T, D] float32; through the cache's format `fmt` first, as the cache
    stores it (None: `k` is already as stored)."""
    if fmt is not None:
        k = fmt.round_trip(k, torch.float32)
    return k.float().mean(dim=1)


def query_proxy(q: torch.Tensor) -> torch.Tensor:
    """q [B, H, D] -> [B, D] float32."""
    return q.float().mean(dim=1)


def uses_selection(n_prev: int, top_k: int, min_sparse_len: int) -> bool:
    """Whether a decode step with `n_prev` earlier tokens attends to a top-k subset of them."""
    return n_prev > top_k and n_prev >= min_sparse_len


def select_topk(proxy: torch.Tensor, keys: torch.Tensor, top_k: int) -> torch.Tensor:
    """proxy [D], keys [n, D] -> the `top_k` highest-scoring positions, ascending, int64."""
    scores = keys @ proxy
    return torch.topk(scores, top_k, sorted=True).indices.sort().values
