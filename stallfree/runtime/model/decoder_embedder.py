"""A decoder embedder: a native causal-LM family's final hidden states (after its last norm),
for last-token or mean pooling, as Qwen3-Embedding is served.

The LM head is never applied. The engine schedules these requests as prompts
(runtime/embed_requests.py), on the pooling runner or beside generation: each step runs `pooled_sums` on the engine's stream over the
engine's paged KV, and the request's pages are freed when its last chunk is done.
`DecoderEmbedder.hidden_states` runs a whole batch over a KV cache of its own instead (the
reference the tests check the scheduled path against).
"""

from __future__ import annotations

import torch

from stallfree.runtime.memory.pool import KVCache
from stallfree.runtime.model.arch import ModelLoadError
from stallfree.runtime.model.forward_batch import ForwardBatch, ForwardMode
from stallfree.runtime.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from stallfree.runtime.model.loader import LoadedModel


class DecoderEmbedder:
    """`hidden_states(rows)` -> ([B, T, hidden] float, mask [B, T]) for a native family."""

    def __init__(self, loaded: LoadedModel) -> None:
        model = loaded.model
        if not isinstance(model, LlamaForCausalLM):
            raise ModelLoadError(
                "decoder embedders run on stallfree's native families only (--model-impl native)"
            )
        if type(model.model).layer_cls is not LlamaDecoderLayer:
            raise ModelLoadError(
                f"{loaded.arch.architecture} has layers of its own; the pooling runner serves "
                "the plain decoder families (Llama, Qwen2, Qwen3, Mistral, Phi-3) as embedders"
            )
        if loaded.tp.size > 1:
            raise ModelLoadError("the pooling runner runs on one rank")
        self.loaded = loaded
        self.model: LlamaForCausalLM = model
        self.hidden_size = loaded.arch.hidden_size
        self.vocab_size = loaded.arch.vocab_size
        self.max_positions = loaded.arch.max_position_embeddings
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def hidden_states(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        fb = self._batch(rows)
        model = self.model
        h = model.embed(fb.input_ids)
        rope = model.model.rotary_emb(fb.positions, h.dtype)
        for layer in model.model.layers:
            h = layer(h, rope, fb, model.attn_backend)
        h = model.model.norm(h).float()
        return _padded(h, [len(r) for r in rows], self.device)

    def _batch(self, rows: list[list[int]]) -> ForwardBatch:
        """Every row a whole prompt (nothing cached), its slots contiguous in a batch-sized KV
        cache (slot 0 unused, as the engine's pool keeps it)."""
        device = self.device
        lens = [len(r) for r in rows]
        width = max(lens)
        kv = KVCache(self.loaded.kv_cache_shape(), len(rows) * width + 1, self.loaded.dtype, device)
        req_to_token_cpu = torch.arange(len(rows) * width, dtype=torch.int64).view(len(rows), width)
        req_to_token_cpu += 1
        locs = torch.cat([req_to_token_cpu[i, :n] for i, n in enumerate(lens)])
        positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens])
        ids = torch.tensor([t for r in rows for t in r], dtype=torch.int64)
        rows_cpu = torch.arange(len(rows), dtype=torch.int64)
        seq_lens_cpu = torch.tensor(lens, dtype=torch.int64)
        return ForwardBatch(
            mode=ForwardMode.EXTEND,
            batch_size=len(rows),
            input_ids=ids.to(device),
            positions=positions.to(device),
            out_cache_loc=locs.to(device),
            req_pool_indices=rows_cpu.to(device),
            seq_lens=seq_lens_cpu.to(device),
            req_pool_indices_cpu=rows_cpu,
            seq_lens_cpu=seq_lens_cpu,
            extend_lens_cpu=lens,
            prefix_lens_cpu=[0] * len(rows),
            req_to_token=req_to_token_cpu.to(device),
            kv_cache=kv,
            prompt_lens_cpu=lens,
        )


@torch.inference_mode()
def pooled_sums(
    model: torch.nn.Module, fb: ForwardBatch, index: torch.Tensor, segment: torch.Tensor
) -> torch.Tensor:
    """A step of pooling rows on the stream: the family's layers over `fb` (writing the
    chunk's KV into the engine's pool, as a prompt chunk does), its last norm on the token rows
    `index`, added into their batch rows `segment`: [batch, hidden] float32."""
    if not isinstance(model, LlamaForCausalLM):
        raise ModelLoadError("pooling steps run on stallfree's native families only")
    h = model.embed(fb.input_ids)
    rope = model.model.rotary_emb(fb.positions, h.dtype)
    for layer in model.model.layers:
        h = layer(h, rope, fb, model.attn_backend)
    picked = model.model.norm(h.index_select(0, index)).float()
    out = torch.zeros(fb.batch_size, picked.shape[-1], dtype=torch.float32, device=h.device)
    return out.index_add_(0, segment, picked)


def _padded(
    flat: torch.Tensor, lens: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """[sum(lens), H] -> [B, max(lens), H], zeros past each row's end, and the row mask."""
    width = max(lens)
    out = flat.new_zeros(len(lens), width, flat.shape[-1])
    mask = torch.zeros(len(lens), width, dtype=torch.bool, device=device)
    start = 0
    for i, n in enumerate(lens):
        out[i, :n] = flat[start : start + n]
        mask[i, :n] = True
        start += n
    return out, mask
