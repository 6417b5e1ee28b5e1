"""How many aten calls a batch-1 decode step makes, per weight format: the per-call cost
(dispatch, allocation, a parallel region each) is what a small model's step spends outside its
matrix products, so the count is held down by a test rather than timed.

Counted with a `TorchDispatchMode` (every op dispatched to a kernel, views included; a native
op counts once) on a random model of SmolLM2-135M's depth (30 layers), tied embeddings, one
request with 64 tokens of context."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from stallfree.runtime.model import cpu_kernels
from stallfree.runtime.model.compile import throwaway_batch
from stallfree.runtime.model.forward_batch import ForwardMode
from stallfree.runtime.model.loader import load_model
from tests.hf_models import make_llama, make_qwen3

LAYERS = 30
# the issue's bound for SmolLM2's 30 layers, every format
MAX_CALLS = 300


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(
        tmp_path_factory.mktemp("ops"),
        num_hidden_layers=LAYERS,
        hidden_size=128,
        intermediate_size=256,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same depth and widths with Qwen3's per-head q/k norms."""
    return make_qwen3(
        tmp_path_factory.mktemp("ops_qwen3"),
        num_hidden_layers=LAYERS,
        hidden_size=128,
        intermediate_size=256,
        tie_word_embeddings=True,
    )


def count_decode_step(model_dir: Path, dtype: str, quantization: str) -> collections.Counter[str]:
    loaded = load_model(str(model_dir), dtype, torch.device("cpu"), 0, quantization=quantization)
    fb = throwaway_batch(loaded, ForwardMode.DECODE, [65], 1)
    loaded.model(fb)  # first call: one-time set-up (buckets, plans)
    with _Count() as counter:
        loaded.model(fb)
    return counter.calls


FORMATS = [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "int8"), ("bfloat16", "int4")]


@pytest.mark.skipif(not cpu_kernels.available(), reason="native CPU kernels unavailable here")
@pytest.mark.parametrize(("dtype", "quantization"), FORMATS)
def test_decode_step_calls_within_bound(
    model_dir: Path, dtype: str, quantization: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layers in Python (`STALLFREE_NATIVE_LOOP=0`): a native call per projection."""
    monkeypatch.setenv("STALLFREE_NATIVE_LOOP", "0")
    calls = count_decode_step(model_dir, dtype, quantization)
    total = sum(calls.values())
    assert total <= MAX_CALLS, f"{total} calls: {calls.most_common(12)}"
    # the linears are native calls, one per projection (q/k/v and gate/up each fused), plus
    # the tied output
    native = sum(n for op, n in calls.items() if op.startswith("stallfree."))
    assert native >= 4 * LAYERS


# a step with the layer loop in C++: the embedding, RoPE's tables, the loop, the last norm
# and the output projection, whatever the depth
LOOP_MAX_CALLS = 40


@pytest.mark.skipif(not cpu_kernels.available(), reason="native CPU kernels unavailable here")
@pytest.mark.parametrize(("dtype", "quantization"), FORMATS)
def test_native_layer_loop_makes_one_call_for_all_layers(
    model_dir: Path, dtype: str, quantization: str
) -> None:
    calls = count_decode_step(model_dir, dtype, quantization)
    total = sum(calls.values())
    assert calls["stallfree.decode_layers"] == 1, calls.most_common(12)
    assert total <= LOOP_MAX_CALLS, f"{total} calls: {calls.most_common(12)}"


@pytest.mark.skipif(not cpu_kernels.available(), reason="native CPU kernels unavailable here")
@pytest.mark.parametrize(("dtype", "quantization"), FORMATS)
def test_qwen3_decode_step_takes_the_layer_loop(
    qwen3_dir: Path, dtype: str, quantization: str
) -> None:
    """Qwen3's q/k norms run inside the loop: the step is as short as Llama's (in Python its
    split, views and two norms per layer make it about 470 calls at this depth)."""
    calls = count_decode_step(qwen3_dir, dtype, quantization)
    total = sum(calls.values())
    assert calls["stallfree.decode_layers"] == 1, calls.most_common(12)
    # the final norm only: the q/k norms are inside the loop
    assert calls["stallfree.rms_norm"] == 1, calls.most_common(12)
    assert total <= LOOP_MAX_CALLS, f"{total} calls: {calls.most_common(12)}"
