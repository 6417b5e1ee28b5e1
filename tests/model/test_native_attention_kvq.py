"""The native decode-attention op over a quantized KV cache (int8, fp8 e4m3 and fp8 e5m2 rows,
each with its scale) against the torch path, on every instruction-set variant this CPU has:
the new token's K/V rows are written bit for bit as `KVCache.write` encodes them, and the
output is bounded against a float64 evaluation over the decoded cache and checked against the
torch path (which decodes at its gather). The sweep draws batches, contexts, GQA ratios, head
dims, windows, soft-capping, scales, q dtypes and `req_to_token` dtypes as
test_native_attention.py does."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.runtime.memory.pool import KVCache, KVCacheShape
from stallfree.runtime.model import cpu_kernels
from stallfree.runtime.model.attention import PagedAttention
from stallfree.runtime.model.forward_batch import ForwardBatch
from stallfree.runtime.model.rope import apply_rope
from tests.model.native_util import each_isa, needs_kernels, set_isa
from tests.model.test_native_attention import Case, Step, make_step, torch_reference

pytestmark = [needs_kernels, pytest.mark.usefixtures("restore_variant")]


def with_cache(step: Step, name: str, dtype: torch.dtype, seed: int | None) -> Step:
    """`step` over a fresh cache in format `name`: random rows encoded (seed given), or a copy
    of `step`'s cache (seed None)."""
    src = step.fb.kv_cache
    shape = KVCacheShape(1, src.shape.num_kv_heads, src.shape.head_dim)
    cache = KVCache(shape, src.num_slots, dtype, torch.device("cpu"), name)
    if seed is None:
        cache.k_buffers[0].copy_(src.k_buffers[0])
        cache.v_buffers[0].copy_(src.v_buffers[0])
    else:
        gen = torch.Generator().manual_seed(seed)
        for buf in (cache.k_buffers[0], cache.v_buffers[0]):
            dims = (src.num_slots, shape.num_kv_heads, shape.head_dim)
            buf.copy_(cache.format.encode(torch.randn(dims, generator=gen) * 2))
    fields = {f: getattr(step.fb, f) for f in ForwardBatch.__dataclass_fields__}
    return Step(ForwardBatch(**{**fields, "kv_cache": cache}), step.q, step.k, step.v, step.rope)


def exact_reference(step: Step, case: Case) -> torch.Tensor:
    """Attention in float64 over the rotated q and the decoded (written) cache."""
    fb, fmt = step.fb, step.fb.kv_cache.format
    q = apply_rope(step.q, *step.rope).double()
    k_buf = fmt.decode(fb.kv_cache.k_buffers[0], torch.float32).double()
    v_buf = fmt.decode(fb.kv_cache.v_buffers[0], torch.float32).double()
    scale = case.scale if case.scale is not None else case.dim**-0.5
    outs = []
    for b, n in enumerate(case.lens):
        first = 0 if case.window is None else max(0, n - case.window)
        slots = fb.req_to_token[fb.req_pool_indices[b], first:n].long()
        k = k_buf[slots].repeat_interleave(case.group, dim=1)
        v = v_buf[slots].repeat_interleave(case.group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b], k) * scale
        if case.softcap is not None:
            scores = torch.tanh(scores / case.softcap) * case.softcap
        outs.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v))
    return torch.stack(outs)


def check(case: Case, name: str, seed: int) -> None:
    step = with_cache(make_step(case, seed), name, case.dtype, seed + 1)
    ref_step = with_cache(step, name, case.dtype, None)
    backend = PagedAttention(case.window, scale=case.scale, softcap=case.softcap)
    out = backend.forward(step.q, step.k, step.v, 0, step.fb, rope=step.rope)
    assert backend._plan_fb is None, "the torch path ran, not the native op"
    ref = torch_reference(ref_step, case)
    for mine, theirs in (
        (step.fb.kv_cache.k_buffers[0], ref_step.fb.kv_cache.k_buffers[0]),
        (step.fb.kv_cache.v_buffers[0], ref_step.fb.kv_cache.v_buffers[0]),
    ):
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))
    assert out.dtype == case.dtype and out.shape == step.q.shape
    exact = exact_reference(step, case)
    err = (out.double() - exact).abs()
    if case.dtype == torch.float32:
        assert err.max().item() <= 1e-5 + 1e-5 * exact.abs().max().item()
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    else:  # the output's own rounding (2^-8 relative) and a little accumulation
        assert (err <= 2**-8 * exact.abs() + 1e-3).all(), err.max().item()
        assert err.max().item() <= (ref.double() - exact).abs().max().item() + 1e-3


@st.composite
def cases(draw: st.DrawFn, max_batch: int, max_ctx: int) -> Case:
    bsz = draw(st.integers(1, max_batch))
    dtype = draw(st.sampled_from((torch.float32, torch.bfloat16)))
    return Case(
        lens=draw(st.lists(st.integers(1, max_ctx), min_size=bsz, max_size=bsz)),
        kv_heads=draw(st.integers(1, 2)),
        group=draw(st.sampled_from((1, 3, 4, 8))),
        dim=draw(st.sampled_from((16, 64, 128))),
        dtype=dtype,
        cache_dtype=dtype,
        window=draw(st.none() | st.integers(1, max_ctx)),
        softcap=draw(st.none() | st.floats(5.0, 50.0)),
        scale=draw(st.none() | st.floats(0.02, 0.3)),
        rtt_dtype=draw(st.sampled_from((torch.int64, torch.int32))),
    )


