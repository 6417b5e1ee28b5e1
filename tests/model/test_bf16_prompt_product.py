"""A bfloat16 prompt's product without the AMX tiles (csrc/bf16_gemm.cpp: `linear_bf16_prompt`
on `vdpbf16ps`, the AVX-512 variant): the exact product within one bfloat16 rounding at every
row count (one chunk of 16 to several walks of 256 rows), height and width, with one thread
or two; its epilogues as the tiles' (a bias in float32, silu(gate) * up with the bits of
silu_mul after the product, the next product's packed activations with the bits of the
row-major output packed again); the layers take it past the matrix-vector kernels' rows, an
MLP as one gate/up call handing its packed output to down; an integer weight's product (int8
with row or block scales, int4; its rows in the vector lanes or row-major) dequantises it 16
rows at a time as it walks it, with the dense path's values and no dense workspace; on the
AVX2 variant it is an error, not a crash."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stallfree.runtime.model import cpu_kernels, native_layers, quant
from tests.model.native_util import VARIANTS, OpCalls

pytestmark = pytest.mark.skipif(
    "avx512" not in VARIANTS, reason="no AVX-512 variant of the native kernels here"
)


def op(*args: object) -> torch.Tensor:
    """`linear_bf16_prompt`, looked up per call: the library is not loaded where the kernels
    are off (STALLFREE_CPU_KERNELS=0), and the module must still import there to be skipped."""
    out: torch.Tensor = torch.ops.stallfree.linear_bf16_prompt(*args)
    return out


@pytest.fixture
def vector(monkeypatch: pytest.MonkeyPatch, restore_variant: None) -> Iterator[None]:
    """The AVX-512 variant with the AMX tiles off (a Zen 4's state, or Intel's with
    STALLFREE_CPU_AMX=0), in the library and in the layers' routing alike (whichever variant
    the process runs: CI runs this module under STALLFREE_CPU_ISA=avx2 too); the usual state
    afterwards."""
    monkeypatch.setenv("STALLFREE_CPU_ISA", "avx512")
    monkeypatch.setenv("STALLFREE_CPU_AMX", "0")
    cpu_kernels.reset()
    assert cpu_kernels.isa() == "avx512" and not cpu_kernels.amx()
    yield
    monkeypatch.undo()
    cpu_kernels.reset()
    cpu_kernels.isa()


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((out.double() - ref).abs() / ref.abs().max().clamp_min(1e-30)).max())


def on_threads(threads: int, fn):  # type: ignore[no-untyped-def]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    m=st.integers(1, 600),
    n16=st.integers(1, 30),
    kblocks=st.integers(1, 20),
    bias=st.booleans(),
    threads=st.integers(1, 2),
    seed=st.integers(0, 2**16),
)
def test_the_product_equals_the_exact_one(
    vector: None, m: int, n16: int, kblocks: int, bias: bool, threads: int, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    n, k = 16 * n16, 32 * kblocks
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g) if bias else None
    out = on_threads(threads, lambda: op(x, w, b))
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    # float32 sums of exact bfloat16 products, the bias added in float32, rounded once
    assert rel(out, want) < 8e-3


# Chunks of 16 rows go in passes of three, as even as they go (a walk of 16 chunks: 3, 3, 3,
# 3, 2, 2); past 256 rows the weight is walked again per 256 rows (the next walk's first rows
# prefetched as the last block of this one runs). Rows past a chunk's live ones are not
# written.
@pytest.mark.parametrize("m", [1, 15, 16, 17, 33, 48, 49, 100, 256, 257, 300, 513])
@pytest.mark.parametrize("threads", [1, 2])
def test_every_pass_width_and_walk(vector: None, m: int, threads: int) -> None:
    g = torch.Generator().manual_seed(m)
    n, k = 80, 576
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    out = torch.full((m + 1, n), 7.0).bfloat16()
    got = on_threads(threads, lambda: op(x, w, None))
    out[:m] = got
    assert rel(out[:m], x.double() @ w.double().T) < 8e-3
    assert (out[m] == 7.0).all()
    # the same rows alone give the same bits: each output's sums do not depend on the others
    alone = on_threads(threads, lambda: op(x[-1:].contiguous(), w, None))
    assert torch.equal(alone[0], got[-1])


# Where a walk's packed activations pass 768 KB (long rows) the product walks k in blocks of
# 512 values, up to 8 blocks of 16 weight rows taking turns over each with their accumulators
# parked: 300 rows of 4128 values (a walk of 256 rows is 2 MB; 129 blocks of 32: eight blocks
# of k and one of a single block), 176 weight rows (a group of 8 blocks and one of 3), and 40
# rows of them (200 KB: the resident walk)
@pytest.mark.parametrize("m", [40, 257, 300])
@pytest.mark.parametrize("threads", [1, 2])
def test_long_rows_walk_k_in_blocks(vector: None, m: int, threads: int) -> None:
    g = torch.Generator().manual_seed(m)
    n, k, inter = 176, 4128, 144
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(n, generator=g)
    gu = (torch.randn(2 * inter, k, generator=g) * 0.05).bfloat16()
    out, fused, plain = on_threads(
        threads, lambda: (op(x, w, b), op(x, gu, None, True), op(x, gu, None))
    )
    assert rel(out, x.double() @ w.double().T + b.double()) < 8e-3
    assert torch.equal(fused, torch.ops.stallfree.silu_mul(plain))


@pytest.mark.parametrize("m", [17, 64, 256, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_silu_in_the_epilogue_has_the_bits_of_silu_mul(vector: None, m: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(m)
    inter, k = 48 * 16, 576  # an odd number of 16-row blocks, split over two threads unevenly
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(2 * inter, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(2 * inter, generator=g) if bias else None
    fused = op(x, w, b, True)
    assert fused.shape == (m, inter)
    assert torch.equal(fused, torch.ops.stallfree.silu_mul(op(x, w, b)))


@pytest.mark.parametrize("m", [20, 64, 300])
def test_a_packed_output_feeds_the_next_product_with_the_rows_bits(vector: None, m: int) -> None:
    g = torch.Generator().manual_seed(m)
    inter, k, out = 96, 128, 64
    x = torch.randn(m, k, generator=g).bfloat16()
    gate_up = (torch.randn(2 * inter, k, generator=g) * 0.05).bfloat16()
    down = (torch.randn(out, inter, generator=g) * 0.05).bfloat16()
    packed = op(x, gate_up, None, True, True)
    assert packed.dtype == torch.int32 and packed.shape == (inter // 32, (m + 15) // 16, 16, 16)
    via_packed = op(packed, down, None, False, False, m)
    rows = op(x, gate_up, None, True)
    assert torch.equal(via_packed, op(rows, down, None))


def test_layers_take_it_past_the_matrix_vector_rows(vector: None) -> None:
    """A dense layer's prompt and a stacked MLP's (one gate/up call writing the packed input
    of down: `mlp_on_tiles`), never F.linear or silu_mul; a few rows stay on the kernel."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_kernels, "amx", lambda: False)
        most = native_layers.dense_max_rows(torch.bfloat16)
        assert native_layers.prompt_product_max_rows() == native_layers.VECTOR_PROMPT_MAX_ROWS
        gate_up = torch.nn.Linear(128, 2 * 96, bias=False).bfloat16()
        down = torch.nn.Linear(96, 128, bias=False).bfloat16()
        assert native_layers.use_native_linears(gate_up) == 1
        assert native_layers.use_native_linears(down) == 1
        for rows in (most + 1, 300):
            x = torch.randn(rows, 128).bfloat16()
            with torch.inference_mode(), OpCalls() as ops:
                got = native_layers.mlp_on_tiles(gate_up, down, x)
            assert got is not None
            assert ops.calls.count("stallfree.linear_bf16_prompt") == 2, ops.calls
            assert "stallfree.silu_mul" not in ops.calls and "aten.addmm" not in ops.calls
            with torch.inference_mode():
                assert torch.equal(got, down(torch.ops.stallfree.silu_mul(gate_up(x))))
        with torch.inference_mode(), OpCalls() as ops:
            native_layers.gate_up_silu(gate_up, torch.randn(most, 128).bfloat16())
        assert "stallfree.linear" in ops.calls and "stallfree.silu_mul" in ops.calls


