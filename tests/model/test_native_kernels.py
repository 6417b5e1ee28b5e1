"""The native CPU kernels (runtime/model/csrc) against their torch references, on every
instruction-set variant this CPU has: dense and integer matrix-vector products over row
counts 1-16 and widths that are not multiples of the vector length, the integer ones against
an exact emulation (activations quantised to blocks of 32 in torch, integer dots in float64),
RMSNorm (alone and with the residual add) and SiLU * up in transformers' rounding order."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.runtime.model import cpu_kernels, native_layers
from stallfree.runtime.model.quant import quantize_int4, quantize_int8
from tests.model.native_util import VARIANTS, each_isa, needs_kernels, set_isa

pytestmark = [needs_kernels, pytest.mark.usefixtures("restore_variant")]


def q8_emulation(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The int8 kernel's arithmetic exactly: x in blocks of 32 to codes round(x * (127 /
    amax)), integer dots, block scales amax / 127, the row scale last. (`127 / tensor` in torch
    is a reciprocal times 127, one rounding off the kernel's division: a tie like -55.5 then
    rounds the other way.)"""
    m, k = x.shape
    blocks = x.float().reshape(m, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inv).clamp(-127, 127).double()
    dots = torch.einsum("mbk,nbk->mnb", codes, q.double().reshape(q.shape[0], k // 32, 32))
    return (dots * (amax[:, None, :, 0] / 127).double()).sum(-1) * scale.double()


def _rel(a: torch.Tensor, b: torch.Tensor, bound: torch.Tensor | None = None) -> float:
    """The largest error relative to `bound` (the sum of the absolute terms, which bounds a
    float sum's rounding error whatever the order), else to the largest |b|."""
    scale = b.double().abs().max() if bound is None else bound.double()
    return float(((a.double() - b.double()).abs() / scale.clamp_min(1e-30)).max())


@each_isa
@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 16),
    n=st.integers(1, 70),
    blocks=st.integers(1, 9),
    bf16=st.booleans(),
    bias=st.booleans(),
    per_block=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_linear_q8_equals_its_emulation(
    isa: str, m: int, n: int, blocks: int, bf16: bool, bias: bool, per_block: bool, seed: int
) -> None:
    """int8 codes with one scale per row (`linear_q8`) or a float16 scale per block of 32
    weights (`linear_q8_blocks`, GGUF Q8_0's layout), against the exact emulation."""
    set_isa(isa)
    g = torch.Generator().manual_seed(seed)
    k = 32 * blocks
    dtype = torch.bfloat16 if bf16 else torch.float32
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g) if bias else None
    if per_block:
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        # scales spread over three decades, as blocks of real weights are
        bscale = (
            (torch.rand(n, blocks, generator=g) * 3 - 4)
            .exp2()
            .mul(10 ** -torch.rand(1, generator=g))
            .half()
        )
        out = torch.ops.stallfree.linear_q8_blocks(x, q, bscale, b)
        # the per-row emulation over the dequantised rows is the same sum (row scale 1)
        codes = q.double() * bscale.double().repeat_interleave(32, 1)
        scale = torch.ones(n, dtype=torch.float64)
    else:
        w = quantize_int8(torch.randn(n, k, generator=g))
        out = torch.ops.stallfree.linear_q8(x, w.q, w.scale, b)
        codes, scale = w.q, w.scale
    ref = q8_emulation(x, codes, scale) + (0 if b is None else b.double())
    bound = q8_emulation(x.abs(), codes.abs(), scale) + (0 if b is None else b.double().abs())
    assert out.dtype == dtype and out.shape == (m, n)
    # float32 sums in another order; bfloat16 adds the output's rounding
    assert _rel(out, ref, None if bf16 else bound) < (8e-3 if bf16 else 1e-5)


