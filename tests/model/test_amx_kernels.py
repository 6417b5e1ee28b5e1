"""The AMX tile paths (csrc/isa_amx.cpp): dense bfloat16 at 2-16 rows, int8 weights at 5-16
rows and int4 codes at 4-64 rows give the same results as the AVX-512 kernels within rounding,
at every row count and weight height (whole blocks of 16 on the tiles, the rest on AVX-512),
and are switched off by the environment, by another variant and on CPUs that do not report
AMX."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stallfree.runtime.model import cpu_kernels, native_layers, quant
from tests.model.native_util import VARIANTS, OpCalls, needs_amx, set_isa


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((out.double() - ref).abs() / ref.abs().max().clamp_min(1e-30)).max())


@needs_amx
@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    m=st.integers(1, 20),
    n=st.integers(1, 90),
    blocks=st.integers(1, 12),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_tiles_equal_the_exact_product(
    tiles: None, m: int, n: int, blocks: int, bias: bool, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    k = 32 * blocks
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g) if bias else None
    out = torch.ops.stallfree.linear(x, w, b)
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    # float32 sums of exact bfloat16 products, rounded once to bfloat16
    assert _rel(out, ref) < 8e-3


@needs_amx
@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    m=st.integers(4, 16),
    parts=st.lists(st.integers(1, 70), min_size=1, max_size=3),
    blocks=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_grouped_tiles_equal_each_linear(
    tiles: None, m: int, parts: list[int], blocks: int, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    k = 32 * blocks
    x = torch.randn(m, k, generator=g).bfloat16()
    ws = [torch.randn(n, k, generator=g).bfloat16() for n in parts]
    out = torch.ops.stallfree.linear_group(x, ws)
    ref = torch.cat([x.double() @ w.double().T for w in ws], dim=-1)
    assert out.shape == (m, sum(parts))
    assert _rel(out, ref) < 8e-3


@needs_amx
def test_tiles_and_avx512_agree_within_rounding(tiles: None) -> None:
    """Same inputs through both paths: only the order of the float32 sums differs."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 576, generator=g).bfloat16()
    w = torch.randn(1536, 576, generator=g).bfloat16()
    before = torch.ops.stallfree.amx_calls()
    on = torch.ops.stallfree.linear(x, w, None).float()
    assert torch.ops.stallfree.amx_calls() == before + 1
    assert not torch.ops.stallfree.set_amx(False)
    off = torch.ops.stallfree.linear(x, w, None).float()
    assert torch.ops.stallfree.amx_calls() == before + 1
    torch.testing.assert_close(on, off, rtol=1.6e-2, atol=1e-2)


@needs_amx
def test_native_linears_take_sixteen_rows_with_tiles() -> None:
    assert native_layers.dense_max_rows() == native_layers.AMX_MAX_ROWS


@pytest.mark.skipif("avx2" not in VARIANTS, reason="no AVX2 variant here")
def test_another_variant_turns_the_tiles_off(restore_variant: None) -> None:
    set_isa("avx2")
    # the tiles belong to the AVX-512 variant: asking for them on AVX2 is refused
    assert not torch.ops.stallfree.set_amx(True)
    x = torch.randn(8, 64).bfloat16()
    w = torch.randn(40, 64).bfloat16()
    ref = x.double() @ w.double().T
    assert _rel(torch.ops.stallfree.linear(x, w, None), ref) < 8e-3


@pytest.mark.skipif(not VARIANTS, reason="native CPU kernels unavailable here")
def test_switched_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STALLFREE_CPU_AMX", "0")
    cpu_kernels.reset()
    try:
        assert cpu_kernels.isa() is not None
        assert not cpu_kernels.amx()
        assert native_layers.dense_max_rows() == native_layers.DENSE_MAX_ROWS
    finally:
        monkeypatch.undo()
        cpu_kernels.reset()
        cpu_kernels.isa()


