"""A prompt's MLP on the AMX tiles as one hand-off (`pack=True`, csrc/amx_gemm.cpp): the gate/up
product writes silu(gate) * up straight in the packed order the down product reads, and the
down product takes that packed tensor with its row count. The result has the bits of the two
products run apart (row-major output, then the down product packing it again), for every
weight format, with and without a bias, at row counts that leave part of the last chunk of 16
empty; `native_layers.mlp_on_tiles` takes a Llama MLP's prompt this way and leaves everything
else (a decode step's rows, the tiles off, a prepacked copy) to the two calls."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stallfree.runtime.model import cpu_kernels, native_layers, quant
from tests.model.native_util import OpCalls, needs_amx

KINDS = ("bf16", "int8 rows", "int8 blocks", "int4")


def projection(n: int, k: int, kind: str, seed: int, bias: bool = False) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) if bias else None
    if kind == "bf16":
        lin = torch.nn.Linear(k, n, bias=bias).bfloat16()
        lin.weight.data.copy_(w)
        if b is not None:
            lin.bias.data.copy_(b)
        assert native_layers.use_native_linears(lin) == 1
        return lin
    if kind == "int4":
        return quant.Int4Linear(quant.quantize_int4(w), b, torch.bfloat16)
    weight = quant.quantize_int8_blocks(w) if kind == "int8 blocks" else quant.quantize_int8(w)
    return quant.Int8Linear(weight, b, torch.bfloat16)


def unpacked(packed: torch.Tensor, width: int) -> torch.Tensor:
    """The packed tensor [width / 32, chunks, 16 pairs, 16 rows] of two bfloat16 values each
    (feature 2p low, 2p + 1 high) as rows [chunks * 16, width]."""
    chunks = packed.shape[1]
    halves = packed.view(torch.int16).view(width // 32, chunks, 16, 16, 2)
    # [block, chunk, pair, row, low/high] -> [chunk * 16 + row, block * 32 + 2 pair + half]
    return halves.permute(1, 3, 0, 2, 4).reshape(chunks * 16, width).view(torch.bfloat16)


def apart(gate_up: torch.nn.Module, down: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The two products as the MLP ran them before: silu in the first one's epilogue, written
    row-major, then the second."""
    h = native_layers.gate_up_silu(gate_up, x)
    out: torch.Tensor = down(h)
    return out


@needs_amx
@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kind_up=st.sampled_from(KINDS),
    kind_down=st.sampled_from(KINDS),
    m=st.integers(17, 256),
    inter32=st.integers(1, 6),
    k32=st.integers(1, 6),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_packed_hand_off_gives_the_bits_of_the_two_products_apart(
    tiles: None,
    kind_up: str,
    kind_down: str,
    m: int,
    inter32: int,
    k32: int,
    bias: bool,
    seed: int,
) -> None:
    inter, k = 32 * inter32, 32 * k32
    gate_up = projection(2 * inter, k, kind_up, seed, bias)
    down = projection(k, inter, kind_down, seed + 1, bias)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).bfloat16()
    with torch.inference_mode(), OpCalls() as ops:
        got = native_layers.mlp_on_tiles(gate_up, down, x)
    assert got is not None
    prompts = [c for c in ops.native() if c.endswith("_prompt")]
    assert len(prompts) == 2 and prompts == ops.native()
    with torch.inference_mode():
        want = apart(gate_up, down, x)
    assert got.shape == want.shape == (m, k)
    assert torch.equal(got, want)


