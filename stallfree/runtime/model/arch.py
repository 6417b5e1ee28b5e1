"""`ModelArchConfig`: a model's shape and conventions, parsed from a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
        Family("Qwen2ForCausalLM", ("qwen2",)),
        Family("MistralForCausalLM", ("mistral",)),
    )
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
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

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelArchConfig:
        arch = _architecture(cfg)
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"unsupported hidden_act {cfg['hidden_act']!r}; expected 'silu'")
        if cfg.get("mlp_bias"):
            raise ModelLoadError("unsupported mlp_bias=true")
        heads = int(cfg["num_attention_heads"])
        theta, scaling = parse_rope(cfg)
        is_qwen2 = arch == "Qwen2ForCausalLM"
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
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if is_qwen2 else attention_bias,
            sliding_window=_sliding_window(cfg, is_qwen2),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_id_list(cfg.get("eos_token_id")),
            architecture=arch,
            o_bias=False if is_qwen2 else attention_bias,
        )


def _architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else _MODEL_TYPES.get(cfg.get("model_type", ""), cfg.get("model_type"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return str(arch)


def parse_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from a v5 `rope_parameters` or a v4 `rope_theta`/`rope_scaling`."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = cfg.get("rope_theta", 10000.0)
        scaling = dict(cfg.get("rope_scaling") or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return float(theta), None
    scaling["rope_type"] = rope_type
    return float(theta), scaling


def _sliding_window(cfg: dict[str, Any], is_qwen2: bool) -> int | None:
    if is_qwen2 and not cfg.get("use_sliding_window", False):
        return None
    window = cfg.get("sliding_window")
    return int(window) if window else None


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
