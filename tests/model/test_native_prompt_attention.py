"""`torch.ops.stallfree.prefill_attention`, a prompt's causal attention on the native kernel,
against attention computed in float64 from the same inputs: query counts that are not whole
blocks, cached prefixes, windows, soft caps, GQA ratios, head dims of 1-8 vectors and query,
key and value rows that are views of a wider projection row; on every instruction-set variant
this CPU has. The torch path (SDPA, and the mask it is given) is checked against the same
reference, so the two agree with each other through it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from stallfree.runtime.model import attention, cpu_kernels
from tests.model.native_util import OpCalls, each_isa, needs_amx, needs_kernels, set_isa

pytestmark = [needs_kernels, pytest.mark.usefixtures("restore_variant")]


@dataclass(frozen=True)
class Case:
    n: int
    prefix: int
    first: int
    heads: int
    kv_heads: int
    dim: int
    window: int | None
    softcap: float | None
    scale: float | None
    dtype: torch.dtype


@st.composite
def cases(
    draw: st.DrawFn,
    max_n: int = 80,
    max_prefix: int = 120,
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
    dim_unit: int = 16,
) -> Case:
    kv_heads = draw(st.integers(1, 4))
    n = draw(st.integers(1, max_n))
    prefix = draw(st.integers(0, max_prefix))
    window = draw(st.none() | st.integers(1, prefix + n + 5))
    # keys before the first query's window are never seen: the caller may leave them out
    first = 0 if window is None else draw(st.integers(0, max(0, prefix + 1 - window)))
    return Case(
        n=n,
        prefix=prefix,
        first=first,
        heads=kv_heads * draw(st.sampled_from((1, 2, 3, 4, 8))),
        kv_heads=kv_heads,
        dim=dim_unit * draw(st.integers(1, 256 // dim_unit)),
        window=window,
        softcap=draw(st.none() | st.floats(5.0, 50.0)),
        scale=draw(st.none() | st.floats(0.02, 0.3)),
        dtype=draw(st.sampled_from(dtypes)),
    )


def inputs(case: Case, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [n, H, D], k/v [keys, KVH, D]: q a view of a joint q/k/v row, k and v views of rows
    wider than their heads (strided, heads contiguous), as the model hands them over."""
    g = torch.Generator().manual_seed(seed)
    h, kvh, d = case.heads, case.kv_heads, case.dim
    keys = case.prefix + case.n - case.first
    qkv = (torch.randn(case.n, (h + 2 * kvh) * d, generator=g) * 1.5).to(case.dtype)
    q = qkv[:, : h * d].view(case.n, h, d)
    kv = torch.randn(keys, 3 * kvh * d, generator=g).to(case.dtype)
    k = kv[:, : kvh * d].view(keys, kvh, d)
    v = kv[:, 2 * kvh * d :].view(keys, kvh, d)
    return q, k, v


