"""The native products with inputs of no features (in_features 0) and rows to fill: every
output row is the bias (zeros without one), as F.linear gives it, on every variant and on the
AMX tiles' prompt products. Before, the decode products returned their output unwritten
(whatever the allocator's memory held) and the prompt products divided the input's size by
its zero width, which stopped the process with SIGFPE."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.model.native_util import each_isa, needs_amx, needs_kernels, set_isa

pytestmark = [needs_kernels, pytest.mark.usefixtures("restore_variant")]

ROWS, OUT = 3, 32
ops = torch.ops.stallfree


def bias() -> torch.Tensor:
    return torch.linspace(-2.0, 3.0, OUT)


def expected(dtype: torch.dtype, with_bias: bool) -> torch.Tensor:
    """F.linear's answer over zero features, in the output's dtype."""
    x = torch.empty(ROWS, 0, dtype=dtype)
    w = torch.empty(OUT, 0, dtype=dtype)
    return F.linear(x, w, bias().to(dtype) if with_bias else None)


@each_isa
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_dense_products_give_the_bias(isa: str, dtype: torch.dtype, with_bias: bool) -> None:
    set_isa(isa)
    x = torch.empty(ROWS, 0, dtype=dtype)
    b = bias() if with_bias else None
    out = ops.linear(x, torch.empty(OUT, 0, dtype=dtype), b)
    assert torch.equal(out, expected(dtype, with_bias))
    group = ops.linear_group(x, [torch.empty(OUT // 2, 0, dtype=dtype)] * 2)
    assert torch.equal(group, torch.zeros(ROWS, OUT, dtype=dtype))


@each_isa
@pytest.mark.parametrize("with_bias", [True, False])
def test_integer_products_give_the_bias(isa: str, with_bias: bool) -> None:
    set_isa(isa)
    x = torch.empty(ROWS, 0, dtype=torch.bfloat16)
    b = bias() if with_bias else None
    want = expected(torch.bfloat16, with_bias)
    q = torch.empty(OUT, 0, dtype=torch.int8)
    assert torch.equal(ops.linear_q8(x, q, torch.ones(OUT), b), want)
    assert torch.equal(ops.linear_q8_blocks(x, q, torch.empty(OUT, 0, dtype=torch.half), b), want)
    codes = torch.empty(OUT, 0, 16, dtype=torch.uint8)
    half = torch.empty(OUT, 0, dtype=torch.half)
    assert torch.equal(ops.linear_q4(x, codes, half, half, b), want)


@needs_amx
@pytest.mark.usefixtures("tiles")
@pytest.mark.parametrize("with_bias", [True, False])
def test_prompt_products_give_the_bias(with_bias: bool) -> None:
    x = torch.empty(ROWS, 0, dtype=torch.bfloat16)
    b = bias() if with_bias else None
    want = expected(torch.bfloat16, with_bias)
    assert torch.equal(
        ops.linear_bf16_prompt(x, torch.empty(OUT, 0, dtype=torch.bfloat16), b), want
    )
    q = torch.empty(OUT, 0, dtype=torch.int8)
    assert torch.equal(ops.linear_q8_prompt(x, q, torch.ones(OUT), None, b), want)
    codes = torch.empty(OUT, 0, 16, dtype=torch.uint8)
    half = torch.empty(OUT, 0, dtype=torch.half)
    assert torch.equal(ops.linear_q4_prompt(x, codes, half, half, b), want)


@needs_amx
@pytest.mark.usefixtures("tiles")
def test_a_prompt_silu_over_no_features_is_silu_of_the_gate_bias_times_the_up_bias() -> None:
    x = torch.empty(ROWS, 0, dtype=torch.bfloat16)
    b = bias()
    out = ops.linear_bf16_prompt(x, torch.empty(OUT, 0, dtype=torch.bfloat16), b, True)
    gate, up = b.bfloat16().chunk(2)
    assert torch.equal(out, (F.silu(gate) * up).expand(ROWS, OUT // 2))
    # without a bias: silu(0) * 0
    out = ops.linear_bf16_prompt(x, torch.empty(OUT, 0, dtype=torch.bfloat16), None, True)
    assert torch.equal(out, torch.zeros(ROWS, OUT // 2, dtype=torch.bfloat16))
