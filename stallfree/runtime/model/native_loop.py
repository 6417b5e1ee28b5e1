"""A decode step's decoder layers as one native call (`torch.ops.stallfree.decode_layers`,
csrc/layers.cpp): the loop of `LlamaDecoderLayer.fused_forward` driven from C++ over the same
operators, so the result is bit for bit the Python loop's and only the Python between the
calls (about 10 module calls, checks and frames per layer) is gone.

It takes a step only where every layer would have run on native calls anyway: Llama-family
layers with a joint q/k/v projection, per-head q/k RMSNorms (Qwen3) or none, any sliding
window or soft-cap the attention backend has (Mistral's window), a decode batch on the CPU with
the kernels on, no LoRA rows, tensor-parallel size 1, not compiled, a dense MLP (a mixture of
experts stays in Python). Each projection is described once per row count (`plan`) as a kind
and its tensors; anything else (a projection that would not take its native kernel at this row
count) leaves the step to Python. `STALLFREE_NATIVE_LOOP=0` turns it off.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from stallfree.runtime.model import native_layers
from stallfree.runtime.model.attention import PagedAttention
from stallfree.runtime.model.forward_batch import ForwardBatch, ForwardMode
from stallfree.runtime.model.native_layers import NativeLinear
from stallfree.runtime.model.padded_rows import rows_contiguous
from stallfree.runtime.model.quant import Int4Linear, Int8Linear

# The layers are llama.py's `LlamaDecoderLayer`s (llama.py imports this module, so they are
# typed by what is read off them here, not by that class)
Layer = Any

# csrc/layers.cpp's projection kinds (APART: q, k and v are the next three projections)
NATIVE, Q8_ROWS, Q8_BLOCKS, Q4, TORCH, GROUP, APART, COMPACT = range(8)


# a cached plan's key: (rows, dtype, the backend's `loop_facts()`)
PlanKey = tuple[int, torch.dtype, tuple[object, ...]]


def enabled() -> bool:
    return os.environ.get("STALLFREE_NATIVE_LOOP", "1").strip().lower() not in (
        "0",
        "off",
        "false",
        "no",
    )


@dataclass(frozen=True)
class Plan:
    """Every layer's norms and projections for one row count, in `decode_layers`' order."""

    norms: list[torch.Tensor]
    params: list[torch.Tensor | None]
    spec: list[int]
    # each layer's q and k norm weights (Qwen3), none for layers without, and their epsilon
    qk_norms: list[torch.Tensor] = field(default_factory=list)
    qk_eps: float = 0.0
    # each layer's window, 0 for none (empty: none anywhere), and the scores' soft-cap
    windows: list[int] = field(default_factory=list)
    softcap: float | None = None


def _projection(
    module: nn.Module, rows: int, dtype: torch.dtype
) -> tuple[list[int], list[torch.Tensor | None]] | None:
    """How `module` runs `rows` rows of `dtype` in the Python loop, as a kind and its
    tensors; None where that is not one of the kinds (the step stays in Python)."""
    if isinstance(module, NativeLinear):
        if dtype == module.weight.dtype and module.compact_rows(rows):
            return [COMPACT], [
                module.weight,
                module.compact_codes,
                module.compact_tables,
                module.bias_f32,
            ]
        if module.compact_only:
            return None  # no dense weight: decoded a block at a time (`decompacted_product`)
        if (
            dtype == module.weight.dtype
            and rows_contiguous(module.weight)
            and rows <= native_layers.dense_max_rows(dtype)
        ):
            return [NATIVE], [module.weight, module.bias_f32]
        # more rows: NativeLinear.forward's own fallback, F.linear with the layer's bias
        return [TORCH], [module.weight, module.bias]
    if isinstance(module, Int8Linear):
        if not module.takes_native(rows, dtype):
            return None
        if module.block_scale is not None:
            return [Q8_BLOCKS], [module.qweight, module.block_scale, module.bias_f32]
        return [Q8_ROWS], [module.qweight, module.scale_f32, module.bias_f32]
    if isinstance(module, Int4Linear):
        if not module.takes_native(rows, dtype):
            return None
        return [Q4], [module.codes, module.q4_scale, module.q4_offset, module.bias_f32]
    if type(module) is nn.Linear:
        return [TORCH], [module.weight, module.bias]
    return None


def _group(
    layers: list[nn.Module], rows: int, dtype: torch.dtype
) -> tuple[list[int], list[torch.Tensor | None]] | None:
    """`native_layers.grouped`'s one call for projections kept apart, where it applies."""
    if rows > native_layers.dense_max_rows(dtype):
        return None
    weights = native_layers.group_weights(layers, dtype)
    if weights is None:
        return None
    return [GROUP, len(weights)], list(weights)