@pytest.mark.parametrize("isa", [v for v in ("avx512", "avx2") if v in VARIANTS])
@pytest.mark.parametrize("per_block", [False, True])
@pytest.mark.parametrize("m", [1, 3, 4])
def test_int8_product_takes_a_weight_of_minus_128(isa: str, m: int, per_block: bool) -> None:
    """A weight code of -128 counts as itself. The AVX-512 int8 dot multiplies w + 128
    (unsigned) by the activation's signed codes from an offset of -128 times their sums; the
    AVX2 dot multiplies |w| (0x80 read as 128) by the activation's codes under w's sign. (The
    old form of both, |x| against w negated where x < 0, wrapped -128 to itself and flipped
    those products' signs; llama.cpp's quantizers never write -128, but a GGUF file may hold
    it.) Up to 4 rows, which take these kernels whether or not the AMX tiles are on."""
    set_isa(isa)
    g = torch.Generator().manual_seed(m)
    n, k = 24, 96
    x = torch.randn(m, k, generator=g)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    q[:, ::3] = -128  # a third of the codes, against activations of both signs
    if per_block:
        bscale = (torch.rand(n, k // 32, generator=g) / 50 + 0.001).half()
        out = torch.ops.stallfree.linear_q8_blocks(x, q, bscale, None)
        codes = q.double() * bscale.double().repeat_interleave(32, 1)
        scale = torch.ones(n, dtype=torch.float64)
    else:
        scale = torch.rand(n, generator=g) / 50 + 0.001
        out = torch.ops.stallfree.linear_q8(x, q, scale, None)
        codes = q.double()  # an int8 tensor's abs() keeps -128
    ref = q8_emulation(x, codes, scale)
    bound = q8_emulation(x.abs(), codes.abs(), scale)
    assert _rel(out, ref, bound) < 1e-5


@each_isa
@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 16),
    n=st.integers(1, 40),
    groups=st.integers(1, 11),
    bf16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_linear_q4_equals_its_emulation(
    isa: str, m: int, n: int, groups: int, bf16: bool, seed: int
) -> None:
    set_isa(isa)
    g = torch.Generator().manual_seed(seed)
    k = 32 * groups
    dtype = torch.bfloat16 if bf16 else torch.float32
    x = torch.randn(m, k, generator=g).to(dtype)
    w = quantize_int4(torch.randn(n, k, generator=g))
    codes = w.pairs.contiguous()  # element j low, j + 16 high
    # the kernel holds scales and offsets in float16: the emulation uses those values
    scale = w.scale.half().contiguous()
    offset = (w.zero - 8 * w.scale).half().contiguous()
    out = torch.ops.stallfree.linear_q4(x, codes, scale, offset, None)
    w.scale, offset = scale.float(), offset.float()
    # the emulation: the int4 weight is exactly q * scale + offset, so the int8 emulation of
    # its dequantised rows (one scale per row of 1) is the same sum
    dense = w.q.double() * w.scale.double().repeat_interleave(
        32, 1
    ) + offset.double().repeat_interleave(32, 1)
    blocks = x.float().reshape(m, groups, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = (torch.round(blocks * inv).clamp(-127, 127) * (amax / 127)).double().reshape(m, k)
    ref = xq @ dense.T
    bound = xq.abs() @ dense.abs().T
    assert _rel(out, ref, None if bf16 else bound) < (8e-3 if bf16 else 1e-5)


@each_isa
@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 16),
    n=st.integers(1, 70),
    k=st.integers(1, 300),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_dense_linear_equals_torch(isa: str, m: int, n: int, k: int, bias: bool, seed: int) -> None:
    set_isa(isa)
    g = torch.Generator().manual_seed(seed)
    for dtype, tol in ((torch.bfloat16, 8e-3), (torch.float32, 1e-5)):
        x = torch.randn(m, k, generator=g).to(dtype)
        w = torch.randn(n, k, generator=g).to(dtype)
        b = torch.randn(n, generator=g) if bias else None
        out = torch.ops.stallfree.linear(x, w, b)
        ref = x.double() @ w.double().T + (0 if b is None else b.double())
        bound = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
        assert out.dtype == dtype
        assert _rel(out, ref, bound if dtype == torch.float32 else None) < tol


@pytest.mark.skipif("avx512" not in VARIANTS, reason="no AVX-512 variant on this CPU")
@pytest.mark.parametrize("k", [32, 63, 576, 1000])
def test_one_row_equals_its_row_in_a_batch_bit_for_bit(k: int) -> None:
    """On the AVX-512 variant (without the tiles) a single row runs its own loop, the paced
    one; each row's sums are taken in the same order whatever the batch, so a row alone and
    the same row among four give the same bits, in bfloat16 and float32."""
    set_isa("avx512")
    g = torch.Generator().manual_seed(k)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(4, k, generator=g).to(dtype)
        w = torch.randn(70, k, generator=g).to(dtype)
        b = torch.randn(70, generator=g)
        batch = torch.ops.stallfree.linear(x, w, b)
        for i in range(4):
            alone = torch.ops.stallfree.linear(x[i : i + 1].clone(), w, b)
            assert torch.equal(alone[0], batch[i]), (dtype, i)


@each_isa
@pytest.mark.parametrize("m", [47, 48, 49, 97, 150])
def test_dense_linear_over_many_rows_equals_torch(isa: str, m: int) -> None:
    """More rows than one pass of the AVX2 kernel splits at a time (48), with a k that is no
    whole number of its 16-value steps: a bfloat16 prompt stays on that kernel."""
    set_isa(isa)
    g = torch.Generator().manual_seed(m)
    for dtype, tol in ((torch.bfloat16, 8e-3), (torch.float32, 1e-5)):
        x = torch.randn(m, 37, generator=g).to(dtype)
        w = torch.randn(22, 37, generator=g).to(dtype)
        b = torch.randn(22, generator=g)
        out = torch.ops.stallfree.linear(x, w, b)
        ref = x.double() @ w.double().T + b.double()
        bound = x.double().abs() @ w.double().abs().T + b.double().abs()
        assert _rel(out, ref, bound if dtype == torch.float32 else None) < tol


@each_isa
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 20), dim=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_rms_norm_and_fused_add_equal_transformers_order(
    isa: str, rows: int, dim: int, seed: int
) -> None:
    set_isa(isa)
    g = torch.Generator().manual_seed(seed)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(rows, dim, generator=g).to(dtype)
        d = torch.randn(rows, dim, generator=g).to(dtype)
        w = (torch.rand(dim, generator=g) + 0.5).to(dtype)
        ref = native_layers.rms_norm_reference(x, w, 1e-6)
        out = torch.ops.stallfree.rms_norm(x, w, 1e-6)
        total, normed = torch.ops.stallfree.add_rms_norm(x, d, w, 1e-6)
        ref_total = x + d
        assert torch.equal(total, ref_total)  # the sum is rounded once, as torch rounds it
        ref_normed = native_layers.rms_norm_reference(ref_total, w, 1e-6)
        if dtype == torch.bfloat16:
            # statistics in another order may move a value by one bfloat16 step
            for a, b in ((out, ref), (normed, ref_normed)):
                ulp = b.float().abs() * 2**-7 + 1e-6
                assert bool(((a.float() - b.float()).abs() <= 2 * ulp).all())
                assert (a != b).float().mean() < 0.05
        else:
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(normed, ref_normed, rtol=1e-5, atol=1e-6)


