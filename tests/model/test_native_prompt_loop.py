"""A prompt's layer loop in C++ (`native_prompt_loop.py`, csrc/prompt_layers.cpp): the same
logits and cache bit for bit as the Python loop over the same native ops, in bfloat16, int8,
int4 and float32, for one prompt, several, prompts with a cached prefix, a sliding window they outgrow,
biases, Qwen3's per-head q/k norms, a soft-capped backend and a mixed step's decode rows, each
step counted to have made the one native call where the AMX tiles take its products (and
oneDNN's: past their rows for dense layers, and on `--prepack-prompt-weights`' copies), or
without them a dense bfloat16 layer's on `vdpbf16ps` (the AVX-512 variant); steps
it does not run (too few rows, integer layers past the tiles, the loop turned off)
stay in Python with the same result; its fake gives the op's shapes; a malformed call is an
error, not a crash."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from stallfree.runtime.memory.pool import KVCache
from stallfree.runtime.model import attention, cpu_kernels, native_layers, native_prompt_loop
from stallfree.runtime.model.forward_batch import ForwardBatch, ForwardMode
from stallfree.runtime.model.loader import LoadedModel, load_model
from tests.hf_models import TILES_SHAPE, make_llama, make_mistral, make_qwen2, make_qwen3
from tests.model.native_util import OpCalls, window_then_cap

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="native CPU kernels unavailable here"
)

SHAPE: dict[str, Any] = {**TILES_SHAPE, "num_hidden_layers": 3}


def _batch(loaded: LoadedModel, requests: list[tuple[int, int]], seed: int = 0) -> ForwardBatch:
    """An extend step of `requests` as (cached prefix, new tokens) each, over a cache of its
    own whose slots are a random permutation and whose prefixes hold random keys and values."""
    gen = torch.Generator().manual_seed(seed)
    width = max(p + n for p, n in requests)
    slots = len(requests) * width + 1
    kv = KVCache(loaded.kv_cache_shape(), slots, loaded.dtype, torch.device("cpu"))
    for buf in (*kv.k_buffers, *kv.v_buffers):
        buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))
    order = torch.randperm(slots - 1, generator=gen) + 1
    req_to_token = order[: len(requests) * width].view(len(requests), width).clone()
    ids, positions, locs = [], [], []
    for row, (prefix, new) in enumerate(requests):
        ids += torch.randint(0, 256, (new,), generator=gen).tolist()
        positions += range(prefix, prefix + new)
        locs += req_to_token[row, prefix : prefix + new].tolist()
    rows = torch.arange(len(requests))
    seq_lens = torch.tensor([p + n for p, n in requests])
    return ForwardBatch(
        mode=ForwardMode.EXTEND,
        batch_size=len(requests),
        input_ids=torch.tensor(ids),
        positions=torch.tensor(positions),
        out_cache_loc=torch.tensor(locs),
        req_pool_indices=rows,
        seq_lens=seq_lens,
        req_pool_indices_cpu=rows.clone(),
        seq_lens_cpu=seq_lens.clone(),
        extend_lens_cpu=[n for _, n in requests],
        prefix_lens_cpu=[p for p, _ in requests],
        req_to_token=req_to_token,
        kv_cache=kv,
    )


def _step(path: Path, dtype: str, quantization: str, requests: list[tuple[int, int]],
          loop: bool, monkeypatch: pytest.MonkeyPatch,
          backend: Callable[[Any], None] | None = None, prepack: bool = False,
          ) -> tuple[torch.Tensor, list[torch.Tensor], int]:  # fmt: skip
    """(logits, the caches after the step, how many `prefill_layers` calls the step made)."""
    monkeypatch.setenv("STALLFREE_NATIVE_LOOP", "1" if loop else "0")
    loaded = load_model(
        str(path), dtype, torch.device("cpu"), 0, quantization=quantization,
        prepack_prompt_weights=prepack,
    )  # fmt: skip
    if backend is not None:
        backend(loaded.model.attn_backend)
    fb = _batch(loaded, requests)
    with OpCalls() as ops:
        logits = loaded.model(fb)
    caches = [*fb.kv_cache.k_buffers, *fb.kv_cache.v_buffers]
    return logits, caches, ops.calls.count("stallfree.prefill_layers")


def _same(path: Path, dtype: str, quantization: str, requests: list[tuple[int, int]],
          monkeypatch: pytest.MonkeyPatch,
          backend: Callable[[Any], None] | None = None, prepack: bool = False) -> int:  # fmt: skip
    """The loop's step against Python's, bit for bit (logits and caches); the loop's calls."""
    python, python_caches, off = _step(
        path, dtype, quantization, requests, False, monkeypatch, backend, prepack
    )
    looped, looped_caches, calls = _step(
        path, dtype, quantization, requests, True, monkeypatch, backend, prepack
    )
    assert off == 0
    assert torch.equal(python, looped)
    assert all(torch.equal(a, b) for a, b in zip(python_caches, looped_caches, strict=True))
    return calls


