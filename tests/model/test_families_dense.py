"""Qwen3 (per-head q/k norms), Phi-3 (fused checkpoint tensors, longrope) and the yarn and
dynamic RoPE types against transformers: RoPE parameters, logits on extend, chunked prefill then
decode, tensor-parallel shards, and GGUF files written from each checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from stallfree import Engine
from stallfree.runtime.model import ModelArchConfig, load_model
from stallfree.runtime.model.forward_batch import ForwardMode
from stallfree.runtime.model.parallel import TPGroup
from stallfree.runtime.model.rope import rope_attention_factor, rope_inv_freq
from tests.engine_util import (
    MODES,
    engine_config,
    greedy_in_mode,
    random_prompts,
    run_greedy,
)
from tests.hf_models import hf_greedy, hf_logits, make_llama, make_phi3, make_qwen2, make_qwen3
from tests.model_harness import CPU, PROMPT_A, PROMPT_B, Harness, check_chunked_prefill_then_decode

ATOL = 1e-4
HEAD_DIM = 16  # Phi-3's and Llama's tiny heads (Qwen3's are 32)

# longrope's short and long factors, one per frequency (head_dim / 2 of them)
SHORT = [1.0 + 0.15 * i for i in range(HEAD_DIM // 2)]
LONG = [2.0 + 0.5 * i for i in range(HEAD_DIM // 2)]
LONGROPE: dict[str, Any] = {
    "max_position_embeddings": 512,
    "original_max_position_embeddings": 128,
    "rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG},
}
YARN: dict[str, Any] = {
    "max_position_embeddings": 256,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}
DYNAMIC: dict[str, Any] = {
    "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
}

BUILDERS: dict[str, tuple[Any, dict[str, Any]]] = {
    "qwen3": (make_qwen3, {}),
    "qwen3-bias": (make_qwen3, {"attention_bias": True}),  # q/k/v and o biases
    "qwen3-tied": (make_qwen3, {"tie_word_embeddings": True}),
    "qwen3-yarn": (make_qwen3, YARN),
    "phi3": (make_phi3, {}),
    "phi3-longrope": (make_phi3, LONGROPE),
    "llama-dynamic": (make_llama, DYNAMIC),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dense")
    return {name: make(root / name, **dict(kw)) for name, (make, kw) in BUILDERS.items()}


def _ours(model_dir: Path) -> torch.nn.Module:
    return load_model(str(model_dir), "float32", CPU, 0).model


# ---------------------------------------------------------------------------- RoPE


def _hf_rope(config: Any) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind = config.rope_parameters["rope_type"]
    fn = ROPE_INIT_FUNCTIONS[kind]
    inv_freq, factor = fn(config, torch.device("cpu"))
    return inv_freq, float(factor)


@pytest.mark.parametrize(
    ("config_cls", "kwargs"),
    [
        ("Qwen3Config", {"max_position_embeddings": 256, **YARN["rope_parameters"]}),
        (
            "LlamaConfig",
            {
                "max_position_embeddings": 4096,
                "rope_type": "yarn",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 512,
                "beta_fast": 16.0,
                "beta_slow": 2.0,
                "truncate": False,
                "mscale": 0.707,
                "mscale_all_dim": 1.0,
            },
        ),
        # no pretraining context: max_position_embeddings
        (
            "LlamaConfig",
            {
                "max_position_embeddings": 1024,
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 2.0,
            },
        ),
        ("LlamaConfig", {"max_position_embeddings": 1024, **DYNAMIC["rope_parameters"]}),
        (
            "Phi3Config",
            {
                "max_position_embeddings": 512,
                "original_max_position_embeddings": 128,
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": SHORT,
                "long_factor": LONG,
            },
        ),
    ],
)
def test_rope_parameters_match_transformers(config_cls: str, kwargs: dict[str, Any]) -> None:
    import transformers

    kwargs = dict(kwargs)
    top = {
        k: kwargs.pop(k)
        for k in ("max_position_embeddings", "original_max_position_embeddings")
        if k in kwargs
    }
    shape = {"hidden_size": 64, "num_attention_heads": 4, "head_dim": HEAD_DIM}
    config = getattr(transformers, config_cls)(**shape, **top, rope_parameters=kwargs)
    want, want_factor = _hf_rope(config)
    arch = ModelArchConfig.from_hf(
        {**config.to_dict(), "architectures": [config_cls[:-6] + "ForCausalLM"]}
    )
    assert torch.equal(rope_inv_freq(arch), want)
    assert rope_attention_factor(arch) == pytest.approx(want_factor, rel=1e-12)


def test_longrope_context_stops_at_the_pretraining_length(dirs: dict[str, Path]) -> None:
    """transformers swaps the short factors for the long ones past the pretraining length,
    keeping what it cached before; the engine's context ends there instead (arch.py)."""
    arch = load_model(str(dirs["phi3-longrope"]), "float32", CPU, 0).arch
    assert arch.max_position_embeddings == 128
    assert arch.rope_scaling is not None and arch.rope_scaling["factor"] == 4.0
    # dynamic NTK equals the default frequencies within max_position_embeddings: no cap
    assert (
        load_model(str(dirs["llama-dynamic"]), "float32", CPU, 0).arch.max_position_embeddings
        == 1024
    )


