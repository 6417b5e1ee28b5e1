"""Weight-only quantized linear layers: int8 per output row, int4 in groups of 32.

The weights stay packed in memory. A call of a few rows (a decode step) runs on torch's CPU
integer-weight kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`), which read the
packed bytes and scale them on the fly: at small batch a step is bound by reading the weights,
so half (int8) or a quarter (int4) of bfloat16's bytes is the speed-up. Those kernels cost a
matrix-vector product per row, so a larger call (a prefill) dequantises the layer into one
shared workspace and runs the dense matmul. Activations, scales and outputs are in the model's
dtype (the kernels take float32 activations in bfloat16 where the CPU has it).

Methods (`model.quantization`, vLLM's `--quantization` spelling):
- `int8`: each output row symmetric, scale = max |w| / 127 (torchao's int8 weight-only);
- `int4`: groups of 32 inputs, asymmetric, scale = (max - min) / 15 and a float zero point
  (torchao's int4 weight-only layout);
- `gguf`: a GGUF file's blocks as they are: Q4_0, Q4_1 and Q4_K are groups of 32 with a scale
  and a zero point, which the int4 layout holds exactly (`w = (q - 8) * scale + zero`); Q8_0
  (blocks of 32 int8 with one scale each) becomes int8 rows, re-scaled once per row.

An int4 layer the kernel cannot take (output rows in multiples of 16, inputs in multiples of
32) becomes int8; the log line of `loader._quantize` counts each kind.
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stallfree.runtime.model import cpu_kernels, native_layers
from stallfree.runtime.model.decode_rows import in_decode

QUANTIZATION_METHODS = ("none", "int8", "int4", "gguf")
GROUP_SIZE = 32
_INT4_ROW_MULTIPLE = 16
_INNER_K_TILES = 2


@dataclass(slots=True)
class GroupQuant:
    """Unsigned 4-bit codes (0..15) with a scale and a zero point per group of `group_size`
    inputs ([out, in // group_size], float32): `w = (q - 8) * scale + zero`.

    The codes are held as nibble pairs, `pairs` [out, in // group_size, group_size // 2]
    uint8: byte j of a group holds element j in its low nibble and element j + group_size / 2
    in its high one. That is how GGUF's Q4_0 and Q4_1 blocks store them and what the int4
    layers keep, so a file's codes are copied, never unpacked and packed again."""

    pairs: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int = GROUP_SIZE

    @property
    def shape(self) -> tuple[int, int]:
        rows, groups, half = self.pairs.shape
        return (int(rows), int(groups * half * 2))

    @property
    def q(self) -> torch.Tensor:
        """The codes unpacked, uint8 [out, in]."""
        return unpack_pairs(self.pairs).reshape(self.shape)

    def dequantize(self) -> torch.Tensor:
        g = self.group_size
        scale = self.scale.repeat_interleave(g, dim=1)
        zero = self.zero.repeat_interleave(g, dim=1)
        return (self.q.float() - 8) * scale + zero

    def rows(self, order: torch.Tensor) -> GroupQuant:
        """The same weight with its output rows reordered (or sliced) by `order`."""
        return GroupQuant(self.pairs[order], self.scale[order], self.zero[order], self.group_size)


def pack_pairs(q: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """4-bit codes [out, in] (uint8, 0..15) as `GroupQuant`'s nibble pairs."""
    rows, cols = q.shape
    halves = q.to(torch.uint8).view(rows, cols // group_size, 2, group_size // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).contiguous()


def unpack_pairs(pairs: torch.Tensor) -> torch.Tensor:
    """`pack_pairs`' inverse: the codes [out, groups, group_size] of nibble pairs."""
    return torch.cat([pairs & 15, pairs >> 4], dim=-1)


@dataclass(slots=True)
class RowQuant:
    """Signed int8 codes `q` [out, in] with one float32 scale per output row: `w = q * scale`."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]

    def rows(self, order: torch.Tensor) -> RowQuant:
        return RowQuant(self.q[order], self.scale[order])


@dataclass(slots=True)
class BlockQuant8:
    """Signed int8 codes `q` [out, in] with a float16 scale per block of 32 inputs
    ([out, in // 32]): `w = q * scale`, GGUF's Q8_0 as the file stores it."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.shape
        blocks = self.q.float().view(rows, cols // GROUP_SIZE, GROUP_SIZE)
        return (blocks * self.scale.float()[..., None]).view(rows, cols)

    def rows(self, order: torch.Tensor) -> BlockQuant8:
        return BlockQuant8(self.q[order], self.scale[order])


QuantizedWeight = GroupQuant | RowQuant | BlockQuant8


def can_stack(parts: list[QuantizedWeight]) -> bool:
    """Whether `stack_rows` can join these without changing any of them: one form, one group
    size (a Q4_K_M file mixes Q4_K and Q6_K projections; those stay apart)."""
    if all(isinstance(p, RowQuant) for p in parts):
        return True
    if all(isinstance(p, BlockQuant8) for p in parts):
        return True
    groups = {p.group_size for p in parts if isinstance(p, GroupQuant)}
    return len(groups) == 1 and all(isinstance(p, GroupQuant) for p in parts)


def stack_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """One weight whose output rows are `parts`' in order (a fused projection)."""
    if not can_stack(parts):
        raise ValueError("cannot stack quantized weights of different forms")
    if isinstance(parts[0], RowQuant):
        rows = [p for p in parts if isinstance(p, RowQuant)]
        return RowQuant(torch.cat([r.q for r in rows]), torch.cat([r.scale for r in rows]))
    if isinstance(parts[0], BlockQuant8):
        blocks = [p for p in parts if isinstance(p, BlockQuant8)]
        return BlockQuant8(torch.cat([b.q for b in blocks]), torch.cat([b.scale for b in blocks]))
    groups = [p for p in parts if isinstance(p, GroupQuant)]
    return GroupQuant(
        torch.cat([g.pairs for g in groups]),
        torch.cat([g.scale for g in groups]),
        torch.cat([g.zero for g in groups]),
        groups[0].group_size,
    )


# Rows quantized at a time: each row's scale is its own, so the result is the same as in one
# go, and the float32 temporaries stay near 8 MB instead of several copies of the weight (a
# 49152 x 576 embedding took 450 MB of peak memory at once).
_QUANT_CHUNK_ELEMENTS = 1 << 21


def quantize_int8(weight: torch.Tensor) -> RowQuant:
    rows, cols = weight.shape
    q = torch.empty((rows, cols), dtype=torch.int8, device=weight.device)
    scale = torch.empty(rows, dtype=torch.float32, device=weight.device)
    step = max(1, _QUANT_CHUNK_ELEMENTS // max(cols, 1))
    for start in range(0, rows, step):
        w = weight[start : start + step].float()
        s = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        scale[start : start + step] = s
        q[start : start + step] = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
    return RowQuant(q, scale)


def quantize_int8_blocks(weight: torch.Tensor) -> BlockQuant8:
    """Int8 codes with a float16 scale per block of 32 inputs (amax / 127), a slice of rows at
    a time; the codes are rounded against the float16 scale they will be multiplied by."""
    rows, cols = weight.shape
    q = torch.empty((rows, cols), dtype=torch.int8, device=weight.device)
    scale = torch.empty((rows, cols // GROUP_SIZE), dtype=torch.float16, device=weight.device)
    step = max(1, _QUANT_CHUNK_ELEMENTS // max(cols, 1))
    for start in range(0, rows, step):
        w = weight[start : start + step].float().reshape(-1, cols // GROUP_SIZE, GROUP_SIZE)
        s = (w.abs().amax(dim=-1) / 127.0).half()
        sf = s.float()
        safe = torch.where(sf > 0, sf, torch.ones_like(sf))
        codes = torch.round(w / safe[..., None]).clamp(-127, 127).to(torch.int8)
        q[start : start + step] = codes.reshape(-1, cols)
        scale[start : start + step] = s
    return BlockQuant8(q, scale)


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> GroupQuant:
    w = weight.float()
    rows, cols = w.shape
    groups = w.reshape(rows, cols // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15.0).clamp_min(1e-12)
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
    codes = pack_pairs(q.reshape(rows, cols).to(torch.uint8), group_size)
    return GroupQuant(codes, scale, low + 8 * scale, group_size)


def int4_fits(shape: tuple[int, int], group_size: int = GROUP_SIZE) -> bool:
    rows, cols = shape
    return rows % _INT4_ROW_MULTIPLE == 0 and cols % group_size == 0


# Up to `kernel_max_rows` rows (tokens) a call runs on the integer kernel; above it the layer
# dequantises into a shared workspace and runs the dense matmul. The kernels cost about one
# matrix-vector product per row, the dense path one dequantisation per call. At SmolLM2's
# 1536 x 576 projection in bfloat16 (2 threads): int8 397 us against 276 + 234 at 16 rows and
# 1473 against 276 + 340 at 64, so they meet near 24 rows; int4 315 against 1014 + 234 at 16
# and 1083 against 1014 + 340 at 64 (4692 against 1014 + 728 at 256), so near 80.
INT8_KERNEL_MAX_ROWS = 24
INT4_KERNEL_MAX_ROWS = 64
_INT8_KERNEL_COLS = 32  # the int8 kernel only for inputs in multiples of this

_workspaces: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}


def _workspace(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """One dense buffer per weight shape, shared by every layer of that shape (the stream runs
    one layer at a time)."""
    key = (rows, cols, dtype)
    buf = _workspaces.get(key)
    if buf is None:
        buf = _workspaces[key] = torch.empty(rows, cols, dtype=dtype)
    return buf


def kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The activations' dtype on the integer kernels: their float32 paths are scalar (an int8
    matrix-vector product 7x slower than bfloat16's here), so a float32 model's activations go
    through them in bfloat16 where the CPU computes it natively."""
    if dtype == torch.float32 and cpu_has_bf16():
        return torch.bfloat16
    return dtype


# Up to this many rows an int8 / int4 layer runs on the native kernels (cpu_kernels.py), which
# quantise the activations to blocks of 32 and stream the weights once for all rows; above it,
# the dense path. In a decode step where the AMX tiles run the integer products
# (`cpu_kernels.amx()`), up to AMX_NATIVE_MAX_ROWS: the tiles beat dequantising into the dense
# product up to about 48 rows (csrc/ops.cpp, kAmxIntMaxRows: Q8_0 at 32 rows 15.0 against 24.2
# ms, int4 16.5 against 22.7), so 32 streams decode on them. Prompt rows keep NATIVE_MAX_ROWS:
# quantised activations cost a prompt accuracy (SmolLM2's Q8_0 file against its float32, 512
# tokens read in chunks of 256: KL 0.0013, top-1 98.6%; in chunks of 32 on the kernels: 0.0046,
# 96.7%), which the dense path does not. Where the tiles are in use, an int8 layer's prompt rows
# keep the dense path's numerics on the tiles' prompt product (`Int8Linear._prompt`), which
# dequantises the weight as it goes instead of into a workspace (`_QuantLinearBase._prompt`).
NATIVE_MAX_ROWS = 16
AMX_NATIVE_MAX_ROWS = 32


def native_max_rows() -> int:
    """The most rows an int8 / int4 layer sends to the native kernels on this CPU, in this
    step (`decode_rows.in_decode`)."""
    if in_decode() and cpu_kernels.amx():
        return AMX_NATIVE_MAX_ROWS
    return NATIVE_MAX_ROWS


def native_quantized(dtype: torch.dtype) -> bool:
    """Whether quantized layers in `dtype` run on the native kernels: the library is loaded and
    `STALLFREE_QUANT_ACTIVATIONS` is not `0` (which keeps torch's weight-only kernels, whose
    activations stay in the model's dtype)."""
    if os.environ.get("STALLFREE_QUANT_ACTIVATIONS", "1").strip() in ("0", "off", "false", "no"):
        return False
    return dtype in (torch.float32, torch.bfloat16) and cpu_kernels.available()


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX tiles)."""
    avx512_bf16 = bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())
    return avx512_bf16 or cpu_kernels.cpu_has_amx()


def _native_dequantize(layer: _QuantLinearBase) -> bool:
    """Whether `layer.dequantize` writes the dense weight with the native kernels (one pass;
    torch's ops take two for int8 and six for int4): a layer on them, outside a compile."""
    return layer.native and not torch.compiler.is_compiling()


class _QuantLinearBase(nn.Module, abc.ABC):
    out_features: int
    in_features: int
    bias: nn.Parameter | None
    kernel_max_rows: int

    def __init__(self, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.kernel_dtype = kernel_dtype(dtype)
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        self.bias_f32: torch.Tensor | None
        f32 = None if bias is None else bias.detach().float().contiguous()
        self.register_buffer("bias_f32", f32, persistent=False)
        # set by a subclass whose weight the native kernels take
        self.native = False
        # set by Int8Linear where its codes are laid out with 16 rows in the lanes
        self.lanes = False

    def _on_native(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and self.takes_native(
            x.numel() // max(self.in_features, 1), x.dtype
        )

    def takes_native(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether a CPU input of `rows` rows in `dtype` goes to the native kernel."""
        return (
            self.native
            and not torch.compiler.is_compiling()  # inductor: no per-row-count guards
            and dtype == self.dtype
            and rows <= native_max_rows()
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T` without the bias, in `x`'s shape with the last dimension `out_features`.

        A few rows go to the native kernel where the layer has it, else to torch's integer
        kernel; more rows (a prefill) to the dense matmul."""
        if self._on_native(x):
            return self._native(x.contiguous(), None)
        flat = x.reshape(-1, self.in_features)
        if not self.native and flat.shape[0] <= self.kernel_max_rows:
            out = self._kernel(flat.to(self.kernel_dtype).contiguous()).to(self.dtype)
        elif (prompt := self._prompt(flat)) is not None:
            out = prompt
        else:
            out = self.dense_product(flat)
        return out.view(*x.shape[:-1], self.out_features)

    def dense_product(self, flat: torch.Tensor) -> torch.Tensor:
        """`flat @ W.T` on the dense weight: torch's product, except where the native kernel
        beats it at this many rows (bfloat16 on the AVX2 variant, native_layers.dense_max_rows).
        Where the product is a float32 one (a float32 model's rows past the dense kernel's, or a
        bfloat16 prompt widened to float32 on the AVX2 variant, `native_layers.widens`), the
        weight is dequantised a block of rows at a time straight into the float32 block that
        product reads (`dequantize_rows`; for bfloat16 each value rounded as the workspace holds
        it), not whole into the shared workspace first: the same values, one pass over them
        fewer, and no dense copy of the weight in memory (a 1B Llama's Q8_0 file: 244 MB of
        float32 workspaces, 122 MB in bfloat16)."""
        if (
            self.native
            and not self.lanes
            and flat.dtype == self.dtype
            and native_layers.product_in_float32(flat, self.in_features)
        ):
            bf16 = flat.dtype == torch.bfloat16
            return native_layers.widened_blocks(
                flat,
                self.out_features,
                self.in_features,
                None,
                lambda n0, block: self.dequantize_rows(n0, block, bf16_values=bf16),
            )
        return native_layers.linear(flat, self.dequantize())

    @abc.abstractmethod
    def dequantize_rows(self, n0: int, out: torch.Tensor, bf16_values: bool = False) -> None:
        """Rows n0 .. n0 + len(out) of the dense weight into `out` (contiguous, float32 or
        bfloat16; with `bf16_values` a float32 `out` holds the values rounded to bfloat16), on
        the native kernels (a native layer whose codes are row-major)."""

    def _prompt(self, flat: torch.Tensor) -> torch.Tensor | None:
        """`flat @ W.T` for a prompt's many rows on the AMX tiles' prompt product, which
        dequantises the weight block by block into L1 to the dense path's values (bfloat16
        rows as they are, so the dense path's accuracy) instead of whole into a workspace that
        oneDNN then re-lays out; None where it does not apply and the dense path runs: up to
        native_layers.PROMPT_TILES_MAX_ROWS rows (integer layers, per format: Q8_0 at 64 rows 38
        against 22% of the bf16 peak, 256 rows 62 against 49%, 512 rows 58 against 73% on the
        dense path; int4 39 / 21%, 56 / 48%, 54 / 69%; at 320 rows int4 already lost), whole
        blocks of 16 outputs, the tiles in use."""
        if not self._prompt_on_tiles(flat):
            return None
        return self._on_tiles(flat.contiguous())

    def _prompt_on_tiles(self, flat: torch.Tensor) -> bool:
        return self._tiles_rows(flat.shape[0], flat.dtype)

    def _tiles_rows(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether `rows` rows in `dtype` that reach the prompt path take the prompt product:
        the tiles (up to PROMPT_TILES_MAX_ROWS, a row-major weight), or without them on the
        AVX-512 variant (`native_layers.prompt_product_max_rows`: any row count) the vector
        product, which dequantises the weight 16 rows at a time into cache as it walks it
        (csrc/bf16_gemm.cpp, `gemm_dequant`) rather than whole into the workspace: SmolLM2's
        Q8_0 file, a 256-row forward spent 6.5% of its time in that pass."""
        return (
            self.native
            and dtype == torch.bfloat16
            and rows <= native_layers.prompt_product_max_rows()
            and self.out_features % 16 == 0
            and not torch.compiler.is_compiling()
            and not (self.lanes and cpu_kernels.amx())
        )

    def silu_product(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up for this layer as a stacked gate and up projection, where a prompt
        runs on the tiles' prompt product (native_layers.gate_up_silu): in its epilogue, the
        bias (if any) added in float32 before the activation; None elsewhere."""
        flat = x.reshape(-1, self.in_features)
        if self._on_native(x) or self.out_features % 32 != 0 or not self._prompt_on_tiles(flat):
            return None
        out = self._on_tiles(flat.contiguous(), self.bias_f32, silu=True)
        return out.view(*x.shape[:-1], self.out_features // 2)

    def tiles_take(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether `forward` runs a contiguous CPU prompt of `rows` rows in `dtype` on the
        tiles' prompt product (native_layers.mlp_on_tiles)."""
        return not self.takes_native(rows, dtype) and self._tiles_rows(rows, dtype)

    def tile_product(
        self, x: torch.Tensor, silu: bool = False, pack: bool = False, rows: int = 0
    ) -> torch.Tensor:
        """`forward`'s tiles product on flat rows `x`, or on a product's packed output of
        `rows` rows: with `silu`, `silu_product`'s (the bias in its epilogue); with `pack`,
        packed for the next product (the bias in the epilogue too, in float32); else the
        product, then the bias as `forward` adds it."""
        if silu or pack:
            return self._on_tiles(x, self.bias_f32, silu, pack, rows)
        out = self._on_tiles(x, None, False, pack, rows)
        return out if self.bias is None else out + self.bias

    @abc.abstractmethod
    def _on_tiles(
        self,
        flat: torch.Tensor,
        bias: torch.Tensor | None = None,
        silu: bool = False,
        pack: bool = False,
        rows: int = 0,
    ) -> torch.Tensor:
        """`flat @ W.T` on the tiles' prompt product (flat contiguous bfloat16, or a product's
        packed output of `rows` rows); with `silu`, silu(gate) * up of the product's two halves
        (`bias` in float32, added first); with `pack`, packed for the next product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._on_native(x):
            return self._native(x.contiguous(), self.bias_f32)
        out = self.matmul(x)
        return out if self.bias is None else out + self.bias

    @abc.abstractmethod
    def _native(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x @ W.T (+ bias)` on the native kernel, in `x`'s shape and dtype."""

    @abc.abstractmethod
    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T` on the integer kernel (x contiguous, in `kernel_dtype`)."""

    @abc.abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The dense weight [out, in] in the model's dtype, in the shared workspace."""


# An int8 or int4 weight's layout on the AVX-512 variant without the AMX tiles: 16 output rows
# in the vector lanes (csrc/q8_lanes.cpp): int8 uint8 [out / 16, in / 4, 64] holding w + 128,
# int4 nibble pairs [out / 16, in / 32, 4, 64], and block scales (and offsets) [out / 16, in /
# 32, 16]. Its product scales each block once per 8 integer dots instead of once per dot or two. SmolLM2's five projection shapes, 30 copies, two
# threads on a Zen 4, us a step, row-major against lanes: 8 rows 1908 / 2033 against 1453 /
# 1257, 16 rows 3627 / 3285 against 2185 / 2167; 1-4 rows, which read at the memory's pace,
# the same. `STALLFREE_INT_LANES=0` keeps the row-major layout.
LANES_ENV = "STALLFREE_INT_LANES"
_SIGN_BITS = -0x7F7F7F80  # 0x80808080 as an int32


def rows_in_lanes(shape: tuple[int, int]) -> bool:
    """Whether an int8 weight of `shape` [out, in] that the native kernels take is laid out
    with 16 rows in the lanes: whole groups of 16 rows and blocks of 32 inputs, on the AVX-512
    variant, the AMX tiles not in use (their kernels read the row-major weight)."""
    if os.environ.get(LANES_ENV, "1").strip() in ("0", "off", "false", "no"):
        return False
    rows, cols = shape
    return (
        rows % 16 == 0
        and cols % GROUP_SIZE == 0
        and cpu_kernels.isa() == "avx512"
        and not cpu_kernels.amx()
    )


def to_lanes(q: torch.Tensor) -> torch.Tensor:
    """Row-major int8 codes [out, in] as 16 rows in the lanes: uint8 [out / 16, in / 4, 64]
    (lane r of a vector holds row r's 4 inputs), each w + 128."""
    rows, cols = q.shape
    # moved as 4-byte words (a byte-wise permute took about 1 s a GB), one copy, each byte's
    # sign bit flipped in place
    words = q.contiguous().view(torch.int32).view(rows // 16, 16, cols // 4)
    lanes = words.permute(0, 2, 1).contiguous().bitwise_xor_(_SIGN_BITS)
    return _bytes_of(lanes, (rows // 16, cols // 4, 64))


def from_lanes(u: torch.Tensor) -> torch.Tensor:
    """`to_lanes`'s inverse: the row-major int8 codes [out, in]."""
    groups, quads, _ = u.shape
    rows = u.view(groups, quads, 16, 4).permute(0, 2, 1, 3).reshape(groups * 16, quads * 4)
    return torch.bitwise_xor(rows, 0x80).view(torch.int8)


def scales_to_lanes(scale: torch.Tensor) -> torch.Tensor:
    """Block scales [out, in / 32] as the lanes take them: [out / 16, in / 32, 16]."""
    rows, blocks = scale.shape
    return scale.view(rows // 16, 16, blocks).transpose(1, 2).contiguous()


def codes_to_lanes(codes: torch.Tensor) -> torch.Tensor:
    """int4 nibble pairs [out, in / 32, 16] (byte j: value j low, j + 16 high) as 16 rows in the
    lanes: [out / 16, in / 32, 4, 64], byte t of lane r in vector q being row r's byte q * 4 +
    t of the block."""
    rows, blocks, _ = codes.shape
    words = codes.contiguous().view(torch.int32).view(rows // 16, 16, blocks, 4)
    lanes = words.permute(0, 2, 3, 1).contiguous()
    return _bytes_of(lanes, (rows // 16, blocks, 4, 64))


def _bytes_of(words: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A contiguous tensor's bytes as uint8 of `shape`, on its storage but not a view of it:
    a view keeps its base (`_base`), so a weight moved to huge pages (`Tensor.set_`) would
    leave the base and its old storage behind (the 1B Q8_0 model: 1 GB more resident)."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return torch.empty(0, dtype=torch.uint8).set_(words.untyped_storage(), 0, shape, strides)


def codes_from_lanes(lanes: torch.Tensor) -> torch.Tensor:
    """`codes_to_lanes`'s inverse: the nibble pairs [out, in / 32, 16]."""
    groups, blocks, _, _ = lanes.shape
    codes = lanes.view(groups, blocks, 4, 16, 4).permute(0, 3, 1, 2, 4)
    return codes.reshape(groups * 16, blocks, 16)


class Int8Linear(_QuantLinearBase):
    """`x @ (q * scale).T (+ bias)` from int8 rows, in the activations' dtype.

    One scale per output row (`RowQuant`), or one per block of 32 inputs (`BlockQuant8`, a
    GGUF's Q8_0 as stored) where the native kernels take it; without them a block-scaled
    weight is re-scaled to one scale per row for torch's kernel.
    """

    kernel_max_rows = INT8_KERNEL_MAX_ROWS

    def __init__(
        self, weight: RowQuant | BlockQuant8, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> None:
        super().__init__(bias, dtype)
        native = weight.shape[1] % GROUP_SIZE == 0 and native_quantized(dtype)
        if isinstance(weight, BlockQuant8) and not native:
            weight = quantize_int8(weight.dequantize())
        self.out_features, self.in_features = weight.shape
        self.qweight: torch.Tensor
        self.scales: torch.Tensor | None
        self.row_scale: torch.Tensor | None
        self.scale_f32: torch.Tensor | None
        self.block_scale: torch.Tensor | None
        self.block_scale_dt: torch.Tensor | None
        # the native kernels' layout: 16 rows in the lanes on AVX-512 without tiles
        self.lanes = native and rows_in_lanes(weight.shape)
        q = weight.q.contiguous()
        self.register_buffer("qweight", to_lanes(q) if self.lanes else q)
        if isinstance(weight, BlockQuant8):
            # float16 for the kernel; in the model's dtype, one per block, for the dense path
            half = weight.scale.half().contiguous()
            self.register_buffer("block_scale", scales_to_lanes(half) if self.lanes else half)
            scale_dt = weight.scale.to(dtype)[..., None].contiguous()
            self.register_buffer("block_scale_dt", scale_dt, persistent=False)
            for name in ("scales", "row_scale", "scale_f32"):
                self.register_buffer(name, None)
            self.kernel_max_rows = 0  # torch's int8 kernel takes row scales only
        else:
            self.register_buffer("block_scale", None)
            self.register_buffer("block_scale_dt", None, persistent=False)
            self.register_buffer("scales", weight.scale.to(self.kernel_dtype).contiguous())
            self.register_buffer("row_scale", weight.scale.to(dtype)[:, None].contiguous())
            f32 = weight.scale.float().contiguous()
            self.register_buffer("scale_f32", f32, persistent=False)
        if self.in_features % _INT8_KERNEL_COLS:
            # torch's bfloat16 int8 kernel reads past rows of other widths: 65 inputs died of
            # SIGSEGV, 40 gave wrong sums (a tensor-parallel shard of an odd MLP hit it)
            self.kernel_max_rows = 0
        self.native = native

    def _native(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out: torch.Tensor
        if self.block_scale is not None:
            out = torch.ops.stallfree.linear_q8_blocks(x, self.qweight, self.block_scale, bias)
        else:
            out = torch.ops.stallfree.linear_q8(x, self.qweight, self.scale_f32, bias)
        return out

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)
        return out

    def _on_tiles(
        self,
        flat: torch.Tensor,
        bias: torch.Tensor | None = None,
        silu: bool = False,
        pack: bool = False,
        rows: int = 0,
    ) -> torch.Tensor:
        scale = self.scale_f32 if self.block_scale is None else None
        out: torch.Tensor = torch.ops.stallfree.linear_q8_prompt(
            flat, self.qweight, scale, self.block_scale, bias, silu, pack, rows
        )
        return out

    def dequantize_rows(self, n0: int, out: torch.Tensor, bf16_values: bool = False) -> None:
        n1 = n0 + out.shape[0]
        scale = None if self.scale_f32 is None else self.scale_f32[n0:n1]
        blocks = None if self.block_scale is None else self.block_scale[n0:n1]
        torch.ops.stallfree.dequantize_q8(self.qweight[n0:n1], scale, blocks, out, bf16_values)

    def dequantize(self) -> torch.Tensor:
        out = _workspace(self.out_features, self.in_features, self.dtype)
        if _native_dequantize(self):
            torch.ops.stallfree.dequantize_q8(self.qweight, self.scale_f32, self.block_scale, out)
            return out
        out.copy_(self.codes())
        if self.block_scale_dt is not None:
            blocks = out.view(self.out_features, -1, GROUP_SIZE)
            blocks.mul_(self.block_scale_dt)
            return out
        assert self.row_scale is not None
        return out.mul_(self.row_scale)

    def codes(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The int8 codes [out, in] row-major (rows `ids` only, where given), whichever layout
        `qweight` holds."""
        if not self.lanes:
            return self.qweight if ids is None else self.qweight.index_select(0, ids)
        if ids is None:
            return from_lanes(self.qweight)
        groups, quads, _ = self.qweight.shape
        picked = self.qweight.view(groups, quads, 16, 4)[ids // 16, :, ids % 16]
        return torch.bitwise_xor(picked.reshape(ids.numel(), quads * 4), 0x80).view(torch.int8)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` dequantised: the embedding lookup of a tied output matrix."""
        rows = self.codes(ids).to(self.dtype)
        if self.block_scale_dt is not None:
            blocks = rows.view(rows.shape[0], -1, GROUP_SIZE)
            scale = self.block_scale_dt.index_select(0, ids)
            return (blocks * scale).view(rows.shape[0], self.in_features)
        assert self.row_scale is not None
        return rows * self.row_scale.index_select(0, ids)


class Int4Linear(_QuantLinearBase):
    """`x @ ((q - 8) * scale + zero).T (+ bias)` from int4 groups.

    The codes are held twice, 4 bits each: in the kernel's packed layout, and as plain nibble
    pairs (byte j of a group: element j low, element j + 16 high) that the dense path expands.
    Where the native kernels take the layer, only the nibble pairs are kept, with 16 rows in
    the vector lanes where `rows_in_lanes` holds (`codes_to_lanes`).
    """

    kernel_max_rows = INT4_KERNEL_MAX_ROWS

    def __init__(self, weight: GroupQuant, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(bias, dtype)
        self.out_features, self.in_features = weight.shape
        self.group_size = g = weight.group_size
        self.qweight: torch.Tensor
        self.scales_and_zeros: torch.Tensor
        self.codes: torch.Tensor
        self.group_scale: torch.Tensor
        self.group_offset: torch.Tensor
        self.native = g == GROUP_SIZE and native_quantized(dtype)
        if self.native:
            # the native kernel reads `codes` with float32 scales and offsets per group;
            # torch's repacked copy is not built
            self.register_buffer("qweight", None)
            self.register_buffer("scales_and_zeros", None)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                weight.q.to(torch.int32).contiguous(), _INNER_K_TILES
            )
            self.register_buffer("qweight", packed)
            # the kernel's layout: [in // group, out, (scale, zero)]
            pairs = torch.stack([weight.scale.t(), weight.zero.t()], dim=-1)
            self.register_buffer("scales_and_zeros", pairs.to(self.kernel_dtype).contiguous())
        pairs = weight.pairs.contiguous()
        # the native kernels' layout: 16 rows in the lanes on AVX-512 without tiles
        self.lanes = self.native and rows_in_lanes(weight.shape)
        self.register_buffer("codes", codes_to_lanes(pairs) if self.lanes else pairs)
        self.register_buffer("group_scale", weight.scale.to(dtype)[..., None].contiguous())
        # the dense path computes codes * scale + (zero - 8 * scale)
        offset = weight.zero - 8 * weight.scale
        self.register_buffer("group_offset", offset.to(dtype)[..., None].contiguous())
        self.q4_scale: torch.Tensor | None
        self.q4_offset: torch.Tensor | None
        # in float16, as GGUF's Q4_0 / Q4_1 blocks hold them (exact there; Q4_K's products of
        # two scales round at 2^-11, far inside the 4-bit step)
        native_scale = weight.scale.half().contiguous() if self.native else None
        native_offset = offset.half().contiguous() if self.native else None
        if self.lanes:
            assert native_scale is not None and native_offset is not None
            native_scale, native_offset = (
                scales_to_lanes(native_scale),
                scales_to_lanes(native_offset),
            )
        self.register_buffer("q4_scale", native_scale, persistent=False)
        self.register_buffer("q4_offset", native_offset, persistent=False)

    def _native(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out: torch.Tensor = torch.ops.stallfree.linear_q4(
            x, self.codes, self.q4_scale, self.q4_offset, bias
        )
        return out

    def _on_tiles(
        self,
        flat: torch.Tensor,
        bias: torch.Tensor | None = None,
        silu: bool = False,
        pack: bool = False,
        rows: int = 0,
    ) -> torch.Tensor:
        out: torch.Tensor = torch.ops.stallfree.linear_q4_prompt(
            flat, self.codes, self.q4_scale, self.q4_offset, bias, silu, pack, rows
        )
        return out

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.qweight, self.group_size, self.scales_and_zeros
        )
        return out

    def dequantize_rows(self, n0: int, out: torch.Tensor, bf16_values: bool = False) -> None:
        n1 = n0 + out.shape[0]
        assert self.q4_scale is not None and self.q4_offset is not None
        torch.ops.stallfree.dequantize_q4(
            self.codes[n0:n1], self.q4_scale[n0:n1], self.q4_offset[n0:n1], out, bf16_values
        )

    def dequantize(self) -> torch.Tensor:
        rows, groups, g = self.out_features, self.in_features // self.group_size, self.group_size
        if _native_dequantize(self):
            dense = _workspace(rows, self.in_features, self.dtype)
            torch.ops.stallfree.dequantize_q4(self.codes, self.q4_scale, self.q4_offset, dense)
            return dense
        out = _workspace(rows, self.in_features, self.dtype).view(rows, groups, 2, g // 2)
        nibbles = _workspace(rows, self.in_features // 2, torch.uint8).view(rows, groups, g // 2)
        codes = codes_from_lanes(self.codes) if self.lanes else self.codes
        torch.bitwise_and(codes, 15, out=nibbles)
        out[:, :, 0].copy_(nibbles)
        torch.bitwise_right_shift(codes, 4, out=nibbles)
        out[:, :, 1].copy_(nibbles)
        dense = out.view(rows, groups, g)
        dense.mul_(self.group_scale).add_(self.group_offset)
        return dense.view(rows, self.in_features)


QuantLinear = Int8Linear | Int4Linear


def make_linear(
    weight: torch.Tensor | QuantizedWeight,
    bias: torch.Tensor | None,
    method: str,
    dtype: torch.dtype,
) -> nn.Module | None:
    """The quantized layer for `weight` under `method`, or None when it stays dense.

    A float weight is quantized by `method` (int8 or int4); an already quantized one (from a
    GGUF file) keeps its own form. An int4 shape the kernel cannot take falls back to int8.
    """
    if isinstance(weight, GroupQuant):
        if int4_fits(weight.shape, weight.group_size):
            return Int4Linear(weight, bias, dtype)
        return Int8Linear(quantize_int8(weight.dequantize()), bias, dtype)
    if isinstance(weight, (RowQuant, BlockQuant8)):
        return Int8Linear(weight, bias, dtype)
    if method == "int4" and int4_fits(tuple(weight.shape)):  # type: ignore[arg-type]
        return Int4Linear(quantize_int4(weight), bias, dtype)
    if method in ("int4", "int8"):
        return Int8Linear(quantize_int8(weight), bias, dtype)
    return None


def check_method(method: str, device: torch.device) -> None:
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"unsupported quantization {method!r}; expected one of {', '.join(QUANTIZATION_METHODS)}"
        )
    if method != "none" and device.type != "cpu":
        raise ValueError(
            f"quantization {method!r} runs on torch's CPU integer kernels; use quantization=none "
            f"on {device.type}"
        )


class Int8Embedding(nn.Module):
    """The embedding lookup of a tied model whose output matrix is int8: rows of that matrix,
    dequantised (one matrix in memory for both)."""

    def __init__(self, head: Int8Linear) -> None:
        super().__init__()
        self.head = head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.embed(ids)


_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def fused_linear(
    layers: list[nn.Linear], prefix: str, fused_name: str, packed: dict[str, QuantizedWeight]
) -> nn.Linear | None:
    """An nn.Linear whose rows are `layers`' stacked; a packed group's stacked weight goes in
    `packed` under the fused name and the layer's own weight stays on the meta device."""
    names = [f"{prefix}{part}.weight" for part in _PARTS[fused_name]]
    in_packed = [n in packed for n in names]
    if any(in_packed) and not (all(in_packed) and can_stack([packed[n] for n in names])):
        return None
    out = sum(layer.out_features for layer in layers)
    first = layers[0]
    has_bias = first.bias is not None
    # made on the meta device, so nn.Linear's random init never runs: on the 1B Llama it
    # filled every fused weight before the stacked rows overwrote it, 2.9 s of a 3.6 s load
    fused = nn.Linear(
        first.in_features, out, bias=has_bias, device="meta", dtype=first.weight.dtype
    )
    with torch.no_grad():
        if all(in_packed):
            parts = [packed.pop(n) for n in names]
            packed[f"{prefix}{fused_name}.weight"] = stack_rows(parts)
        else:
            fused.weight = nn.Parameter(torch.cat([layer.weight for layer in layers]))
        if has_bias:
            bias = torch.cat([layer.bias for layer in layers])
            fused.bias = nn.Parameter(bias, requires_grad=False)
    return fused


def weight_bytes(module: nn.Module) -> int:
    """Bytes of every weight the module holds, quantized layers counted packed."""
    total = 0
    seen: set[int] = set()
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) in seen or tensor.dtype == torch.bool:
            continue
        seen.add(id(tensor))
        total += tensor.numel() * tensor.element_size()
    return total


def describe(layers: dict[str, Any]) -> str:
    """'int4 x 180, int8 x 1, dense x 30' for the log line."""
    counts: dict[str, int] = {}
    for layer in layers.values():
        kind = (
            "int4"
            if isinstance(layer, Int4Linear)
            else ("int8" if isinstance(layer, Int8Linear) else "dense")
        )
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{k} x {v}" for k, v in sorted(counts.items()))