def exact(
    case: Case,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """The attention in float64 (or `dtype`): scale, soft cap, causal (and window) mask,
    softmax, values."""
    group = case.heads // case.kv_heads
    qd = q.to(dtype).transpose(0, 1)  # [H, n, D]
    kd = k.to(dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [H, keys, D]
    vd = v.to(dtype).repeat_interleave(group, dim=1).transpose(0, 1)
    scale = case.scale if case.scale is not None else case.dim**-0.5
    s = qd @ kd.transpose(-1, -2) * scale
    if case.softcap is not None:
        s = torch.tanh(s / case.softcap) * case.softcap
    pos = torch.arange(case.prefix, case.prefix + case.n)[:, None]
    key = torch.arange(case.first, case.prefix + case.n)[None, :]
    seen = key <= pos
    if case.window is not None:
        seen &= key > pos - case.window
    s = s.masked_fill(~seen, -math.inf)
    return (s.softmax(-1) @ vd).transpose(0, 1)


def assert_near(
    got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, peer: torch.Tensor | None = None
) -> None:
    """float32: float32 sums; bfloat16: float32 sums and one rounding of the output (half a
    unit in the last place, 2^-8 relative, at most: the bound allows a whole unit, since the
    sums' own error can push a value across a rounding boundary). `peer`: the same attention
    in plain float32 arithmetic (`exact(..., torch.float32)`), whose error, twice over, the
    bound also allows: large scores (head dim 256, queries at 1.5 sigma) take float32 SDPA
    and this formula past the fixed bound alone (2.3e-5 against 2.2e-5)."""
    err = (got.double() - want).abs()
    rel, floor = (2e-5, 2e-5) if dtype == torch.float32 else (2**-7, 1e-3)
    bound = floor + rel * want.abs()
    if peer is not None:
        bound = bound + 2 * (peer.double() - want).abs()
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g}"


def native(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch.ops.stallfree.prefill_attention(
        q, k, v, case.prefix, case.first, case.scale, case.softcap, case.window
    )
    return out


@each_isa
@settings(max_examples=40, deadline=None)
@given(case=cases(), seed=st.integers(0, 2**16))
@example(case=Case(38, 14, 0, 24, 3, 256, None, None, 0.25634002805793177, torch.float32), seed=180)
def test_prefill_attention_equals_exact_attention(isa: str, case: Case, seed: int) -> None:
    set_isa(isa)
    q, k, v = inputs(case, seed)
    got = native(case, q, k, v)
    assert got.shape == q.shape and got.dtype == q.dtype and got.is_contiguous()
    assert_near(got, exact(case, q, k, v), case.dtype, peer32(case, q, k, v))


def peer32(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """A float32 case's attention in plain float32 arithmetic (assert_near's `peer`)."""
    return exact(case, q, k, v, torch.float32) if case.dtype == torch.float32 else None


@pytest.mark.slow
@each_isa
@settings(max_examples=10, deadline=None)
@given(case=cases(max_n=700, max_prefix=1400), seed=st.integers(0, 2**16))
def test_prefill_attention_long_prompts(isa: str, case: Case, seed: int) -> None:
    set_isa(isa)
    q, k, v = inputs(case, seed)
    assert_near(native(case, q, k, v), exact(case, q, k, v), case.dtype, peer32(case, q, k, v))


@each_isa
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_thread_and_two_give_the_same_bits(isa: str, dtype: torch.dtype) -> None:
    """Each query block is one thread's whole work, so the thread count changes no sum."""
    set_isa(isa)
    assert_same_bits_on_one_thread_or_two(Case(200, 30, 0, 12, 4, 64, None, None, None, dtype))


def assert_same_bits_on_one_thread_or_two(case: Case) -> None:
    q, k, v = inputs(case, 7)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native(case, q, k, v)
        torch.set_num_threads(2)
        two = native(case, q, k, v)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@settings(max_examples=15, deadline=None)
@given(case=cases(max_n=40, max_prefix=40, dtypes=(torch.float32,)), seed=st.integers(0, 2**16))
def test_attend_prompt_on_either_path_equals_exact_attention(case: Case, seed: int) -> None:
    """`attend_prompt` (the model's entry) gives the same float32 attention with the kernels
    and on SDPA with its mask."""
    q, k, v = inputs(case, seed)
    want = exact(case, q, k, v)
    args = (case.prefix, case.first, case.window, case.scale, case.softcap)
    with OpCalls() as ops:
        assert_near(attention.attend_prompt(q, k, v, *args), want, case.dtype)
    assert ops.calls.count("stallfree.prefill_attention") == 1
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention.cpu_kernels, "available", lambda: False)
        with OpCalls() as ops:
            assert_near(attention.attend_prompt(q, k, v, *args), want, case.dtype)
        assert ops.calls.count("stallfree.prefill_attention") == 0


# A bfloat16 prompt whose head dim is a multiple of 32 runs on the AMX tiles where they are in
# use (amx_prefill_attention.cpp): its keys walked in chunks of 512 with an online softmax
# across chunks, its probabilities rounded to bfloat16 for the second product.
tiles_cases = cases(dtypes=(torch.bfloat16,), dim_unit=32)


@needs_amx
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=tiles_cases, seed=st.integers(0, 2**16))
def test_bfloat16_prompt_attention_on_the_tiles_equals_exact_attention(
    tiles: None, case: Case, seed: int
) -> None:
    q, k, v = inputs(case, seed)
    got = native(case, q, k, v)
    assert got.shape == q.shape and got.dtype == q.dtype and got.is_contiguous()
    assert_near(got, exact(case, q, k, v), case.dtype, peer32(case, q, k, v))


@pytest.mark.slow
@needs_amx
@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    case=cases(max_n=700, max_prefix=1400, dtypes=(torch.bfloat16,), dim_unit=32),
    seed=st.integers(0, 2**16),
)
def test_bfloat16_prompt_attention_on_the_tiles_long_prompts(
    tiles: None, case: Case, seed: int
) -> None:
    q, k, v = inputs(case, seed)
    assert_near(native(case, q, k, v), exact(case, q, k, v), case.dtype, peer32(case, q, k, v))


@needs_amx
@pytest.mark.parametrize(
    "n, prefix, first, window, softcap",
    [
        (40, 1100, 0, None, None),  # three chunks of keys: the running max rescales the output
        (33, 1300, 500, 700, None),  # a window: the first chunks hold keys no query sees
        (700, 0, 0, None, 30.0),  # a long prompt of its own, soft-capped
        (17, 2040, 1000, 1030, None),  # the window starts mid-chunk
    ],
)
def test_bfloat16_prompt_attention_on_the_tiles_across_chunks_of_keys(
    tiles: None, n: int, prefix: int, first: int, window: int | None, softcap: float | None
) -> None:
    case = Case(n, prefix, first, 8, 2, 64, window, softcap, None, torch.bfloat16)
    q, k, v = inputs(case, n + prefix)
    assert_near(native(case, q, k, v), exact(case, q, k, v), case.dtype, peer32(case, q, k, v))


