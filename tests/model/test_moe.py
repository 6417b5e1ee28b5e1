"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers: the routing
(ties included), the grouped experts, logits on the paged path, quantization, and the engine's
greedy output in every mode."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from stallfree import Engine
from stallfree.runtime.model import ModelArchConfig, ModelLoadError, load_model, quant
from stallfree.runtime.model import arch as arch_module
from stallfree.runtime.model.forward_batch import ForwardMode
from stallfree.runtime.model.loader import check_tensor_parallel
from stallfree.runtime.model.moe import Expert, Router, SparseMoeBlock, route
from tests.engine_util import (
    MODES,
    engine_config,
    greedy_in_mode,
    guarded,
    random_prompts,
    run_greedy,
)
from tests.hf_models import (
    _load_hf,
    hf_greedy,
    hf_logits,
    make_mixtral,
    make_qwen2_moe,
    make_qwen3_moe,
)
from tests.model_harness import CPU, PROMPT_A, PROMPT_B, Harness, check_chunked_prefill_then_decode

ATOL = 1e-4
NAMES = ["mixtral", "qwen2_moe", "qwen3_moe"]
_MAKERS = {"mixtral": make_mixtral, "qwen2_moe": make_qwen2_moe, "qwen3_moe": make_qwen3_moe}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {name: make(root) for name, make in _MAKERS.items()}


def _ours(model_dir: Path, dtype: str = "float32", **kwargs: Any) -> torch.nn.Module:
    return load_model(str(model_dir), dtype, CPU, 0, **kwargs).model


def _blocks(model: torch.nn.Module) -> list[tuple[int, SparseMoeBlock]]:
    return [
        (i, layer.mlp)
        for i, layer in enumerate(model.model.layers)
        if isinstance(layer.mlp, SparseMoeBlock)
    ]


def _hf_block(model_dir: Path, layer: int) -> torch.nn.Module:
    hf_layer = _load_hf(str(model_dir)).model.layers[layer]
    return getattr(hf_layer, "block_sparse_moe", None) or hf_layer.mlp


# ---------------------------------------------------------------------------- routing


@pytest.mark.parametrize("name", NAMES)
def test_routing_equals_transformers(hf_dirs: dict[str, Path], name: str) -> None:
    model = _ours(hf_dirs[name])
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    for i, block in _blocks(model):
        weights, ids = route(block.gate(x), block.moe)
        _, hf_weights, hf_ids = _hf_block(hf_dirs[name], i).gate(x)
        assert torch.equal(ids, hf_ids)
        assert torch.equal(weights, hf_weights) and weights.dtype == hf_weights.dtype