@needs_amx
@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    m=st.integers(5, 40),
    n=st.integers(16, 70),
    blocks=st.integers(1, 8),
    per_block=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_int8_tiles_equal_the_avx512_kernel(
    tiles: None, m: int, n: int, blocks: int, per_block: bool, seed: int
) -> None:
    """5-40 rows of int8 weights on the tiles (a block's widened scales serve each chunk of
    16 rows): the same integer block sums as the AVX-512 kernel, scaled in another order
    (float32 outputs, so that order shows)."""
    g = torch.Generator().manual_seed(seed)
    k = 32 * blocks
    x = torch.randn(m, k, generator=g)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) / 50
    bscale = (torch.rand(n, blocks, generator=g) / 50).half()
    bias = torch.randn(n, generator=g)

    def run() -> torch.Tensor:
        if per_block:
            out: torch.Tensor = torch.ops.stallfree.linear_q8_blocks(x, q, bscale, bias)
        else:
            out = torch.ops.stallfree.linear_q8(x, q, scale, bias)
        return out

    on = run()
    assert not torch.ops.stallfree.set_amx(False)
    off = run()
    assert torch.ops.stallfree.set_amx(True)
    assert _rel(on, off.double()) < 1e-5


@needs_amx
def test_int8_tiles_run_from_five_rows(tiles: None) -> None:
    q = torch.randint(-127, 128, (64, 256), dtype=torch.int8)
    bscale = (torch.rand(64, 8) / 50).half()
    for m, taken in ((4, 0), (5, 1), (16, 1), (17, 1), (64, 1), (65, 0)):
        before = torch.ops.stallfree.amx_calls()
        torch.ops.stallfree.linear_q8_blocks(torch.randn(m, 256), q, bscale, None)
        assert torch.ops.stallfree.amx_calls() - before == taken, m


@needs_amx
def test_bfloat16_tiles_run_from_three_rows(tiles: None) -> None:
    """At one and two rows the AVX-512 kernel reads the weights faster and takes the call."""
    w = torch.randn(64, 576).bfloat16()
    for m, taken in ((1, 0), (2, 0), (3, 1), (16, 1), (17, 1), (64, 1), (65, 0)):
        before = torch.ops.stallfree.amx_calls()
        torch.ops.stallfree.linear(torch.randn(m, 576).bfloat16(), w, None)
        assert torch.ops.stallfree.amx_calls() - before == taken, m


def _q4_weight(g: torch.Generator, n: int, groups: int) -> tuple[torch.Tensor, ...]:
    codes = torch.randint(0, 256, (n, groups, 16), dtype=torch.uint8, generator=g)
    scale = (torch.rand(n, groups, generator=g) / 10).half()
    offset = (torch.rand(n, groups, generator=g) - 0.5).half()
    return codes, scale, offset


@needs_amx
@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    m=st.integers(4, 40),
    n=st.integers(16, 70),
    groups=st.integers(1, 9),
    bias=st.booleans(),
    bf16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_int4_tiles_equal_the_avx512_kernel(
    tiles: None, m: int, n: int, groups: int, bias: bool, bf16: bool, seed: int
) -> None:
    """4-40 rows of int4 groups on the tiles (odd group counts, one group, a last chunk of
    fewer than 16 rows past 16): the same integer sums as the AVX-512 kernel, the scale and
    offset applied in another order."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 32 * groups, generator=g)
    if bf16:
        x = x.bfloat16()
    codes, scale, offset = _q4_weight(g, n, groups)
    b = torch.randn(n, generator=g) if bias else None
    on = torch.ops.stallfree.linear_q4(x, codes, scale, offset, b)
    assert not torch.ops.stallfree.set_amx(False)
    off = torch.ops.stallfree.linear_q4(x, codes, scale, offset, b)
    assert torch.ops.stallfree.set_amx(True)
    tol = 8e-3 if bf16 else 1e-5
    assert _rel(on.float(), off.double()) < tol


@needs_amx
@pytest.mark.parametrize("m", [4, 15, 16, 17, 31, 33, 64])
@pytest.mark.parametrize("groups", [1, 2, 3, 18])
def test_int4_tiles_cover_each_chunk_and_group_count(tiles: None, m: int, groups: int) -> None:
    """The tiles read the activation rows in chunks of 16 (a last chunk past m reads the rows
    quantize_act pads) and the scales two groups at a time (a last odd group, a lone group):
    every case equals the AVX-512 kernel."""
    g = torch.Generator().manual_seed(m * 100 + groups)
    x = torch.randn(m, 32 * groups, generator=g)
    codes, scale, offset = _q4_weight(g, 48, groups)
    b = torch.randn(48, generator=g)
    on = torch.ops.stallfree.linear_q4(x, codes, scale, offset, b)
    assert not torch.ops.stallfree.set_amx(False)
    off = torch.ops.stallfree.linear_q4(x, codes, scale, offset, b)
    assert torch.ops.stallfree.set_amx(True)
    assert _rel(on, off.double()) < 1e-5


@needs_amx
def test_int4_tiles_run_from_four_rows(tiles: None) -> None:
    g = torch.Generator().manual_seed(5)
    codes, scale, offset = _q4_weight(g, 64, 8)
    for m, taken in ((3, 0), (4, 1), (16, 1), (17, 1), (64, 1), (65, 0)):
        before = torch.ops.stallfree.amx_calls()
        torch.ops.stallfree.linear_q4(torch.randn(m, 256), codes, scale, offset, None)
        assert torch.ops.stallfree.amx_calls() - before == taken, m


@needs_amx
@pytest.mark.parametrize("blocks", [False, True])
def test_a_decode_steps_twenty_rows_take_the_integer_tiles_and_a_prompts_do_not(
    tiles: None, blocks: bool
) -> None:
    """A quantized layer sends a decode step's rows to the integer tiles (quantised
    activations) up to quant.AMX_NATIVE_MAX_ROWS; a prompt's rows past NATIVE_MAX_ROWS keep
    the dense path's numerics, on the tiles' prompt product (`linear_q8_prompt`: the weight
    dequantised as it goes, the activations not quantised)."""
    from stallfree.runtime.model import quant
    from stallfree.runtime.model.decode_rows import decode_rows

    w = torch.randn(64, 256)
    weight = quant.quantize_int8_blocks(w) if blocks else quant.quantize_int8(w)
    layer = quant.Int8Linear(weight, None, torch.bfloat16)
    assert layer.native
    w8a8 = "stallfree.linear_q8_blocks" if blocks else "stallfree.linear_q8"
    x = torch.randn(20, 256).bfloat16()
    with OpCalls() as ops:
        prompt = layer(x)
    assert ops.native() == ["stallfree.linear_q8_prompt"]  # 20 prompt rows: dense numerics
    with decode_rows():
        assert quant.native_max_rows() == quant.AMX_NATIVE_MAX_ROWS >= 20
        with OpCalls() as ops:
            decode = layer(x)
            layer(torch.randn(quant.AMX_NATIVE_MAX_ROWS + 1, 256).bfloat16())
        assert ops.native() == [w8a8, "stallfree.linear_q8_prompt"]  # past it: dense again
    assert quant.native_max_rows() == quant.NATIVE_MAX_ROWS
    # the same product either way, within the activations' quantisation
    assert _rel(decode.float(), prompt.double()) < 2e-2


@needs_amx
def test_a_decode_steps_twenty_bfloat16_rows_take_the_tiles_and_a_prompts_do_not(
    tiles: None,
) -> None:
    """A dense bfloat16 linear sends a decode step's rows to the tiles up to
    native_layers.AMX_DECODE_MAX_ROWS, a prompt's past AMX_MAX_ROWS to F.linear; float32 has
    no tiles and keeps AMX_MAX_ROWS either way."""
    from stallfree.runtime.model.decode_rows import decode_rows

    w = torch.randn(64, 256).bfloat16()
    x = torch.randn(20, 256).bfloat16()
    before = torch.ops.stallfree.amx_calls()
    prompt = native_layers.linear(x, w)
    assert torch.ops.stallfree.amx_calls() == before
    with decode_rows():
        assert native_layers.dense_max_rows(torch.bfloat16) == native_layers.AMX_DECODE_MAX_ROWS
        assert native_layers.dense_max_rows(torch.float32) == native_layers.AMX_MAX_ROWS
        decode = native_layers.linear(x, w)
        assert torch.ops.stallfree.amx_calls() == before + 1
        native_layers.linear(torch.randn(native_layers.AMX_DECODE_MAX_ROWS + 1, 256).bfloat16(), w)
        assert torch.ops.stallfree.amx_calls() == before + 1
    assert _rel(decode.float(), prompt.double()) < 1.6e-2


@needs_amx
@pytest.mark.parametrize("blocks", range(1, 10))
def test_every_block_count_keeps_its_pairs_in_order(tiles: None, blocks: int) -> None:
    """int8 and int4 tiles run pairs of blocks in flight in alternating sum tiles, with an odd
    block last; every count from 1 to 9 (no pair, one pair, an odd tail, several pairs of
    each parity) gives the AVX-512 kernel's results. Reordering the int4 path's code once let
    GCC move the unpacking of the next pair past the tile loads of the last one (its
    tile-load intrinsic names no memory): 4 groups and up came out 10-50% off."""
    g = torch.Generator().manual_seed(blocks)
    x = torch.randn(8, 32 * blocks, generator=g)
    q = torch.randint(-127, 128, (32, 32 * blocks), generator=g, dtype=torch.int8)
    bscale = (torch.rand(32, blocks, generator=g) / 50).half()
    codes, scale, offset = _q4_weight(g, 32, blocks)
    for run in (
        lambda: torch.ops.stallfree.linear_q8_blocks(x, q, bscale, None),
        lambda: torch.ops.stallfree.linear_q4(x, codes, scale, offset, None),
    ):
        before = torch.ops.stallfree.amx_calls()
        on = run()
        assert torch.ops.stallfree.amx_calls() - before == 1
        assert not torch.ops.stallfree.set_amx(False)
        off = run()
        assert torch.ops.stallfree.set_amx(True)
        assert _rel(on, off.double()) < 1e-5


@pytest.mark.skipif("avx2" not in VARIANTS, reason="no AVX2 variant of the native kernels here")
def test_a_bfloat16_layer_on_the_avx2_variant_widens_a_prompt_past_the_kernel(
    monkeypatch: pytest.MonkeyPatch, restore_variant: None
) -> None:
    """Without AVX512-BF16, torch's bfloat16 product is several times slower than the AVX2
    kernel, so a bfloat16 layer stays on the kernel up to AVX2_BF16_MAX_ROWS and past them
    multiplies in float32 (`widened_product`, the weight widened a block of rows at a time),
    never torch's bfloat16 product; float32 still leaves the kernel past DENSE_MAX_ROWS."""
    monkeypatch.setenv("STALLFREE_CPU_ISA", "avx2")
    cpu_kernels.reset()
    seen: list[torch.dtype] = []
    product = native_layers.float32_product

    def spy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        seen.extend((x.dtype, w.dtype))
        return product(x, w, b)

    monkeypatch.setattr(native_layers, "float32_product", spy)
    try:
        assert cpu_kernels.isa() == "avx2" and not cpu_kernels.amx()
        assert native_layers.dense_max_rows(torch.float32) == native_layers.DENSE_MAX_ROWS
        most = native_layers.dense_max_rows(torch.bfloat16)
        assert most == native_layers.AVX2_BF16_MAX_ROWS
        layer = torch.nn.Linear(96, 64).bfloat16()
        assert native_layers.use_native_linears(layer) == 1
        with torch.no_grad():
            for rows in (1, native_layers.DENSE_MAX_ROWS + 1, most, most + 1, 300):
                seen.clear()
                x = torch.randn(rows, 96).bfloat16()
                with OpCalls() as ops:
                    out = layer(x)
                assert out.dtype == torch.bfloat16
                widened = rows > most
                assert ("stallfree.linear" in ops.calls) != widened
                assert seen == ([torch.float32] * 2 if widened else [])
                want = x.double() @ layer.weight.double().T + layer.bias.double()
                assert _rel(out, want) < 8e-3
            # an integer layer's prompt rows past its kernels' dequantise, then the same
            for lin in (
                quant.Int8Linear(quant.quantize_int8(torch.randn(64, 96)), None, torch.bfloat16),
                quant.Int4Linear(quant.quantize_int4(torch.randn(64, 96)), None, torch.bfloat16),
            ):
                for rows in (most, 300):
                    seen.clear()
                    x = torch.randn(rows, 96).bfloat16()
                    with OpCalls() as ops:
                        out = lin(x)
                    assert ("stallfree.linear" in ops.calls) == (rows <= most)
                    assert seen == ([torch.float32] * 2 if rows > most else [])
                    assert _rel(out, x.double() @ lin.dequantize().double().T) < 8e-3
    finally:
        monkeypatch.undo()
        cpu_kernels.reset()
        cpu_kernels.isa()


@pytest.mark.skipif(
    "avx512" not in VARIANTS, reason="no AVX-512 variant of the native kernels here"
)
def test_a_bfloat16_layer_on_avx512_without_tiles_takes_the_kernel_then_the_prompt_product(
    monkeypatch: pytest.MonkeyPatch, restore_variant: None
) -> None:
    """AVX512-BF16 without the AMX tiles (a Zen 4): bfloat16 calls stay on the matrix-vector
    kernel up to AVX512_BF16_MAX_ROWS, then take the prompt product on `vdpbf16ps`
    (`linear_bf16_prompt`, csrc/bf16_gemm.cpp) at any row count, never F.linear; float32 keeps
    DENSE_MAX_ROWS."""
    monkeypatch.setenv("STALLFREE_CPU_ISA", "avx512")
    monkeypatch.setenv("STALLFREE_CPU_AMX", "0")
    cpu_kernels.reset()
    try:
        assert cpu_kernels.isa() == "avx512" and not cpu_kernels.amx()
        assert native_layers.dense_max_rows(torch.float32) == native_layers.DENSE_MAX_ROWS
        most = native_layers.dense_max_rows(torch.bfloat16)
        assert most == native_layers.AVX512_BF16_MAX_ROWS == 24
        layer = torch.nn.Linear(96, 64).bfloat16()
        assert native_layers.use_native_linears(layer) == 1
        rows_and_ops = (
            (1, "stallfree.linear"),
            (native_layers.DENSE_MAX_ROWS + 1, "stallfree.linear"),
            (most, "stallfree.linear"),
            (most + 1, "stallfree.linear_bf16_prompt"),
            (native_layers.PROMPT_TILES_MAX_ROWS + 45, "stallfree.linear_bf16_prompt"),
        )
        with torch.no_grad():
            for rows, op in rows_and_ops:
                x = torch.randn(rows, 96).bfloat16()
                with OpCalls() as ops:
                    out = layer(x)
                assert op in ops.calls and "aten.addmm" not in ops.calls, (rows, ops.calls)
                assert ("stallfree.linear" in ops.calls) == (op == "stallfree.linear"), rows
                want = x.double() @ layer.weight.double().T + layer.bias.double()
                assert _rel(out, want) < 8e-3
    finally:
        monkeypatch.undo()
        cpu_kernels.reset()
        cpu_kernels.isa()
