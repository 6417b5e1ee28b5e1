"""The decode step's layer loop in C++ (`native_loop.py`, csrc/layers.cpp): the same logits bit
for bit as the Python loop over the same native ops, in every weight format and at several
batch sizes; layers it does not run (q/k norms, a mixture of experts) stay in Python with the
same result; its fake gives the op's shapes; `STALLFREE_NATIVE_LOOP=0` turns it off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stallfree.runtime.model import cpu_kernels, native_loop
from stallfree.runtime.model.compile import throwaway_batch
from stallfree.runtime.model.forward_batch import ForwardMode
from stallfree.runtime.model.loader import load_model
from tests.hf_models import make_llama, make_qwen2, make_qwen3

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="native CPU kernels unavailable here"
)

FORMATS = [
    ("float32", "none"),
    ("bfloat16", "none"),
    ("bfloat16", "int8"),
    ("bfloat16", "int4"),
]


def _step(path: Path, dtype: str, quantization: str, lens: list[int], loop: bool,
          monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, dict]:  # fmt: skip
    monkeypatch.setenv("STALLFREE_NATIVE_LOOP", "1" if loop else "0")
    loaded = load_model(str(path), dtype, torch.device("cpu"), 0, quantization=quantization)
    fb = throwaway_batch(loaded, ForwardMode.DECODE, lens, 1)
    torch.manual_seed(0)
    # a cache with something in it: the prefix's keys and values drawn at random
    for k, v in zip(fb.kv_cache.k_buffers, fb.kv_cache.v_buffers, strict=True):
        k.copy_(torch.randn(k.shape).to(k.dtype))
        v.copy_(torch.randn(v.shape).to(v.dtype))
    logits = loaded.model(fb)
    return logits, dict(loaded.model._loop_plans)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory.mktemp("loop"), num_hidden_layers=3)


@pytest.mark.parametrize(("dtype", "quantization"), FORMATS)
@pytest.mark.parametrize("lens", [[7], [5, 17, 33], [9 + i for i in range(20)]])
def test_loop_equals_the_python_loop_bit_for_bit(
    llama_dir: Path, dtype: str, quantization: str, lens: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    python, none = _step(llama_dir, dtype, quantization, lens, False, monkeypatch)
    looped, plans = _step(llama_dir, dtype, quantization, lens, True, monkeypatch)
    assert none == {}  # off: never planned
    planned = plans[(len(lens), getattr(torch, dtype))]
    # 20 rows: past the integer kernels' rows (a prompt-sized product in Python) and the
    # grouped float32 call's; bfloat16's projections go to F.linear in both loops
    loop_runs = len(lens) <= 16 or (dtype == "bfloat16" and quantization == "none")
    assert (planned is not None) == loop_runs
    assert torch.equal(python, looped)


@pytest.mark.parametrize("make", [make_qwen3, make_qwen2])
def test_other_layers_equal_with_the_loop_on(
    tmp_path: Path, make: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen3's q/k norms keep the step in Python (no plan); Qwen2's biases go through the
    loop (the projections' bias epilogues). Either way the logits equal the Python loop's."""
    path = make(tmp_path, num_hidden_layers=2)  # type: ignore[operator]
    python, _ = _step(path, "bfloat16", "none", [9, 4], False, monkeypatch)
    looped, plans = _step(path, "bfloat16", "none", [9, 4], True, monkeypatch)
    assert torch.equal(python, looped)
    planned = plans.get((2, torch.bfloat16))
    assert (planned is None) == (make is make_qwen3)


def test_the_fake_matches_the_op(llama_dir: Path) -> None:
    loaded = load_model(str(llama_dir), "bfloat16", torch.device("cpu"), 0, quantization="none")
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
