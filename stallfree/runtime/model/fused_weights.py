"""Checkpoint tensors stored fused (Phi-3's `qkv_proj` and `gate_up_proj`, and their GGUF
`attn_qkv` / `ffn_up`) split at load into the separate q/k/v and gate/up weights of the model,
so that tensor-parallel sharding, `fuse_projections` and quantization treat them as they treat
every other family's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from stallfree.runtime.model.arch import ModelArchConfig, ModelLoadError

if TYPE_CHECKING:
    from stallfree.runtime.model.quant import QuantizedWeight

# the architectures whose checkpoints store these fused tensors
FUSED_ARCHITECTURES = ("Phi3ForCausalLM",)

# fused leaf name (after "model.layers.N.") -> the parts, in row order
_PARTS = {
    "self_attn.qkv_proj.weight": ("q_proj", "k_proj", "v_proj"),
    "mlp.gate_up_proj.weight": ("gate_proj", "up_proj"),
}


def is_fused(name: str, arch: ModelArchConfig) -> bool:
    """Whether checkpoint tensor `name` (a Hugging Face name) holds several of the model's."""
    if arch.architecture not in FUSED_ARCHITECTURES:
        return False
    parts = name.split(".", 3)
    return len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _PARTS


def split_fused(
    name: str, weight: torch.Tensor | QuantizedWeight, arch: ModelArchConfig
) -> list[tuple[str, Any]]:
    """The parts of a fused tensor by name, split by rows: q [heads x head_dim], k and v
    [kv_heads x head_dim] each; gate then up, [intermediate_size] each (transformers'
    `chunk(2)`). Quantized weights (a GGUF file's blocks) are split the same way."""
    model, layers, index, leaf = name.split(".", 3)
    module = leaf.split(".")[0]
    prefix = f"{model}.{layers}.{index}.{module}."
    if leaf.startswith("self_attn."):
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        sizes = [q, kv, kv]
    else:
        sizes = [arch.intermediate_size, arch.intermediate_size]
    rows = int(weight.shape[0])
    if rows != sum(sizes):
        raise ModelLoadError(
            f"shape mismatch for {name}: {rows} rows, config expects {sum(sizes)} "
            f"({' + '.join(map(str, sizes))})"
        )
    out: list[tuple[str, Any]] = []
    start = 0
    for part, size in zip(_PARTS[leaf], sizes, strict=True):
        piece: Any
        if isinstance(weight, torch.Tensor):
            piece = weight[start : start + size]
        else:
            piece = weight.rows(torch.arange(start, start + size))
        out.append((f"{prefix}{part}.weight", piece))
        start += size
    return out