def test_su_is_longrope_and_partial_rotary_is_refused() -> None:
    cfg: dict[str, Any] = {
        "architectures": ["Phi3ForCausalLM"],
        "vocab_size": 260,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "max_position_embeddings": 512,
        "rope_scaling": {"type": "su", "short_factor": SHORT, "long_factor": LONG},
    }
    arch = ModelArchConfig.from_hf(cfg)
    assert arch.rope_scaling is not None and arch.rope_scaling["rope_type"] == "longrope"
    assert arch.rope_scaling["original_max_position_embeddings"] == 4096  # Phi3Config's default
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0\.75"):
        ModelArchConfig.from_hf({**cfg, "partial_rotary_factor": 0.75})


# ---------------------------------------------------------------------------- parity with HF


@pytest.mark.parametrize("name", list(BUILDERS))
def test_single_extend_matches_hf(dirs: dict[str, Path], name: str) -> None:
    logits = Harness(_ours(dirs[name])).run(ForwardMode.EXTEND, [(0, PROMPT_A), (1, PROMPT_B)])
    torch.testing.assert_close(logits[0], hf_logits(dirs[name], PROMPT_A)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], hf_logits(dirs[name], PROMPT_B)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["qwen3", "phi3-longrope", "qwen3-yarn", "llama-dynamic"])
def test_chunked_prefill_then_decode_matches_hf(dirs: dict[str, Path], name: str) -> None:
    model_dir = dirs[name]
    check_chunked_prefill_then_decode(_ours(model_dir), model_dir, steps=3)


def test_fused_and_quantized_match_hf(dirs: dict[str, Path]) -> None:
    """int8 fuses q/k/v (Qwen3's per-head norms follow the fused matmul's split) and quantizes
    Phi-3's split projections; the logits stay close to transformers' float32 ones."""
    for name in ("qwen3", "phi3"):
        want = hf_logits(dirs[name], PROMPT_A)[-1]
        loaded = load_model(str(dirs[name]), "float32", CPU, 0, quantization="int8")
        attn = loaded.model.model.layers[0].self_attn
        assert attn.qkv_proj is not None and not hasattr(attn, "q_proj")
        got = Harness(loaded.model).run(ForwardMode.EXTEND, [(0, PROMPT_A)])[0]
        assert (got - want).abs().max().item() <= 0.1 * want.std().item(), name


@pytest.mark.usefixtures("float32_apart")
def test_parameter_names(dirs: dict[str, Path]) -> None:
    stored = set(load_file(str(dirs["qwen3"] / "model.safetensors")))
    ours = {n for n, _ in _ours(dirs["qwen3"]).named_parameters()}
    assert ours == stored and "model.layers.0.self_attn.q_norm.weight" in ours
    stored = set(load_file(str(dirs["phi3"] / "model.safetensors")))
    assert "model.layers.0.self_attn.qkv_proj.weight" in stored
    qkv = {n for n in stored if "qkv_proj" in n}
    gate_up = {n for n in stored if "gate_up_proj" in n}
    parts = {n.replace("qkv_proj", p) for n in qkv for p in ("q_proj", "k_proj", "v_proj")}
    parts |= {n.replace("gate_up_proj", p) for n in gate_up for p in ("gate_proj", "up_proj")}
    ours = {n for n, _ in _ours(dirs["phi3"]).named_parameters()}
    assert ours == (stored - qkv - gate_up) | parts


# ---------------------------------------------------------------------------- tensor parallel


