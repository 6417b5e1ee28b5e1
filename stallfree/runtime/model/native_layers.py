"""The model's small ops on the native CPU kernels (`cpu_kernels.py`), each beside its torch
reference: RMSNorm with the residual add fused in, SiLU * up, and dense bfloat16 linears at
a few rows. Every function here takes the native path only where it applies (a CPU tensor in
float32 or bfloat16, contiguous, the library loaded) and otherwise computes the torch way, so
callers never branch on it.

Dense float32 linears take the native kernel at a few rows like bfloat16's. On a CPU that is not
Intel's, where torch's float32 product (MKL's) reads the weights at a third of the native
kernel's speed, a decode step's float32 rows go further on the kernel and a prompt's run on
oneDNN (`float32_product`); on Intel's a float32 prompt stays on F.linear, so it keeps
transformers' sums bit for bit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from stallfree.runtime.model import cpu_kernels
from stallfree.runtime.model.decode_rows import in_decode
from stallfree.runtime.model.padded_rows import rows_contiguous

# Up to this many rows (tokens) a dense bfloat16 linear runs on the native matrix-vector
# kernel, which streams the weights once for all rows; a larger call (a prefill chunk) is a
# matrix product, where torch's oneDNN path is faster. With AMX tiles (`cpu_kernels.amx()`)
# the native product stays bound by reading the weights up to AMX_MAX_ROWS, and a decode step's
# rows (`decode_rows.in_decode`) take the tiles up to AMX_DECODE_MAX_ROWS: SmolLM2's four
# projection shapes, 30 copies, two threads, the tiles against F.linear (which re-lays the
# weight out for oneDNN on every call) at 24 rows 15.4 against 20.3 ms, 32 rows 16.1 against
# 21.3, 48 rows 19.6 against 24.4, 64 rows 27.4 against 26.4.
DENSE_MAX_ROWS = 8
AMX_MAX_ROWS = 16
AMX_DECODE_MAX_ROWS = 32
# On the AVX2 variant (no AVX512-BF16) torch has no fast bfloat16 product: held to AVX2, its
# F.linear took 3.5-4.0x the native kernel's time at every row count measured, 8 to 128
# (SmolLM2's five shapes, 2 threads: 128 rows 477 against 119 ms a step), and 3.6x at 512;
# allowed AVX-512 without BF16 (a Cascade Lake's set, which gets this variant too), 1.16-2.93x
# at 8-512 rows. A bfloat16 model
# there (only by asking: `--dtype auto` picks float32 on such CPUs) sends its dense calls to
# the native kernel up to this many rows, and a prompt's past them to `widened_product`.
AVX2_BF16_MAX_ROWS = 128
# On the AVX-512 variant without the tiles (Zen 4 has AVX512-BF16 and no AMX) the
# matrix-vector kernel beats F.linear, which re-lays the weight out on every call, at every
# row count to 96 (SmolLM2's five shapes, 30 copies, two threads on a Zen 4, us a step: 8 rows
# 1864 against 6426, 32 rows 5828 against 9823, 96 rows 17247 against 19398), but past 24 rows
# the prompt product (`linear_bf16_prompt` on `vdpbf16ps`, csrc/bf16_gemm.cpp) beats both:
# SmolLM2's four stacked shapes, 30 copies, two threads, the prompt product against the
# matrix-vector kernel, ms a step: 16 rows 12.8 against 13.2, 24 rows 18.3 against 16.6, 32
# rows 18.7 against 21.7, 64 rows 33.7 against 38.4, 96 rows 48.9 against 55.6.
AVX512_BF16_MAX_ROWS = 24
# bfloat16's limit per variant without the tiles (cpu_kernels.isa())
_BF16_MAX_ROWS: dict[str | None, int] = {"avx2": AVX2_BF16_MAX_ROWS, "avx512": AVX512_BF16_MAX_ROWS}
# torch's float32 product is MKL's, which takes its fast paths on Intel's CPUs only. Elsewhere
# (`cpu_kernels.vendor()`) a decode step's float32 rows go to the native kernel up to these
# many, per variant. On a Zen 4, SmolLM2's two MLP shapes, 120 weights, 2 threads, native
# against F.linear, ms a step: AVX-512 1 row 5.1 against 15.9 (29.9 against 12.2 GB/s), 8 rows
# 17.0 against 38.2, 16 rows 21.1 against 46.7, 64 rows 69.7 against 97.4, 128 rows 142 against
# 214, 256 rows 304 against 357, 512 rows 614 against 578; the AVX2 variant (60 weights) 1 row
# 8.3 against 20.0, 16 rows 19.7 against 27.6, 32 rows 34.2 against 36.9, 64 rows 67.8 against
# 52.9.
F32_DECODE_MAX_ROWS = 256
AVX2_F32_DECODE_MAX_ROWS = 32
_F32_DECODE_MAX_ROWS: dict[str | None, int] = {
    "avx2": AVX2_F32_DECODE_MAX_ROWS,
    "avx512": F32_DECODE_MAX_ROWS,
}
_MKL_FAST = ("GenuineIntel", "")  # '': a CPU Linux does not name is taken for Intel's


def _mkl_slow() -> bool:
    """Whether torch's float32 product (MKL's) is off its fast paths: a CPU not Intel's."""
    return cpu_kernels.vendor() not in _MKL_FAST