@each_isa
@settings(max_examples=25, deadline=None)
@given(case=cases(max_batch=8, max_ctx=300), seed=st.integers(0, 2**16))
def test_int8_cache_matches_torch(isa: str, case: Case, seed: int) -> None:
    set_isa(isa)
    check(case, "int8", seed)


@each_isa
@settings(max_examples=15, deadline=None)
@given(
    case=cases(max_batch=8, max_ctx=300),
    name=st.sampled_from(("fp8_e4m3", "fp8_e5m2")),
    seed=st.integers(0, 2**16),
)
def test_fp8_cache_matches_torch(isa: str, case: Case, name: str, seed: int) -> None:
    set_isa(isa)
    check(case, name, seed)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_the_written_rows_are_the_encoders_bits_at_the_edges(name: str) -> None:
    """Rows with zeros, one huge value, values past fp8's range and fp8's subnormals: the
    op's encoder and `KVFormat.encode` agree bit for bit (the property test draws normals)."""
    case = Case([3, 9], 2, 2, 64, torch.float32, torch.float32, None, None, None)
    step = with_cache(make_step(case, 7), name, torch.float32, 8)
    k = torch.zeros_like(step.k)
    k[0, 0, :8] = torch.tensor([1e-3, -3e-3, 2**-9, 2**-17, 449.0, -1e5, 6e4, 0.5])
    k[1, 1] = torch.logspace(-8, 5, 64) * torch.tensor([1.0, -1.0]).repeat(32)
    v = k.flip(-1)
    step = Step(step.fb, step.q, k, v, step.rope)
    ref_step = with_cache(step, name, torch.float32, None)
    torch.ops.stallfree.decode_attention(
        step.q, k, v, None, None, step.fb.kv_cache.k_buffers[0], step.fb.kv_cache.v_buffers[0],
        step.fb.out_cache_loc, step.fb.req_to_token, step.fb.req_pool_indices,
        step.fb.seq_lens,
    )  # fmt: skip
    ref_step.fb.kv_cache.write(0, step.fb.out_cache_loc, k, v)
    mine, theirs = step.fb.kv_cache, ref_step.fb.kv_cache
    assert torch.equal(mine.k_buffers[0].view(torch.uint8), theirs.k_buffers[0].view(torch.uint8))
    assert torch.equal(mine.v_buffers[0].view(torch.uint8), theirs.v_buffers[0].view(torch.uint8))


def test_kernels_off_decodes_in_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kernels off, a quantized cache takes the torch path, which decodes the rows."""
    monkeypatch.setenv("STALLFREE_CPU_KERNELS", "0")
    cpu_kernels.reset()
    try:
        case = Case([30, 7, 12], 2, 3, 64, torch.bfloat16, torch.bfloat16, 10, None, None)
        step = with_cache(make_step(case, 11), "int8", torch.bfloat16, 12)
        ref_step = with_cache(step, "int8", torch.bfloat16, None)
        backend = PagedAttention(case.window)
        out = backend.forward(step.q, step.k, step.v, 0, step.fb, rope=step.rope)
        assert backend._plan_fb is step.fb  # the bucket plan: the torch path
        assert torch.equal(out, torch_reference(ref_step, case))
    finally:
        monkeypatch.undo()
        cpu_kernels.reset()


def test_opcheck_with_an_int8_cache() -> None:
    case = Case([3, 20], 1, 4, 64, torch.float32, torch.float32, 8, 20.0, 0.1)
    step = with_cache(make_step(case, 2), "int8", torch.float32, 3)
    fb = step.fb
    args = (
        step.q, step.k, step.v, *step.rope, fb.kv_cache.k_buffers[0], fb.kv_cache.v_buffers[0],
        fb.out_cache_loc, fb.req_to_token, fb.req_pool_indices, fb.seq_lens, 0.1, 20.0, 8,
    )  # fmt: skip
    torch.library.opcheck(
        torch.ops.stallfree.decode_attention.default,
        args,
        test_utils=("test_schema", "test_faketensor"),
    )


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_quantized_cache_without_room_for_scales_is_refused(dtype: torch.dtype) -> None:
    case = Case([4], 1, 2, 64, torch.float32, torch.float32, None, None, None)
    step = make_step(case, 1)
    fb = step.fb
    bare = torch.zeros(fb.kv_cache.k_buffers[0].shape, dtype=dtype)  # [slots, 1, 64]
    with pytest.raises(RuntimeError, match=r"\[slots, 1, 68\].*a quantized row: 64 codes and its"):
        torch.ops.stallfree.decode_attention(
            step.q, step.k, step.v, *step.rope, bare, bare.clone(), fb.out_cache_loc,
            fb.req_to_token, fb.req_pool_indices, fb.seq_lens,
        )  # fmt: skip
