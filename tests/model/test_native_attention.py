"""The native paged decode-attention op (csrc/attention.cpp) against the torch path it
replaces: `apply_rope`, `KVCache.write` and `PagedAttention._decode`, on every instruction-set
variant this CPU has. The K/V write must match bit for bit; the output is bounded against a
float64 evaluation of the same inputs (the rotated q in its dtype, the cache as written), and
checked against the torch path. The sweep covers batches 1-16, contexts 1-2048, GQA ratios,
head dims 64 and 128, sliding windows, soft-capping, custom scales, float32 and bfloat16 q and
cache, int32 and int64 `req_to_token`, and slots scattered by random permutations."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.runtime.memory.pool import KVCache, KVCacheShape
from stallfree.runtime.model import cpu_kernels
from stallfree.runtime.model.attention import PagedAttention
from stallfree.runtime.model.forward_batch import ForwardBatch, ForwardMode
from stallfree.runtime.model.rope import apply_rope
from tests.model.native_util import each_isa, needs_kernels, set_isa

pytestmark = [needs_kernels, pytest.mark.usefixtures("restore_variant")]


@dataclass(slots=True)
class Case:
    lens: list[int]  # keys per request after this step
    kv_heads: int
    group: int  # query heads per KV head
    dim: int
    dtype: torch.dtype  # q, k, v and the RoPE tables
    cache_dtype: torch.dtype
    window: int | None
    softcap: float | None
    scale: float | None
    rtt_dtype: torch.dtype = torch.int64


@dataclass(slots=True)
class Step:
    fb: ForwardBatch
    q: torch.Tensor  # [B, H, D] unrotated
    k: torch.Tensor  # [B, KVH, D] unrotated
    v: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor]


def rope_tables(
    positions: torch.Tensor, dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) [B, 1, D] as `RotaryEmbedding.forward` builds them."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat((freqs, freqs), dim=-1).cos().to(dtype), freqs.sin().to(dtype)
    return cos[:, None, :], torch.cat((-sin, sin), dim=-1)[:, None, :]


def make_step(case: Case, seed: int) -> Step:
    """A decode step whose requests' earlier keys sit in randomly permuted cache slots of
    randomly chosen `req_to_token` rows; each new token's slot is its row's last one."""
    gen = torch.Generator().manual_seed(seed)
    bsz, kvh, dim = len(case.lens), case.kv_heads, case.dim
    heads = kvh * case.group
    num_slots = sum(case.lens) + 3  # some slots belong to no request
    cache = KVCache(KVCacheShape(1, kvh, dim), num_slots, case.cache_dtype, torch.device("cpu"))
    for buf in (cache.k_buffers[0], cache.v_buffers[0]):
        buf.copy_(torch.randn(buf.shape, generator=gen))
    width = max(case.lens) + 5
    req_to_token = torch.zeros((bsz + 2, width), dtype=case.rtt_dtype)
    rows = torch.randperm(bsz + 2, generator=gen)[:bsz]
    perm = torch.randperm(num_slots, generator=gen)
    at = 0
    for row, n in zip(rows.tolist(), case.lens, strict=True):
        req_to_token[row, :n] = perm[at : at + n].to(case.rtt_dtype)
        at += n
    lens = torch.tensor(case.lens, dtype=torch.int64)
    loc = req_to_token[rows, lens - 1].to(torch.int64)
    fb = ForwardBatch(
        mode=ForwardMode.DECODE,
        batch_size=bsz,
        input_ids=torch.zeros(bsz, dtype=torch.int64),
        positions=lens - 1,
        out_cache_loc=loc,
        req_pool_indices=rows.clone(),
        seq_lens=lens.clone(),
        req_pool_indices_cpu=rows,
        seq_lens_cpu=lens,
        extend_lens_cpu=[1] * bsz,
        prefix_lens_cpu=[n - 1 for n in case.lens],
        req_to_token=req_to_token,
        kv_cache=cache,
        prompt_lens_cpu=list(case.lens),
    )

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(case.dtype)

    rope = rope_tables(lens - 1, dim, case.dtype)
    return Step(fb, randn(bsz, heads, dim), randn(bsz, kvh, dim), randn(bsz, kvh, dim), rope)


def clone_step(step: Step) -> Step:
    """The same step over a copy of the cache."""
    src = step.fb.kv_cache
    cache = KVCache(
        KVCacheShape(1, src.k_buffers[0].shape[1], src.k_buffers[0].shape[2]),
        src.k_buffers[0].shape[0],
        src.dtype,
        torch.device("cpu"),
    )
    cache.k_buffers[0].copy_(src.k_buffers[0])
    cache.v_buffers[0].copy_(src.v_buffers[0])
    fields = {f: getattr(step.fb, f) for f in ForwardBatch.__dataclass_fields__}
    fb = ForwardBatch(**{**fields, "kv_cache": cache})
    return Step(fb, step.q, step.k, step.v, step.rope)


def torch_reference(step: Step, case: Case) -> torch.Tensor:
    """Today's torch path: rotate, write the cache, bucketed decode."""
    backend = PagedAttention(case.window, scale=case.scale, softcap=case.softcap)
    cos, signed_sin = step.rope
    q, k = apply_rope(step.q, cos, signed_sin), apply_rope(step.k, cos, signed_sin)
    step.fb.kv_cache.write(0, step.fb.out_cache_loc, k, step.v)
    return backend._decode(q, 0, step.fb)


