"""A prompt's RoPE and K/V write as one native call (`attention.rope_and_write`,
`torch.ops.stallfree.rope_write`): the rotated q and k and the cache's rows have the bits of
`rope_qk` then `KVCache.write` (two index_put calls), for float32 and bfloat16, GQA ratios, any
permutation of slots, on every instruction-set variant; where it does not apply (q and k not
one projection's neighbouring heads, a quantized cache) it declines and the caller takes the
old path; a slot outside the cache is an error, not a write out of bounds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.runtime.memory.pool import KVCache, KVCacheShape
from stallfree.runtime.model import attention
from stallfree.runtime.model.arch import ModelArchConfig
from stallfree.runtime.model.rope import RotaryEmbedding
from tests.model.native_util import OpCalls, each_isa, needs_kernels, set_isa

pytestmark = [needs_kernels, pytest.mark.usefixtures("restore_variant")]


def prompt(
    tokens: int, heads: int, kv: int, dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """q, k, v as views of one joint projection row (as the model hands them), and the RoPE
    tables of positions 0 .. tokens - 1."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv) * dim, generator=g).to(dtype)
    q, k, v = qkv.split([heads * dim, kv * dim, kv * dim], dim=-1)
    arch = ModelArchConfig(
        vocab_size=8,
        hidden_size=heads * dim,
        intermediate_size=8,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=dim,
    )
    rope = RotaryEmbedding(arch)(torch.arange(tokens), dtype)
    return (
        q.view(tokens, heads, dim),
        k.view(tokens, kv, dim),
        v.view(tokens, kv, dim),
        rope,
    )


def cache(kv: int, dim: int, dtype: torch.dtype, slots: int = 512, fmt: str = "auto") -> KVCache:
    return KVCache(KVCacheShape(2, kv, dim), slots, dtype, torch.device("cpu"), fmt)


@each_isa
@settings(max_examples=30, deadline=None)
@given(
    tokens=st.integers(1, 80),
    kv=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 3, 4]),
    dim=st.sampled_from([16, 64, 128]),
    bf16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_one_call_gives_the_bits_of_rope_then_the_write(
    isa: str, tokens: int, kv: int, group: int, dim: int, bf16: bool, seed: int
) -> None:
    set_isa(isa)
    dtype = torch.bfloat16 if bf16 else torch.float32
    q, k, v, rope = prompt(tokens, kv * group, kv, dim, dtype, seed)
    loc = torch.randperm(512, generator=torch.Generator().manual_seed(seed))[:tokens]
    ours, theirs = cache(kv, dim, dtype), cache(kv, dim, dtype)
    with torch.inference_mode(), OpCalls() as ops:
        got = attention.rope_and_write(q, k, v, rope, ours, 1, loc)
    assert got is not None
    assert ops.native() == ["stallfree.rope_write"] and "aten.index_put_" not in ops.calls
    with torch.inference_mode():
        wq, wk = attention.rope_qk(q, k, rope)
        theirs.write(1, loc, wk, v)
    assert torch.equal(got[0], wq) and torch.equal(got[1], wk)
    for a, b in ((ours.k_buffers, theirs.k_buffers), (ours.v_buffers, theirs.v_buffers)):
        assert torch.equal(a[1], b[1])  # the written rows, and nothing else touched
        assert not a[0].any()


def test_it_declines_what_it_does_not_take() -> None:
    q, k, v, rope = prompt(20, 4, 2, 64, torch.bfloat16, 0)
    loc = torch.arange(20)
    # q and k not one row's neighbouring heads
    assert (
        attention.rope_and_write(q.clone(), k, v, rope, cache(2, 64, torch.bfloat16), 0, loc)
        is None
    )
    # a quantized cache, and a cache of another dtype
    assert (
        attention.rope_and_write(q, k, v, rope, cache(2, 64, torch.bfloat16, fmt="int8"), 0, loc)
        is None
    )
    assert attention.rope_and_write(q, k, v, rope, cache(2, 64, torch.float32), 0, loc) is None
    # int32 slots
    assert (
        attention.rope_and_write(q, k, v, rope, cache(2, 64, torch.bfloat16), 0, loc.int()) is None
    )


def test_a_slot_outside_the_cache_is_an_error() -> None:
    q, _, v, rope = prompt(8, 2, 2, 16, torch.float32, 1)
    kv = cache(2, 16, torch.float32, slots=16)
    both = q.as_strided((8, 4, 16), (q.stride(0), 16, 1))
    for bad in (torch.tensor([0, 1, 2, 3, 4, 5, 6, 16]), torch.tensor([-1, 1, 2, 3, 4, 5, 6, 7])):
        with pytest.raises(RuntimeError, match="outside the cache"):
            torch.ops.stallfree.rope_write(both, *rope, 2, v, kv.k_buffers[0], kv.v_buffers[0], bad)
    assert not kv.k_buffers[0].any() and not kv.v_buffers[0].any()


def test_the_fake_gives_the_shape() -> None:
    q, _, v, rope = prompt(8, 2, 2, 16, torch.float32, 2)
    kv = cache(2, 16, torch.float32, slots=16)
    both = q.as_strided((8, 4, 16), (q.stride(0), 16, 1))
    torch.library.opcheck(
        torch.ops.stallfree.rope_write,
        (both, *rope, 2, v, kv.k_buffers[0], kv.v_buffers[0], torch.arange(8)),
        test_utils=("test_schema", "test_faketensor"),
    )
