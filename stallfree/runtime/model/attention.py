"""Paged attention: K/V live in the KV cache, addressed through `req_to_token` rows.

Everything here is enqueued work: shapes and loops come from the batch's host metadata, and
masks are built by device-side comparisons, so nothing waits for the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stallfree.runtime.forward_batch import ForwardBatch, ForwardMode


class PagedAttention:
    """Default attention backend. q [T, H, D], k/v [T, KVH, D] -> out [T, H, D]."""

    def __init__(self, sliding_window: int | None = None) -> None:
        self.sliding_window = sliding_window

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch
    ) -> torch.Tensor:
        fb.kv_cache.write(layer_id, fb.out_cache_loc, k, v)
        if fb.mode is ForwardMode.DECODE:
            return self._decode(q, layer_id, fb)
        return self._extend(q, layer_id, fb)

    def _extend(self, q: torch.Tensor, layer_id: int, fb: ForwardBatch) -> torch.Tensor:
        k_buf, v_buf = fb.kv_cache.k_buffers[layer_id], fb.kv_cache.v_buffers[layer_id]
        outs = []
        start = 0
        for i in range(fb.batch_size):
            n, prefix = fb.extend_lens_cpu[i], fb.prefix_lens_cpu[i]
            seq = prefix + n
            row = int(fb.req_pool_indices_cpu[i])
            slots = fb.req_to_token[row, :seq]
            mask = causal_mask(prefix, seq, q.device, self.sliding_window)
            outs.append(attend(q[start : start + n], k_buf[slots], v_buf[slots], mask))
            start += n
        return torch.cat(outs) if outs else q.new_empty(q.shape)

    def _decode(self, q: torch.Tensor, layer_id: int, fb: ForwardBatch) -> torch.Tensor:
        k_buf, v_buf = fb.kv_cache.k_buffers[layer_id], fb.kv_cache.v_buffers[layer_id]
        slots = fb.req_to_token[fb.req_pool_indices, : fb.max_seq_len]  # [B, L]
        k_pos = torch.arange(slots.shape[1], device=q.device)[None, :]
        seq_lens = fb.seq_lens[:, None]
        mask = k_pos < seq_lens
        if self.sliding_window is not None:
            mask &= k_pos >= seq_lens - self.sliding_window
        # Batched as B independent single-query problems: [B, H, 1, D] against [B, H, L, D].
        out = attend_batched(q[:, :, None, :], k_buf[slots], v_buf[slots], mask[:, None, None, :])
        return out[:, :, 0, :]


def causal_mask(
    prefix: int, seq: int, device: torch.device, sliding_window: int | None = None
) -> torch.Tensor:
    """[seq - prefix, seq]: query at position prefix + i sees keys 0..prefix + i (and the window)."""
    q_pos = torch.arange(prefix, seq, device=device)[:, None]
    k_pos = torch.arange(seq, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def _expand_kv(kv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., L, KVH, D] -> [..., H, L, D], repeating each KV head for its query group."""
    kv = kv.transpose(-3, -2)
    groups = num_heads // kv.shape[-3]
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=-3)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One request: q [n, H, D], k/v [seq, KVH, D], mask [n, seq] -> [n, H, D]."""
    heads = q.shape[1]
    k, v = _expand_kv(k.to(q.dtype), heads), _expand_kv(v.to(q.dtype), heads)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask)
    return out.transpose(0, 1)


def attend_batched(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    heads = q.shape[1]
    k, v = _expand_kv(k.to(q.dtype), heads), _expand_kv(v.to(q.dtype), heads)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
