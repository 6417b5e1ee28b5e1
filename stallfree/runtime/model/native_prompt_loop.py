"""A prompt's decoder layers as one native call (`torch.ops.stallfree.prefill_layers`,
csrc/prompt_layers.cpp): the loop of `LlamaDecoderLayer.fused_forward` over an extend step,
driven from C++ over the same operators, so the result is bit for bit the Python loop's and only
the Python between the calls is gone: about 10 module calls, their checks and frames per layer,
during which the second compute thread waits for the first.

It takes an extend step only where every call of it would have been native or torch's own
anyway. In bfloat16: Llama-family layers with a joint q/k/v projection and a stacked gate/up
projection (`fuse_projections`), with per-head q/k norms (Qwen3) or without, each projection on
the AMX tiles at this row count (`tiles_take`: more rows than the matrix-vector kernels take, up
to native_layers.PROMPT_TILES_MAX_ROWS) or without them on the AVX-512 variant's prompt product
(any row count; an integer weight dequantised 16 rows at a time as it goes), on
`--prepack-prompt-weights`' blocked copy past its
threshold, or, past the tiles' rows, a dense layer's F.linear (`at::linear` there; an integer
layer's dequantised product past the tiles stays in Python), head dims the tiles' prompt
attention takes. In float32 (dense layers, which keep transformers' separate projections and
sums), past the rows of the grouped native call: q, k and v three F.linear calls, o and down
F.linear, gate and up side by side (`native_layers.side_by_side`), the prompt attention's
vector path; on a CPU not Intel's, where the model stacks q/k/v and gate/up
(`native_layers.stacks_float32`), the four products on oneDNN with the weights as they are
(`native_layers.float32_product`). Either way: a cache in the model's dtype, no LoRA rows,
tensor-parallel size 1, not compiled. A mixed step's one-token tail (two or more trailing
decode rows) takes the decode attention op inside the loop, as `PagedAttention` runs it in
Python. Everything else stays in Python.
`STALLFREE_NATIVE_LOOP=0` turns it off, with the decode step's loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from stallfree.runtime.model import cpu_kernels, native_layers, native_loop
from stallfree.runtime.model.attention import PagedAttention, bf16_prompt_native
from stallfree.runtime.model.forward_batch import ForwardBatch, ForwardMode
from stallfree.runtime.model.native_layers import NativeLinear
from stallfree.runtime.model.quant import Int4Linear, Int8Linear

Layer = Any  # llama.py's `LlamaDecoderLayer` (llama.py imports this module)

# csrc/prompt_layers.cpp's projection kinds: the tiles' products, oneDNN's (F.linear, or on
# `--prepack-prompt-weights`' blocked copy, or on a float32 weight as it is where
# `native_layers.float32_on_onednn`), float32's gate and up side by side (the count follows),
# and float32's q, k and v as three calls (APART: the next three)
BF16, Q8, Q4, TORCH, PREPACKED, SIDE, APART = range(7)
TILES = (BF16, Q8, Q4)


# a dense float32 layer: nn.Linear, or the same switched to the native kernels' few rows
_DENSE = (nn.Linear, NativeLinear)

# the plan of a prompt's layers: native_loop's, its kinds this module's
Plan = native_loop.Plan


def _projection(
    module: nn.Module, rows: int, dtype: torch.dtype
) -> tuple[int, list[torch.Tensor | None]] | None:
    """How `module` runs a prompt of `rows` rows in `dtype`, as a kind and its tensors: on the
    prompt products (the tiles, or without them on the AVX-512 variant at any row count, an
    integer weight dequantised as it goes), on `--prepack-prompt-weights`' copy past its
    threshold, or (a dense layer past the tiles' rows) F.linear; None where it would run
    otherwise (an integer layer past the tiles' rows, or of a float32 model)."""
    tensors: list[torch.Tensor | None]
    if type(module) is NativeLinear and module.compact_only:
        return None  # no dense weight to read: its own forward decodes it (compact_only.py)
    if type(module) is NativeLinear and module.weight.dtype == torch.float32:
        # a stacked float32 layer (`native_layers.stacks_float32`) past the native kernel's
        # rows, as `native_layers.float32_product` runs it: oneDNN on the weight as it is, or
        # F.linear
        if rows <= native_layers.dense_max_rows(torch.float32):
            return None
        onednn = native_layers.float32_on_onednn()
        return (PREPACKED if onednn else TORCH), [module.weight, module.bias]
    if type(module) is NativeLinear and rows > native_layers.dense_max_rows(torch.bfloat16):
        # NativeLinear.forward's order: the prepacked copy, the tiles, F.linear
        if module.weight_prepacked is not None and rows >= native_layers.PREPACKED_MIN_ROWS:
            return PREPACKED, [module.weight_prepacked, module.bias]
        if rows > native_layers.prompt_product_max_rows():
            return TORCH, [module.weight, module.bias]
    if type(module) is NativeLinear:
        kind, tensors = BF16, [module.weight, module.bias_f32]
    elif type(module) is Int8Linear:
        scale = module.scale_f32 if module.block_scale is None else None
        kind, tensors = (
            Q8,
            [module.qweight, scale, module.block_scale, module.bias_f32, module.bias],
        )
    elif type(module) is Int4Linear:
        kind = Q4
        tensors = [module.codes, module.q4_scale, module.q4_offset, module.bias_f32, module.bias]
    else:
        return None
    # (an integer layer of a float32 model runs its prompt in Python: the prompt products take
    # bfloat16 activations)
    return (kind, tensors) if module.tiles_take(rows, dtype) else None


Part = tuple[list[int], list[torch.Tensor | None]]  # a projection's spec entries and tensors


def _float32_layer(layer: Layer, rows: int) -> list[Part] | None:
    """A float32 layer's projections apart (transformers' sums) as the Python loop runs a
    prompt past the grouped native call's rows, or None: q, k and v three F.linear calls
    (`LlamaAttention.project`), o and down F.linear, gate and up `native_layers.side_by_side`
    (each its own torch.mm into one output, so `silu_mul` reads them in one pass). Where
    `native_layers.float32_on_onednn` the model stacks them (`native_layers.stacks_float32`,
    planned by `_layer`); a layer kept apart there stays in Python."""
    attn, mlp = layer.self_attn, layer.mlp
    if rows <= native_layers.dense_max_rows(torch.float32) or native_layers.float32_on_onednn():
        return None
    # a mixture of experts' MLP has none of these
    gate, up, down = (getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj"))
    if attn.qkv_proj is not None or getattr(mlp, "gate_up_proj", None) is not None:
        return None
    if not (isinstance(gate, nn.Linear) and isinstance(up, nn.Linear) and down is not None):
        return None
    plain = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, down)
    if any(type(m) not in _DENSE or m.weight.dtype != torch.float32 for m in plain):
        return None
    side = native_layers.group_weights([gate, up], torch.float32)
    if side is None:
        return None
    qkv: Part = ([APART], [])
    for m in plain[:3]:
        qkv[0].append(TORCH)
        qkv[1].extend([m.weight, m.bias])
    return [
        qkv,
        ([TORCH], [attn.o_proj.weight, attn.o_proj.bias]),
        ([SIDE, len(side)], list(side)),
        ([TORCH], [down.weight, down.bias]),
    ]


def _layer(layer: Layer, rows: int, dtype: torch.dtype) -> list[Part] | None:
    """The layer's q/k/v, o, gate/up and down projections, or None."""
    attn, mlp = layer.self_attn, layer.mlp
    gate_up, down = getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)
    if (
        attn.qkv_proj is None
        or gate_up is None
        or down is None
        # native_layers.mlp_on_tiles' shapes: gate and up stacked, whole blocks of 32
        or gate_up.in_features != down.out_features
        or gate_up.out_features != 2 * down.in_features
        or down.in_features % 32 != 0
    ):
        return None
    parts = [_projection(m, rows, dtype) for m in (attn.qkv_proj, attn.o_proj, gate_up, down)]
    if any(part is None for part in parts):
        return None
    # the MLP's two products both on the tiles (the packed hand-off), or both F.linear
    mlp_kinds = [part[0] for part in parts[2:] if part is not None]
    if (mlp_kinds[0] in TILES) != (mlp_kinds[1] in TILES):
        return None
    return [([kind], tensors) for kind, tensors in parts]  # type: ignore[misc]


def plan(
    layers: Sequence[Layer], rows: int, backend: PagedAttention, cache: torch.dtype,
    dtype: torch.dtype = torch.bfloat16,
) -> Plan | None:  # fmt: skip
    """The plan for a prompt of `rows` rows in `dtype` (bfloat16 or float32), or None where
    some layer would not run every call of it on the native prompt path."""
    norms: list[torch.Tensor] = []
    params: list[torch.Tensor | None] = []
    spec: list[int] = []
    qk = native_loop.qk_norms(layers, dtype)
    windows = native_loop.layer_windows(backend, len(layers), cache)
    if qk is None or windows is None or not native_loop.same_layers(layers):
        return None
    if dtype == torch.float32 and qk[0]:
        # Qwen3's per-head norms: the Python loop norms float32 q and k as the projections'
        # own contiguous tensors, the loop on strided head views of the joined q/k/v, and
        # torch's float32 statistics differ in their last bits between the two
        return None
    for layer in layers:
        stacked = layer.self_attn.qkv_proj is not None
        parts = (
            _float32_layer(layer, rows)
            if dtype == torch.float32 and not stacked
            else _layer(layer, rows, dtype)
        )
        if parts is None:
            return None
        for kinds, tensors in parts:
            spec += kinds
            params += tensors
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            w = norm.weight
            if w.dtype != dtype or not w.is_contiguous():
                return None
            norms.append(w)
    return Plan(
        norms, params, spec, qk_norms=qk[0], qk_eps=qk[1], windows=windows, softcap=backend.softcap
    )


def takes(
    layers: Sequence[Layer], backend: object, h: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor], fb: ForwardBatch,
) -> bool:  # fmt: skip
    """Whether the step's facts (not its layers') let the loop run it."""
    if fb.mode is not ForwardMode.EXTEND or fb.lora is not None or not layers:
        return False
    attn = layers[0].self_attn
    dim, t = attn.head_dim, h.shape[0]
    cos, signed_sin = rope
    kv = fb.kv_cache
    loc = fb.out_cache_loc
    dtype = h.dtype
    if dtype == torch.bfloat16:
        # the prompt products (the tiles, or `vdpbf16ps` without them) and the native prompt
        # attention (attention._native_prompt for bfloat16)
        native = (
            dim % 32 == 0
            and native_layers.prompt_product_max_rows() > 0
            and bf16_prompt_native(dim)
        )
    else:
        # float32: torch's own products (MKL's), the native prompt attention's vector path
        native = dtype == torch.float32 and dim % 16 == 0
    return (
        native
        and isinstance(backend, PagedAttention)
        and backend.takes_rope
        and h.dim() == 2
        and h.is_contiguous()
        and h.device.type == "cpu"
        and dim <= 256
        and attn.num_heads % attn.num_kv_heads == 0
        and cos.dtype == signed_sin.dtype == dtype
        and cos.shape == signed_sin.shape == (t, 1, dim)
        and cos.stride(2) == signed_sin.stride(2) == 1
        and not kv.format.quantized
        and kv.k_buffers[0].dtype == kv.v_buffers[0].dtype == dtype
        and kv.k_buffers[0].shape[1:] == (attn.num_kv_heads, dim)
        and all(b.is_contiguous() for b in (*kv.k_buffers, *kv.v_buffers))
        and loc.dtype == torch.int64
        and loc.dim() == 1
        and loc.shape[0] == t
        and loc.is_contiguous()
        # a decode tail's rows take the native decode attention (`decode_attention`)
        and fb.req_to_token.dtype in (torch.int32, torch.int64)
        and not torch.compiler.is_compiling()
        and not torch.is_grad_enabled()
        and cpu_kernels.available()
    )