@needs_amx
def test_bfloat16_prompt_attention_on_the_tiles_gives_the_same_bits_on_one_thread_or_two(
    tiles: None,
) -> None:
    assert_same_bits_on_one_thread_or_two(
        Case(200, 30, 0, 12, 4, 64, None, None, None, torch.bfloat16)
    )


@needs_amx
def test_a_bfloat16_prompt_takes_the_tiles_where_they_are_in_use_else_sdpa(tiles: None) -> None:
    """`attend_prompt`: a bfloat16 prompt with a head dim a multiple of 32 goes to the native
    op with the tiles on, to SDPA with them off or with a head dim of 16 x odd; both agree."""
    args = (0, 0, None, None, None)
    case = Case(50, 0, 0, 8, 2, 64, None, None, None, torch.bfloat16)
    q, k, v = inputs(case, 3)
    want = exact(case, q, k, v)
    with OpCalls() as ops:
        assert_near(attention.attend_prompt(q, k, v, *args), want, torch.bfloat16)
    assert ops.calls.count("stallfree.prefill_attention") == 1
    assert not any("scaled_dot_product" in c for c in ops.calls)
    odd = Case(50, 0, 0, 8, 2, 48, None, None, None, torch.bfloat16)
    q48, k48, v48 = inputs(odd, 3)
    with OpCalls() as ops:
        sdpa_near(attention.attend_prompt(q48, k48, v48, *args), exact(odd, q48, k48, v48))
    assert ops.calls.count("stallfree.prefill_attention") == 0
    assert any("scaled_dot_product" in c for c in ops.calls)
    torch.ops.stallfree.set_amx(False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention.cpu_kernels, "amx", lambda: False)
        with OpCalls() as ops:
            sdpa_near(attention.attend_prompt(q, k, v, *args), want)
    assert ops.calls.count("stallfree.prefill_attention") == 0
    assert any("scaled_dot_product" in c for c in ops.calls)


def sdpa_near(got: torch.Tensor, want: torch.Tensor) -> None:
    """SDPA's bfloat16 kernel rounds its probabilities to bfloat16 before the values' product
    (8 bits where the native kernels keep about 16), so it is held to a looser bound: errors
    of 0.003-0.008 at these sizes against assert_near's 0.001 floor."""
    err = (got.double() - want).abs()
    assert bool((err <= 0.03 + 2**-6 * want.abs()).all()), f"max error {err.max().item():.3g}"


def test_bad_arguments_are_errors_not_crashes() -> None:
    q, k = torch.randn(4, 2, 32), torch.randn(4, 1, 32)
    op = torch.ops.stallfree.prefill_attention
    with pytest.raises(RuntimeError, match="not a multiple of 16"):
        op(torch.randn(4, 2, 24), torch.randn(4, 1, 24), torch.randn(4, 1, 24))
    with pytest.raises(RuntimeError, match="up to 256"):
        op(torch.randn(4, 2, 272), torch.randn(4, 1, 272), torch.randn(4, 1, 272))
    with pytest.raises(RuntimeError, match="k must be a CPU"):
        op(q, torch.randn(5, 1, 32), k)  # 5 keys for 4 queries and no prefix
    with pytest.raises(RuntimeError, match="v must be a CPU"):
        op(q, k, k.double())
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(q.half(), k.half(), k.half())
    with pytest.raises(RuntimeError, match="heads over"):
        op(torch.randn(4, 3, 32), torch.randn(4, 2, 32), torch.randn(4, 2, 32))
    with pytest.raises(RuntimeError, match="first <= prefix"):
        op(q, k, k, 0, 2)
    with pytest.raises(RuntimeError, match="window must be positive"):
        op(q, k, k, 0, 0, None, None, 0)
    with pytest.raises(RuntimeError, match="contiguous heads"):
        op(q.transpose(0, 1).contiguous().transpose(0, 1), k, k)


def test_a_bfloat16_prompt_without_amx_on_the_cpu_takes_the_vector_path() -> None:
    """On a CPU without AMX tiles (a Zen 4) SDPA's bfloat16 products have no tiles either, and
    the native op's vector path is the faster: a bfloat16 prompt goes there, head dims of 16 x
    odd included. Where the CPU has tiles and they are off, SDPA keeps it."""
    args = (0, 0, None, None, None)
    for dim in (64, 48):
        case = Case(50, 0, 0, 8, 2, dim, None, None, None, torch.bfloat16)
        q, k, v = inputs(case, 5)
        want = exact(case, q, k, v)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(attention.cpu_kernels, "amx", lambda: False)
            mp.setattr(cpu_kernels, "cpu_has_amx", lambda: False)
            with OpCalls() as ops:
                assert_near(attention.attend_prompt(q, k, v, *args), want, torch.bfloat16)
            assert ops.calls.count("stallfree.prefill_attention") == 1
            assert not any("scaled_dot_product" in c for c in ops.calls)
            mp.setattr(cpu_kernels, "cpu_has_amx", lambda: True)
            with OpCalls() as ops:
                sdpa_near(attention.attend_prompt(q, k, v, *args), want)
            assert ops.calls.count("stallfree.prefill_attention") == 0
