"""`ModelArchConfig`: a model's shape and conventions, parsed from a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stallfree.runtime.model.moe_config import MoEConfig, parse_moe


@dataclass(frozen=True, slots=True)
class Family:
    """One natively implemented architecture: its Hugging Face name, the `model_type`s that
    name it, llama.cpp's `general.architecture` names for its GGUF files, and what it runs
    with (the README's supported-models table is written from these)."""

    architecture: str
    model_types: tuple[str, ...]
    gguf: tuple[str, ...] = ()
    tensor_parallel: bool = True
    hisparse: bool = True


FAMILIES: dict[str, Family] = {
    f.architecture: f
    for f in (
        Family("LlamaForCausalLM", ("llama",), ("llama",)),
        Family("Qwen2ForCausalLM", ("qwen2",), ("qwen2",)),
        Family("MistralForCausalLM", ("mistral",)),
        # HiSparse: refused (sliding-window layers, Gemma 2's soft-capping, Gemma's scale)
        Family("Gemma2ForCausalLM", ("gemma2",), ("gemma2",), hisparse=False),
        Family("Gemma3ForCausalLM", ("gemma3_text",), ("gemma3",), hisparse=False),
        # mixture of experts (moe.py); llama.cpp writes Mixtral as `llama` with expert tensors
        Family("MixtralForCausalLM", ("mixtral",), ("llama",)),
        Family("Qwen2MoeForCausalLM", ("qwen2_moe",), ("qwen2moe",)),
        Family("Qwen3MoeForCausalLM", ("qwen3_moe",), ("qwen3moe",)),
        Family("Qwen3ForCausalLM", ("qwen3",), ("qwen3",)),
        Family("Phi3ForCausalLM", ("phi3",), ("phi3",)),
    )
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
# older configs' spellings of a RoPE type
_ROPE_ALIASES = {"su": "longrope"}
# the types whose parameters carry the pretraining context (transformers' standardize_rope_params)
_ORIGINAL_CONTEXT_TYPES = ("llama3", "yarn", "longrope")
_MODEL_TYPES = {t: f.architecture for f in FAMILIES.values() for t in f.model_types}


class ModelLoadError(ValueError):
    """A model directory or preset cannot be turned into a runnable model."""


@dataclass(slots=True)
class ModelArchConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "LlamaForCausalLM"
    # Llama's `attention_bias` also puts a bias on o_proj; Qwen2 biases only q/k/v.
    o_bias: bool = False
    # Qwen3: an RMSNorm over each head of q and of k (weight [head_dim]) before RoPE
    qk_norm: bool = False
    # a mixture-of-experts model's routing and experts (moe_config.py); None: dense
    moe: MoEConfig | None = None

    # Gemma 2/3 (gemma.py): the MLP's activation; attention scaled by
    # `query_pre_attn_scalar ** -0.5` (None: head_dim ** -0.5); tanh soft-capping of the
    # attention scores and of the logits (None: off); each layer's kind ("sliding_attention"
    # or "full_attention"; None: every layer as `sliding_window` says) and the sliding
    # layers' own RoPE base, unscaled (None: every layer uses `rope_theta`, `rope_scaling`)
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    layer_types: list[str] | None = None
    rope_local_theta: float | None = None

    def layer_windows(self) -> list[int | None] | None:
        """Each layer's sliding window (None: full attention); None when all share one."""
        if self.layer_types is None:
            return None
        return [self.sliding_window if t == "sliding_attention" else None for t in self.layer_types]

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelArchConfig:
        arch = _architecture(cfg)
        if arch in GEMMA_ARCHITECTURES:
            return _gemma_from_hf(cls, cfg, arch)
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"unsupported hidden_act {cfg['hidden_act']!r}; expected 'silu'")
        if cfg.get("mlp_bias"):
            raise ModelLoadError("unsupported mlp_bias=true")
        heads = int(cfg["num_attention_heads"])
        params = cfg.get("rope_parameters")
        partial = cfg.get("partial_rotary_factor") or (
            params.get("partial_rotary_factor") if isinstance(params, dict) else None
        )
        if float(partial or 1.0) != 1.0:
            raise ModelLoadError(f"unsupported partial_rotary_factor={partial}; expected 1.0")
        theta, scaling = parse_rope(cfg, arch)
        max_positions = _context_length(cfg, scaling)
        is_qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        windowed_by_flag = arch in (
            "Qwen2ForCausalLM",
            "Qwen3ForCausalLM",
            "Qwen2MoeForCausalLM",
            "Qwen3MoeForCausalLM",
        )
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("qkv_bias", True)) if is_qwen2 else attention_bias,
            sliding_window=_sliding_window(cfg, windowed_by_flag),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_id_list(cfg.get("eos_token_id")),
            architecture=arch,
            o_bias=False if is_qwen2 else attention_bias,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            moe=parse_moe(cfg, arch),
        )


def _architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else _MODEL_TYPES.get(cfg.get("model_type", ""), cfg.get("model_type"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r} for the native implementation; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}. `--model-impl transformers` "
            "(model.model_impl) runs other causal LMs through transformers' own modelling "
            "code, slower (pip install transformers)"
        )
    return str(arch)