def exact_reference(step: Step, case: Case) -> torch.Tensor:
    """Attention in float64 over the rotated q (rounded to its dtype) and the written cache."""
    fb = step.fb
    q = apply_rope(step.q, *step.rope).double()
    k_buf, v_buf = fb.kv_cache.k_buffers[0].double(), fb.kv_cache.v_buffers[0].double()
    scale = case.scale if case.scale is not None else case.dim**-0.5
    outs = []
    for b, n in enumerate(case.lens):
        first = 0 if case.window is None else max(0, n - case.window)
        slots = fb.req_to_token[fb.req_pool_indices[b], first:n].long()
        k = k_buf[slots].repeat_interleave(case.group, dim=1)  # [L, H, D]
        v = v_buf[slots].repeat_interleave(case.group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b], k) * scale
        if case.softcap is not None:
            scores = torch.tanh(scores / case.softcap) * case.softcap
        outs.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v))
    return torch.stack(outs)


def check(case: Case, seed: int) -> None:
    step = make_step(case, seed)
    ref_step = clone_step(step)
    backend = PagedAttention(case.window, scale=case.scale, softcap=case.softcap)
    out = backend.forward(step.q, step.k, step.v, 0, step.fb, rope=step.rope)
    assert backend._plan_fb is None, "the torch path ran, not the native op"
    ref = torch_reference(ref_step, case)
    # the K/V write: the same bits as KVCache.write of the rotated k
    for mine, theirs in (
        (step.fb.kv_cache.k_buffers[0], ref_step.fb.kv_cache.k_buffers[0]),
        (step.fb.kv_cache.v_buffers[0], ref_step.fb.kv_cache.v_buffers[0]),
    ):
        assert torch.equal(
            mine.view(torch.int16 if mine.dtype == torch.bfloat16 else torch.int32),
            theirs.view(torch.int16 if theirs.dtype == torch.bfloat16 else torch.int32),
        )
    assert out.dtype == case.dtype and out.shape == step.q.shape
    exact = exact_reference(step, case)
    err = (out.double() - exact).abs()
    if case.dtype == torch.float32:
        assert err.max().item() <= 1e-5 + 1e-5 * exact.abs().max().item()
    else:  # the output's own rounding (2^-8 relative) and a little accumulation
        assert (err <= 2**-8 * exact.abs() + 1e-3).all(), err.max().item()
    if case.dtype == case.cache_dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    else:  # the torch path rounds k, v and (soft-capped) scores to bfloat16: at least as close
        assert err.max().item() <= (ref.double() - exact).abs().max().item() + 1e-3


@st.composite
def cases(draw: st.DrawFn, max_batch: int, max_ctx: int) -> Case:
    bsz = draw(st.integers(1, max_batch))
    lens = draw(st.lists(st.integers(1, max_ctx), min_size=bsz, max_size=bsz))
    dtypes = st.sampled_from((torch.float32, torch.bfloat16))
    return Case(
        lens=lens,
        kv_heads=draw(st.integers(1, 2)),
        group=draw(st.sampled_from((1, 3, 4, 8))),
        dim=draw(st.sampled_from((64, 128))),
        dtype=draw(dtypes),
        cache_dtype=draw(dtypes),
        window=draw(st.none() | st.integers(1, max_ctx)),
        softcap=draw(st.none() | st.floats(5.0, 50.0)),
        scale=draw(st.none() | st.floats(0.02, 0.3)),
        rtt_dtype=draw(st.sampled_from((torch.int64, torch.int32))),
    )


@each_isa
@settings(max_examples=20, deadline=None)
@given(case=cases(max_batch=8, max_ctx=300), seed=st.integers(0, 2**16))
def test_decode_attention_matches_torch(isa: str, case: Case, seed: int) -> None:
    set_isa(isa)
    check(case, seed)