@pytest.mark.usefixtures("float32_apart")
def test_tp_shards_split_phi3_fused_rows_and_replicate_qk_norms(dirs: dict[str, Path]) -> None:
    d, tp = HEAD_DIM, 2
    full = load_file(str(dirs["phi3"] / "model.safetensors"))
    qkv = full["model.layers.1.self_attn.qkv_proj.weight"]  # 4 q heads, 2 k, 2 v
    gate_up = full["model.layers.1.mlp.gate_up_proj.weight"]
    qwen3 = load_file(str(dirs["qwen3"] / "model.safetensors"))
    for rank in range(tp):
        params = dict(
            load_model(
                str(dirs["phi3"]), "float32", CPU, 0, tp=TPGroup(rank, tp)
            ).model.named_parameters()
        )
        attn = "model.layers.1.self_attn"
        q0, k0 = rank * 2 * d, 4 * d + rank * d
        assert torch.equal(params[f"{attn}.q_proj.weight"], qkv[q0 : q0 + 2 * d])
        assert torch.equal(params[f"{attn}.k_proj.weight"], qkv[k0 : k0 + d])
        assert torch.equal(params[f"{attn}.v_proj.weight"], qkv[k0 + 2 * d : k0 + 3 * d])
        up0 = 128 + rank * 64
        assert torch.equal(
            params["model.layers.1.mlp.gate_proj.weight"], gate_up[rank * 64 : rank * 64 + 64]
        )
        assert torch.equal(params["model.layers.1.mlp.up_proj.weight"], gate_up[up0 : up0 + 64])
        loaded = load_model(str(dirs["qwen3"]), "float32", CPU, 0, tp=TPGroup(rank, tp))
        params = dict(loaded.model.named_parameters())
        for norm in ("q_norm", "k_norm"):
            name = f"{attn}.{norm}.weight"
            assert torch.equal(params[name], qwen3[name])  # per head: replicated


# ---------------------------------------------------------------------------- GGUF

GGUF_CASES = {
    # (checkpoint, llama.cpp family)
    "qwen2": ("qwen2", "qwen2"),
    "qwen3-tied": ("qwen3-tied", "qwen3"),
    "qwen3-yarn": ("qwen3-yarn", "qwen3"),
    "phi3-longrope": ("phi3-longrope", "phi3"),
}


@pytest.fixture(scope="module")
def ggufs(
    dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, Path]]:
    from tests.model.test_gguf import write_gguf

    root = tmp_path_factory.mktemp("dense-gguf")
    made = dict(dirs)
    made["qwen2"] = make_qwen2(root / "qwen2-dir")
    return {
        name: (made[src], write_gguf(made[src], root / f"{name}.gguf", arch=family))
        for name, (src, family) in GGUF_CASES.items()
    }


@pytest.mark.parametrize("name", list(GGUF_CASES))
def test_gguf_loads_the_checkpoint(ggufs: dict[str, tuple[Path, Path]], name: str) -> None:
    model_dir, path = ggufs[name]
    loaded = load_model(str(path), "float32", CPU, 0)
    from_dir = load_model(str(model_dir), "float32", CPU, 0)
    assert loaded.arch.architecture == from_dir.arch.architecture
    assert loaded.arch.rope_scaling == from_dir.arch.rope_scaling or name == "phi3-longrope"
    assert loaded.arch.max_position_embeddings == from_dir.arch.max_position_embeddings
    want = from_dir.model.state_dict()
    for key, param in loaded.model.state_dict().items():
        assert torch.equal(param, want[key]), key  # no Q/K permutation for these families
    logits = Harness(loaded.model).run(ForwardMode.EXTEND, [(0, PROMPT_A)])
    torch.testing.assert_close(logits[0], hf_logits(model_dir, PROMPT_A)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["qwen2", "qwen3-yarn", "phi3-longrope"])
async def test_gguf_engine_greedy_matches_hf(
    ggufs: dict[str, tuple[Path, Path]], name: str
) -> None:
    model_dir, path = ggufs[name]
    cfg = engine_config(str(path), scheduler={"chunked_prefill_size": 5, "max_prefill_tokens": 8})
    async with Engine(cfg) as engine:
        got = await run_greedy(engine, [PROMPT_A, PROMPT_B], 6)
    assert got == [hf_greedy(model_dir, PROMPT_A, 6), hf_greedy(model_dir, PROMPT_B, 6)]


