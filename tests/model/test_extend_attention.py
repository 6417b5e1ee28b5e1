"""A prompt step's attention: q and k of one joint projection rotated in one pass (the same
bits as rotating each), and a prompt with no cached prefix attending over its new keys and
values as written, with no gather back out of a plain cache (on the native prompt kernel in
float32); a float32 prompt's gate and up side by side for one SiLU * up pass."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from stallfree.runtime.model import cpu_kernels, native_layers
from stallfree.runtime.model.attention import rope_qk
from stallfree.runtime.model.compile import throwaway_batch
from stallfree.runtime.model.forward_batch import ForwardMode
from stallfree.runtime.model.loader import load_model
from stallfree.runtime.model.rope import apply_rope, rope_rows
from tests.hf_models import make_llama

LAYERS = 2


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_joint_rotation_equals_each_bit_for_bit(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    t, heads, kv_heads, dim = 7, 6, 2, 32
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(t, heads, dim), k.view(t, kv_heads, dim)
    cos = torch.randn(t, 1, dim, generator=g).to(dtype)
    sin = torch.randn(t, 1, dim, generator=g).to(dtype)
    qr, kr = rope_qk(q, k, (cos, sin))
    assert torch.equal(qr, apply_rope(q, cos, sin))
    assert torch.equal(kr, apply_rope(k, cos, sin))
    # not neighbours (k from another tensor): each rotated on its own, same result
    k2 = k.clone()
    qr2, kr2 = rope_qk(q, k2, (cos, sin))
    assert torch.equal(qr2, qr) and torch.equal(kr2, kr)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory.mktemp("extend"), num_hidden_layers=LAYERS)


def _prompt_calls(path: Path) -> collections.Counter[str]:
    loaded = load_model(str(path), "float32", torch.device("cpu"), 0, quantization="none")
    # two fresh prompts of 5 and 3 tokens: 8 rows, which every kernel variant's grouped q/k/v
    # call takes (one joint output); without the kernels q, k and v are three products
    fb = throwaway_batch(loaded, ForwardMode.EXTEND, [5, 3], 5)
    fb.extend_lens_cpu, fb.prefix_lens_cpu = [5, 3], [0, 0]
    fb.input_ids = torch.arange(8) + 3
    fb.positions = torch.cat([torch.arange(5), torch.arange(3)])
    fb.out_cache_loc = torch.cat([fb.req_to_token[0, :5], fb.req_to_token[1, :3]])
    with _Count() as counter:
        loaded.model(fb)
    return counter.calls


def test_fresh_prompts_attend_without_a_gather(llama_dir: Path) -> None:
    calls = _prompt_calls(llama_dir)
    assert calls["aten.index_select"] == 0
    # float32 prompts attend on the native kernel where it is built, else on SDPA
    native = cpu_kernels.available()
    assert calls["stallfree.prefill_attention"] == (2 * LAYERS if native else 0)
    assert calls["aten.scaled_dot_product_attention"] == (0 if native else 2 * LAYERS)
    # RoPE's roll(x): q and k of the joint q/k/v output together, one per layer; two where
    # they come from separate products (the torch path)
    # q/k/v (and gate/up) as grouped calls, or stacked products where the model stacks them
    stacked = native_layers.stacks_float32(torch.device("cpu"))
    joint = calls["stallfree.linear_group"] > 0 or stacked
    assert joint == cpu_kernels.available()
    assert (calls["stallfree.linear_group"] > 0) == (joint and not stacked)
    # RoPE: q and k of the joint q/k/v output in one native call per layer, which also writes
    # the layer's K and V into the cache (no index_put); apply_rope's four kernels on each of q
    # and k where they come from separate products (the torch path), then KVCache.write
    assert calls["stallfree.rope_write"] == (LAYERS if joint else 0)
    assert calls["stallfree.rope"] == 0
    assert calls["aten.index_put_"] == (0 if joint else 2 * LAYERS)
    assert calls["aten.roll"] == (0 if joint else 2 * LAYERS)


@pytest.mark.skipif(not cpu_kernels.available(), reason="native CPU kernels not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("t", "heads", "dim"), [(1, 2, 128), (7, 12, 64), (5, 3, 80), (3, 4, 40), (4, 5, 32)]
)
def test_native_rope_equals_apply_rope_bit_for_bit(
    dtype: torch.dtype, t: int, heads: int, dim: int
) -> None:
    g = torch.Generator().manual_seed(t * heads + dim)
    # heads of a wider projection row (the joint q/k/v output's q and k), as the model has them
    rows = torch.randn(t, (heads + 3) * dim, generator=g).to(dtype)
    x = rows.as_strided((t, heads, dim), (rows.stride(0), dim, 1))
    cos = torch.randn(t, 1, dim, generator=g).to(dtype)
    sin = torch.randn(t, 1, dim, generator=g).to(dtype)
    rows[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38])
    rows[-1, :4] = torch.tensor([1e-38, -3e-39, 2e-30, 5e-20])  # subnormal products
    want = apply_rope(x, cos, sin)
    got = torch.ops.stallfree.rope(x, cos, sin)
    assert got.is_contiguous() and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(rope_rows(x, cos, sin).nan_to_num(), want.nan_to_num())


@pytest.mark.skipif(not cpu_kernels.available(), reason="native CPU kernels not built")
def test_native_rope_refuses_mismatched_tables() -> None:
    x = torch.randn(4, 2, 8)
    with pytest.raises(RuntimeError, match="cos and signed_sin must be"):
        torch.ops.stallfree.rope(x, torch.randn(3, 1, 8), torch.randn(3, 1, 8))
    with pytest.raises(RuntimeError, match="x's dtype"):
        torch.ops.stallfree.rope(x, torch.randn(4, 1, 8).bfloat16(), torch.randn(4, 1, 8))


@pytest.mark.skipif(not cpu_kernels.available(), reason="native CPU kernels not built")
@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])
@pytest.mark.parametrize("rows", [1, 17, 40])
def test_side_by_side_columns_keep_each_linears_bits(
    rows: int, vendor: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A float32 prompt's gate and up go into one tensor, each its own product: the same bits
    as each F.linear (float32 keeps transformers' sums) on Intel; none elsewhere (there the
    model stacks gate and up, and a layer kept apart runs each on oneDNN) or for bfloat16."""
    monkeypatch.setattr(cpu_kernels, "vendor", lambda: vendor)
    g = torch.Generator().manual_seed(rows)
    gate, up = torch.nn.Linear(48, 40, bias=False), torch.nn.Linear(48, 24, bias=False)
    x = torch.randn(2, rows, 48, generator=g)
    with torch.no_grad():
        both = native_layers.side_by_side([gate, up], x)
        if vendor != "GenuineIntel":
            assert both is None
            return
        assert both is not None and both.shape == (2, rows, 64)
        flat = x.reshape(-1, 48)
        want = [gate(flat), up(flat)]
        assert torch.equal(both[..., :40], want[0].view(2, rows, 40))
        assert torch.equal(both[..., 40:], want[1].view(2, rows, 24))
        assert native_layers.side_by_side([gate.bfloat16(), up.bfloat16()], x.bfloat16()) is None
        biased = torch.nn.Linear(48, 24)
        assert native_layers.side_by_side([gate.float(), biased], x) is None


def test_a_long_float32_prompt_makes_one_silu_mul_call_per_layer(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the grouped call's rows, gate and up still reach `silu_mul` side by side (one pass
    over both) instead of F.silu and a multiply: in the Python loop, which the prompt's layer
    loop in C++ (native_prompt_loop, whose own tests compare it to this one bit for bit) is
    turned off for here, since the ops it calls are not dispatched through Python."""
    monkeypatch.setenv("STALLFREE_NATIVE_LOOP", "0")
    loaded = load_model(str(llama_dir), "float32", torch.device("cpu"), 0, quantization="none")
    n = 40
    fb = throwaway_batch(loaded, ForwardMode.EXTEND, [n], n)
    fb.input_ids = torch.arange(n) + 3
    with _Count() as counter:
        loaded.model(fb)
    native = cpu_kernels.available()
    assert counter.calls["stallfree.silu_mul"] == (LAYERS if native else 0)
    assert counter.calls["aten.silu"] == (0 if native else LAYERS)