def float32_on_onednn() -> bool:
    """Whether float32 products past the native kernel's rows (a prompt's) run on oneDNN rather
    than F.linear: on a CPU that is not Intel's, where F.linear is MKL's slow path. oneDNN's
    product (`mkldnn._linear_pointwise`) takes the weight as it is, with no blocked copy kept:
    on a Zen 4, SmolLM2's two MLP shapes, 60 weights, 2 threads, oneDNN against F.linear, ms a
    step: 64 rows 48.0 against 54.6, 256 rows 141.6 against 181.5, 512 rows 275.2 against 334.8.
    Its sums are not MKL's, so such a prompt's logits are not transformers' bit for bit."""
    return _mkl_slow()


def stacks_float32(device: torch.device) -> bool:
    """Whether a dense float32 model stacks q/k/v and gate/up into one product each, as every
    other format does (loader.fuses): on the CPU where its products leave MKL's sums anyway
    (`float32_on_onednn`, the kernels built: decode rows on the native kernel, prompts on
    oneDNN). There one product over the stacked rows is cheaper than three or two: a Zen 4,
    SmolLM2's 30 layers, 2 threads, oneDNN, ms: 256 rows 315 apart against 285 stacked, 512
    rows 619 against 549. Elsewhere float32 keeps transformers' separate products, bit for
    bit."""
    return device.type == "cpu" and float32_on_onednn() and cpu_kernels.available()


