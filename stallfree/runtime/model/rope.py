"""Rotary position embeddings: the inverse frequencies of each scaling type, computed as
transformers computes them, and their application to q and k."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from stallfree.runtime.model import cpu_kernels

if TYPE_CHECKING:
    from stallfree.runtime.model.arch import ModelArchConfig


def rope_inv_freq(arch: ModelArchConfig) -> torch.Tensor:
    """Float32 inverse frequencies on the host, computed exactly as HF does."""
    dim = arch.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (arch.rope_theta**exponents)
    scaling = arch.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "dynamic":
        # NTK scaling grows the base only past max_position_embeddings, the engine's limit:
        # below it transformers' formula is the default's, bit for bit
        return inv_freq
    if rope_type == "yarn":
        return _yarn_inv_freq(arch.rope_theta, dim, scaling)
    if rope_type == "longrope":
        # the short factors: the context stops at original_max_position_embeddings (arch.py)
        factors = torch.tensor(scaling["short_factor"], dtype=torch.float32)
        return 1.0 / (factors * arch.rope_theta**exponents)
    raise ValueError(
        f"unsupported rope scaling type {rope_type!r}; "
        "supported: default, linear, llama3, dynamic, yarn, longrope"
    )


def rope_attention_factor(arch: ModelArchConfig) -> float:
    """The factor transformers multiplies cos and sin by (yarn's mscale, longrope's
    `sqrt(1 + log(factor) / log(original context))`); 1.0 for the other types."""
    scaling = arch.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    given = scaling.get("attention_factor")
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    if given is not None:
        return float(given)
    factor = float(scaling["factor"])
    if rope_type == "longrope":
        if factor <= 1.0:
            return 1.0
        original = float(scaling["original_max_position_embeddings"])
        return math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(base: float, dim: int, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: interpolated (divided by `factor`) for the slow dimensions, kept for the fast
    ones, blended linearly between the dimensions that turn `beta_slow` and `beta_fast`
    times over the pretraining context."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_ctx / high) * ~(wavelen > old_ctx / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self._inv_freq_f32 = rope_inv_freq(arch)
        self.attention_factor = rope_attention_factor(arch)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", self._inv_freq_f32.clone(), persistent=False)

    def _apply(
        self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
    ) -> RotaryEmbedding:
        # model.to(dtype) would round inv_freq; HF keeps it float32, so re-derive from the master.
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        self.inv_freq = self._inv_freq_f32.to(self.inv_freq.device)
        return self

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) for `apply_rope`, once per step for every layer."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = torch.cat((freqs, freqs), dim=-1).cos(), freqs.sin()
        if self.attention_factor != 1.0:  # in float32, as transformers scales them
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        cos, sin = cos.to(dtype), sin.to(dtype)
        return cos[:, None, :], torch.cat((-sin, sin), dim=-1)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' `x * cos + rotate_half(x) * sin`, bit for bit, in four kernels: with
    `rotate_half(x) = cat(-x2, x1)` and `sin = cat(s, s)`, `rotate_half(x) * sin` is
    `roll(x, half) * cat(-s, s)` (negating is exact)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


def rope_rows(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope` on x [T, H, D] (a view with any row and head strides), the same bits, in
    one native call where the kernels run (a prompt step's q and k: apply_rope's four kernels
    are each a pass over them); `apply_rope` otherwise, and while torch.compile traces."""
    if (
        x.device.type == "cpu"
        and x.dim() == 3
        and x.dtype in (torch.float32, torch.bfloat16)
        and cos.dtype == signed_sin.dtype == x.dtype
        and x.stride(2) == 1
        and not (torch.is_grad_enabled() and x.requires_grad)
        and not torch.compiler.is_compiling()
        and cpu_kernels.available()
    ):
        out: torch.Tensor = torch.ops.stallfree.rope(x, cos, signed_sin)
        return out
    return apply_rope(x, cos, signed_sin)
