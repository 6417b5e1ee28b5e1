"""int8 and int4 weights with 16 output rows in the vector lanes (csrc/q8_lanes.cpp,
quant.to_lanes, quant.codes_to_lanes): the layouts' round trips, the products against the
exact emulation of the integer arithmetic (int8 row scales and GGUF Q8_0's block scales, int4
groups with scale and offset, row counts 1-40, an int8 code of -128), the dequantised weight
bit for bit, and where Int8Linear and Int4Linear take the layout."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.runtime.model import cpu_kernels, quant
from stallfree.runtime.model.quant import (
    Int4Linear,
    Int8Linear,
    codes_from_lanes,
    codes_to_lanes,
    from_lanes,
    quantize_int4,
    quantize_int8,
    quantize_int8_blocks,
    scales_to_lanes,
    to_lanes,
)
from tests.model.native_util import VARIANTS, set_isa
from tests.model.test_native_kernels import _rel, q8_emulation

pytestmark = [
    pytest.mark.skipif("avx512" not in VARIANTS, reason="no AVX-512 variant on this CPU"),
    pytest.mark.usefixtures("restore_variant"),
]


def test_the_lanes_layout_puts_row_r_of_a_group_in_lane_r_and_comes_back() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-128, 128, (48, 96), generator=g, dtype=torch.int8)
    u = to_lanes(q)
    assert u.dtype == torch.uint8 and u.shape == (3, 24, 64)
    # group 2, inputs 40-43 of row 2 * 16 + 5: vector 10 of the group, lane 5
    assert u[2, 10, 20:24].tolist() == [int(v) + 128 for v in q[37, 40:44]]
    assert torch.equal(from_lanes(u), q)
    s = torch.rand(48, 3, generator=g).half()
    sl = scales_to_lanes(s)
    assert sl.shape == (3, 3, 16) and sl[1, 2, 7] == s[23, 2]


def _lanes_product(
    x: torch.Tensor, q: torch.Tensor, per_block: bool, g: torch.Generator, b: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`linear_q8_blocks` (float16 scales per block, spread over three octaves) or `linear_q8`
    (a scale per row) on `q` laid out in the lanes; with the exact emulation's sums and the
    sums of the absolute terms, which bound a float sum's rounding error."""
    n, k = q.shape
    if per_block:
        bscale = ((torch.rand(n, k // 32, generator=g) * 3 - 4).exp2()).half()
        out = torch.ops.stallfree.linear_q8_blocks(x, to_lanes(q), scales_to_lanes(bscale), b)
        codes = q.double() * bscale.double().repeat_interleave(32, 1)
        scale = torch.ones(n, dtype=torch.float64)
    else:
        scale = torch.rand(n, generator=g) / 50 + 0.001
        out = torch.ops.stallfree.linear_q8(x, to_lanes(q), scale, b)
        codes = q.double()
    ref = q8_emulation(x, codes, scale) + (0 if b is None else b.double())
    bound = q8_emulation(x.abs(), codes.abs(), scale) + (0 if b is None else b.double().abs())
    return out, ref, bound


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 40),
    groups=st.integers(1, 6),
    blocks=st.integers(1, 9),
    bf16=st.booleans(),
    bias=st.booleans(),
    per_block=st.booleans(),
    variant=st.sampled_from(VARIANTS),
    seed=st.integers(0, 2**16),
)
def test_a_weight_in_the_lanes_equals_the_emulation(
    m: int,
    groups: int,
    blocks: int,
    bf16: bool,
    bias: bool,
    per_block: bool,
    variant: str,
    seed: int,
) -> None:
    """`linear_q8` and `linear_q8_blocks` on a weight in the lanes, whichever variant is
    selected (the layout's kernel is the AVX-512 one): the exact emulation's sums, up to the
    float32 order (and the bfloat16 output's rounding)."""
    set_isa(variant)
    g = torch.Generator().manual_seed(seed)
    n, k = 16 * groups, 32 * blocks
    dtype = torch.bfloat16 if bf16 else torch.float32
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g) if bias else None
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    out, ref, bound = _lanes_product(x, q, per_block, g, b)
    assert out.dtype == dtype and out.shape == (m, n)
    assert _rel(out, ref, None if bf16 else bound) < (8e-3 if bf16 else 1e-5)