INT_KINDS = ("int8 rows", "int8 blocks", "int4")


def int_layer(
    n: int, k: int, kind: str, lanes: bool, seed: int, bias: bool = False
) -> quant.QuantLinear:
    """An integer layer of `kind` with its rows in the vector lanes or row-major."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) if bias else None
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(quant.LANES_ENV, "1" if lanes else "0")
        if kind == "int4":
            lin: quant.QuantLinear = quant.Int4Linear(quant.quantize_int4(w), b, torch.bfloat16)
        else:
            weight = (
                quant.quantize_int8_blocks(w) if kind == "int8 blocks" else quant.quantize_int8(w)
            )
            lin = quant.Int8Linear(weight, b, torch.bfloat16)
    assert lin.lanes == lanes
    return lin


def int_op(
    lin: quant.QuantLinear, x: torch.Tensor, silu: bool = False, pack: bool = False, rows: int = 0
) -> torch.Tensor:
    out: torch.Tensor
    if isinstance(lin, quant.Int4Linear):
        out = torch.ops.stallfree.linear_q4_prompt(
            x, lin.codes, lin.q4_scale, lin.q4_offset, None, silu, pack, rows
        )
    else:
        scale = lin.scale_f32 if lin.block_scale is None else None
        out = torch.ops.stallfree.linear_q8_prompt(
            x, lin.qweight, scale, lin.block_scale, None, silu, pack, rows
        )
    return out


# An integer weight's prompt product dequantises its rows 16 at a time into cache as it walks
# them (`gemm_dequant`), in either layout, to the dense path's values: the product of the
# dequantised weight within one bfloat16 rounding, and silu(gate) * up with silu_mul's bits
@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    m=st.integers(1, 300),
    n16=st.integers(1, 12),
    kblocks=st.integers(1, 20),
    kind=st.sampled_from(INT_KINDS),
    lanes=st.booleans(),
    threads=st.integers(1, 2),
    seed=st.integers(0, 2**16),
)
def test_an_integer_weights_product_equals_its_dense_one(
    vector: None, m: int, n16: int, kblocks: int, kind: str, lanes: bool, threads: int, seed: int
) -> None:
    n, k = 32 * n16, 32 * kblocks
    lin = int_layer(n, k, kind, lanes, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
    out, fused, plain = on_threads(
        threads, lambda: (int_op(lin, x), int_op(lin, x, silu=True), int_op(lin, x))
    )
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert rel(out, x.double() @ lin.dequantize().double().T) < 8e-3
    assert torch.equal(fused, torch.ops.stallfree.silu_mul(plain))


@pytest.mark.parametrize("kind", INT_KINDS)
@pytest.mark.parametrize("lanes", [True, False])
def test_an_integer_layers_prompt_takes_it_without_a_dense_workspace(
    vector: None, kind: str, lanes: bool
) -> None:
    """Without the tiles an integer layer's prompt, and its MLP's packed hand-off, run on the
    dequantising product: no dense copy of the weight (`dequantize_*`), no F.linear."""
    lin = int_layer(128, 128, kind, lanes, 1, bias=True)  # gate and up of 64 rows each
    down = int_layer(128, 64, kind, lanes, 2)
    x = torch.randn(300, 128, generator=torch.Generator().manual_seed(3)).bfloat16()
    with pytest.MonkeyPatch.context() as mp, torch.inference_mode():
        mp.setattr(cpu_kernels, "amx", lambda: False)
        with OpCalls() as ops:
            out = lin(x)
            mlp = native_layers.mlp_on_tiles(lin, down, x)
    assert len([c for c in ops.calls if c.endswith("_prompt")]) == 3, ops.calls
    assert not any(c.startswith("stallfree.dequantize") for c in ops.calls), ops.calls
    assert not {"aten.addmm", "aten.mm", "aten.linear"} & set(ops.calls), ops.calls
    assert lin.bias is not None
    want = x.double() @ lin.dequantize().double().T + lin.bias.double()
    assert rel(out, want) < 8e-3
    assert mlp is not None
    with torch.inference_mode():
        assert torch.equal(mlp, down(native_layers.gate_up_silu(lin, x)))


@pytest.mark.skipif("avx2" not in VARIANTS, reason="no AVX2 variant here")
def test_the_avx2_variant_has_no_prompt_product(restore_variant: None) -> None:
    torch.ops.stallfree.set_isa("avx2")
    with pytest.raises(RuntimeError, match="neither the AMX tiles nor the AVX-512 variant"):
        op(torch.randn(40, 64).bfloat16(), torch.randn(32, 64).bfloat16(), None)
