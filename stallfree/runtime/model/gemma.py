"""Gemma 2 and Gemma 3 (text) decoders, built from llama.py's pieces, with HF parameter names.

What differs from Llama: the embedding is scaled by sqrt(hidden_size) (the factor rounded to
the hidden dtype, as transformers does); every RMSNorm scales by `1 + weight` in float32 before
casting back; four norms per layer (the attention's and the MLP's outputs are normed before
their residual adds); a GeLU-tanh MLP; attention scaled by `query_pre_attn_scalar ** -0.5`;
layers alternate between a sliding window and full attention (`ModelArchConfig.layer_types`,
applied per layer by `PagedAttention`). Gemma 2 soft-caps the attention scores and the final
logits with tanh; Gemma 3 norms each head of q and k (the same `1 + weight` form) and gives its
sliding layers their own RoPE base (`rope_local_theta`), its full layers `rope_theta` and
`rope_scaling`.

Tensor parallelism shards as Llama's (parallel.py); the norms are replicated.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from stallfree.runtime.model.attention import PagedAttention
from stallfree.runtime.model.forward_batch import ForwardBatch
from stallfree.runtime.model.llama import (
    AttentionBackend,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    RMSNorm,
    _row_parallel,
)
from stallfree.runtime.model.parallel import TPGroup
from stallfree.runtime.model.rope import RotaryEmbedding

if TYPE_CHECKING:
    from stallfree.runtime.model.arch import ModelArchConfig

_HAS_RMS_NORM = hasattr(torch, "rms_norm")  # torch >= 2.4


class GemmaRMSNorm(RMSNorm):
    """`(x / rms(x)) * (1 + weight)` in float32, then cast to x's dtype (the weight starts at 0;
    Llama's casts before scaling)."""

    def __init__(self, dim: int, eps: float, **factory: Any) -> None:
        super().__init__(dim, eps, **factory)
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        if _HAS_RMS_NORM:
            h = torch.rms_norm(h, h.shape[-1:], None, self.eps)
        else:
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).split((self.inter, self.inter), dim=-1)
            x = F.gelu(gate, approximate="tanh") * up
        else:
            x = F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x)
        if self.tp.size == 1:
            out: torch.Tensor = self.down_proj(x)
            return out
        return _row_parallel(self.down_proj, x, self.tp)


class GemmaAttention(LlamaAttention):
    """Llama's projections; Gemma 3's per-head q/k norms; its layer's RoPE of the two."""

    def __init__(self, arch: ModelArchConfig, layer_id: int, tp: TPGroup, **factory: Any) -> None:
        super().__init__(arch, layer_id, tp, **factory)
        if arch.qk_norm:  # Gemma 3: in place of Llama's norms, the `1 + weight` form
            self.q_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps, **factory)
            self.k_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps, **factory)
        # which of `GemmaRotary`'s stacked tables this layer takes (None: a single table)
        self.rope_index: int | None = None
        if arch.rope_local_theta is not None:
            sliding = (
                arch.layer_types is not None and arch.layer_types[layer_id] != "full_attention"
            )
            self.rope_index = 0 if sliding else 1

    def layer_rope(
        self, cos: torch.Tensor, signed_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rope_index is not None:
            return cos[self.rope_index], signed_sin[self.rope_index]
        return cos, signed_sin


class GemmaDecoderLayer(LlamaDecoderLayer):
    def __init__(self, arch: ModelArchConfig, layer_id: int, tp: TPGroup, **factory: Any) -> None:
        nn.Module.__init__(self)  # not Llama's modules: Gemma's own below
        dim, eps = arch.hidden_size, arch.rms_norm_eps
        self.self_attn = GemmaAttention(arch, layer_id, tp, **factory)
        self.mlp = GemmaMLP(arch, tp, **factory)
        self.input_layernorm = GemmaRMSNorm(dim, eps, **factory)
        self.post_attention_layernorm = GemmaRMSNorm(dim, eps, **factory)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps, **factory)
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps, **factory)

    def forward(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        fb: ForwardBatch,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(h), rope, fb, backend)
        h = h + self.post_attention_layernorm(attn)
        out: torch.Tensor = h + self.post_feedforward_layernorm(
            self.mlp(self.pre_feedforward_layernorm(h))
        )
        return out


class GemmaRotary(RotaryEmbedding):
    """Gemma 3's two RoPE tables, stacked: [0] the sliding layers' (`rope_local_theta`,
    unscaled, this module's own), [1] the full layers' (`rope_theta`, `rope_scaling`)."""

    def __init__(self, arch: ModelArchConfig) -> None:
        assert arch.rope_local_theta is not None
        super().__init__(replace(arch, rope_theta=arch.rope_local_theta, rope_scaling=None))
        self.full = RotaryEmbedding(arch)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos_l, sin_l = super().forward(positions, dtype)
        cos_g, sin_g = self.full(positions, dtype)
        return torch.stack((cos_l, cos_g)), torch.stack((sin_l, sin_g))


class GemmaModel(LlamaModel):
    layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm

    @staticmethod
    def rotary(arch: ModelArchConfig) -> RotaryEmbedding:
        return GemmaRotary(arch) if arch.rope_local_theta is not None else RotaryEmbedding(arch)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma2ForCausalLM and Gemma3ForCausalLM: `LlamaForCausalLM`'s forward, quantization,
    fusing and compiling over Gemma's layers."""

    model_cls = GemmaModel

    def __init__(
        self,
        arch: ModelArchConfig,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__(arch, device, dtype, tp)
        scalar = arch.query_pre_attn_scalar
        self.attn_backend = PagedAttention(
            arch.sliding_window,
            layer_windows=arch.layer_windows(),
            scale=None if scalar is None else scalar**-0.5,
            softcap=arch.attn_logit_softcapping,
        )
        # transformers keeps sqrt(hidden) as a float32 tensor and rounds it to the hidden dtype
        self.embed_scale: torch.Tensor
        self.register_buffer("embed_scale", torch.tensor(arch.hidden_size**0.5), persistent=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        h = super().embed(ids)
        return h * self.embed_scale.to(h.dtype)

    def _output(self, x: torch.Tensor) -> torch.Tensor:
        logits = super()._output(x)
        cap = self.arch.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

    def compile_layers(self) -> None:
        """As `LlamaForCausalLM.compile_layers`, with Gemma's norms after attention."""
        super().compile_layers()
        assert self.compiled is not None
        self.compiled = (self.compiled[0], torch.compile(_gemma_after_attention, dynamic=True))


def _gemma_after_attention(
    layer: GemmaDecoderLayer, h: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    h = h + layer.post_attention_layernorm(layer.self_attn.o_proj(out))
    mlp = layer.mlp(layer.pre_feedforward_layernorm(h))
    after: torch.Tensor = h + layer.post_feedforward_layernorm(mlp)
    return after


# the Hugging Face architectures this module builds
GEMMA_MODELS: dict[str, type[LlamaForCausalLM]] = {
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
}
