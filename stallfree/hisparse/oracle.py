"""The naive reference: the same top-k attention, computed densely with a mask over full KV.

`TopkOracleAttention` is an attention backend usable in place of HiSparse (HiSparse disabled,
full device KV cache). Dense layers and prompt prefill are plain paged attention; decode in
sparse layers masks every earlier token except the indexer's top-k (plus the newest token), and
so do output positions of a re-prefill after retraction, as their decode steps did.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from stallfree.hisparse.indexer import index_keys, query_proxy, select_topk, uses_selection
from stallfree.runtime.memory.pool import KVCache
from stallfree.runtime.model.attention import PagedAttention, attend, causal_mask
from stallfree.runtime.model.forward_batch import ForwardBatch, ForwardMode


def topk_reference_row(
    q: torch.Tensor,
    k_hist: torch.Tensor,
    v_hist: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    top_k: int,
    min_sparse_len: int,
) -> torch.Tensor:
    """One decode row: q [H, D]; history k/v [n, KVH, D]; newest k/v [KVH, D] -> [H, D]."""
    n = k_hist.shape[0]
    keep = torch.ones(n + 1, dtype=torch.bool, device=q.device)
    if uses_selection(n, top_k, min_sparse_len):
        chosen = select_topk(query_proxy(q[None])[0], index_keys(k_hist), top_k)
        keep[:n] = False
        keep[chosen] = True
    k_all = torch.cat([k_hist, k_new[None]])
    v_all = torch.cat([v_hist, v_new[None]])
    return attend(q[None], k_all, v_all, keep[None])[0]


def _float_rows(cache: KVCache) -> Callable[[torch.Tensor], torch.Tensor]:
    """Stored rows of `cache` as float rows (the rows themselves when not quantized)."""
    fmt = cache.format
    if not fmt.quantized:
        return lambda rows: rows
    return fmt.decode


class TopkOracleAttention:
    def __init__(
        self,
        top_k: int,
        min_sparse_len: int,
        sparse_layers: Iterable[int],
        dense: PagedAttention | None = None,
    ) -> None:
        self.top_k = top_k
        self.min_sparse_len = min_sparse_len
        self.sparse_layers = frozenset(sparse_layers)
        self.dense = dense or PagedAttention()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch
    ) -> torch.Tensor:
        if layer_id not in self.sparse_layers or fb.mode is ForwardMode.IDLE:
            return self.dense.forward(q, k, v, layer_id, fb)
        if fb.mode is ForwardMode.EXTEND:
            return self._extend(q, k, v, layer_id, fb)
        cache = fb.kv_cache
        cache.write(layer_id, fb.out_cache_loc, k, v)
        k_buf, v_buf = cache.k_buffers[layer_id], cache.v_buffers[layer_id]
        rows = _float_rows(cache)
        outs = []
        for i in range(fb.batch_size):
            row, n = int(fb.req_pool_indices_cpu[i]), int(fb.seq_lens_cpu[i]) - 1
            hist = fb.req_to_token[row, :n]
            new = fb.out_cache_loc[i]
            outs.append(
                topk_reference_row(
                    q[i],
                    rows(k_buf[hist]),
                    rows(v_buf[hist]),
                    rows(k_buf[new]),
                    rows(v_buf[new]),
                    self.top_k,
                    self.min_sparse_len,
                )
            )
        return torch.stack(outs)

    def _extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch
    ) -> torch.Tensor:
        cache = fb.kv_cache
        cache.write(layer_id, fb.out_cache_loc, k, v)
        k_buf, v_buf = cache.k_buffers[layer_id], cache.v_buffers[layer_id]
        rows = _float_rows(cache)
        outs, start = [], 0
        for i in range(fb.batch_size):
            n, prefix = fb.extend_lens_cpu[i], fb.prefix_lens_cpu[i]
            seq = prefix + n
            slots = fb.req_to_token[int(fb.req_pool_indices_cpu[i]), :seq]
            keys, chunk = rows(k_buf[slots]), q[start : start + n]
            mask = causal_mask(prefix, seq, q.device)
            for pos in range(max(prefix, fb.prompt_lens_cpu[i]), seq):
                if uses_selection(pos, self.top_k, self.min_sparse_len):
                    proxy = query_proxy(chunk[pos - prefix][None])[0]
                    chosen = select_topk(proxy, index_keys(keys[:pos]), self.top_k)
                    mask[pos - prefix, :pos] = False
                    mask[pos - prefix, chosen] = True
            outs.append(attend(chunk, keys, rows(v_buf[slots]), mask))
            start += n
        return torch.cat(outs) if outs else q.new_empty(q.shape)
