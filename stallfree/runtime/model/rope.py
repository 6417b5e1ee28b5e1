"""Rotary position embeddings: the inverse frequencies of each scaling type, computed as
transformers computes them, and their application to q and k."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

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
    raise ValueError(
        f"unsupported rope scaling type {rope_type!r}; supported: default, linear, llama3"
    )


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
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", self._inv_freq_f32.clone(), persistent=False)

    def _apply(
        self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
    ) -> RotaryEmbedding:
        # model.to(dtype) would round inv_freq; HF keeps it float32, so re-derive from the master.
        super()._apply(fn, recurse)
        self.inv_freq = self._inv_freq_f32.to(self.inv_freq.device)
        return self

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) for `apply_rope`, once per step for every layer."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos = torch.cat((freqs, freqs), dim=-1).cos().to(dtype)
        sin = freqs.sin().to(dtype)
        return cos[:, None, :], torch.cat((-sin, sin), dim=-1)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' `x * cos + rotate_half(x) * sin`, bit for bit, in four kernels: with
    `rotate_half(x) = cat(-x2, x1)` and `sin = cat(s, s)`, `rotate_half(x) * sin` is
    `roll(x, half) * cat(-s, s)` (negating is exact)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin
