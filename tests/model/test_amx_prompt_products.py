"""A prompt's integer products on the AMX tiles (csrc/amx_gemm.cpp, `linear_q8_prompt` and
`linear_q4_prompt`): the weight dequantised block by block into L1 gives the dense path's
product (the same bfloat16 weight values, float32 sums in another order) for int8 with row and
block scales and for int4 groups, every row count past the decode kernels', weights whose
height is not a whole block of 32 rows and inputs of one to many blocks of k; `Int8Linear` and
`Int4Linear` take it for a bfloat16 prompt where the tiles are in use, and the dense path
otherwise. A dense bfloat16 prompt's product reads its row-major weight in place there
(`linear_bf16_prompt`, `NativeLinear`) between the decode kernels' rows and 256."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stallfree.runtime.model import cpu_kernels, native_layers, quant
from tests.model.native_util import VARIANTS, OpCalls, needs_amx

KINDS = ("int8 rows", "int8 blocks", "int4")


def layer(n: int, k: int, kind: str | bool, seed: int) -> quant.QuantLinear:
    """`kind` one of KINDS (True / False: int8 with block / row scales)."""
    if isinstance(kind, bool):
        kind = "int8 blocks" if kind else "int8 rows"
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    if kind == "int4":
        return quant.Int4Linear(quant.quantize_int4(w), None, torch.bfloat16)
    weight = quant.quantize_int8_blocks(w) if kind == "int8 blocks" else quant.quantize_int8(w)
    return quant.Int8Linear(weight, None, torch.bfloat16)


def prompt_op(
    lin: quant.QuantLinear, x: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    out: torch.Tensor
    if isinstance(lin, quant.Int4Linear):
        out = torch.ops.stallfree.linear_q4_prompt(x, lin.codes, lin.q4_scale, lin.q4_offset, bias)
    else:
        scale = lin.scale_f32 if lin.block_scale is None else None
        out = torch.ops.stallfree.linear_q8_prompt(x, lin.qweight, scale, lin.block_scale, bias)
    return out


def dense(lin: quant.QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """The exact product of x with the dense path's bfloat16 weight values."""
    return x.double() @ lin.dequantize().double().T


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((out.double() - ref).abs() / ref.abs().max().clamp_min(1e-30)).max())


@needs_amx
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    m=st.integers(1, 300),
    n16=st.integers(1, 40),
    kblocks=st.integers(1, 20),
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 2**16),
)
def test_prompt_product_equals_the_dense_one(
    tiles: None, m: int, n16: int, kblocks: int, kind: str, seed: int
) -> None:
    n, k = 16 * n16, 32 * kblocks  # heights of 16-row blocks that are not whole 32-row blocks too
    lin = layer(n, k, kind, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
    out = prompt_op(lin, x)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    # float32 sums of exact bfloat16 products, rounded once to bfloat16
    assert rel(out, dense(lin, x)) < 8e-3


@needs_amx
@pytest.mark.parametrize("kind", KINDS)
def test_bias_is_added_in_float32(tiles: None, kind: str) -> None:
    lin = layer(64, 96, kind, 0)
    x = torch.randn(40, 96).bfloat16()
    bias = torch.randn(64)
    assert rel(prompt_op(lin, x, bias), dense(lin, x) + bias.double()) < 8e-3


@needs_amx
@pytest.mark.parametrize("kind", KINDS)
def test_a_bfloat16_prompt_takes_the_tiles_and_a_float32_one_does_not(
    tiles: None, kind: str
) -> None:
    lin = layer(96, 128, kind, 3)
    x = torch.randn(2, 30, 128).bfloat16()  # 60 rows: past the decode kernels' 16
    before = torch.ops.stallfree.amx_calls()
    out = lin(x)
    assert torch.ops.stallfree.amx_calls() == before + 1
    assert out.shape == (2, 30, 96)
    assert rel(out.reshape(60, 96), dense(lin, x.reshape(60, 128))) < 8e-3
    # past PROMPT_TILES_MAX_ROWS rows: the dense path
    before = torch.ops.stallfree.amx_calls()
    long = torch.randn(native_layers.PROMPT_TILES_MAX_ROWS + 1, 128).bfloat16()
    assert rel(lin(long), dense(lin, long)) < 8e-3
    assert torch.ops.stallfree.amx_calls() == before
    f32 = quant.Int8Linear(quant.quantize_int8(torch.randn(96, 128) * 0.05), None, torch.float32)
    if kind == "int4":
        f32 = quant.Int4Linear(
            quant.quantize_int4(torch.randn(96, 128) * 0.05), None, torch.float32
        )
    before = torch.ops.stallfree.amx_calls()
    f32(torch.randn(60, 128))
    assert torch.ops.stallfree.amx_calls() == before  # the dense path: float32 numerics


@needs_amx
def test_bad_arguments_are_errors_not_crashes(tiles: None) -> None:
    lin = layer(32, 64, False, 0)
    op = torch.ops.stallfree.linear_q8_prompt
    x = torch.randn(20, 64).bfloat16()
    with pytest.raises(RuntimeError, match="one of scale and bscale"):
        op(x, lin.qweight, None, None, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        op(x.float(), lin.qweight, lin.scale_f32, None, None)
    with pytest.raises(RuntimeError, match="multiple of 32 and out_features of 16"):
        op(torch.randn(20, 48).bfloat16(), torch.zeros(32, 48, dtype=torch.int8), lin.scale_f32,
           None, None)  # fmt: skip
    with pytest.raises(RuntimeError, match="multiple of 32 and out_features of 16"):
        op(x, torch.zeros(24, 64, dtype=torch.int8), torch.ones(24), None, None)
    with pytest.raises(RuntimeError, match="features"):
        op(torch.randn(20, 96).bfloat16(), lin.qweight, lin.scale_f32, None, None)
    q4 = layer(32, 64, "int4", 0)
    assert isinstance(q4, quant.Int4Linear)
    op4 = torch.ops.stallfree.linear_q4_prompt
    with pytest.raises(
        RuntimeError, match=r"codes must be a contiguous uint8 \[out, in / 32, 16\]"
    ):
        op4(x, q4.codes.view(32, 32), q4.q4_scale, q4.q4_offset, None)
    with pytest.raises(RuntimeError, match="scales and offsets must be float16"):
        op4(x, q4.codes, q4.q4_scale.float(), q4.q4_offset, None)


def test_without_the_tiles_the_prompt_runs_dense(
    restore_variant: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the tiles are not in use (the AVX2 variant, a CPU without AMX, or
    STALLFREE_CPU_AMX=0) the layer takes no tiles (on the AVX-512 variant the vector prompt
    product: test_bf16_prompt_product.py; else the dense path), and on the AVX2 variant the op
    refuses rather than run without either (restore_variant puts the process's tiles back)."""
    if not VARIANTS:
        pytest.skip("native CPU kernels unavailable here")
    monkeypatch.setattr(cpu_kernels, "amx", lambda: False)
    for kind in KINDS:
        lin = layer(64, 64, kind, 1)
        x = torch.randn(40, 64).bfloat16()
        before = torch.ops.stallfree.amx_calls()
        out = lin(x)
        assert torch.ops.stallfree.amx_calls() == before
        assert rel(out, dense(lin, x)) < 8e-3
    monkeypatch.undo()
    # row-major codes, as a layer has them where the tiles are in use (quant.rows_in_lanes)
    monkeypatch.setenv(quant.LANES_ENV, "0")
    lin = layer(64, 64, True, 1)
    if "avx2" not in VARIANTS:
        return
    torch.ops.stallfree.set_isa("avx2")
    with pytest.raises(RuntimeError, match="neither the AMX tiles nor the AVX-512 variant"):
        torch.ops.stallfree.linear_q8_prompt(x, lin.qweight, None, lin.block_scale, None)


@needs_amx
@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    m=st.integers(1, 300),
    n16=st.integers(1, 40),
    kblocks=st.integers(1, 20),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_bfloat16_prompt_product_equals_the_exact_one(
    tiles: None, m: int, n16: int, kblocks: int, bias: bool, seed: int
) -> None:
    """`linear_bf16_prompt`: the row-major bfloat16 weight read in place (no re-layout)."""
    g = torch.Generator().manual_seed(seed)
    n, k = 16 * n16, 32 * kblocks
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g) if bias else None
    out = torch.ops.stallfree.linear_bf16_prompt(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    assert rel(out, want) < 8e-3


@needs_amx
@pytest.mark.parametrize("m", [1, 16, 17, 33, 49, 64, 65, 80, 113, 256])
@pytest.mark.parametrize("n, k", [(16, 32), (48, 288), (96, 576), (160, 2048)])
@pytest.mark.parametrize("threads", [1, 2])
def test_bfloat16_prompt_product_at_every_width_of_its_first_pass(
    tiles: None, m: int, n: int, k: int, threads: int
) -> None:
    """The first pass over each block of k loads the weight tiles from the weight itself into
    one to four chunks of 16 rows at once (17, 33, 49, 64 rows), storing them for the chunks
    after it when there are more (65 rows on); heights with a 16-row tail (48, 160) and k with
    a short last block (288, 576: 256 + 32, 2 x 256 + 64)."""
    g = torch.Generator().manual_seed(m * 7919 + n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.ops.stallfree.linear_bf16_prompt(x, w, None)
    finally:
        torch.set_num_threads(before)
    assert rel(out, x.double() @ w.double().T) < 8e-3


@needs_amx
def test_a_bfloat16_prompt_layer_takes_the_tiles_between_the_decode_kernels_and_256_rows(
    tiles: None,
) -> None:
    layer = torch.nn.Linear(96, 64).bfloat16()
    assert native_layers.use_native_linears(layer) == 1
    with torch.no_grad():
        for rows, op in (
            (native_layers.dense_max_rows(torch.bfloat16), "stallfree.linear"),
            (native_layers.dense_max_rows(torch.bfloat16) + 1, "stallfree.linear_bf16_prompt"),
            (native_layers.PROMPT_TILES_MAX_ROWS, "stallfree.linear_bf16_prompt"),
            (native_layers.PROMPT_TILES_MAX_ROWS + 1, "aten.addmm"),  # F.linear
        ):
            x = torch.randn(1, rows, 96).bfloat16()
            with OpCalls() as ops:
                out = layer(x)
            assert op in ops.calls and out.shape == (1, rows, 64)
            want = x[0].double() @ layer.weight.double().T + layer.bias.double()
            assert rel(out[0], want) < 8e-3


@needs_amx
def test_bfloat16_prompt_bad_arguments_are_errors(tiles: None) -> None:
    op = torch.ops.stallfree.linear_bf16_prompt
    x = torch.randn(20, 64).bfloat16()
    with pytest.raises(
        RuntimeError, match=r"weight must be a BFloat16 \[out, in\] tensor with contiguous rows"
    ):
        op(x, torch.randn(32, 64), None)
    with pytest.raises(RuntimeError, match="out_features of 16"):
        op(x, torch.randn(24, 64).bfloat16(), None)
    with pytest.raises(RuntimeError, match="features"):
        op(x, torch.randn(32, 96).bfloat16(), None)


# A gate and up projection stacked in one layer ([gate | up] rows): with `silu` the prompt
# product writes silu(gate) * up in its epilogue (16 gate rows and their up rows per block),
# where silu_mul would make a second pass over the product.
def fused_and_plain(
    kind: str, m: int, inter: int, k: int, bias: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(2 * inter, generator=g) if bias else None
    if kind == "bf16":
        w = (torch.randn(2 * inter, k, generator=g) * 0.05).bfloat16()
        op = torch.ops.stallfree.linear_bf16_prompt
        fused, plain = op(x, w, b, True), op(x, w, b)
    else:
        lin = layer(2 * inter, k, kind, seed)
        if isinstance(lin, quant.Int4Linear):
            args = (x, lin.codes, lin.q4_scale, lin.q4_offset, b)
            op = torch.ops.stallfree.linear_q4_prompt
        else:
            scale = lin.scale_f32 if lin.block_scale is None else None
            args = (x, lin.qweight, scale, lin.block_scale, b)
            op = torch.ops.stallfree.linear_q8_prompt
        fused, plain = op(*args, True), op(*args)
    return fused, torch.ops.stallfree.silu_mul(plain)


@needs_amx
@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kind=st.sampled_from(("bf16", *KINDS)),
    m=st.integers(1, 300),
    inter16=st.integers(1, 40),
    kblocks=st.integers(1, 20),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_silu_in_the_epilogue_gives_the_bits_of_silu_mul_after_the_product(
    tiles: None, kind: str, m: int, inter16: int, kblocks: int, bias: bool, seed: int
) -> None:
    fused, plain = fused_and_plain(kind, m, 16 * inter16, 32 * kblocks, bias, seed)
    assert fused.shape == plain.shape == (m, 16 * inter16)
    assert torch.equal(fused, plain)


@needs_amx
@pytest.mark.parametrize("kind", ["bf16", *KINDS])
@pytest.mark.parametrize("m", [17, 64, 65, 256])
@pytest.mark.parametrize("threads", [1, 2])
def test_silu_in_the_epilogue_at_every_pass_width(
    tiles: None, kind: str, m: int, threads: int
) -> None:
    """Whole chunk passes, the first pass alone (up to 64 rows) and with chunk pairs after it;
    an intermediate size with an odd number of 16-row blocks (48 x 16 = 768 gate rows, split
    over two threads unevenly)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused, plain = fused_and_plain(kind, m, 768, 576, True, m)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(fused, plain)


# The product walks each block of weight rows over the whole of k with its accumulators
# resident in their tiles while the packed activations fit in 1 MB (rows x in_features x 2
# bytes, rows rounded up to 16), and any prompt of up to 64 rows; past that it walks k in
# blocks with the accumulators parked between them. The cases above stay on the resident
# walk (up to 304 x 640 features); these cross over to the parked one (144 x 4128 x 2 bytes
# is 1.13 MB), with the last block of k short (4128 = 16 x 256 + 32).
@needs_amx
@pytest.mark.parametrize("kind", ["bf16", *KINDS])
@pytest.mark.parametrize("m", [64, 129, 144, 256])
@pytest.mark.parametrize("threads", [1, 2])
def test_prompt_products_past_half_of_l2_walk_k_in_blocks(
    tiles: None, kind: str, m: int, threads: int
) -> None:
    n, k = 48, 4128
    g = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=g).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if kind == "bf16":
            w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
            out = torch.ops.stallfree.linear_bf16_prompt(x, w, None)
            want = x.double() @ w.double().T
        else:
            lin = layer(n, k, kind, m)
            out, want = prompt_op(lin, x), dense(lin, x)
        fused, plain = fused_and_plain(kind, m, 48, k, True, m)
    finally:
        torch.set_num_threads(before)
    assert out.shape == (m, n)
    assert rel(out, want) < 8e-3
    assert torch.equal(fused, plain)


@needs_amx
def test_silu_needs_whole_blocks_of_gate_rows(tiles: None) -> None:
    x = torch.randn(20, 64).bfloat16()
    with pytest.raises(RuntimeError, match="silu needs gate and up of a multiple of 16 rows"):
        torch.ops.stallfree.linear_bf16_prompt(x, torch.randn(48, 64).bfloat16(), None, True)


@needs_amx
@pytest.mark.parametrize("kind", ["bf16", *KINDS])
def test_a_stacked_gate_up_layer_takes_silu_in_its_prompt_product(tiles: None, kind: str) -> None:
    """`native_layers.gate_up_silu`: a prompt on the tiles makes one product call and no
    silu_mul, with the bits of the product then silu_mul; a decode step's few rows, and a
    prompt with the tiles off, keep the separate silu_mul."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(2 * 96, 128, generator=g) * 0.05
    lin: torch.nn.Module
    if kind == "bf16":
        lin = torch.nn.Linear(128, 2 * 96, bias=False).bfloat16()
        lin.weight.data.copy_(w)
        assert native_layers.use_native_linears(lin) == 1
    else:
        lin = layer(2 * 96, 128, kind, 5)
    x = torch.randn(40, 128, generator=g).bfloat16()
    with torch.inference_mode(), OpCalls() as ops:
        got = native_layers.gate_up_silu(lin, x)
    assert "stallfree.silu_mul" not in ops.calls
    assert len([c for c in ops.calls if c.endswith("_prompt")]) == 1
    with torch.inference_mode():
        assert torch.equal(got, torch.ops.stallfree.silu_mul(lin(x)))
    with torch.inference_mode(), OpCalls() as ops:
        native_layers.gate_up_silu(lin, x[:2])
    assert "stallfree.silu_mul" in ops.calls
    torch.ops.stallfree.set_amx(False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_kernels, "amx", lambda: False)
        # nor the AVX-512 variant's bfloat16 prompt product (test_bf16_prompt_product.py)
        mp.setattr(native_layers, "prompt_product_max_rows", lambda: 0)
        with torch.inference_mode(), OpCalls() as ops:
            native_layers.gate_up_silu(lin, x)
    assert "stallfree.silu_mul" in ops.calls
    assert not any(c.endswith("_prompt") for c in ops.calls)