def _bf16_loop() -> bool:
    """Whether a bfloat16 prompt past the matrix-vector kernels' rows takes the loop here: its
    products on the prompt products (the tiles, or `vdpbf16ps` on the AVX-512 variant without
    them, an integer weight dequantised as it goes) and its attention on the native prompt
    op."""
    return native_layers.prompt_product_max_rows() > 0 and attention.bf16_prompt_native(
        SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
    )


needs_bf16_loop = pytest.mark.skipif(
    not cpu_kernels.available() or not _bf16_loop(),
    reason="no bfloat16 prompt products here (neither the AMX tiles nor the AVX-512 variant)",
)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory.mktemp("prompt_loop"), **SHAPE)


REQUESTS = [
    [(0, 40)],
    [(0, 23), (0, 64), (0, 17)],  # three prompts, none a multiple of the tiles' 16 rows
    [(11, 30), (0, 25), (70, 33)],  # two with a cached prefix: their keys gathered
    [(0, 200), (0, 56)],  # the tiles' most rows
    [(0, 300), (40, 97)],  # past them: oneDNN's products (bfloat16), Python's (int8, int4)
]


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("requests", REQUESTS)
def test_loop_equals_the_python_loop_bit_for_bit(
    llama_dir: Path, quantization: str, requests: list[tuple[int, int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    calls = _same(llama_dir, "bfloat16", quantization, requests, monkeypatch)
    rows = sum(n for _, n in requests)
    if quantization == "none":
        assert calls == int(_bf16_loop())
    else:  # integer layers past the tiles' rows (with them) stay in Python
        assert calls == int(_bf16_loop() and rows <= native_layers.prompt_product_max_rows())


def _softcap(backend: Any) -> None:
    backend.softcap = 8.0  # Gemma 2's kind of cap, low enough to bite on these scores


# Qwen3: per-head q/k norms (torch's float32 statistics on the strided head views), with
# biases too; Qwen2: biases on q, k and v (int8 and int4 add theirs after the product, in the
# dtype);
# Mistral: a window of 16 that 40 tokens, and a prefix of 9 with 30 new ones, outgrow (keys
# gathered from the cache from the first one a query sees); a soft-capped backend
FAMILIES: list[tuple[Callable[..., Path], dict[str, Any], Callable[[Any], None] | None]] = [
    (make_qwen3, {}, None),
    (make_qwen3, {"attention_bias": True}, None),
    (make_qwen2, {}, None),
    (make_mistral, {"sliding_window": 16}, None),
    (make_llama, {}, _softcap),
]


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize(("make", "config", "backend"), FAMILIES)
def test_other_families_take_the_loop_bit_for_bit(
    tmp_path: Path, make: Callable[..., Path], config: dict[str, Any],
    backend: Callable[[Any], None] | None, quantization: str, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    path = make(tmp_path, **SHAPE, **config)
    requests = [(0, 40), (9, 30)]
    assert _same(path, "bfloat16", quantization, requests, monkeypatch, backend) == int(
        _bf16_loop()
    )
    if _bf16_loop():
        loaded = load_model(str(path), "bfloat16", torch.device("cpu"), 0, quantization="none")
        if backend is not None:
            backend(loaded.model.attn_backend)
        step = native_prompt_loop.plan(
            list(loaded.model.model.layers), 70, loaded.model.attn_backend, torch.bfloat16
        )
        assert step is not None
        assert step.windows == ([16] * 3 if make is make_mistral else [])
        assert step.softcap == (8.0 if backend is _softcap else None)
        assert len(step.qk_norms) == (6 if make is make_qwen3 else 0)


FLOAT32 = [
    [(0, 40)],
    [(0, 23), (0, 64), (0, 17)],
    [(11, 30), (0, 25), (70, 33)],  # cached prefixes: their keys gathered
    [(0, 300), (40, 97)],
    [(0, 40), (5, 1), (7, 1)],  # a mixed step: its decode rows on the decode attention
]


@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])
@pytest.mark.parametrize("requests", FLOAT32)
def test_a_float32_prompt_takes_the_loop_bit_for_bit(
    llama_dir: Path, requests: list[tuple[int, int]], vendor: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    # torch's products as the Python loop makes them: q, k and v three F.linear calls, gate
    # and up side by side, o and down F.linear (off Intel the stacked q/k/v and gate/up, each
    # product on oneDNN: native_layers.float32_product); the native prompt attention's vector
    # path
    monkeypatch.setattr(cpu_kernels, "vendor", lambda: vendor)
    assert _same(llama_dir, "float32", "none", requests, monkeypatch) == 1


@pytest.mark.parametrize(("make", "config", "backend"), FAMILIES)
def test_a_float32_prompt_of_other_families_takes_the_loop_bit_for_bit(
    tmp_path: Path, make: Callable[..., Path], config: dict[str, Any],
    backend: Callable[[Any], None] | None, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    # q, k and v with biases (Qwen2) are three F.linear calls with their biases; a window
    # outgrown, a soft-cap, a mixed step's tail. Qwen3's per-head q/k norms keep a float32 step
    # in Python (native_prompt_loop.plan), with the same result.
    path = make(tmp_path, **SHAPE, **config)
    requests = [(0, 40), (9, 30), (5, 1), (7, 1)]
    calls = _same(path, "float32", "none", requests, monkeypatch, backend)
    assert calls == (0 if make is make_qwen3 else 1)


def test_a_window_or_cap_set_after_a_step_reaches_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the plan is cached per row count; the backend's window and soft-cap are read per step,
    # as the Python loop reads them (float32: the loop runs without the tiles too)
    path = make_mistral(tmp_path, **SHAPE, sliding_window=16)
    requests = [(0, 40)]
    loaded = load_model(str(path), "float32", torch.device("cpu"), 0, quantization="none")
    backend = loaded.model.attn_backend
    monkeypatch.setenv("STALLFREE_NATIVE_LOOP", "1")
    windowed = loaded.model(_batch(loaded, requests))  # the plan cached, the window in force
    for _ in window_then_cap(backend):
        monkeypatch.setenv("STALLFREE_NATIVE_LOOP", "1")
        with OpCalls() as ops:
            looped = loaded.model(_batch(loaded, requests))
        assert ops.calls.count("stallfree.prefill_layers") == 1
        monkeypatch.setenv("STALLFREE_NATIVE_LOOP", "0")
        assert torch.equal(looped, loaded.model(_batch(loaded, requests)))
        assert not torch.equal(looped, windowed)
        windowed = looped


@pytest.mark.parametrize(
    ("dtype", "requests"),
    [
        ("bfloat16", [(0, 12)]),  # the matrix-vector kernels' rows, not the tiles'
        ("float32", None),  # float32's grouped native call's rows (this CPU's most)
    ],
)
def test_steps_it_does_not_take_stay_in_python(
    llama_dir: Path, dtype: str, requests: list[tuple[int, int]] | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    if requests is None:
        requests = [(0, native_layers.dense_max_rows(torch.float32))]
    assert _same(llama_dir, dtype, "none", requests, monkeypatch) == 0


@pytest.mark.parametrize("requests", [[(0, 40)], [(0, 70), (9, 30)], [(0, 300)]])
def test_prepacked_copies_take_the_loop_bit_for_bit(
    llama_dir: Path, requests: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--prepack-prompt-weights`: up to 64 rows the tiles, from 65 the blocked copy."""
    calls = _same(llama_dir, "bfloat16", "none", requests, monkeypatch, prepack=True)
    # (without the tiles no copy is kept: native_layers.prepack_pays)
    assert calls == int(_bf16_loop())
    if cpu_kernels.amx():
        loaded = load_model(
            str(llama_dir), "bfloat16", torch.device("cpu"), 0, prepack_prompt_weights=True
        )
        layers = list(loaded.model.model.layers)
        rows = sum(n for _, n in requests)
        step = native_prompt_loop.plan(layers, rows, loaded.model.attn_backend, torch.bfloat16)
        assert step is not None
        assert (native_prompt_loop.PREPACKED in step.spec) == (rows >= 65)


def test_one_plan_serves_every_row_count_past_the_tiles(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past 256 rows the products are all F.linear whatever the count (with the tiles), or all
    the prompt product (`vdpbf16ps` without them): one plan for all."""
    monkeypatch.setenv("STALLFREE_NATIVE_LOOP", "1")
    loaded = load_model(str(llama_dir), "bfloat16", torch.device("cpu"), 0, quantization="none")
    for requests in ([(0, 257)], [(0, 300), (0, 150)], [(0, 40)]):
        loaded.model(_batch(loaded, requests))
    plans = {rows: step for (rows, *_), step in loaded.model._prompt_plans.items()}
    assert sorted(plans) == ([40, 257] if _bf16_loop() else [])
    if cpu_kernels.amx():
        assert set(plans[257].spec) == {native_prompt_loop.TORCH}
        assert native_prompt_loop.TORCH not in plans[40].spec
    elif _bf16_loop():
        assert set(plans[257].spec) == set(plans[40].spec) == {native_prompt_loop.BF16}


# A mixed step (`--enable-mixed-chunk`): a prefill chunk, then the running streams' decode rows,
# one token each after their cached keys. Two or more such rows take the decode attention op
# together, in the loop as in Python (`PagedAttention._extend_with_tail`).
MIXED = [
    [(0, 40), (5, 1), (7, 1)],
    [(30, 25), (0, 18), (9, 1), (61, 1), (3, 1)],  # a prefix-cached chunk, three decode rows
    [(0, 24), *[(10 + 3 * i, 1) for i in range(20)]],  # more decode rows than prompt rows
]


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("requests", MIXED)
def test_a_mixed_steps_decode_rows_take_the_loop_bit_for_bit(
    llama_dir: Path, quantization: str, requests: list[tuple[int, int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    with OpCalls() as ops:
        calls = _same(llama_dir, "bfloat16", quantization, requests, monkeypatch)
    looped = _bf16_loop()
    assert calls == int(looped)
    # one decode_attention call a layer for the decode rows in each Python loop that ran (the
    # C++ loop's own calls run inside prefill_layers, below the dispatch mode that counts)
    python_loops = 1 if looped else 2
    assert (
        ops.calls.count("stallfree.decode_attention") == python_loops * SHAPE["num_hidden_layers"]
    )


@pytest.mark.parametrize(("make", "config", "backend"), FAMILIES)
def test_a_mixed_step_of_other_families_takes_the_loop_bit_for_bit(
    tmp_path: Path, make: Callable[..., Path], config: dict[str, Any],
    backend: Callable[[Any], None] | None, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Qwen3's q/k norms, biases, a window the decode rows outgrow, a soft-cap."""
    path = make(tmp_path, **SHAPE, **config)
    requests = [(20, 30), (0, 17), (40, 1), (12, 1)]
    calls = _same(path, "bfloat16", "none", requests, monkeypatch, backend)
    assert calls == int(_bf16_loop())


def test_one_decode_row_after_a_prompt_takes_the_loop(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A single trailing one-token row is any request to `PagedAttention._extend`."""
    calls = _same(llama_dir, "bfloat16", "none", [(0, 40), (6, 1)], monkeypatch)
    assert calls == int(_bf16_loop())


def _arguments(
    path: Path, requests: list[tuple[int, int]], dtype: torch.dtype = torch.bfloat16
) -> tuple[LoadedModel, tuple[Any, ...]]:
    loaded = load_model(str(path), str(dtype).removeprefix("torch."), torch.device("cpu"), 0,
                        quantization="none")  # fmt: skip
    fb = _batch(loaded, requests)
    model = loaded.model
    layers = list(model.model.layers)
    h = model.embed(fb.input_ids)
    rope = model.model.rotary_emb(fb.positions, h.dtype)
    cache = fb.kv_cache.k_buffers[0].dtype
    step = native_prompt_loop.plan(layers, h.shape[0], model.attn_backend, cache, dtype)
    assert step is not None
    return loaded, native_prompt_loop.arguments(layers, model.attn_backend, h, rope, fb, step)


@needs_bf16_loop
def test_the_fake_matches_the_op(llama_dir: Path) -> None:
    _, args = _arguments(llama_dir, [(0, 24), (5, 20)])
    torch.library.opcheck(
        torch.ops.stallfree.prefill_layers, args, test_utils=("test_schema", "test_faketensor")
    )


@needs_bf16_loop
def test_a_malformed_call_is_an_error_not_a_crash(llama_dir: Path) -> None:
    _, args = _arguments(llama_dir, [(0, 24), (5, 20)])
    op = torch.ops.stallfree.prefill_layers
    names = [a.name for a in op.default._schema.arguments]

    def call(**changes: Any) -> None:
        values = list(args)
        for name, value in changes.items():
            values[names.index(name)] = value
        op(*values)

    with pytest.raises(RuntimeError, match="do not add up"):
        call(extend_lens=[24, 19])
    with pytest.raises(RuntimeError, match="outside req_to_token"):
        call(pool_rows=[0, 2])
    with pytest.raises(RuntimeError, match="outside req_to_token"):
        call(prefix_lens=[0, 10_000])
    with pytest.raises(RuntimeError, match="a prefix length and a pool row per request"):
        call(prefix_lens=[0])
    with pytest.raises(RuntimeError, match="unknown projection kind"):
        call(spec=[9, *args[names.index("spec")][1:]])
    with pytest.raises(RuntimeError, match="params ran out"):
        call(params=args[names.index("params")][:-2])
    with pytest.raises(RuntimeError, match="one per layer"):
        call(windows=[4])
    with pytest.raises(RuntimeError, match="two per layer"):
        call(qk_norms=args[names.index("norms")][:2])


def test_a_malformed_float32_plan_is_an_error_not_a_crash(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On Intel a float32 layer's projections apart: q, k and v three calls, gate and up side
    by side."""
    monkeypatch.setattr(cpu_kernels, "vendor", lambda: "GenuineIntel")
    _, args = _arguments(llama_dir, [(0, 24), (5, 20)], torch.float32)
    op = torch.ops.stallfree.prefill_layers
    names = [a.name for a in op.default._schema.arguments]
    spec, params = args[names.index("spec")], args[names.index("params")]
    side = spec.index(native_prompt_loop.SIDE)  # the first layer's gate/up: its kind, its count

    def call(**changes: Any) -> None:
        values = list(args)
        for name, value in changes.items():
            values[names.index(name)] = value
        with torch.inference_mode():  # as the engine runs it (the weights are parameters)
            op(*values)

    call()  # the plan as made runs
    with pytest.raises(RuntimeError, match="a side-by-side group of 0 weights"):
        call(spec=[*spec[: side + 1], 0, *spec[side + 2 :]])
    with pytest.raises(RuntimeError, match="a side-by-side weight is missing"):
        call(spec=[*spec[: side + 1], 10_000, *spec[side + 2 :]])
    with pytest.raises(RuntimeError, match="without its count"):
        call(spec=[*spec[: side + 1]])
    # q, k and v apart with a weight of the wrong width: torch's own error
    with pytest.raises(RuntimeError):
        call(params=[params[0][:, :8], *params[1:]])


def test_a_stacked_float32_plan_multiplies_on_onednn_and_refuses_a_wrong_weight(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off Intel a float32 model stacks q/k/v and gate/up (native_layers.stacks_float32): each
    layer's four products are oneDNN's on the weights as they are (PREPACKED), none apart or
    side by side; a weight of the wrong width is torch's error, not a crash."""
    monkeypatch.setattr(cpu_kernels, "vendor", lambda: "AuthenticAMD")
    loaded, args = _arguments(llama_dir, [(0, 24), (5, 20)], torch.float32)
    assert loaded.model.model.layers[0].self_attn.qkv_proj is not None
    op = torch.ops.stallfree.prefill_layers
    names = [a.name for a in op.default._schema.arguments]
    spec, params = args[names.index("spec")], args[names.index("params")]
    assert spec == [native_prompt_loop.PREPACKED] * 4 * SHAPE["num_hidden_layers"]
    with torch.inference_mode():
        op(*args)
        values = list(args)
        values[names.index("params")] = [params[0][:, :8], *params[1:]]
        with pytest.raises(RuntimeError):
            op(*values)


def test_a_stacked_float32_layer_on_intel_takes_the_loop_as_f_linear(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A float32 model stacked where MKL is fast (a LoRA test forces that) plans its four
    products as `native_layers.float32_product` runs them there, F.linear (TORCH), and the loop
    equals the Python loop bit for bit."""
    monkeypatch.setattr(cpu_kernels, "vendor", lambda: "GenuineIntel")
    monkeypatch.setattr(native_layers, "stacks_float32", lambda device: True)
    loaded, args = _arguments(llama_dir, [(0, 24), (5, 20)], torch.float32)
    assert loaded.model.model.layers[0].self_attn.qkv_proj is not None
    names = [a.name for a in torch.ops.stallfree.prefill_layers.default._schema.arguments]
    assert args[names.index("spec")] == [native_prompt_loop.TORCH] * 4 * SHAPE["num_hidden_layers"]
    assert _same(llama_dir, "float32", "none", [(0, 40), (9, 30)], monkeypatch) == 1