def run(
    layers: Sequence[Layer],
    backend: object,
    h: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    fb: ForwardBatch,
    plans: dict[native_loop.PlanKey, Plan | None],
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the last layer's output, the residual stream before it), as `fused_forward`'s loop
    returns them, or None when the step stays in Python. `plans` caches `plan` per row count,
    dtype and the backend's windows and soft-cap (`PagedAttention.loop_facts`), as
    `native_loop.run` caches its own."""
    if not takes(layers, backend, h, rope, fb):
        return None
    assert isinstance(backend, PagedAttention)
    # past the tiles' rows every row count takes the same plan (as it does past the thresholds
    # below them where the prompt product takes any number): one entry for all of them
    rows = min(h.shape[0], native_layers.PROMPT_TILES_MAX_ROWS + 1)
    key = (rows, h.dtype, backend.loop_facts())
    if key not in plans:
        plans[key] = plan(layers, rows, backend, fb.kv_cache.k_buffers[0].dtype, h.dtype)
    step = plans[key]
    if step is None:
        return None
    out, residual = torch.ops.stallfree.prefill_layers(
        *arguments(layers, backend, h, rope, fb, step)
    )
    return out, residual


def arguments(
    layers: Sequence[Layer],
    backend: PagedAttention,
    h: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    fb: ForwardBatch,
    step: Plan,
) -> tuple[object, ...]:
    """`prefill_layers`' arguments for this step."""
    first = layers[0].self_attn
    kv = fb.kv_cache
    return (
        h,
        *rope,
        kv.k_buffers,
        kv.v_buffers,
        fb.out_cache_loc,
        fb.req_to_token,
        list(fb.extend_lens_cpu),
        list(fb.prefix_lens_cpu),
        fb.req_pool_indices_cpu.tolist(),
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