def _apart(
    layers: list[nn.Module], rows: int, dtype: torch.dtype
) -> tuple[list[int], list[torch.Tensor | None]] | None:
    """q, k and v as three calls (`LlamaAttention.project` where they are neither fused nor
    grouped: float32 with biases), each as `_projection` runs it."""
    spec, params = [APART], []
    for layer in layers:
        part = _projection(layer, rows, dtype)
        if part is None:
            return None
        spec += part[0]
        params += part[1]
    return spec, params


def qk_norms(
    layers: Sequence[Layer], dtype: torch.dtype
) -> tuple[list[torch.Tensor], float] | None:
    """Every layer's q and k norm weights and their one epsilon; ([], 0.0) where no layer has
    them; None where some do and some do not, or a norm is not the Python loop's RMSNorm on the
    native kernel's terms (a weight in the step's dtype, contiguous)."""
    if all(layer.self_attn.q_norm is None and layer.self_attn.k_norm is None for layer in layers):
        return [], 0.0
    if layers[0].self_attn.q_norm is None:
        return None
    eps = float(layers[0].self_attn.q_norm.eps)
    weights: list[torch.Tensor] = []
    for layer in layers:
        rms = type(layer.input_layernorm)  # llama.py's RMSNorm (`_fuses_residual` checks)
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            if type(norm) is not rms or norm.eps != eps:
                return None
            w = norm.weight
            if w.dtype != dtype or not w.is_contiguous():
                return None
            weights.append(w)
    return weights, eps


def _parts(layer: Layer, rows: int, dtype: torch.dtype) -> list[Any] | None:
    """The layer's q/k/v, o, gate/up and down projections as (kinds, tensors), or None."""
    attn = layer.self_attn
    mlp: Any = layer.mlp  # a dense MLP, or a mixture of experts (none of its projections)
    qkv = (
        _projection(attn.qkv_proj, rows, dtype)
        if attn.qkv_proj is not None
        else _group([attn.q_proj, attn.k_proj, attn.v_proj], rows, dtype)
        or _apart([attn.q_proj, attn.k_proj, attn.v_proj], rows, dtype)
    )
    fused, down = getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)
    if down is None or (fused is None and not hasattr(mlp, "gate_proj")):
        return None
    gate_up = (
        _projection(fused, rows, dtype)
        if fused is not None
        else _group([mlp.gate_proj, mlp.up_proj], rows, dtype)
    )
    parts = [qkv, _projection(attn.o_proj, rows, dtype), gate_up, _projection(down, rows, dtype)]
    return None if any(part is None for part in parts) else parts


def plan(layers: Sequence[Layer], rows: int, dtype: torch.dtype) -> Plan | None:
    """The step's plan for `rows` rows of `dtype`, or None when a layer is not one the loop
    runs exactly as Python would (no windows or soft-cap: `run` adds the backend's)."""
    norms: list[torch.Tensor] = []
    params: list[torch.Tensor | None] = []
    spec: list[int] = []
    qk = qk_norms(layers, dtype)
    if qk is None or not same_layers(layers):
        return None
    for layer in layers:
        parts = _parts(layer, rows, dtype)
        if parts is None:
            return None
        for kinds, tensors in parts:
            spec += kinds
            params += tensors
        norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    return Plan(norms, params, spec, qk_norms=qk[0], qk_eps=qk[1])