def parse_rope(
    cfg: dict[str, Any], arch: str = "LlamaForCausalLM"
) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from a v5 `rope_parameters` or a v4 `rope_theta`/`rope_scaling`,
    completed as transformers' `standardize_rope_params` does: the pretraining context
    (`original_max_position_embeddings`, a top-level value first) and, for yarn and longrope,
    a missing `factor` as the ratio of the two contexts."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = {
            k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")
        }
    else:
        theta = cfg.get("rope_theta", 10000.0)
        scaling = dict(cfg.get("rope_scaling") or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    rope_type = _ROPE_ALIASES.get(rope_type, rope_type)
    if arch == "Phi3ForCausalLM" and rope_type == "yarn":
        rope_type = "longrope"  # Phi3Config reads its yarn as longrope (short/long factors)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return float(theta), None
    scaling["rope_type"] = rope_type
    max_positions = int(cfg.get("max_position_embeddings", 2048))
    if rope_type in _ORIGINAL_CONTEXT_TYPES:
        top = cfg.get("original_max_position_embeddings")
        if top is None and arch == "Phi3ForCausalLM":
            top = 4096  # Phi3Config's default, which outranks the scaling's own
        if top is not None:
            scaling["original_max_position_embeddings"] = int(top)
        scaling.setdefault("original_max_position_embeddings", max_positions)
    if rope_type in ("yarn", "longrope") and scaling.get("factor") is None:
        scaling["factor"] = max_positions / scaling["original_max_position_embeddings"]
    return float(theta), scaling


def _context_length(cfg: dict[str, Any], scaling: dict[str, Any] | None) -> int:
    """`max_position_embeddings`, but no longer than the pretraining context under longrope.

    transformers switches a longrope model from its short factors to its long ones once a
    forward's sequence outgrows `original_max_position_embeddings`, keeping the keys cached
    before the switch as they were; a paged, chunked, retracting batch cannot reproduce that
    history, so the context stops where the short factors (exactly transformers') end, and a
    longer request is refused by the context-length check. Dynamic NTK needs no cap: it
    equals the default frequencies up to `max_position_embeddings`, the engine's limit.
    """
    positions = int(cfg.get("max_position_embeddings", 2048))
    if scaling is not None and scaling["rope_type"] == "longrope":
        return min(positions, int(scaling["original_max_position_embeddings"]))
    return positions


def _sliding_window(cfg: dict[str, Any], by_flag: bool) -> int | None:
    if by_flag and not cfg.get("use_sliding_window", False):
        return None
    window = cfg.get("sliding_window")
    return int(window) if window else None


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh",)


def _gemma_from_hf(cls: type[ModelArchConfig], cfg: dict[str, Any], arch: str) -> ModelArchConfig:
    """Gemma 2 / Gemma 3 (text): transformers' config defaults where a key is missing."""
    gemma3 = arch == "Gemma3ForCausalLM"
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GEMMA_ACTIVATIONS:
        raise ModelLoadError(f"unsupported hidden_activation {act!r}; expected 'gelu_pytorch_tanh'")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError("unsupported use_bidirectional_attention=true (an encoder Gemma)")
    heads = int(cfg["num_attention_heads"])
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        # Gemma 2: every other layer slides; Gemma 3: all but every `sliding_window_pattern`-th
        pattern = int(cfg.get("sliding_window_pattern", 6)) if gemma3 else 2
        types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"unsupported layer_types {types!r}")
    window = cfg.get("sliding_window", 4096)
    if gemma3:
        theta, scaling, local = _gemma3_rope(cfg)
    else:
        (theta, scaling), local = parse_rope(cfg), None
    if not window and "sliding_attention" in types:
        raise ModelLoadError("sliding_attention layers need a sliding_window")
    soft = (None, None) if gemma3 else (50.0, 30.0)
    return cls(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or 256),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)),
        sliding_window=int(window) if window else None,
        bos_token_id=cfg.get("bos_token_id", 2),
        eos_token_ids=_as_id_list(cfg.get("eos_token_id", 1)),
        architecture=arch,
        hidden_act=act,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        attn_logit_softcapping=_optional_float(cfg.get("attn_logit_softcapping", soft[0])),
        final_logit_softcapping=_optional_float(cfg.get("final_logit_softcapping", soft[1])),
        layer_types=list(types),
        rope_local_theta=local,
        qk_norm=gemma3,
    )


def _gemma3_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(global theta, global scaling, local theta): v5 nests `rope_parameters` per layer
    type; v4 has `rope_theta` / `rope_scaling` (global) and `rope_local_base_freq`."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full = dict(params.get("full_attention") or {})
        sliding = dict(params.get("sliding_attention") or {})
        full.setdefault("rope_theta", 1_000_000.0)
        local = float(sliding.get("rope_theta", 10_000.0))
        if sliding.get("rope_type", sliding.get("type", "default")) != "default":
            raise ModelLoadError(
                f"unsupported rope scaling {sliding!r} on sliding_attention layers; expected default"
            )
        theta, scaling = parse_rope({"rope_parameters": full})
        return theta, scaling, local
    v4 = {"rope_theta": cfg.get("rope_theta", 1_000_000.0), "rope_scaling": cfg.get("rope_scaling")}
    theta, scaling = parse_rope(v4)
    return theta, scaling, float(cfg.get("rope_local_base_freq", 10_000.0))


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
