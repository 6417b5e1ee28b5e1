"""The decode step's layer loop in C++ (`native_loop.py`, csrc/layers.cpp): the same logits bit
for bit as the Python loop over the same native ops, in every weight format and at several
batch sizes, for plain Llama layers, Qwen3's per-head q/k norms, Qwen2's biases, Mistral's
sliding window and a soft-capped backend, each step counted to have made the one native call;
layers it does not run (a mixture of experts) stay in Python with the same result; its fake
gives the op's shapes; `STALLFREE_NATIVE_LOOP=0` turns it off."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from stallfree.runtime.model import cpu_kernels, native_layers, native_loop
from stallfree.runtime.model.compile import throwaway_batch
from stallfree.runtime.model.decode_rows import decode_rows
from stallfree.runtime.model.forward_batch import ForwardMode
from stallfree.runtime.model.loader import load_model
from stallfree.runtime.model.native_layers import dense_max_rows
from stallfree.runtime.model.quant import native_max_rows
from tests.hf_models import (
    make_llama,
    make_mistral,
    make_phi3,
    make_qwen2,
    make_qwen3,
    make_qwen3_moe,
)
from tests.model.native_util import window_then_cap

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="native CPU kernels unavailable here"
)

FORMATS = [
    ("float32", "none"),
    ("bfloat16", "none"),
    ("bfloat16", "int8"),
    ("bfloat16", "int4"),
]


class _Count(TorchDispatchMode):
    """Native and aten calls by name (a native op counts once, its inner calls not at all)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _step(path: Path, dtype: str, quantization: str, lens: list[int], loop: bool,
          monkeypatch: pytest.MonkeyPatch,
          backend: Callable[[Any], None] | None = None) -> tuple[torch.Tensor, dict, int]:  # fmt: skip
    """(logits, the model's loop plans by (rows, dtype), how many `decode_layers` calls the
    step made)."""
    monkeypatch.setenv("STALLFREE_NATIVE_LOOP", "1" if loop else "0")
    loaded = load_model(str(path), dtype, torch.device("cpu"), 0, quantization=quantization)
    if backend is not None:
        backend(loaded.model.attn_backend)
    fb = throwaway_batch(loaded, ForwardMode.DECODE, lens, 1)
    torch.manual_seed(0)
    # a cache with something in it: the prefix's keys and values drawn at random
    for k, v in zip(fb.kv_cache.k_buffers, fb.kv_cache.v_buffers, strict=True):
        k.copy_(torch.randn(k.shape).to(k.dtype))
        v.copy_(torch.randn(v.shape).to(v.dtype))
    with _Count() as counter:
        logits = loaded.model(fb)
    # one backend, so one entry per (rows, dtype)
    plans = {key[:2]: step for key, step in loaded.model._loop_plans.items()}
    return logits, plans, counter.calls["stallfree.decode_layers"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory.mktemp("loop"), num_hidden_layers=3)


