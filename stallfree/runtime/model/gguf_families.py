"""The llama.cpp families a GGUF file may name in `general.architecture`: the Hugging Face
architecture each one loads as, its tensor names, and how its converter wrote Q and K.

llama.cpp's converter reorders the rows of each Q and K head for its interleaved RoPE only in
its Llama conversions (`LlamaModel.permute`); Qwen2, Qwen3 and Phi-3 files keep the Hugging
Face order (their llama.cpp graphs use the NeoX rotation, which is transformers' own).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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
    # norm weights stored as `1 + w` (llama.cpp's Gemma converters add the one that Gemma's
    # RMSNorm adds at run time): the loader takes it off again
    norm_shift: bool = False


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

# Gemma 2/3: four norms per layer (the attention's and the MLP's outputs normed too)
_GEMMA = {
    **{k: v for k, v in _LLAMA.items() if k not in _NORMS},
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
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
    "gemma2": GGUFFamily("Gemma2ForCausalLM", _GEMMA, sliding_window=True, norm_shift=True),
    "gemma3": GGUFFamily(
        "Gemma3ForCausalLM",
        {**_GEMMA, **_QK_NORM},
        qk_norm=True,
        sliding_window=True,
        norm_shift=True,
    ),
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


# llama.cpp's Gemma 27B sizes (by layer count), whose query scale is hidden / heads
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def with_gemma(arch: ModelArchConfig, meta: Metadata, family: str) -> ModelArchConfig:
    """Gemma's fields from a gemma2/gemma3 file, as llama.cpp reads them: soft-capping from
    `{arch}.attn_logit_softcapping` / `final_logit_softcapping`; sliding layers every other
    one (Gemma 2) or by `attention.sliding_window_pattern` (Gemma 3: a period, or a flag per
    layer; 6 by default); the query scale from `attention.scale`, else llama.cpp's rule
    (hidden / heads on the 27B sizes, head_dim otherwise); Gemma 3's sliding layers' RoPE base
    from `rope.freq_base_swa` (10000 by default)."""
    n = arch.num_layers
    pattern = meta.get(f"{family}.attention.sliding_window_pattern") if family == "gemma3" else 2
    if pattern is None:
        pattern = 6
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
        if len(sliding) != n:
            raise ModelLoadError(
                f"{family}.attention.sliding_window_pattern has {len(sliding)} flags for {n} layers"
            )
    else:
        sliding = [bool((i + 1) % int(pattern)) for i in range(n)]
    scale = meta.get(f"{family}.attention.scale")
    if scale is not None:
        scalar = float(scale) ** -2
    elif n == _GEMMA_27B_LAYERS[family]:
        scalar = arch.hidden_size / arch.num_heads
    else:
        scalar = float(arch.head_dim)

    def cap(key: str) -> float | None:
        value = meta.get(f"{family}.{key}")
        return float(value) if value else None

    local = meta.get(f"{family}.rope.freq_base_swa") if family == "gemma3" else None
    return replace(
        arch,
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=scalar,
        attn_logit_softcapping=cap("attn_logit_softcapping"),
        final_logit_softcapping=cap("final_logit_softcapping"),
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        rope_local_theta=(float(local) if local else 10_000.0) if family == "gemma3" else None,
    )