def same_layers(layers: Sequence[Layer]) -> bool:
    """Whether every layer is a whole one (tensor-parallel size 1) with the first's head shape
    and norm epsilon, as both loops (this one and native_prompt_loop's) pass them once."""
    first = layers[0]
    shape = (first.self_attn.num_heads, first.self_attn.num_kv_heads, first.self_attn.head_dim)
    eps = first.input_layernorm.eps
    for layer in layers:
        attn = layer.self_attn
        if (
            attn.tp.size != 1
            or getattr(layer.mlp, "tp", attn.tp).size != 1
            or (attn.num_heads, attn.num_kv_heads, attn.head_dim) != shape
            or layer.input_layernorm.eps != eps
            or layer.post_attention_layernorm.eps != eps
        ):
            return False
    return True


def layer_windows(backend: PagedAttention, layers: int, cache: torch.dtype) -> list[int] | None:
    """Each layer's window as the loops' ops take it (0: none; [] where no layer has one), or
    None where the cache is not one the native ops read (or a window is one they would not
    take as the Python loop passes it)."""
    windows = backend.loop_windows(layers, cache)
    if windows is None or any(w is not None and w <= 0 for w in windows):
        return None
    return [] if all(w is None for w in windows) else [w or 0 for w in windows]


def _with_attention(
    step: Plan | None, backend: PagedAttention, layers: int, cache: torch.dtype
) -> Plan | None:
    """`step` with the backend's windows and soft-cap, or None where `layer_windows` is."""
    windows = layer_windows(backend, layers, cache)
    if step is None or windows is None:
        return None
    return replace(step, windows=windows, softcap=backend.softcap)


def run(
    layers: Sequence[Layer],
    backend: object,
    h: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    fb: ForwardBatch,
    plans: dict[PlanKey, Plan | None],
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the last layer's output, the residual stream before it), as `fused_forward`'s loop
    returns them, or None when the step stays in Python. `plans` caches `plan` per row count,
    dtype and the backend's windows and soft-cap (`PagedAttention.loop_facts`: the model's
    weights do not change once loaded, but those can be set)."""
    if fb.mode is not ForwardMode.DECODE or fb.lora is not None or not layers:
        return None
    first = layers[0].self_attn
    kv = fb.kv_cache
    if (
        not isinstance(backend, PagedAttention)
        or not backend.takes_rope  # the Python loop's condition for the fused decode op
        or not backend.takes_qkv(
            h.dtype, first.head_dim, first.num_heads, first.num_kv_heads, fb, rope
        )
    ):
        return None
    key = (h.shape[0], h.dtype, backend.loop_facts())
    if key not in plans:
        step = plan(layers, h.shape[0], h.dtype)
        plans[key] = _with_attention(step, backend, len(layers), kv.k_buffers[0].dtype)
    step = plans[key]
    if step is None:
        return None
    args = arguments(layers, backend, h, rope, fb, step)
    out, residual = torch.ops.stallfree.decode_layers(*args)
    return out, residual


def arguments(
    layers: Sequence[Layer],
    backend: PagedAttention,
    h: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    fb: ForwardBatch,
    step: Plan,
) -> tuple[object, ...]:
    """`decode_layers`' arguments for this step."""
    first = layers[0].self_attn
    kv = fb.kv_cache
    return (
        h,
        *rope,
        kv.k_buffers,
        kv.v_buffers,
        fb.out_cache_loc,
        fb.req_to_token,
        fb.req_pool_indices,
        fb.seq_lens,
        first.num_heads,
        first.num_kv_heads,
        backend.scale,
        step.norms,
        layers[0].input_layernorm.eps,
        step.params,
        step.spec,
        step.softcap,
        step.windows,
        step.qk_norms,
        step.qk_eps,
    )
