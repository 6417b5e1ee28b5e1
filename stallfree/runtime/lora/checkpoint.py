"""PEFT LoRA checkpoints (`adapter_config.json` and `adapter_model.safetensors`) read and checked
against the served model: every refusal is an `AdapterError` that names the reason."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stallfree.runtime.model.lora import Weights
from stallfree.runtime.request.errors import InvalidRequestError

CONFIG = "adapter_config.json"
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")

# ...layers.N.(self_attn|mlp).TARGET.lora_(A|B)[.adapter name].weight
_KEY = re.compile(
    r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight"
)


class AdapterError(InvalidRequestError):
    """An adapter the server cannot take (400 at load), with the reason."""

    def __init__(self, message: str, code: str = "invalid_adapter") -> None:
        super().__init__(message, param="lora_path", code=code)


class AdapterNotFoundError(InvalidRequestError):
    """No adapter (and not the base model) by that name (404)."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"The model `{name}` does not exist.", param="model", code="model_not_found"
        )


@dataclass(slots=True, eq=False)
class LoraAdapter:
    """An adapter's weights in host memory: (A [r, in], B [out, r], scale) per (layer,
    target)."""

    name: str
    path: str
    rank: int
    weights: Weights

    @property
    def targets(self) -> list[str]:
        return sorted({t for _, t in self.weights})


def read_config(path: str) -> dict[str, Any]:
    """The adapter's `adapter_config.json`, checked to be a plain LoRA one."""
    folder = Path(path)
    if not (folder / CONFIG).is_file():
        raise AdapterError(f"{path!r} is not a LoRA adapter: it has no {CONFIG}")
    try:
        cfg = json.loads((folder / CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{path!r}: {CONFIG} is not readable JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{path!r}: {CONFIG} is not a JSON object")
    kind = str(cfg.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise AdapterError(f"{path!r} is a {kind} adapter; only LoRA adapters are served")
    for key, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out weights")):
        if cfg.get(key):
            raise AdapterError(f"{path!r}: {why} adapters are not supported")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        raise AdapterError(f"{path!r}: adapters that train biases are not supported")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"{path!r}: adapters with modules_to_save are not supported")
    return cfg


def _pattern_value(table: Any, module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern: the first key matching the module's name."""
    if not table:
        return default
    if not isinstance(table, dict):
        raise AdapterError("rank_pattern and alpha_pattern are JSON objects")
    for pattern, value in table.items():
        try:
            if re.fullmatch(rf"(.*\.)?{pattern}", module):
                return value
        except re.error as exc:
            shown = str(pattern)[:64]
            raise AdapterError(f"pattern {shown!r} is not a regular expression ({exc})") from None
    return default


def scale_of(cfg: dict[str, Any], module: str) -> float:
    """`lora_alpha / r`, or `lora_alpha / sqrt(r)` under rsLoRA, for one module."""
    r = _pattern_value(cfg.get("rank_pattern"), module, cfg.get("r", 8))
    alpha = _pattern_value(cfg.get("alpha_pattern"), module, cfg.get("lora_alpha", 8))
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise AdapterError(f"{module}: r is {str(r)[:32]!r}, not a positive whole number")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise AdapterError(f"{module}: lora_alpha is {str(alpha)[:32]!r}, not a finite number")
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def read_tensors(path: str) -> dict[str, torch.Tensor]:
    folder = Path(path)
    file = folder / WEIGHTS[0]
    if file.is_file():
        from safetensors.torch import load_file

        try:
            return load_file(str(file))
        except Exception as exc:  # a truncated or foreign file
            raise AdapterError(f"{path!r}: {WEIGHTS[0]} is not readable ({exc})") from None
    if (folder / WEIGHTS[1]).is_file():
        try:
            out: dict[str, torch.Tensor] = torch.load(folder / WEIGHTS[1], weights_only=True)
        except Exception as exc:
            raise AdapterError(f"{path!r}: {WEIGHTS[1]} is not readable ({exc})") from None
        return out
    raise AdapterError(f"{path!r} is not a LoRA adapter: it has no {' or '.join(WEIGHTS)}")


def read_adapter(
    name: str,
    path: str,
    shapes: dict[tuple[int, str], tuple[int, int]],
    max_rank: int,
    dtype: torch.dtype,
) -> LoraAdapter:
    """Read and check an adapter against the model's adapted projections (`shapes`: (in,
    out) by (layer, target))."""
    cfg = read_config(path)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    modules: dict[tuple[int, str], str] = {}
    for key, tensor in read_tensors(path).items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise AdapterError(
                f"{path!r}: tensor {key} is not a LoRA weight of a decoder projection"
            )
        layer, target, which = int(m.group(1)), m.group(2), m.group(3)
        pairs.setdefault((layer, target), {})[which] = tensor
        modules[(layer, target)] = key.split(".lora_")[0]
    if not pairs:
        raise AdapterError(f"{path!r}: the adapter has no LoRA weights")
    weights: Weights = {}
    for where, ab in sorted(pairs.items()):
        scale = scale_of(cfg, modules[where])
        weights[where] = _checked(path, where, ab, shapes, max_rank, dtype, scale)
    rank = max(int(a.shape[0]) for a, _, _ in weights.values())
    return LoraAdapter(name, path, rank, weights)


def _checked(
    path: str,
    key: tuple[int, str],
    ab: dict[str, torch.Tensor],
    shapes: dict[tuple[int, str], tuple[int, int]],
    max_rank: int,
    dtype: torch.dtype,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    layer, target = key
    where = f"layer {layer} {target}"
    if key not in shapes:
        raise AdapterError(
            f"{path!r} targets {where}, which this model does not have (adaptable: attention "
            "and dense MLP projections of its layers)",
            code="invalid_target",
        )
    if set(ab) != {"A", "B"}:
        raise AdapterError(f"{path!r}: {where} has lora_{''.join(ab)} without its pair")
    a, b = ab["A"], ab["B"]
    fan_in, fan_out = shapes[key]
    rank = int(a.shape[0]) if a.dim() == 2 else -1
    if a.dim() != 2 or b.dim() != 2 or int(b.shape[1]) != rank:
        raise AdapterError(f"{path!r}: {where}'s lora_A and lora_B shapes do not pair up")
    if rank > max_rank:
        raise AdapterError(
            f"{path!r}: rank {rank} ({where}) exceeds the maximum LoRA rank {max_rank} "
            "(--max-lora-rank)",
            code="rank_too_large",
        )
    if int(a.shape[1]) != fan_in or int(b.shape[0]) != fan_out:
        raise AdapterError(
            f"{path!r} does not fit this base model: {where} maps {fan_in} -> {fan_out}, the "
            f"adapter {int(a.shape[1])} -> {int(b.shape[0])}",
            code="base_model_mismatch",
        )
    return a.to(dtype).contiguous(), b.to(dtype).contiguous(), scale
