"""The torch Llama-family model against Hugging Face, the paged KV path, and the loader."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from stallfree.runtime.model import (
    PRESETS,
    LlamaForCausalLM,
    ModelArchConfig,
    ModelLoadError,
    load_model,
    loader,
)
from stallfree.runtime.model.forward_batch import ForwardMode
from tests.hf_models import hf_greedy, hf_logits, make_llama, make_mistral, make_qwen2
from tests.model_harness import CPU, PROMPT_A, PROMPT_B, Harness, check_chunked_prefill_then_decode

ATOL = 1e-4


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {
        "llama": make_llama(root),
        "qwen2": make_qwen2(root),
        "mistral": make_mistral(root, sliding_window=4),
        "llama-tied": make_llama(root / "tied", tie_word_embeddings=True),
        "llama-rope3": make_llama(
            root / "rope3",
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 50000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        "llama-linear": make_llama(
            root / "linear",
            rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
        ),
    }


def _ours(model_dir: Path) -> LlamaForCausalLM:
    return load_model(str(model_dir), "auto", CPU, 0).model


# ---------------------------------------------------------------------------- parity with HF


@pytest.mark.parametrize(
    "name", ["llama", "qwen2", "mistral", "llama-tied", "llama-rope3", "llama-linear"]
)
def test_single_extend_matches_hf(hf_dirs: dict[str, Path], name: str) -> None:
    logits = Harness(_ours(hf_dirs[name])).run(ForwardMode.EXTEND, [(0, PROMPT_A)])
    assert logits.shape == (1, 260) and logits.dtype == torch.float32
    torch.testing.assert_close(logits[0], hf_logits(hf_dirs[name], PROMPT_A)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_chunked_prefill_then_decode_matches_hf(hf_dirs: dict[str, Path], name: str) -> None:
    model_dir = hf_dirs[name]
    check_chunked_prefill_then_decode(_ours(model_dir), model_dir, steps=3)


def test_hf_greedy_is_exact_length(hf_dirs: dict[str, Path]) -> None:
    assert len(hf_greedy(hf_dirs["llama"], PROMPT_B, 5)) == 5


def test_sliding_window_changes_long_context(hf_dirs: dict[str, Path]) -> None:
    model = _ours(hf_dirs["mistral"])
    windowed = Harness(model).run(ForwardMode.EXTEND, [(0, PROMPT_A)])
    model.attn_backend.sliding_window = None  # type: ignore[attr-defined]
    full = Harness(model).run(ForwardMode.EXTEND, [(0, PROMPT_A)])
    assert not torch.allclose(windowed, full, atol=1e-3)


def test_attn_backend_is_swappable(hf_dirs: dict[str, Path]) -> None:
    model = _ours(hf_dirs["llama"])
    seen: list[int] = []
    inner = model.attn_backend

    class Spy:
        def forward(self, q, k, v, layer_id, fb):  # type: ignore[no-untyped-def]
            seen.append(layer_id)
            return inner.forward(q, k, v, layer_id, fb)

    model.attn_backend = Spy()
    logits = Harness(model).run(ForwardMode.EXTEND, [(0, PROMPT_B)])
    assert seen == [0, 1]
    torch.testing.assert_close(
        logits[0], hf_logits(hf_dirs["llama"], PROMPT_B)[-1], atol=ATOL, rtol=0
    )


def test_idle_batch_returns_empty_logits() -> None:
    model = load_model("tiny", "auto", CPU, 0).model
    fb = Harness(model).batch(ForwardMode.IDLE, [])
    assert model(fb).shape == (0, 260)


# ---------------------------------------------------------------------------- config parsing


@pytest.mark.usefixtures("float32_apart")
def test_parameter_names_match_hf(hf_dirs: dict[str, Path]) -> None:
    for name, tied in (("qwen2", False), ("llama-tied", True)):
        stored = set(load_file(str(hf_dirs[name] / "model.safetensors")))
        ours = {n for n, _ in _ours(hf_dirs[name]).named_parameters()}
        assert ours == stored - {"lm_head.weight"} if tied else ours == stored


def test_from_hf_v4_style_rope_and_eos_list() -> None:
    cfg = _hf_config(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    cfg["eos_token_id"] = [257, 258]
    arch = ModelArchConfig.from_hf(cfg)
    assert arch.rope_theta == 500000.0 and arch.rope_scaling == {
        "type": "linear",
        "factor": 2.0,
        "rope_type": "linear",
    }
    assert arch.eos_token_ids == [257, 258] and arch.head_dim == 16


def test_from_hf_unsupported_rope_type_is_named() -> None:
    with pytest.raises(ValueError, match="'mrope'"):
        ModelArchConfig.from_hf(_hf_config(rope_scaling={"rope_type": "mrope", "factor": 2.0}))


def test_from_hf_qwen2_sliding_window_only_when_enabled() -> None:
    cfg = _hf_config(architectures=["Qwen2ForCausalLM"], sliding_window=8)
    assert ModelArchConfig.from_hf(cfg).sliding_window is None
    assert ModelArchConfig.from_hf({**cfg, "use_sliding_window": True}).sliding_window == 8
    assert ModelArchConfig.from_hf(cfg).qkv_bias


def _hf_config(**overrides: object) -> dict[str, object]:
    cfg: dict[str, object] = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 260,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "eos_token_id": 257,
    }
    cfg.update(overrides)
    return cfg


# ---------------------------------------------------------------------------- loader errors


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture(tmp_path: Path, hf_dirs: dict[str, Path]) -> None:
    d = _copy(hf_dirs["llama"], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(str(d), "auto", CPU, 0)


def test_missing_tensor(tmp_path: Path, hf_dirs: dict[str, Path]) -> None:
    d = _copy(hf_dirs["llama"], tmp_path / "m")
    state = load_file(str(d / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(d), "auto", CPU, 0)


def test_unexpected_tensor(tmp_path: Path, hf_dirs: dict[str, Path]) -> None:
    d = _copy(hf_dirs["llama"], tmp_path / "m")
    save_file({"model.layers.0.extra.weight": torch.zeros(2)}, str(d / "extra.safetensors"))
    with pytest.raises(ModelLoadError, match=r"unexpected.*model\.layers\.0\.extra\.weight"):
        load_model(str(d), "auto", CPU, 0)


def test_shape_mismatch(tmp_path: Path, hf_dirs: dict[str, Path]) -> None:
    d = _copy(hf_dirs["llama"], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"shape mismatch for model\.layers\.0\.mlp\.\w+_proj"):
        load_model(str(d), "auto", CPU, 0)


def test_sharded_checkpoint_loads(tmp_path: Path, hf_dirs: dict[str, Path]) -> None:
    d = _copy(hf_dirs["llama"], tmp_path / "m")
    state = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    keys = sorted(state)
    save_file({k: state[k] for k in keys[::2]}, str(d / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in keys[1::2]}, str(d / "model-00002-of-00002.safetensors"))
    logits = Harness(_ours(d)).run(ForwardMode.EXTEND, [(0, PROMPT_B)])
    torch.testing.assert_close(
        logits[0], hf_logits(hf_dirs["llama"], PROMPT_B)[-1], atol=ATOL, rtol=0
    )


def test_nonexistent_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"does not exist.*tiny, bench-cpu"):
        load_model(str(tmp_path / "nope"), "auto", CPU, 0)


def test_dtype_resolution(hf_dirs: dict[str, Path]) -> None:
    assert load_model(str(hf_dirs["llama"]), "bfloat16", CPU, 0).dtype == torch.bfloat16
    loaded = load_model(str(hf_dirs["llama"]), "auto", CPU, 0)
    assert loaded.dtype == torch.float32 and loaded.name == "llama"
    assert loaded.path == str(hf_dirs["llama"])


# ---------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", ["tiny", "bench-cpu"])
def test_presets_build_and_run(name: str) -> None:
    loaded = load_model(name, "auto", CPU, 0)
    wide = PRESETS[name].hidden_size >= loader.BF16_MIN_HIDDEN
    want = torch.bfloat16 if wide and loader.cpu_has_bf16() else torch.float32
    assert loaded.path is None and loaded.arch == PRESETS[name] and loaded.dtype == want
    h = Harness(loaded.model)
    first = h.run(ForwardMode.EXTEND, [(0, PROMPT_A), (1, PROMPT_B)])
    step = h.run(ForwardMode.DECODE, [(0, [5]), (1, [6])])
    assert first.shape == step.shape == (2, 260)
    assert torch.isfinite(first).all() and torch.isfinite(step).all()
    assert float(first.std()) > 0.1  # not collapsed


def test_preset_weights_follow_seed() -> None:
    w = [load_model("tiny", "auto", CPU, s).model.lm_head.weight for s in (0, 0, 1)]
    assert torch.equal(w[0], w[1]) and not torch.equal(w[0], w[2])