@needs_amx
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [17, 64, 65, 200, 256])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_packed_output_is_pack_x_gemm_order_with_empty_rows_zero(
    tiles: None, kind: str, m: int, threads: int
) -> None:
    """The packed tensor itself: [inter / 32, chunks, 16 pairs, 16 rows] of two bfloat16 values
    each (features 2p low, 2p + 1 high), the row-major silu product's values, and zero in the
    rows past the prompt's."""
    torch.set_num_threads(threads)
    inter, k = 96, 128
    gate_up = projection(2 * inter, k, kind, 3, bias=True)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    with torch.inference_mode():
        packed = gate_up.tile_product(x, silu=True, pack=True)
        rows = native_layers.gate_up_silu(gate_up, x)
    chunks = (m + 15) // 16
    assert packed.dtype == torch.int32 and packed.shape == (inter // 32, chunks, 16, 16)
    values = unpacked(packed, inter)
    assert torch.equal(values[:m], rows)
    assert not values[m:].view(torch.int16).any()


@needs_amx
@pytest.mark.parametrize("m", [17, 64, 256])
def test_a_plain_product_packs_its_output_the_same_way(tiles: None, m: int) -> None:
    """Without silu: each pair of output features of the row-major product (bias included)."""
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 96, generator=g).bfloat16(), torch.randn(64, 96, generator=g).bfloat16()
    b = torch.randn(64, generator=g)
    op = torch.ops.stallfree.linear_bf16_prompt
    packed = op(x, w, b, False, True)
    assert packed.shape == (2, (m + 15) // 16, 16, 16)
    values = unpacked(packed, 64)
    assert torch.equal(values[:m], op(x, w, b))
    assert not values[m:].view(torch.int16).any()
    assert torch.equal(
        op(packed, w[:, :64].contiguous(), None, False, False, m),
        op(values[:m], w[:, :64].contiguous(), None),
    )


@needs_amx
def test_an_llama_mlp_prompt_takes_the_hand_off(tiles: None) -> None:
    """`LlamaMLP.forward` (stacked gate/up): a prompt on the tiles makes two product calls and
    nothing else; a decode step's rows, a prompt past the tiles' 256 rows and a prepacked copy
    go the way they went before."""
    from stallfree.runtime.model.arch import ModelArchConfig
    from stallfree.runtime.model.llama import LlamaMLP
    from stallfree.runtime.model.parallel import TPGroup

    arch = ModelArchConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=96,
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
        head_dim=64,
    )
    mlp = LlamaMLP(arch, TPGroup(), dtype=torch.bfloat16)
    torch.nn.init.normal_(mlp.gate_proj.weight, std=0.05)
    torch.nn.init.normal_(mlp.up_proj.weight, std=0.05)
    torch.nn.init.normal_(mlp.down_proj.weight, std=0.05)
    gate_up = torch.nn.Linear(128, 192, bias=False).bfloat16()
    gate_up.weight.data.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    native_layers.use_native_linears(gate_up)
    native_layers.use_native_linears(mlp.down_proj)
    mlp.gate_up_proj = gate_up
    x = torch.randn(80, 128).bfloat16()
    with torch.inference_mode(), OpCalls() as ops:
        got = mlp(x)
    assert ops.native() == ["stallfree.linear_bf16_prompt"] * 2
    with torch.inference_mode():
        assert torch.equal(got, mlp.down_proj(native_layers.gate_up_silu(gate_up, x)))
    for rows in (2, 300):
        with torch.inference_mode(), OpCalls() as ops:
            mlp(torch.randn(rows, 128).bfloat16())
        assert "stallfree.silu_mul" in ops.calls
        assert not any(c.endswith("_prompt") for c in ops.calls)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_kernels, "amx", lambda: False)
        assert native_layers.mlp_on_tiles(gate_up, mlp.down_proj, x) is None


@needs_amx
def test_packed_activations_that_do_not_fit_are_errors(tiles: None) -> None:
    w = torch.randn(64, 96).bfloat16()
    op = torch.ops.stallfree.linear_bf16_prompt
    good = op(torch.randn(40, 64).bfloat16(), torch.randn(192, 64).bfloat16(), None, True, True)
    assert good.shape == (3, 3, 16, 16)
    with pytest.raises(RuntimeError, match="packed activations"):
        op(good, w, None, False, False, 0)  # no row count
    with pytest.raises(RuntimeError, match="packed activations"):
        op(good, w, None, False, False, 49)  # four chunks of rows, not three
    with pytest.raises(RuntimeError, match="packed activations"):
        op(good, torch.randn(64, 64).bfloat16(), None, False, False, 40)  # 64 features, not 96
    with pytest.raises(RuntimeError, match="whole blocks of 32"):
        op(torch.randn(40, 64).bfloat16(), torch.randn(48, 64).bfloat16(), None, False, True)
    assert op(good, w, None, False, False, 40).shape == (40, 64)
    empty = op(torch.empty(0, 64).bfloat16(), torch.randn(192, 64).bfloat16(), None, True, True)
    assert empty.shape == (3, 0, 16, 16) and empty.dtype == torch.int32


@needs_amx
def test_the_fakes_give_the_packed_shapes(tiles: None) -> None:
    """torch.compile's fakes (cpu_kernel_fakes.py) for the packed hand-off's two calls."""
    x = torch.randn(40, 64).bfloat16()
    gu, down = torch.randn(192, 64).bfloat16(), torch.randn(64, 96).bfloat16()
    packed = torch.ops.stallfree.linear_bf16_prompt(x, gu, None, True, True)
    for args in ((x, gu, None, True, True, 0), (packed, down, None, False, False, 40)):
        torch.library.opcheck(
            torch.ops.stallfree.linear_bf16_prompt,
            args,
            test_utils=("test_schema", "test_faketensor"),
        )