@pytest.mark.slow
@each_isa
@settings(max_examples=25, deadline=None)
@given(case=cases(max_batch=16, max_ctx=2048), seed=st.integers(0, 2**16))
def test_decode_attention_long_contexts(isa: str, case: Case, seed: int) -> None:
    set_isa(isa)
    check(case, seed)


@each_isa
@pytest.mark.parametrize("threads", [1, 2])
def test_batch_one_splits_a_long_context(isa: str, threads: int) -> None:
    """Batch 1 at 2048 keys is cut into splits (so both threads work); the merged result is
    the same attention, with a window and without."""
    set_isa(isa)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for window in (None, 700):
            case = Case([2048], 3, 3, 64, torch.float32, torch.float32, window, None, None)
            check(case, seed=window or 0)
    finally:
        torch.set_num_threads(before)


@each_isa
def test_head_dim_multiple_of_16(isa: str) -> None:
    set_isa(isa)
    for dim in (16, 48, 80, 256):
        check(Case([5, 70], 2, 4, dim, torch.bfloat16, torch.float32, None, None, None), seed=dim)


def test_without_rope_tables_the_op_writes_k_as_given() -> None:
    step = make_step(Case([9], 1, 2, 64, torch.float32, torch.float32, None, None, None), 3)
    fb = step.fb
    k_buf, v_buf = fb.kv_cache.k_buffers[0], fb.kv_cache.v_buffers[0]
    torch.ops.stallfree.decode_attention(
        step.q, step.k, step.v, None, None, k_buf, v_buf, fb.out_cache_loc,
        fb.req_to_token, fb.req_pool_indices, fb.seq_lens,
    )  # fmt: skip
    assert torch.equal(k_buf[fb.out_cache_loc], step.k)
    assert torch.equal(v_buf[fb.out_cache_loc], step.v)


def test_unsupported_steps_take_the_torch_path() -> None:
    """A head dim off the 16 grid, and extend steps, rotate in torch and run today's code."""
    case = Case([4, 6], 1, 2, 40, torch.float32, torch.float32, None, None, None)
    step, ref_step = make_step(case, 5), None
    ref_step = clone_step(step)
    backend = PagedAttention()
    out = backend.forward(step.q, step.k, step.v, 0, step.fb, rope=step.rope)
    assert backend._plan_fb is step.fb  # the bucket plan: the torch path
    ref = torch_reference(ref_step, case)
    assert torch.equal(out, ref)
    assert torch.equal(step.fb.kv_cache.k_buffers[0], ref_step.fb.kv_cache.k_buffers[0])


def test_kernels_off_is_todays_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STALLFREE_CPU_KERNELS", "0")
    cpu_kernels.reset()
    try:
        case = Case([30, 7, 12], 2, 3, 64, torch.bfloat16, torch.bfloat16, 10, None, None)
        step = make_step(case, 11)
        ref_step = clone_step(step)
        backend = PagedAttention(case.window)
        out = backend.forward(step.q, step.k, step.v, 0, step.fb, rope=step.rope)
        assert torch.equal(out, torch_reference(ref_step, case))
    finally:
        monkeypatch.undo()
        cpu_kernels.reset()


def test_fake_registration_and_schema() -> None:
    step = make_step(Case([3, 20], 1, 4, 64, torch.float32, torch.bfloat16, 8, 20.0, 0.1), 2)
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


@each_isa
@settings(max_examples=15, deadline=None)
@given(case=cases(max_batch=8, max_ctx=300), seed=st.integers(0, 2**16))
def test_the_joint_qkv_entry_equals_the_split_one(isa: str, case: Case, seed: int) -> None:
    """`decode_attention_qkv` on a fused projection's output [B, (H + 2 KVH) * D] is the split
    call bit for bit, the cache writes included; `PagedAttention.forward_qkv` takes it."""
    set_isa(isa)
    step = make_step(case, seed)
    joint = torch.cat([t.flatten(1) for t in (step.q, step.k, step.v)], dim=1)
    heads, kv_heads = step.q.shape[1], step.k.shape[1]
    backend = PagedAttention(case.window, scale=case.scale, softcap=case.softcap)
    other = clone_step(step)
    out = backend.forward_qkv(joint, heads, kv_heads, 0, step.fb, step.rope)
    want = backend.forward(other.q, other.k, other.v, 0, other.fb, rope=other.rope)
    assert out is not None and out.shape == (len(case.lens), heads * case.dim)
    assert torch.equal(out, want.reshape(out.shape))
    assert torch.equal(step.fb.kv_cache.k_buffers[0], other.fb.kv_cache.k_buffers[0])
    assert torch.equal(step.fb.kv_cache.v_buffers[0], other.fb.kv_cache.v_buffers[0])