def float32_product(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """F.linear for float32 rows past the native kernel's: on oneDNN where `float32_on_onednn`."""
    if x.device.type == "cpu" and not torch.compiler.is_compiling() and float32_on_onednn():
        return packed_linear(x, weight, bias)
    return F.linear(x, weight, bias)


# A bfloat16 prompt past AVX2_BF16_MAX_ROWS on the AVX2 variant is multiplied in float32 on
# `float32_product` (MKL's or oneDNN's, near the CPU's float32 peak at a prompt's rows), its
# weight widened into a float32 buffer WIDEN_BLOCK_BYTES at most at a time (a block of rows
# that stays in the cache for the product that reads it), the output rounded to bfloat16 once,
# as the native kernel rounds its float32 sums. The matrix-vector kernel multiplies each weight
# vector into three activation rows at a time, loading the activations for every product. On
# a Zen 3 (AVX2 only, 2 threads, a float32 2048^3 product at about 128 GFLOP/s), SmolLM2's
# four stacked shapes, 8 copies on 2 MB pages, ms for all 32, the kernel against this with 2 /
# 4 / 16 MB blocks: 96 rows 70.8 against 76.0 / 67.3 / 67.8, 128 rows 79.1 against 71.6 / 73.5
# / 74.5, 160 rows 84.4 against 89.4 / 85.4 / 82.7, 192 rows 100.4 against 100.6 / 93.2 /
# 92.5, 256 rows 144.2 against 125.6 / 122.1 / 124.1; a 1B Llama's four shapes (3072 / 2048 /
# 16384 x 2048, 2048 x 8192) at 256 rows, the kernel against 4 / 16 / 64 MB blocks: 403.2
# against 339.5 / 326.1 / 319.7.
WIDEN_BLOCK_BYTES = 16 << 20


class _WidenBuffers(threading.local):
    def __init__(self) -> None:
        self.by_width: dict[tuple[int, torch.dtype, bool], torch.Tensor] = {}


_widen_buffers = _WidenBuffers()


def _weight_block(rows: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """This thread's buffer for blocks of at least `rows` weight rows of `k` values in `dtype`
    (one per input width and dtype, grown as needed, reused by every layer). One made under
    inference mode (the engine's forwards) is an inference tensor, which a product outside it
    may not write, so each mode has its own."""
    key = (k, dtype, torch.is_inference_mode_enabled())
    buf = _widen_buffers.by_width.get(key)
    if buf is None or buf.shape[0] < rows:
        buf = _widen_buffers.by_width[key] = torch.empty(rows, k, dtype=dtype)
    return buf


def widens(rows: int, dtype: torch.dtype) -> bool:
    """Whether `rows` rows of `dtype` take `widened_product`: bfloat16 past AVX2_BF16_MAX_ROWS
    on the AVX2 variant, outside torch.compile's tracing."""
    return (
        dtype == torch.bfloat16
        and rows > AVX2_BF16_MAX_ROWS
        and cpu_kernels.isa() == "avx2"
        and not torch.compiler.is_compiling()
    )


def product_in_float32(x: torch.Tensor, k: int) -> bool:
    """Whether `linear` multiplies `x`'s rows (a prompt's) with a dense weight of `k` inputs in
    float32 past the native kernel: float32 rows past `dense_max_rows`, or bfloat16 ones that
    `widens`. An integer layer's dequantised weight can then go to `widened_blocks` a block of
    rows at a time (`quant._QuantLinearBase.dense_product`)."""
    if not applies(x):
        return False
    rows = x.numel() // max(k, 1)
    if x.dtype == torch.float32:
        return rows > dense_max_rows(torch.float32)
    return widens(rows, x.dtype)


def widened_product(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias_f32: torch.Tensor | None,
    compact: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for bfloat16 `x` and `weight` on the CPU, in float32 on
    `float32_product`: the weight's rows widened a block at a time into this thread's buffer
    (WIDEN_BLOCK_BYTES), the sums rounded to bfloat16 once (`bias_f32` added before). With
    `compact` (a layer kept only in its compact form, `decompacted_product`), each block is
    decoded from the codes and tables instead, `weight` holding only the rows that do not fit."""
    n, k = weight.shape

    def fill(n0: int, block: torch.Tensor) -> None:
        if compact is None:
            block.copy_(weight[n0 : n0 + block.shape[0]])
        else:
            torch.ops.stallfree.decompact_bf16(*compact, weight, n0, block)

    return widened_blocks(x, n, k, bias_f32, fill)


def widened_blocks(
    x: torch.Tensor,
    n: int,
    k: int,
    bias_f32: torch.Tensor | None,
    fill: Callable[[int, torch.Tensor], None],
) -> torch.Tensor:
    """`widened_product` for a weight [n, k] that `fill(n0, block)` writes a block of rows at a
    time, from row n0, into a float32 `block` (this thread's buffer): a dense or compact weight,
    or an integer layer's dequantised rows (`quant._QuantLinearBase.dense_product`). The output
    is in `x`'s dtype: bfloat16 rounded once from the float32 sums, or float32 (an integer
    layer of a float32 model: each output column is its own row's product either way, so the
    blocks give the whole weight's bits where float32_product splits its columns so too)."""
    flat = x.reshape(-1, k).float()
    step = max(1, min(n, WIDEN_BLOCK_BYTES // (4 * max(k, 1))))
    buf = _weight_block(step, k, torch.float32)
    out = torch.empty(flat.shape[0], n, dtype=x.dtype)
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        block = buf[: n1 - n0]
        fill(n0, block)
        bias = None if bias_f32 is None else bias_f32[n0:n1]
        out[:, n0:n1] = float32_product(flat, block, bias)
    return out.view(*x.shape[:-1], n)


def decompacted_product(x: torch.Tensor, layer: NativeLinear) -> torch.Tensor:
    """`layer(x)` for a layer kept only in its compact form (`--compact-decode-weights only`)
    at more rows than `linear_compact` takes (`compact_only_max_rows`): its weight decoded a
    block of rows at a time into this thread's buffer (`decompact_bf16`, the rows that do not
    fit read from `layer.weight`, which holds only those), each block multiplied as the dense
    weight's rows would be at this row count: widened to float32 (`widens`), else through
    `linear` on the decoded bfloat16 rows (blocks of whole tiles of 16 rows). The outputs are
    the dense layer's bits: every output column is its own row's product either way."""
    weight, bias = layer.weight, layer.bias_f32
    codes, tables = layer.compact_codes, layer.compact_tables
    assert codes is not None and tables is not None
    n, k = weight.shape
    rows = x.numel() // max(k, 1)
    if applies(x) and widens(rows, x.dtype):
        return widened_product(x, weight, bias, (codes, tables))
    # whole tiles of 16 rows a block (a block of another count would leave the prompt
    # product, which takes whole tiles only); a weight of another count in one block
    step = min(n, max(16, WIDEN_BLOCK_BYTES // (2 * max(k, 1)) // 16 * 16)) if n % 16 == 0 else n
    buf = _weight_block(step, k, torch.bfloat16)
    flat = x.reshape(-1, k)
    out = flat.new_empty(flat.shape[0], n)
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        block = buf[: n1 - n0]
        torch.ops.stallfree.decompact_bf16(codes, tables, weight, n0, block)
        out[:, n0:n1] = linear(flat, block, None if bias is None else bias[n0:n1])
    return out.view(*x.shape[:-1], n)


def dense_max_rows(dtype: torch.dtype | None = None) -> int:
    """The most rows a dense linear of `dtype` takes to the native kernel on this CPU, in this
    step (a decode step's bfloat16 rows go further on the tiles; its float32 rows on a CPU where
    torch's float32 product is slow)."""
    if dtype == torch.float32 and in_decode() and _mkl_slow():
        return _F32_DECODE_MAX_ROWS.get(cpu_kernels.isa(), DENSE_MAX_ROWS)
    if not cpu_kernels.amx():
        if dtype == torch.bfloat16:
            return _BF16_MAX_ROWS.get(cpu_kernels.isa(), DENSE_MAX_ROWS)
        return DENSE_MAX_ROWS
    if dtype == torch.bfloat16 and in_decode():
        return AMX_DECODE_MAX_ROWS
    return AMX_MAX_ROWS


_DTYPES = (torch.float32, torch.bfloat16)


def applies(x: torch.Tensor) -> bool:
    """Whether `x` can go to a native op. Not while torch.compile traces (`runtime.
    torch_compile`): inductor fuses these ops itself, and a branch on the row count would
    guard and recompile per batch size."""
    return (
        not torch.compiler.is_compiling()
        and x.device.type == "cpu"
        and x.dtype in _DTYPES
        and x.is_contiguous()
        and cpu_kernels.available()
    )


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: float32 statistics, the weight applied in the input's dtype."""
    if x.dtype == torch.float32:
        return torch.rms_norm(x, weight.shape, weight, eps)
    h = torch.rms_norm(x.float(), x.shape[-1:], None, eps)
    return weight * h.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if applies(x) and weight.dtype == x.dtype and weight.is_contiguous():
        out: torch.Tensor = torch.ops.stallfree.rms_norm(x, weight, eps)
        return out
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta)): the residual stream and the next block's input, the sum
    rounded to the dtype before its statistics (transformers' order)."""
    if (
        applies(x)
        and delta.dtype == x.dtype
        and delta.shape == x.shape
        and delta.is_contiguous()
        and weight.dtype == x.dtype
        and weight.is_contiguous()
    ):
        total, normed = torch.ops.stallfree.add_rms_norm(x, delta, weight, eps)
        return total, normed
    total = x + delta
    return total, rms_norm_reference(total, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for `gate_up` = [..., gate | up], each product rounded to the dtype."""
    if applies(gate_up):
        out: torch.Tensor = torch.ops.stallfree.silu_mul(gate_up)
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gate_up_silu(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a gate and up projection stacked in one layer (`layer`'s rows: the
    gate's, then the up's): where the layer's prompt product runs on the AMX tiles it computes
    this in its epilogue (`silu_product`; the same bits as silu_mul after the product, and one
    pass over the product's output fewer), else the product, then silu_mul."""
    fused = getattr(layer, "silu_product", None)
    if fused is not None and (out := fused(x)) is not None:
        return out  # type: ignore[no-any-return]
    return silu_mul(layer(x))


def mlp_on_tiles(gate_up: nn.Module, down: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """down(silu(gate) * up) of a stacked gate and up projection and its down projection, where
    a prompt's two products both run on the AMX tiles (each layer's `tiles_take`): the first
    writes silu(gate) * up straight in the packed order the second multiplies (`pack=True`,
    rounded to the dtype as the row-major output is), so the first transposes no output and
    the second packs no input. The same bits as `gate_up_silu` then `down`; None where it does
    not apply (the caller runs them apart). The 256-row MLP of SmolLM2 took 0.90 of the time,
    a 1B Llama's 0.97, 64-128 rows 0.94-0.96 (two threads, one process alternating)."""
    first, second = getattr(gate_up, "tiles_take", None), getattr(down, "tiles_take", None)
    if first is None or second is None or not applies(x):
        return None
    width = x.shape[-1]
    rows = x.numel() // max(width, 1)
    inter = getattr(down, "in_features", -1)
    if (
        getattr(gate_up, "in_features", -1) != width
        or getattr(gate_up, "out_features", -1) != 2 * inter
        or inter % 32 != 0
        or not first(rows, x.dtype)
        or not second(rows, x.dtype)
    ):
        return None
    packed = cast(Any, gate_up).tile_product(x.reshape(rows, width), silu=True, pack=True)
    out: torch.Tensor = cast(Any, down).tile_product(packed, rows=rows)
    return out.view(*x.shape[:-1], out.shape[-1])


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias_f32: torch.Tensor | None = None,
    compact: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, on the native kernel for a few bfloat16 or float32 rows
    (`bias_f32`: the bias in float32, or None), from `compact` (the weight's compact codes and
    tables, `compact_bf16`) up to `compact_max_rows` rows where given; bfloat16 past them on the
    prompt product where it takes them (`prompt_on_tiles`: an integer layer's dequantised
    weight without the AMX tiles, for one), float32 as `float32_product`."""
    if (
        compact is not None
        and applies(x)
        and x.dtype == weight.dtype
        and x.numel() <= compact_max_rows() * weight.shape[-1]
    ):
        out: torch.Tensor = torch.ops.stallfree.linear_compact(x, weight, *compact, bias_f32)
        return out
    if (
        applies(x)
        and x.dtype == weight.dtype
        and x.numel() <= dense_max_rows(x.dtype) * weight.shape[-1]
        and rows_contiguous(weight)
    ):
        out = torch.ops.stallfree.linear(x, weight, bias_f32)
        return out
    if x.dtype == weight.dtype == torch.float32:
        return float32_product(x, weight, bias_f32)
    if (
        applies(x)
        and x.dtype == weight.dtype
        and widens(x.numel() // max(weight.shape[-1], 1), x.dtype)
    ):
        return widened_product(x, weight, bias_f32)
    if prompt_on_tiles(x, weight):
        flat = x.reshape(-1, weight.shape[-1])
        out = torch.ops.stallfree.linear_bf16_prompt(flat, weight, bias_f32)
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, None if bias_f32 is None else bias_f32.to(x.dtype))


def grouped(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor | None:
    """The outputs of `layers` (plain linears without bias, one input width) side by side in
    one tensor, as one native call, for a few rows of `x`; None where that does not apply
    (the caller runs them one by one). A model whose projections are not stacked (dense
    float32, which keeps transformers' sums) still makes one call for q/k/v and one for
    gate/up."""
    if not applies(x) or x.numel() > dense_max_rows(x.dtype) * x.shape[-1]:
        return None
    weights = group_weights(layers, x.dtype)
    if weights is None:
        return None
    out: torch.Tensor = torch.ops.stallfree.linear_group(x, weights)
    return out


def side_by_side(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor | None:
    """The outputs of `layers` side by side in one tensor, for a float32 prompt that `grouped`
    does not take: each is its own `torch.mm` written into its columns, so each keeps the bits
    of its `F.linear` (float32 keeps transformers' sums), and `silu_mul` then reads gate and up
    in one pass instead of `F.silu(gate) * up`'s two. None where that does not apply, and where
    `float32_on_onednn` (there the model stacks gate and up, `stacks_float32`; a layer kept apart
    runs each on `float32_product`)."""
    if not applies(x) or x.dtype != torch.float32 or float32_on_onednn():
        return None
    weights = group_weights(layers, x.dtype)
    if weights is None:
        return None
    rows = x.reshape(-1, x.shape[-1])
    out = rows.new_empty(rows.shape[0], sum(w.shape[0] for w in weights))
    col = 0
    for w in weights:
        torch.mm(rows, w.t(), out=out[:, col : col + w.shape[0]])
        col += w.shape[0]
    return out.view(*x.shape[:-1], col)


def group_weights(layers: list[nn.Module], dtype: torch.dtype) -> list[torch.Tensor] | None:
    """The weights `grouped` hands its one call for inputs in `dtype` (plain linears without
    bias, rows contiguous, on the CPU, in `dtype`), or None where any layer is not one."""
    weights: list[torch.Tensor] = []
    for layer in layers:
        if (
            not isinstance(layer, nn.Linear)
            or layer.bias is not None
            or getattr(layer, "compact_only", False)
        ):
            return None
        w = layer.weight
        if w.dtype != dtype or not rows_contiguous(w) or w.device.type != "cpu":
            return None
        weights.append(w)
    return weights


class NativeLinear(nn.Linear):
    """nn.Linear whose calls of up to `dense_max_rows()` rows of its dtype (bfloat16 or float32)
    run on the native matrix-vector kernel (bias added in its epilogue); a bfloat16 prompt past
    them may take the tiles or a prepacked copy; anything else is F.linear."""

    bias_f32: torch.Tensor | None
    weight_prepacked: torch.Tensor | None  # oneDNN's blocked copy (`adopt(prepack=True)`)
    # the weight's compact form for decode rows (`adopt(compact=True)`, `compact_rows`)
    compact_codes: torch.Tensor | None
    compact_tables: torch.Tensor | None
    # the weight kept only in its compact form, `weight` holding only the rows that do not fit
    # (compact_only.py, `--compact-decode-weights only`)
    compact_only: bool = False

    @classmethod
    def adopt(cls, layer: nn.Linear, prepack: bool = False, compact: bool = False) -> NativeLinear:
        """`layer` itself, its class switched (its parameters are kept, not copied); with
        `prepack`, beside a copy of its weight in oneDNN's blocked order for prompts
        (`prepacked_prompt`); with `compact`, beside its compact form for decode rows where the
        weight has one (`compact_applies`)."""
        layer.__class__ = cls
        native = layer if isinstance(layer, NativeLinear) else None
        assert native is not None
        bias = None if layer.bias is None else layer.bias.detach().float().contiguous()
        native.register_buffer("bias_f32", bias, persistent=False)
        packed = None
        if prepack:
            packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), None)
        native.register_buffer("weight_prepacked", packed, persistent=False)
        codes = tables = None
        if compact and compact_applies(layer.weight):
            codes, tables = torch.ops.stallfree.compact_bf16(layer.weight.detach())
        native.register_buffer("compact_codes", codes, persistent=False)
        native.register_buffer("compact_tables", tables, persistent=False)
        return native

    def compact_rows(self, rows: int) -> bool:
        """Whether `rows` rows of bfloat16 take the compact form's product (`compact_max_rows`;
        `compact_only_max_rows` for a layer kept only in that form)."""
        if self.compact_codes is None:
            return False
        return rows <= (compact_only_max_rows() if self.compact_only else compact_max_rows())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the weight is bfloat16 or float32 on the CPU (`use_native_linears` checked), so only
        # an input of its dtype can take a native route; its facts are read once here, not
        # again per route (nor in `linear`). The routes, in order: the matrix-vector kernel
        # (`applies`, up to `dense_max_rows`), then for bfloat16 the prepacked copy
        # (`prepacked_prompt`) and the tiles' prompt product (`prompt_on_tiles`), else F.linear.
        dtype = self.weight.dtype
        if (x.dtype != dtype or torch.compiler.is_compiling()) and not self.compact_only:
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // max(self.in_features, 1)
        native = x.device.type == "cpu" and x.is_contiguous() and cpu_kernels.available()
        if native and x.dtype == dtype and self.compact_rows(rows):
            out: torch.Tensor = torch.ops.stallfree.linear_compact(
                x, self.weight, self.compact_codes, self.compact_tables, self.bias_f32
            )
            return out
        if self.compact_only:
            return decompacted_product(x, self)
        if native and rows_contiguous(self.weight) and rows <= dense_max_rows(dtype):
            out = torch.ops.stallfree.linear(x, self.weight, self.bias_f32)
            return out
        if dtype != torch.bfloat16:
            return float32_product(x, self.weight, self.bias)
        if native and widens(rows, dtype):
            return widened_product(x, self.weight, self.bias_f32)
        if self.weight_prepacked is not None and rows >= PREPACKED_MIN_ROWS:
            return packed_linear(x, self.weight_prepacked, self.bias)
        if native and _tiles_rows(rows, self.weight):
            flat = x.reshape(-1, self.in_features)
            out = torch.ops.stallfree.linear_bf16_prompt(flat, self.weight, self.bias_f32)
            return out.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)

    def silu_product(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up for this layer as a stacked gate and up projection, where a prompt
        runs on the tiles (`gate_up_silu`); None elsewhere."""
        if (
            self.compact_only
            or self.prepacked_prompt(x)
            or not (self.out_features % 32 == 0 and prompt_on_tiles(x, self.weight))
        ):
            return None
        rows = x.reshape(-1, self.in_features)
        out: torch.Tensor = torch.ops.stallfree.linear_bf16_prompt(
            rows, self.weight, self.bias_f32, True
        )
        return out.view(*x.shape[:-1], self.out_features // 2)

    def tiles_take(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether `forward` runs a contiguous CPU prompt of `rows` rows in `dtype` on the
        tiles' prompt product (`mlp_on_tiles`)."""
        return (
            not (self.weight_prepacked is not None and rows >= PREPACKED_MIN_ROWS)
            and not self.compact_only
            and dtype == self.weight.dtype == torch.bfloat16
            and _tiles_rows(rows, self.weight)
            and not torch.compiler.is_compiling()
            and cpu_kernels.available()
        )

    def tile_product(
        self, x: torch.Tensor, silu: bool = False, pack: bool = False, rows: int = 0
    ) -> torch.Tensor:
        """`forward`'s tiles product on flat rows `x`, or on a product's packed output of
        `rows` rows; with `silu`, as `silu_product`; with `pack`, packed for the next one."""
        out: torch.Tensor = torch.ops.stallfree.linear_bf16_prompt(
            x, self.weight, self.bias_f32, silu, pack, rows
        )
        return out

    def prepacked_prompt(self, x: torch.Tensor) -> bool:
        """Whether `x` takes the prepacked copy: a bfloat16 prompt of PREPACKED_MIN_ROWS rows
        or more, outside torch.compile's tracing (which the opaque copy would not pass)."""
        return (
            not torch.compiler.is_compiling()
            and self.weight_prepacked is not None
            and x.dtype == torch.bfloat16
            and x.numel() >= PREPACKED_MIN_ROWS * self.in_features
        )


# A prompt of up to this many rows runs on the AMX tiles' blocked product (csrc/amx_gemm.cpp:
# `linear_bf16_prompt` here, reading the row-major weight in place; the integer layers' in
# quant.py), rather than F.linear, whose oneDNN re-lays the weight out into its blocked order
# on every call. One bfloat16 layer, two threads, 64 / 128 / 256 rows, tiles against F.linear:
# SmolLM2's shapes 1.10-1.31x / 1.04-1.31x / 0.91-1.30x, a 1B Llama's 3072 x 2048 and 2048 x
# 8192 0.99-1.19x / 1.05-1.07x / 1.03-1.11x. The product walks the weight once per 256 rows
# (kMBlock), so past that oneDNN wins.
PROMPT_TILES_MAX_ROWS = 256

# With `--prepack-prompt-weights` each dense bfloat16 projection keeps a second copy of its weight
# in oneDNN's blocked order (torch's `mkldnn._reorder_linear_weight`, as inductor's frozen graphs
# use it; vLLM's CPU backend keeps only such a copy), and a prompt of this many rows or more
# multiplies that copy: no per-call re-layout, and oneDNN's own AMX kernel, with F.linear's bits.
# Time against F.linear, one process alternating, 2 threads, the copy / the tiles: SmolLM2's four
# shapes (8 copies) at 48 rows 0.72 / 0.61, 64 rows 0.78 / 0.69, 80 rows 0.82 / 0.85, 128 rows
# 0.76 / 0.93, 256 rows 0.81 / 1.02, 272 rows 0.82 (past the tiles' 256: F.linear's turn); a 1B
# Llama's four at 64 rows 0.81 / 0.71, 80 rows 0.83 / 1.00, 128 rows 0.78 / 0.95, 256 rows 0.80 /
# 0.94. Up to 64 rows the tiles' first pass serves every chunk of the prompt at once and stays
# ahead. The decode kernels keep reading the row-major weight, so the copy costs the dense
# weights' bytes once more; it is off by default.
PREPACKED_MIN_ROWS = 65


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """`x @ W.T + bias` on oneDNN: `packed` is W in its blocked order (`NativeLinear.adopt`), or
    a float32 W as it is (`float32_product`)."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out


# Without the tiles, on the AVX-512 variant (AVX512-BF16: a Zen 4), `linear_bf16_prompt` runs
# on `vdpbf16ps` (csrc/bf16_gemm.cpp) at any row count: it walks the weight once per 256
# activation rows, as the tiles do, but keeps ahead of oneDNN past that too. SmolLM2's four
# stacked shapes, 30 copies, two threads on a Zen 4, ms a step, the prompt product / oneDNN on
# its prepacked copy / F.linear: 128 rows 68.1 / 77.4 / 93.0, 256 rows 133.4 / 142.1 / 158.0,
# 512 rows 282.1 / 277.7 / 296.5, 1024 rows 523.4 / 541.1 / 596.8 (the CPU's peak, a register
# loop of `vdpbf16ps`: 459 GFLOP/s; the prompt product 389-415 of it from 64 rows).
VECTOR_PROMPT_MAX_ROWS = 1 << 30


def prompt_product_max_rows() -> int:
    """The most rows a bfloat16 prompt's product takes on `linear_bf16_prompt` on this CPU: the
    AMX tiles' PROMPT_TILES_MAX_ROWS, any number on the AVX-512 variant without them, none
    elsewhere (the AVX2 variant's matrix-vector kernel takes every row count)."""
    if cpu_kernels.amx():
        return PROMPT_TILES_MAX_ROWS
    return VECTOR_PROMPT_MAX_ROWS if cpu_kernels.isa() == "avx512" else 0


def prompt_on_tiles(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a bfloat16 prompt's product with `weight` runs on the prompt product
    (`linear_bf16_prompt`: the tiles, or `vdpbf16ps` without them): more rows than the
    matrix-vector kernels take, up to `prompt_product_max_rows`, whole blocks of 16 outputs and
    32 inputs."""
    rows = x.numel() // max(weight.shape[-1], 1)
    return x.dtype == weight.dtype == torch.bfloat16 and _tiles_rows(rows, weight) and applies(x)


def _tiles_rows(rows: int, weight: torch.Tensor) -> bool:
    """`prompt_on_tiles` without the input's own checks: the row count and the weight."""
    return (
        dense_max_rows(weight.dtype) < rows <= prompt_product_max_rows()
        and weight.shape[0] % 16 == 0
        and weight.shape[1] % 32 == 0
        and rows_contiguous(weight)
    )


def prepack_pays() -> bool:
    """Whether `--prepack-prompt-weights` keeps oneDNN's blocked copy on this CPU: with the AMX
    tiles in use. Without them the AVX-512 variant's prompt product (VECTOR_PROMPT_MAX_ROWS
    above) is ahead of oneDNN on such a copy, and the AVX2 variant's matrix-vector kernel
    takes every bfloat16 row count."""
    return cpu_kernels.amx()


# With `--compact-decode-weights` each dense bfloat16 linear also keeps its weight in 12 bits a
# value (csrc/compact_bf16.cpp: each value's low byte and a 4-bit code into its row's 16 high
# bytes; lossless), and calls of up to this many rows multiply that form, with the dense
# kernel's bits. A decode step reads about 0.75 of the bytes; a prompt reads the dense weight as
# before, so the weights take 1.75x their memory. SmolLM2's four stacked shapes, many copies
# from memory on 2 MB pages, two threads on a Zen 4, the compact form's time over the dense
# kernel's: 1 row 0.81-0.94 (the down projection's 576 x 1536 worst), 4 rows 0.83-0.85, 8 rows
# 0.96-1.06, 16 rows 1.02-1.12 (there the products are no longer bound by the bytes). Where
# the AMX tiles are in use they take bfloat16 decode rows from AMX_MIN_ROWS (csrc/ops.cpp's
# kAmxMinRows), so the compact form takes fewer there (`compact_max_rows`).
COMPACT_MAX_ROWS = 4
AMX_MIN_ROWS = 3
# The AVX2 variant's compact product (csrc/isa_avx2.cpp) decodes the weight in the registers
# up to 4 rows (3 and 4 a pair of weight rows at a time) and for more rows each tile into a
# buffer that its dense kernel then reads. On a Zen 3 (AVX2 only), the same shapes and copies,
# its time over the dense kernel's: 1 row 0.74-0.80, 2 rows 0.81-0.94, 3 rows about 1.09 and
# 4 rows about 1.07 (medians; 1.20 and 1.25 through the buffer: no longer bound by the bytes),
# 8 rows 1.21-1.42. A second copy beside the dense weight pays up to 2 rows.
AVX2_COMPACT_MAX_ROWS = 2


def compact_max_rows() -> int:
    """The most rows a call takes to the compact form on this CPU (COMPACT_MAX_ROWS; fewer on
    the AVX2 variant and where the AMX tiles take bfloat16 rows)."""
    if cpu_kernels.isa() == "avx2":
        return AVX2_COMPACT_MAX_ROWS
    return min(COMPACT_MAX_ROWS, AMX_MIN_ROWS - 1) if cpu_kernels.amx() else COMPACT_MAX_ROWS


def compact_only_max_rows() -> int:
    """The most rows a layer kept only in the compact form multiplies on `linear_compact`: on
    the AVX2 variant every count its dense kernel takes (AVX2_BF16_MAX_ROWS: past four rows the
    product decodes each tile of four weight rows once into a buffer that kernel reads, with
    its bits), elsewhere `compact_max_rows`; past that `decompacted_product`."""
    if cpu_kernels.isa() == "avx2":
        return AVX2_BF16_MAX_ROWS
    return compact_max_rows()


def compact_applies(weight: torch.Tensor) -> bool:
    """Whether `weight` gets a compact form: bfloat16 [out, in] on the CPU, rows contiguous,
    `in` a multiple of 64, the native kernels in use (each variant has its decoding kernel)."""
    return (
        weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.device.type == "cpu"
        and weight.shape[1] % 64 == 0
        and weight.shape[1] > 0
        and rows_contiguous(weight)
        and cpu_kernels.isa() in ("avx512", "avx2")
    )


def use_native_linears(model: nn.Module, prepack: bool = False, compact: bool = False) -> int:
    """Switch every dense bfloat16 or float32 CPU nn.Linear of `model` to `NativeLinear`, in
    place; returns how many (none when the library is not available). With `prepack`, each
    bfloat16 one but the output head (`lm_head`, which sees a prompt's last rows only) also
    keeps its weight in oneDNN's blocked order for prompts (PREPACKED_MIN_ROWS), where that
    pays (`prepack_pays`). With `compact`, each bfloat16 one also keeps its compact form for
    decode rows (COMPACT_MAX_ROWS)."""
    if not cpu_kernels.available():
        return 0
    pack = prepack and prepack_pays()
    count = 0
    for name, module in model.named_modules():
        if (
            type(module) is nn.Linear
            and module.weight.device.type == "cpu"
            and module.weight.dtype in _DTYPES
            and module.weight.is_contiguous()
        ):
            prepack_this = (
                module.weight.dtype == torch.bfloat16 and name.rsplit(".", 1)[-1] != "lm_head"
            )
            NativeLinear.adopt(module, pack and prepack_this, compact)
            count += 1
    return count
