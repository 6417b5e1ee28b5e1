"""The llama.cpp families a GGUF file may name in `general.architecture`: the Hugging Face
architecture each one loads as, its tensor names, and how its converter wrote Q and K.

llama.cpp's converter reorders the rows of each Q and K head for its interleaved RoPE only in
its Llama conversions (`LlamaModel.permute`); Qwen2, Qwen3 and Phi-3 files keep the Hugging
Face order (their llama.cpp graphs use the NeoX rotation, which is transformers' own).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from stallfree.runtime.model.arch import ModelArchConfig, ModelLoadError


class Metadata(Protocol):
    """A GGUF file's key/value fields (gguf.py's reader)."""

    def get(self, key: str, default: Any = None) -> Any: ...

    def require(self, key: str) -> Any: ...


@dataclass(frozen=True, slots=True)
class GGUFFamily:
    architecture: str  # the Hugging Face architecture (arch.py's FAMILIES)
    # GGUF tensor name after "blk.N." -> Hugging Face parameter name after "model.layers.N."
    layer_tensors: dict[str, str]
    permute_qk: bool = False  # Q/K rows interleaved per head by the converter
    qkv_bias: bool = False
    qk_norm: bool = False
    # `{arch}.attention.sliding_window` is the model's window (0: none)
    sliding_window: bool = False


GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# longrope's factors (Phi-3), read into the config rather than loaded as weights
ROPE_FACTOR_TENSORS = {
    "rope_factors_short.weight": "short_factor",
    "rope_factors_long.weight": "long_factor",
}

_NORMS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_LLAMA = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    **_NORMS,
}
_QKV_BIAS = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
_QK_NORM = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Phi-3: q/k/v in one tensor, gate and up in `ffn_up` (gate rows first), as in its checkpoint;
# fused_weights.py splits both
_PHI3 = {
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    **_NORMS,
}

GGUF_FAMILIES: dict[str, GGUFFamily] = {
    "llama": GGUFFamily("LlamaForCausalLM", _LLAMA, permute_qk=True),
    "qwen2": GGUFFamily("Qwen2ForCausalLM", {**_LLAMA, **_QKV_BIAS}, qkv_bias=True),
    "qwen3": GGUFFamily("Qwen3ForCausalLM", {**_LLAMA, **_QK_NORM}, qk_norm=True),
    "phi3": GGUFFamily("Phi3ForCausalLM", _PHI3, sliding_window=True),
    # mixture of experts: the experts' and routers' tensors are gguf_moe.py's (`llama` files
    # with experts are Mixtral's)
    "qwen2moe": GGUFFamily("Qwen2MoeForCausalLM", {**_LLAMA, **_QKV_BIAS}, qkv_bias=True),
    "qwen3moe": GGUFFamily("Qwen3MoeForCausalLM", {**_LLAMA, **_QK_NORM}, qk_norm=True),
}


def rope_scaling(meta: Metadata, family: str, path: Path) -> dict[str, Any] | None:
    kind = meta.get(f"{family}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(meta.require(f"{family}.rope.scaling.factor"))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling: dict[str, Any] = {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": int(
                meta.require(f"{family}.rope.scaling.original_context_length")
            ),
        }
        for key in ("beta_fast", "beta_slow"):
            value = meta.get(f"{family}.rope.scaling.yarn_{key}")
            if value is not None:
                scaling[key] = float(value)
        return scaling
    raise ModelLoadError(f"{path}: unsupported GGUF rope scaling {kind!r}; supported: linear, yarn")


def with_longrope(
    arch: ModelArchConfig, meta: Metadata, factors: dict[str, list[float]], path: Path
) -> ModelArchConfig:
    """Phi-3's longrope from its `rope_factors_*` tensors; the context stops at the pretraining
    length, as arch.py's `_context_length` does for a Hugging Face config."""
    family = meta.require("general.architecture")
    if set(factors) != {"short_factor", "long_factor"}:
        raise ModelLoadError(
            f"{path}: longrope needs both rope_factors_short and rope_factors_long"
        )
    original = int(meta.require(f"{family}.rope.scaling.original_context_length"))
    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        **factors,
        "original_max_position_embeddings": original,
        "factor": arch.max_position_embeddings / original,
    }
    attn_factor = meta.get(f"{family}.rope.scaling.attn_factor")
    if attn_factor is not None:
        scaling["attention_factor"] = float(attn_factor)
    arch.rope_scaling = scaling
    arch.max_position_embeddings = min(arch.max_position_embeddings, original)
    return arch