@pytest.mark.parametrize("name", NAMES)
def test_routing_ties_break_as_transformers(tmp_path: Path, name: str) -> None:
    """Two experts with the same router row have exactly equal logits for every token; where
    the pair straddles the top-k boundary the one chosen is the one transformers chooses."""
    model_dir = _MAKERS[name](tmp_path)
    file = model_dir / "model.safetensors"
    state = load_file(str(file))
    for key in [k for k in state if k.endswith(".gate.weight")]:
        state[key][3] = state[key][1]  # experts 1 and 3 tie
    save_file(state, str(file), metadata={"format": "pt"})
    model = _ours(model_dir)
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    straddles = 0
    for i, block in _blocks(model):
        logits = block.gate(x)
        assert torch.equal(logits[:, 1], logits[:, 3])
        weights, ids = route(logits, block.moe)
        _, hf_weights, hf_ids = _hf_block(model_dir, i).gate(x)
        assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)
        chosen = torch.stack([(ids == 1).any(-1), (ids == 3).any(-1)], dim=-1)
        straddles += int((chosen.sum(-1) == 1).sum())
    assert straddles > 0  # the tie did decide some tokens' experts
    ours = Harness(model).run(ForwardMode.EXTEND, [(0, PROMPT_A)])
    torch.testing.assert_close(ours[0], hf_logits(model_dir, PROMPT_A)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_block_equals_transformers_on_both_paths(hf_dirs: dict[str, Path], name: str) -> None:
    model = _ours(hf_dirs[name])
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(2))
    for i, block in _blocks(model):
        with torch.no_grad():
            want = _hf_block(hf_dirs[name], i)(x[None])[0]
            grouped = block(x)
            block.group_on_host = False  # the path a CUDA device takes (no counts read back)
            every = block(x)
        torch.testing.assert_close(grouped, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(every, want, atol=1e-5, rtol=0)


def test_decode_runs_only_the_chosen_experts(hf_dirs: dict[str, Path]) -> None:
    model = _ours(hf_dirs["mixtral"])
    calls: list[int] = []
    forward = Expert.forward

    def spy(self: Expert, x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return forward(self, x)

    Expert.forward = spy  # type: ignore[method-assign]
    try:
        _, block = _blocks(model)[0]
        with torch.no_grad():
            block(torch.randn(1, 64))
            assert calls == [1, 1]  # top 2 of 4 experts, one row each
            calls.clear()
            block(torch.randn(9, 64))
    finally:
        Expert.forward = forward  # type: ignore[method-assign]
    assert len(calls) <= 4 and sum(calls) == 9 * 2  # one call per expert that got rows
    with torch.no_grad():
        assert block(torch.empty(0, 64)).shape == (0, 64)


# ---------------------------------------------------------------------------- the model


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.usefixtures("float32_apart")
def test_parameter_names_match_hf(hf_dirs: dict[str, Path], name: str) -> None:
    stored = set(load_file(str(hf_dirs[name] / "model.safetensors")))
    assert {n for n, _ in _ours(hf_dirs[name]).named_parameters()} == stored


def test_sparse_layers_follow_the_config(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    # make_qwen2_moe: layer 1 is in mlp_only_layers
    assert [i for i, _ in _blocks(_ours(hf_dirs["qwen2_moe"]))] == [0, 2]
    stepped = make_qwen2_moe(tmp_path, mlp_only_layers=[], decoder_sparse_step=2)
    assert [i for i, _ in _blocks(_ours(stepped))] == [1]
    torch.testing.assert_close(
        Harness(_ours(stepped)).run(ForwardMode.EXTEND, [(0, PROMPT_B)])[0],
        hf_logits(stepped, PROMPT_B)[-1],
        atol=ATOL,
        rtol=0,
    )
    arch = ModelArchConfig.from_hf(_load_hf(str(hf_dirs["qwen3_moe"])).config.to_dict())
    assert arch.qk_norm and arch.moe is not None and arch.moe.norm_topk_prob
    assert arch.moe.shared_expert_intermediate_size == 0


def test_mixtral_sliding_window_matches_hf(tmp_path: Path) -> None:
    model_dir = make_mixtral(tmp_path, sliding_window=4)
    model = _ours(model_dir)
    assert model.arch.sliding_window == 4
    logits = Harness(model).run(ForwardMode.EXTEND, [(0, PROMPT_A)])
    torch.testing.assert_close(logits[0], hf_logits(model_dir, PROMPT_A)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_single_extend_matches_hf(hf_dirs: dict[str, Path], name: str) -> None:
    logits = Harness(_ours(hf_dirs[name])).run(ForwardMode.EXTEND, [(0, PROMPT_A), (1, PROMPT_B)])
    torch.testing.assert_close(logits[0], hf_logits(hf_dirs[name], PROMPT_A)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], hf_logits(hf_dirs[name], PROMPT_B)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_chunked_prefill_then_decode_matches_hf(hf_dirs: dict[str, Path], name: str) -> None:
    model_dir = hf_dirs[name]
    check_chunked_prefill_then_decode(_ours(model_dir), model_dir, steps=3)


def test_tensor_parallel_is_checked_before_loading(
    hf_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """MoE runs split (tests/parallel/test_tensor_parallel_moe.py); a family marked
    `tensor_parallel=False` is refused by name before any weight is read."""
    check_tensor_parallel(str(hf_dirs["mixtral"]), 2)
    family = arch_module.FAMILIES["MixtralForCausalLM"]
    monkeypatch.setitem(
        arch_module.FAMILIES, family.architecture, replace(family, tensor_parallel=False)
    )
    with pytest.raises(ModelLoadError, match="MixtralForCausalLM does not support tensor"):
        check_tensor_parallel(str(hf_dirs["mixtral"]), 2)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_experts(hf_dirs: dict[str, Path], method: str) -> None:
    """The experts' and shared expert's linears are quantized, the routers stay dense, and the
    model computes what its dequantised weights do."""
    model_dir = hf_dirs["qwen2_moe"]
    model = _ours(model_dir, quantization=method)
    kind = quant.Int8Linear if method == "int8" else quant.Int4Linear
    _, block = _blocks(model)[0]
    assert isinstance(block.experts[0].gate_proj, kind)
    assert isinstance(block.experts[3].down_proj, kind)
    assert isinstance(block.shared_expert.gate_proj, kind)  # type: ignore[union-attr]
    assert isinstance(block.gate, Router) and block.gate.weight.dtype == torch.float32
    reference = _ours(model_dir)
    reference.fuse_projections()  # as the quantized model's attention is
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, quant.Int8Linear | quant.Int4Linear):
                reference.get_submodule(name).weight.copy_(module.dequantize())
    got = Harness(model).run(ForwardMode.EXTEND, [(0, PROMPT_A)])[0]
    want = Harness(reference).run(ForwardMode.EXTEND, [(0, PROMPT_A)])[0]
    # what remains is the activations' rounding on the integer kernels
    assert (got - want).abs().max() <= 0.15 * want.std()


def test_bfloat16_fuses_attention_and_stays_close(hf_dirs: dict[str, Path]) -> None:
    model = _ours(hf_dirs["mixtral"], "bfloat16")
    assert model.model.layers[0].self_attn.qkv_proj is not None  # fused; the experts are not
    got = Harness(model).run(ForwardMode.EXTEND, [(0, PROMPT_A)])[0]
    want = hf_logits(hf_dirs["mixtral"], PROMPT_A)[-1]
    assert (got - want).abs().max() <= 0.1 * want.std() + 0.05


# ---------------------------------------------------------------------------- the engine

NEW_TOKENS = 16
PROMPTS = random_prompts(6, seed=3)
STRESSED = {
    "cache": {"page_size": 4, "max_total_tokens": 160, "max_running_requests": 6},
    "scheduler": {"chunked_prefill_size": 7, "max_prefill_tokens": 16},
}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("overlap", "mirrors"), MODES)
async def test_engine_greedy_equals_transformers(
    hf_dirs: dict[str, Path], name: str, overlap: bool, mirrors: bool
) -> None:
    """Chunked prefill and a pool small enough to retract, in every overlap x mirrors mode."""
    path = hf_dirs[name]
    reference = [hf_greedy(path, p, NEW_TOKENS) for p in PROMPTS]
    run = await greedy_in_mode(str(path), PROMPTS, NEW_TOKENS, overlap, mirrors, **STRESSED)
    assert run.outputs == reference
    assert run.counters.retractions > 0


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
async def test_hisparse_runs_moe_models(hf_dirs: dict[str, Path], name: str) -> None:
    """HiSparse swaps attention only: with a top k covering every context it equals dense."""
    path = hf_dirs[name]
    cfg = engine_config(
        str(path),
        runtime={"strict": True},
        hisparse={"enabled": True, "top_k": 512, "device_buffer_size": 512},
        **STRESSED,
    )
    async with guarded(Engine(cfg)) as engine:
        outputs = await run_greedy(engine, PROMPTS, NEW_TOKENS)
        await engine.wait_idle()
        assert engine.core.monitor.schedule_path_reads == 0
    assert outputs == [hf_greedy(path, p, NEW_TOKENS) for p in PROMPTS]


@pytest.mark.slow
def test_torch_compile_runs_the_moe_block_eagerly_between_graphs(hf_dirs: dict[str, Path]) -> None:
    """runtime.torch_compile: the expert counts read back break the after-attention graph
    there (dynamo's graph break); the output is unchanged."""
    model_dir = hf_dirs["mixtral"]
    model = _ours(model_dir)
    model.compile_layers()
    h = Harness(model)
    out = h.run(ForwardMode.EXTEND, [(0, PROMPT_A)])
    torch.testing.assert_close(out[0], hf_logits(model_dir, PROMPT_A)[-1], atol=ATOL, rtol=0)
    gen = hf_greedy(model_dir, PROMPT_A, 2)
    out = h.run(ForwardMode.DECODE, [(0, [gen[0]])])
    ref = hf_logits(model_dir, PROMPT_A + gen)
    torch.testing.assert_close(out[0], ref[len(PROMPT_A)], atol=ATOL, rtol=0)