@pytest.mark.parametrize("per_block", [False, True])
def test_a_weight_in_the_lanes_takes_a_code_of_minus_128(per_block: bool) -> None:
    """The lanes hold w + 128 and each block's sum starts from -128 times the activation's
    codes: a code of -128 (which a GGUF file may hold) counts as itself."""
    set_isa("avx512")
    g = torch.Generator().manual_seed(3)
    n, k = 32, 96
    x = torch.randn(5, k, generator=g)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    q[:, ::3] = -128
    out, ref, bound = _lanes_product(x, q, per_block, g, None)
    assert _rel(out, ref, bound) < 1e-5


@pytest.mark.parametrize("per_block", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantising_a_weight_in_the_lanes_gives_the_row_major_values(
    per_block: bool, dtype: torch.dtype
) -> None:
    set_isa("avx512")
    g = torch.Generator().manual_seed(4)
    n, k = 48, 160
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) / 50
    bscale = (torch.rand(n, k // 32, generator=g) / 50).half()
    want, got = torch.empty(n, k, dtype=dtype), torch.empty(n, k, dtype=dtype)
    if per_block:
        torch.ops.stallfree.dequantize_q8(q, None, bscale, want)
        torch.ops.stallfree.dequantize_q8(to_lanes(q), None, scales_to_lanes(bscale), got)
    else:
        torch.ops.stallfree.dequantize_q8(q, scale, None, want)
        torch.ops.stallfree.dequantize_q8(to_lanes(q), scale, None, got)
    assert torch.equal(got, want)


def test_a_weight_in_the_lanes_of_the_wrong_width_is_refused() -> None:
    q = to_lanes(torch.zeros(16, 64, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="input has 32 features, weight 64"):
        torch.ops.stallfree.linear_q8(torch.zeros(1, 32), q, torch.ones(16), None)
    with pytest.raises(RuntimeError, match="block scales must be float16"):
        torch.ops.stallfree.linear_q8_blocks(torch.zeros(1, 64), q, torch.ones(16, 3).half(), None)


@pytest.mark.parametrize("make", [quantize_int8, quantize_int8_blocks])
def test_int8_linear_takes_the_lanes_on_avx512_without_tiles(
    make: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the AVX-512 variant runs without the AMX tiles, an int8 layer of whole groups of
    16 rows keeps its codes in the lanes, and its products, dequantised weight and embedding
    rows are the row-major layer's; `STALLFREE_INT_LANES=0`, rows not a multiple of 16, or
    the tiles in use keep the row-major layout."""
    set_isa("avx512")
    monkeypatch.setattr(cpu_kernels, "isa", lambda: "avx512")
    monkeypatch.setattr(cpu_kernels, "amx", lambda: False)
    g = torch.Generator().manual_seed(5)
    weight = make(torch.randn(64, 96, generator=g))  # type: ignore[operator]
    lanes = Int8Linear(weight, None, torch.bfloat16)
    monkeypatch.setenv(quant.LANES_ENV, "0")
    rows = Int8Linear(weight, None, torch.bfloat16)
    monkeypatch.delenv(quant.LANES_ENV)
    assert lanes.lanes and lanes.qweight.dim() == 3
    assert not rows.lanes and rows.qweight.dim() == 2
    assert torch.equal(lanes.codes(), rows.qweight)
    assert torch.equal(lanes.dequantize().clone(), rows.dequantize().clone())
    ids = torch.tensor([0, 63, 17, 17, 40])
    assert torch.equal(lanes.embed(ids), rows.embed(ids))
    for m in (1, 4, 8, 16):
        x = torch.randn(m, 96, generator=g).bfloat16()
        assert (lanes(x).float() - rows(x).float()).abs().max() <= 0.02 * rows(x).abs().max()
    assert not Int8Linear(make(torch.randn(40, 96, generator=g)), None, torch.bfloat16).lanes  # type: ignore[operator]
    monkeypatch.setattr(cpu_kernels, "amx", lambda: True)
    assert not Int8Linear(weight, None, torch.bfloat16).lanes


def test_int8_linear_keeps_rows_on_the_avx2_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "isa", lambda: "avx2")
    monkeypatch.setattr(cpu_kernels, "amx", lambda: False)
    layer = Int8Linear(quantize_int8(torch.randn(32, 64)), None, torch.bfloat16)
    assert not layer.lanes and layer.qweight.dim() == 2


def test_int4_codes_in_the_lanes_put_row_r_in_lane_r_and_come_back() -> None:
    g = torch.Generator().manual_seed(6)
    codes = torch.randint(0, 256, (32, 3, 16), generator=g, dtype=torch.uint8)
    lanes = codes_to_lanes(codes)
    assert lanes.shape == (2, 3, 4, 64)
    # row 16 + 9, block 2, bytes 8-11: vector 2 of the block, lane 9
    assert lanes[1, 2, 2, 36:40].tolist() == codes[25, 2, 8:12].tolist()
    assert torch.equal(codes_from_lanes(lanes), codes)


def _int4(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """An int4 weight's nibble pairs, float16 scales and offsets, and its exact dense values."""
    w = quantize_int4(torch.randn(n, k, generator=g))
    codes = w.pairs.contiguous()  # element j low, j + 16 high
    scale = w.scale.half().contiguous()
    offset = (w.zero - 8 * w.scale).half().contiguous()
    dense = w.q.double() * scale.double().repeat_interleave(
        32, 1
    ) + offset.double().repeat_interleave(32, 1)
    return codes, scale, offset, dense


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 40),
    groups=st.integers(1, 6),
    blocks=st.integers(1, 9),
    bf16=st.booleans(),
    bias=st.booleans(),
    variant=st.sampled_from(VARIANTS),
    seed=st.integers(0, 2**16),
)
def test_int4_codes_in_the_lanes_equal_the_emulation(
    m: int, groups: int, blocks: int, bf16: bool, bias: bool, variant: str, seed: int
) -> None:
    """`linear_q4` on codes in the lanes, whichever variant is selected: the activation's codes
    in blocks of 32 times the exact int4 values (code * scale + offset, in float16)."""
    set_isa(variant)
    g = torch.Generator().manual_seed(seed)
    n, k = 16 * groups, 32 * blocks
    dtype = torch.bfloat16 if bf16 else torch.float32
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g) if bias else None
    codes, scale, offset, dense = _int4(n, k, g)
    out = torch.ops.stallfree.linear_q4(
        x, codes_to_lanes(codes), scales_to_lanes(scale), scales_to_lanes(offset), b
    )
    ones = torch.ones(n, dtype=torch.float64)
    ref = q8_emulation(x, dense, ones) + (0 if b is None else b.double())
    bound = q8_emulation(x.abs(), dense.abs(), ones) + (0 if b is None else b.double().abs())
    assert out.dtype == dtype and out.shape == (m, n)
    assert _rel(out, ref, None if bf16 else bound) < (8e-3 if bf16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantising_int4_codes_in_the_lanes_gives_the_nibble_pairs_values(
    dtype: torch.dtype,
) -> None:
    set_isa("avx512")
    g = torch.Generator().manual_seed(7)
    codes, scale, offset, _ = _int4(48, 160, g)
    want, got = torch.empty(48, 160, dtype=dtype), torch.empty(48, 160, dtype=dtype)
    torch.ops.stallfree.dequantize_q4(codes, scale, offset, want)
    torch.ops.stallfree.dequantize_q4(
        codes_to_lanes(codes), scales_to_lanes(scale), scales_to_lanes(offset), got
    )
    assert torch.equal(got, want)


def test_int4_linear_takes_the_lanes_on_avx512_without_tiles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As for int8: the layer's products and dequantised weight (native, and torch's for a
    compile) are the nibble-pair layer's."""
    set_isa("avx512")
    monkeypatch.setattr(cpu_kernels, "isa", lambda: "avx512")
    monkeypatch.setattr(cpu_kernels, "amx", lambda: False)
    g = torch.Generator().manual_seed(8)
    weight = quantize_int4(torch.randn(64, 96, generator=g))
    lanes = Int4Linear(weight, None, torch.bfloat16)
    monkeypatch.setenv(quant.LANES_ENV, "0")
    pairs = Int4Linear(weight, None, torch.bfloat16)
    monkeypatch.delenv(quant.LANES_ENV)
    assert lanes.lanes and lanes.codes.dim() == 4
    assert not pairs.lanes and pairs.codes.dim() == 3
    assert torch.equal(lanes.dequantize().clone(), pairs.dequantize().clone())
    monkeypatch.setattr(quant, "_native_dequantize", lambda layer: False)
    assert torch.equal(lanes.dequantize().clone(), pairs.dequantize().clone())
    monkeypatch.undo()
    set_isa("avx512")
    for m in (1, 4, 8, 16):
        x = torch.randn(m, 96, generator=g).bfloat16()
        want = pairs(x).float()
        assert (lanes(x).float() - want).abs().max() <= 0.02 * want.abs().max()
