"""`native_layers.widened_product`: a bfloat16 prompt's product in float32 on the AVX2 variant,
the weight widened a block of rows at a time into one reused buffer."""

from __future__ import annotations

import pytest
import torch

from stallfree.runtime.model import native_layers


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
