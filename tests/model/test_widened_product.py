"""`native_layers.widened_product`: a bfloat16 prompt's product in float32 on the AVX2 variant,
the weight widened a block of rows at a time into one reused buffer."""

from __future__ import annotations

import pytest
import torch

from stallfree.runtime.model import native_layers, quant

from .native_util import OpCalls, needs_kernels, set_isa


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return native_layers.float32_product(x.float(), w.float(), bias).to(torch.bfloat16)


@pytest.mark.parametrize("bias", [False, True])
def test_one_block_is_the_float32_product_rounded_once(bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(80, 96, generator=gen).bfloat16()
    b = torch.randn(80, generator=gen) if bias else None
    x = torch.randn(2, 70, 96, generator=gen).bfloat16()
    out = native_layers.widened_product(x, w, b)
    assert out.shape == (2, 70, 80) and out.dtype == torch.bfloat16
    assert torch.equal(out, _reference(x, w, b))


def test_blocks_of_rows_cover_every_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight past WIDEN_BLOCK_BYTES is widened in blocks (the last one short), each block's
    outputs in its own columns, its bias slice added."""
    gen = torch.Generator().manual_seed(1)
    k = 64
    monkeypatch.setattr(native_layers, "WIDEN_BLOCK_BYTES", 24 * 4 * k)  # 24 rows a block
    w = torch.randn(100, k, generator=gen).bfloat16()
    b = torch.randn(100, generator=gen)
    x = torch.randn(150, k, generator=gen).bfloat16()
    out = native_layers.widened_product(x, w, b)
    want = x.double() @ w.double().T + b.double()
    assert out.shape == (150, 100)
    err = (out.double() - want).abs() / want.abs().clamp_min(1.0)
    assert err.max() < 1e-2  # bfloat16's rounding of the result, nothing more
    for n0 in range(0, 100, 24):  # each block is its own float32 product, rounded once
        n1 = min(100, n0 + 24)
        assert torch.equal(out[:, n0:n1], _reference(x, w[n0:n1], b[n0:n1]))


def test_the_buffer_holds_each_weight_only_for_its_own_product() -> None:
    """Layers of one width share the buffer: each call sees its own weight, not the last one's
    (nothing downstream may keep the buffer's old values)."""
    gen = torch.Generator().manual_seed(2)
    weights = [torch.randn(48, 64, generator=gen).bfloat16() for _ in range(3)]
    x = torch.randn(40, 64, generator=gen).bfloat16()
    for _ in range(2):
        for w in weights:
            assert torch.equal(native_layers.widened_product(x, w, None), _reference(x, w, None))


def test_a_weight_with_padded_rows() -> None:
    """A weight whose rows are `ldw` > k values apart (padded_rows.py) reads only its k."""
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(32, 80, generator=gen).bfloat16()
    w = full[:, :64]
    x = torch.randn(20, 64, generator=gen).bfloat16()
    assert torch.equal(
        native_layers.widened_product(x, w, None), _reference(x, w.contiguous(), None)
    )


def test_widens_only_bfloat16_past_the_kernel_on_the_avx2_variant(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    most = native_layers.AVX2_BF16_MAX_ROWS
    for isa, rows, dtype, want in (
        ("avx2", most + 1, torch.bfloat16, True),
        ("avx2", most, torch.bfloat16, False),
        ("avx2", most + 1, torch.float32, False),
        ("avx512", most + 1, torch.bfloat16, False),
        (None, most + 1, torch.bfloat16, False),
    ):
        monkeypatch.setattr(native_layers.cpu_kernels, "isa", lambda isa=isa: isa)
        assert native_layers.widens(rows, dtype) is want


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["q8_0", "int8_rows", "int4"])
def test_an_integer_prompt_dequantises_block_by_block_into_the_float32_product(
    fmt: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch, restore_variant: None
) -> None:
    """An integer layer's prompt multiplied in float32 (a bfloat16 one past the kernel's rows on
    the AVX2 variant, a float32 one past the dense kernel's) is dequantised a block of rows at a
    time straight into the product's float32 block (`dense_product`): the bits of dequantising
    the whole weight into the shared workspace and multiplying that, and no workspace made."""
    set_isa("avx2")
    monkeypatch.setattr(native_layers.cpu_kernels, "isa", lambda: "avx2")
    monkeypatch.setattr(native_layers.cpu_kernels, "amx", lambda: False)
    monkeypatch.setattr(native_layers, "WIDEN_BLOCK_BYTES", 48 * 4 * 128)  # 48 rows a block
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(160, 128, generator=gen) * 0.05
    if fmt == "q8_0":
        layer: quant._QuantLinearBase = quant.Int8Linear(quant.quantize_int8_blocks(w), None, dtype)
    elif fmt == "int8_rows":
        layer = quant.Int8Linear(quant.quantize_int8(w), None, dtype)
    else:
        layer = quant.Int4Linear(quant.quantize_int4(w), None, dtype)
    assert layer.native and not layer.lanes
    if dtype == torch.bfloat16:
        rows = native_layers.AVX2_BF16_MAX_ROWS + 10
    else:
        rows = native_layers.dense_max_rows(torch.float32) + 10
    x = torch.randn(2, rows // 2, 128, generator=gen).to(dtype)
    monkeypatch.setattr(quant, "_workspaces", {})
    calls = OpCalls()
    with calls:
        got = layer(x)
    assert quant._workspaces == {}  # no dense copy of the weight
    op = "stallfree.dequantize_q4" if fmt == "int4" else "stallfree.dequantize_q8"
    assert calls.native().count(op) == 4  # 160 rows in blocks of 48
    want = native_layers.linear(x.reshape(-1, 128), layer.dequantize()).view(2, -1, 160)
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == torch.bfloat16 or native_layers.float32_on_onednn():
        assert torch.equal(got, want)  # oneDNN splits no output column's sum by the blocks
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_product_outside_inference_mode_after_one_inside_it() -> None:
    """The thread's buffer for a width, made under inference mode (the engine's forwards), is
    not written by a product outside it (torch refuses to update an inference tensor there)."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(24, 112, generator=gen).bfloat16()
    x = torch.randn(10, 112, generator=gen).bfloat16()
    with torch.inference_mode():
        inside = native_layers.widened_product(x, w, None)
    outside = native_layers.widened_product(x, w, None)
    assert torch.equal(inside, outside) and torch.equal(outside, _reference(x, w, None))