@each_isa
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 16), inter=st.integers(1, 200), seed=st.integers(0, 2**16))
def test_silu_mul_equals_torch(isa: str, rows: int, inter: int, seed: int) -> None:
    set_isa(isa)
    g = torch.Generator().manual_seed(seed)
    for dtype in (torch.bfloat16, torch.float32):
        gu = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
        gate, up = gu.chunk(2, dim=-1)
        ref = torch.nn.functional.silu(gate) * up
        out = torch.ops.stallfree.silu_mul(gu)
        if dtype == torch.bfloat16:
            ulp = ref.float().abs() * 2**-7 + 1e-6
            assert bool(((out.float() - ref.float()).abs() <= 2 * ulp).all())
        else:
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@each_isa
def test_bad_shapes_are_errors_not_crashes(isa: str) -> None:
    set_isa(isa)
    x = torch.randn(2, 64)
    q = torch.zeros(8, 40, dtype=torch.int8)
    with pytest.raises(RuntimeError, match=r"multiple of 32|features"):
        torch.ops.stallfree.linear_q8(x, q, torch.ones(8), None)
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.stallfree.linear(x, torch.randn(8, 63), None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.stallfree.rms_norm(x.double(), torch.ones(64).double(), 1e-6)


def test_switched_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STALLFREE_CPU_KERNELS", "0")
    cpu_kernels.reset()
    try:
        assert cpu_kernels.isa() is None
        x = torch.randn(3, 48)
        w = torch.rand(48) + 0.5
        # the wrappers take the torch path
        torch.testing.assert_close(
            native_layers.rms_norm(x, w, 1e-6), native_layers.rms_norm_reference(x, w, 1e-6)
        )
    finally:
        monkeypatch.undo()
        cpu_kernels.reset()


@each_isa
@settings(max_examples=20, deadline=None)
@given(
    m=st.integers(1, 8),
    parts=st.lists(st.integers(1, 70), min_size=1, max_size=3),
    k=st.integers(1, 200),
    seed=st.integers(0, 2**16),
)
def test_linear_group_equals_each_linear(
    isa: str, m: int, parts: list[int], k: int, seed: int
) -> None:
    set_isa(isa)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    ws = [torch.randn(n, k, generator=g) for n in parts]
    out = torch.ops.stallfree.linear_group(x, ws)
    ref = torch.cat([x.double() @ w.double().T for w in ws], dim=-1)
    bound = torch.cat([x.double().abs() @ w.double().abs().T for w in ws], dim=-1)
    assert out.shape == (m, sum(parts))
    assert _rel(out, ref, bound) < 1e-5


def test_a_stale_build_lock_is_cleared_and_a_fresh_one_kept(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """torch's build lock is a plain file its waiters poll for ever: one left by a process
    that died while building would hang every later start."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    lock = tmp_path / "lock"
    lock.write_text("")
    old = time.time() - cpu_kernels.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    cpu_kernels._clear_stale_lock("any")
    assert not lock.exists()
    lock.write_text("")
    cpu_kernels._clear_stale_lock("any")
    assert lock.exists()  # a build in progress


@each_isa
@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(1, 70),
    blocks=st.integers(1, 9),
    bf16=st.booleans(),
    form=st.sampled_from(["rows", "blocks", "int4"]),
    seed=st.integers(0, 2**16),
)
def test_dequantize_writes_the_dense_weight(
    isa: str, n: int, blocks: int, bf16: bool, form: str, seed: int
) -> None:
    """The integer layers' prompt path: the weight written dense in one pass, each value the
    float32 product (and offset) rounded once to the output's dtype; with `bf16_values`, a
    float32 output holding the bfloat16 output's values exactly (the AVX2 variant's widened
    prompt product reads those)."""
    set_isa(isa)
    g = torch.Generator().manual_seed(seed)
    k = 32 * blocks
    dtype = torch.bfloat16 if bf16 else torch.float32
    if form == "int4":
        w = quantize_int4(torch.randn(n, k, generator=g))
        codes = w.pairs.contiguous()  # element j low, j + 16 high
        scale = w.scale.half().contiguous()
        offset = (w.zero - 8 * w.scale).half().contiguous()

        def dequantize(out: torch.Tensor, bf16_values: bool = False) -> None:
            torch.ops.stallfree.dequantize_q4(codes, scale, offset, out, bf16_values)

        want = w.q.float() * scale.float().repeat_interleave(32, 1)
        want = want + offset.float().repeat_interleave(32, 1)
    else:
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        if form == "rows":
            rows = torch.rand(n, generator=g) / 50
            args: tuple[torch.Tensor | None, ...] = (rows, None)
            want = q.float() * rows[:, None]
        else:
            bscale = (torch.rand(n, blocks, generator=g) / 50).half()
            args = (None, bscale)
            want = q.float() * bscale.float().repeat_interleave(32, 1)

        def dequantize(out: torch.Tensor, bf16_values: bool = False) -> None:
            torch.ops.stallfree.dequantize_q8(q, *args, out, bf16_values)

    out = torch.empty(n, k, dtype=dtype)
    dequantize(out)
    if bf16:
        # one rounding of the float32 value (an FMA's, for int4, may differ by one ulp)
        assert (out.float() - want.to(dtype).float()).abs().le(want.abs() * 2**-7).all()
    else:
        assert torch.allclose(out, want, rtol=1e-6, atol=1e-7)
    as_bf16 = torch.empty(n, k, dtype=torch.bfloat16)
    values = torch.empty(n, k)
    dequantize(as_bf16)
    dequantize(values, bf16_values=True)
    assert torch.equal(values, as_bf16.float())


def test_every_fake_matches_its_op() -> None:
    """torch.compile traces the ops through their fakes (cpu_kernel_fakes.py): each fake gives
    the real op's output shapes and dtypes, and mutates what the op mutates."""
    from stallfree.runtime.model.cpu_kernel_fakes import FAKES

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g).bfloat16()
    w = torch.randn(40, 64, generator=g).bfloat16()
    q = torch.randint(-127, 128, (40, 64), generator=g, dtype=torch.int8)
    codes = torch.randint(0, 256, (40, 2, 16), generator=g, dtype=torch.uint8)
    half = torch.rand(40, 2, generator=g).half()
    cases = {
        "linear": (x, w, None),
        "linear_group": (x, [w, w[:8].contiguous()]),
        "linear_q8": (x, q, torch.rand(40, generator=g), None),
        "linear_q8_blocks": (x, q, half, None),
        "linear_q4": (x, codes, half, half, None),
        "dequantize_q8": (q, None, half, torch.empty(40, 64, dtype=torch.bfloat16)),
        "dequantize_q4": (codes, half, half, torch.empty(40, 64)),
        "rms_norm": (x, torch.ones(64).bfloat16(), 1e-6),
        "add_rms_norm": (x, x, torch.ones(64).bfloat16(), 1e-6),
        "silu_mul": (x,),
    }
    assert set(cases) <= set(FAKES)
    for name, args in cases.items():
        torch.library.opcheck(
            getattr(torch.ops.stallfree, name), args, test_utils=("test_schema", "test_faketensor")
        )


def test_instruction_set_pragmas_come_after_the_system_headers() -> None:
    """A variant's `#pragma GCC target` covers its own code only: GCC 13 refuses to build a file
    whose system headers (libstdc++'s always-inline allocator) were read under the pragma
    ("inlining failed ... target specific option mismatch"), which left the kernels off on such
    a machine. GCC 12 here builds either way, so the order itself is checked."""
    csrc = Path(cpu_kernels.__file__).parent / "csrc"
    variants = 0
    for source in sorted(csrc.glob("*.cpp")):
        lines = source.read_text().splitlines()
        targets = [i for i, line in enumerate(lines) if line.startswith("#pragma GCC target")]
        if not targets:
            continue
        variants += 1
        start = targets[0]
        assert lines[start - 1] == "#pragma GCC push_options", source.name
        assert "#pragma GCC pop_options" in lines[start:], source.name
        late = [line for line in lines[start:] if line.startswith("#include <")]
        assert not late, f"{source.name}: system headers under the target pragma: {late}"
    # isa_avx512, isa_avx2, isa_amx, amx_gemm, amx_prefill_attention, attention_avx512,
    # attention_avx2, rope (AVX2 without FMA), q8_lanes, bf16_gemm, compact_bf16
    assert variants == 11