@pytest.mark.parametrize(("dtype", "quantization"), FORMATS)
@pytest.mark.parametrize("lens", [[7], [5, 17, 33], [9 + i for i in range(20)]])
def test_loop_equals_the_python_loop_bit_for_bit(
    llama_dir: Path, dtype: str, quantization: str, lens: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    python, none, off = _step(llama_dir, dtype, quantization, lens, False, monkeypatch)
    looped, plans, calls = _step(llama_dir, dtype, quantization, lens, True, monkeypatch)
    assert none == {} and off == 0  # off: never planned
    planned = plans[(len(lens), getattr(torch, dtype))]
    # 20 rows: past the grouped float32 call's rows unless a decode step's float32 rows go
    # further on this CPU (a CPU not Intel's: native_layers.dense_max_rows), and past the
    # integer kernels' (a prompt-sized product in Python) unless the AMX tiles take a decode
    # step's rows (up to quant.native_max_rows() there); bfloat16's projections go to F.linear
    # in both loops
    with decode_rows():
        most = native_max_rows() if quantization != "none" else dense_max_rows(torch.float32)
    loop_runs = len(lens) <= most or (dtype == "bfloat16" and quantization == "none")
    assert (planned is not None) == loop_runs
    assert calls == int(loop_runs)
    assert torch.equal(python, looped)


def _softcap(backend: Any) -> None:
    backend.softcap = 8.0  # Gemma 2's kind of cap, low enough to bite on these scores


# Qwen3: per-head q/k norms (one row: the native norm on a contiguous view; more: torch's on a
# strided one), with biases too; Qwen2: the projections' biases (float32: q, k and v three
# calls); Mistral: a window of 8 that 17 and 33 outgrow;
# Phi-3: its checkpoint's fused projections; a soft-capped backend on Llama layers
FAMILIES: list[tuple[Callable[..., Path], dict[str, Any], Callable[[Any], None] | None]] = [
    (make_qwen3, {}, None),
    (make_qwen3, {"attention_bias": True}, None),
    (make_qwen2, {}, None),
    (make_mistral, {"sliding_window": 8}, None),
    (make_phi3, {}, None),  # q/k/v and gate/up fused in the checkpoint
    (make_llama, {}, _softcap),
]


@pytest.mark.parametrize(("dtype", "quantization"), FORMATS)
@pytest.mark.parametrize("lens", [[7], [5, 17, 33]])
@pytest.mark.parametrize(("make", "config", "backend"), FAMILIES)
def test_other_families_take_the_loop_bit_for_bit(
    tmp_path: Path, make: Callable[..., Path], config: dict[str, Any],
    backend: Callable[[Any], None] | None, dtype: str, quantization: str, lens: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    path = make(tmp_path, num_hidden_layers=2, **config)
    python, _, off = _step(path, dtype, quantization, lens, False, monkeypatch, backend)
    looped, plans, calls = _step(path, dtype, quantization, lens, True, monkeypatch, backend)
    planned = plans[(len(lens), getattr(torch, dtype))]
    assert torch.equal(python, looped)
    assert planned is not None
    # q, k and v kept apart (float32 keeps transformers' sums, stacked only where its products
    # leave them anyway) with biases: three calls
    apart = (
        dtype == "float32"
        and not native_layers.stacks_float32(torch.device("cpu"))
        and (make is make_qwen2 or "attention_bias" in config)
    )
    assert (native_loop.APART in planned.spec) == apart
    assert off == 0 and calls == 1
    assert bool(planned.qk_norms) == (make is make_qwen3)
    assert planned.windows == ([8, 8] if make is make_mistral else [])
    assert planned.softcap == (8.0 if backend is _softcap else None)


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_qwen3_at_twenty_rows(
    tmp_path: Path, quantization: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the native kernels' rows: bfloat16's projections go to F.linear in both loops (the
    loop runs, q/k normed by torch's arithmetic); int8's to a prompt-sized product (Python),
    unless the AMX tiles take a decode step's 20 rows (then the loop runs them too)."""
    path = make_qwen3(tmp_path, num_hidden_layers=2)
    lens = [9 + i for i in range(20)]
    python, _, _ = _step(path, "bfloat16", quantization, lens, False, monkeypatch)
    looped, plans, calls = _step(path, "bfloat16", quantization, lens, True, monkeypatch)
    with decode_rows():
        runs = quantization == "none" or native_max_rows() >= 20
    assert calls == runs
    assert (plans[(20, torch.bfloat16)] is not None) == runs
    assert torch.equal(python, looped)


def test_a_window_or_cap_set_after_a_step_reaches_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the plan is cached per row count and dtype; the backend's window and soft-cap are read
    # per step, as the Python loop reads them
    path = make_mistral(tmp_path, num_hidden_layers=3, sliding_window=8)
    loaded = load_model(str(path), "float32", torch.device("cpu"), 0, quantization="none")
    backend = loaded.model.attn_backend

    def decode() -> torch.Tensor:
        fb = throwaway_batch(loaded, ForwardMode.DECODE, [40, 25], 1)
        gen = torch.Generator().manual_seed(0)
        for k, v in zip(fb.kv_cache.k_buffers, fb.kv_cache.v_buffers, strict=True):
            k.copy_(torch.randn(k.shape, generator=gen).to(k.dtype))
            v.copy_(torch.randn(v.shape, generator=gen).to(v.dtype))
        return loaded.model(fb)

    monkeypatch.setenv("STALLFREE_NATIVE_LOOP", "1")
    before = decode()  # the plan cached, the window in force
    for _ in window_then_cap(backend):
        monkeypatch.setenv("STALLFREE_NATIVE_LOOP", "1")
        with _Count() as counter:
            looped = decode()
        assert counter.calls["stallfree.decode_layers"] == 1
        monkeypatch.setenv("STALLFREE_NATIVE_LOOP", "0")
        assert torch.equal(looped, decode())
        assert not torch.equal(looped, before)
        before = looped


def test_a_mixture_of_experts_stays_in_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = make_qwen3_moe(tmp_path, num_hidden_layers=2)
    python, _, _ = _step(path, "bfloat16", "none", [9, 4], False, monkeypatch)
    looped, plans, calls = _step(path, "bfloat16", "none", [9, 4], True, monkeypatch)
    assert plans[(2, torch.bfloat16)] is None and calls == 0
    assert torch.equal(python, looped)


@pytest.mark.parametrize("make", [make_llama, make_qwen3])
def test_the_fake_matches_the_op(tmp_path: Path, make: Callable[..., Path]) -> None:
    path = make(tmp_path, num_hidden_layers=2)
    loaded = load_model(str(path), "bfloat16", torch.device("cpu"), 0, quantization="none")
    fb = throwaway_batch(loaded, ForwardMode.DECODE, [6, 3], 1)
    model = loaded.model
    layers = list(model.model.layers)
    h = model.embed(fb.input_ids)
    rope = model.model.rotary_emb(fb.positions, h.dtype)
    step = native_loop.plan(layers, 2, torch.bfloat16)
    assert step is not None
    args = native_loop.arguments(layers, model.attn_backend, h, rope, fb, step)
    torch.library.opcheck(
        torch.ops.stallfree.decode_layers, args, test_utils=("test_schema", "test_faketensor")
    )


def test_a_malformed_plan_is_an_error_not_a_crash(llama_dir: Path) -> None:
    loaded = load_model(str(llama_dir), "bfloat16", torch.device("cpu"), 0, quantization="none")
    fb = throwaway_batch(loaded, ForwardMode.DECODE, [6], 1)
    model = loaded.model
    layers = list(model.model.layers)
    h = model.embed(fb.input_ids)
    rope = model.model.rotary_emb(fb.positions, h.dtype)
    step = native_loop.plan(layers, 1, torch.bfloat16)
    assert step is not None
    short = native_loop.Plan(step.norms, step.params[:-3], step.spec)
    with pytest.raises(RuntimeError, match="decode_layers"):
        torch.ops.stallfree.decode_layers(
            *native_loop.arguments(layers, model.attn_backend, h, rope, fb, short)
        )
    unknown = native_loop.Plan(step.norms, step.params, [9, *step.spec[1:]])
    with pytest.raises(RuntimeError, match="unknown projection kind"):
        torch.ops.stallfree.decode_layers(
            *native_loop.arguments(layers, model.attn_backend, h, rope, fb, unknown)
        )
    windows = dataclasses.replace(step, windows=[4])  # 3 layers
    with pytest.raises(RuntimeError, match="one per layer"):
        torch.ops.stallfree.decode_layers(
            *native_loop.arguments(layers, model.attn_backend, h, rope, fb, windows)
        )
    norms = dataclasses.replace(step, qk_norms=step.norms[:2])
    with pytest.raises(RuntimeError, match="two per layer"):
        torch.ops.stallfree.decode_layers(
            *native_loop.arguments(layers, model.attn_backend, h, rope, fb, norms)
        )