def test_gguf_phi3_blocks_split_like_dense(
    ggufs: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """Q4_0 blocks of the fused attn_qkv / ffn_up split by rows: the packed model computes what
    the same file dequantised computes (up to the kernel's activation rounding)."""
    from tests.model.test_gguf import write_gguf

    model_dir, _ = ggufs["phi3-longrope"]
    path = write_gguf(model_dir, tmp_path / "q4.gguf", arch="phi3", layer_type="Q4_0")
    packed = load_model(str(path), "float32", CPU, 0, quantization="gguf")
    dense = load_model(str(path), "float32", CPU, 0, quantization="none")
    assert type(packed.model.model.layers[0].self_attn.qkv_proj).__name__ != "Linear"
    a = Harness(packed.model).run(ForwardMode.EXTEND, [(0, PROMPT_A)])[0]
    b = Harness(dense.model).run(ForwardMode.EXTEND, [(0, PROMPT_A)])[0]
    assert (a - b).abs().max().item() <= 0.1 * b.std().item()
    assert int(a.argmax()) == int(b.argmax())


def test_transformers_reads_the_written_qwen2_gguf_alike(
    ggufs: dict[str, tuple[Path, Path]],
) -> None:
    """The writer's conventions (tensor names, no Q/K permutation outside llama) checked by an
    independent reader: transformers' own GGUF loader gives the checkpoint's logits. (Its
    config mapping misreads the tiny Qwen3 and Phi-3 files' shapes, so Qwen2 stands for the
    unpermuted families.)"""
    from transformers import AutoModelForCausalLM

    model_dir, path = ggufs["qwen2"]
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    with torch.no_grad():
        got = hf(torch.tensor([PROMPT_A])).logits[0, -1].float()
    torch.testing.assert_close(got, hf_logits(model_dir, PROMPT_A)[-1], atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------- through the engine

NEW_TOKENS = 16
PROMPTS = random_prompts(6, seed=5, lo=3, hi=40)
# page_size 4, prefill chunks of 7 tokens and a pool small enough to force retraction
STRESSED = {
    "cache": {"page_size": 4, "max_total_tokens": 160, "max_running_requests": 6},
    "scheduler": {"chunked_prefill_size": 7, "max_prefill_tokens": 16},
}
ENGINE_CASES = [
    # every mode on the two that carry the new pieces (Qwen3's norms with yarn; Phi-3's split
    # tensors with longrope), one mode on the others
    *[
        pytest.param(name, *mode.values, id=f"{name}-{mode.id}")
        for name in ("qwen3-yarn", "phi3-longrope")
        for mode in MODES
    ],
    pytest.param("qwen3", True, True, id="qwen3-overlap-mirrors"),
    pytest.param("llama-dynamic", False, False, id="llama-dynamic-plain-legacy"),
]


@pytest.mark.parametrize(("name", "overlap", "mirrors"), ENGINE_CASES)
async def test_engine_greedy_equals_transformers(
    dirs: dict[str, Path], name: str, overlap: bool, mirrors: bool
) -> None:
    reference = [hf_greedy(dirs[name], p, NEW_TOKENS) for p in PROMPTS]
    run = await greedy_in_mode(str(dirs[name]), PROMPTS, NEW_TOKENS, overlap, mirrors, **STRESSED)
    outputs = run.outputs
    assert run.counters.retractions > 0
    for i, (got, want) in enumerate(zip(outputs, reference, strict=True)):
        assert got == want, f"prompt {i} (len {len(PROMPTS[i])}) diverged"


async def test_longrope_request_past_the_pretraining_length_is_refused(
    dirs: dict[str, Path],
) -> None:
    from stallfree.runtime.request.errors import InvalidRequestError

    async with Engine(engine_config(str(dirs["phi3-longrope"]))) as engine:
        with pytest.raises(InvalidRequestError, match="maximum context length is 128"):
            await engine.complete([65] * 130, {"max_new_tokens": 4})
        ok = await engine.complete([65] * 100, {"max_new_tokens": 4, "ignore_eos": True})
        assert len(ok.token_ids) == 4


@pytest.mark.slow  # inductor compiles C++ on first use: tens of seconds
async def test_compiled_qwen3_layers_equal_transformers(dirs: dict[str, Path]) -> None:
    """The compiled half before attention runs `project`, per-head norms included."""
    prompts = PROMPTS[:4]
    reference = [hf_greedy(dirs["qwen3-yarn"], p, 8) for p in prompts]
    cfg = engine_config(str(dirs["qwen3-yarn"]), runtime={"torch_compile": True})
    async with Engine(cfg) as engine:
        outputs = await run_greedy(engine, prompts, 8)
    # inductor may sum in another order than eager; on this model the greedy tokens agree
    assert sum(a == b for a, b in zip(outputs, reference, strict=True)) >= len(prompts) - 1
