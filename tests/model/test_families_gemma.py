"""Gemma 2 and Gemma 3 (text) against transformers: logits, the paged path, engine greedy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stallfree import Engine
from stallfree.config import HisparseConfig
from stallfree.hisparse import HisparseConfigError
from stallfree.hisparse.coordinator import resolve_sparse_layers
from stallfree.runtime.model import ModelArchConfig, load_model
from stallfree.runtime.model.forward_batch import ForwardMode
from stallfree.runtime.model.gemma import GemmaForCausalLM
from tests.engine_util import MODES, engine_config, guarded, random_prompts, run_greedy
from tests.hf_models import hf_greedy, hf_logits, make_gemma2, make_gemma3
from tests.model_harness import CPU, PROMPT_A, PROMPT_B, Harness

ATOL = 1e-4
NAMES = ["gemma2", "gemma3"]


@pytest.fixture(scope="module")
def gemma_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma")
    return {"gemma2": make_gemma2(root), "gemma3": make_gemma3(root)}


def _ours(model_dir: Path) -> GemmaForCausalLM:
    model = load_model(str(model_dir), "auto", CPU, 0).model
    assert isinstance(model, GemmaForCausalLM)
    return model


@pytest.mark.parametrize("name", NAMES)
def test_single_extend_matches_hf(gemma_dirs: dict[str, Path], name: str) -> None:
    logits = Harness(_ours(gemma_dirs[name])).run(ForwardMode.EXTEND, [(0, PROMPT_A)])
    want = hf_logits(gemma_dirs[name], PROMPT_A)[-1]
    torch.testing.assert_close(logits[0], want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_chunked_prefill_then_decode_matches_hf(gemma_dirs: dict[str, Path], name: str) -> None:
    """Chunks and decode steps past the window of 4, sliding and full layers alternating."""
    model_dir = gemma_dirs[name]
    h = Harness(_ours(model_dir))
    gen_a, gen_b = hf_greedy(model_dir, PROMPT_A, 4), hf_greedy(model_dir, PROMPT_B, 4)
    ref_a, ref_b = hf_logits(model_dir, PROMPT_A + gen_a), hf_logits(model_dir, PROMPT_B + gen_b)
    first = h.run(ForwardMode.EXTEND, [(2, PROMPT_A[:7]), (0, PROMPT_B)])
    torch.testing.assert_close(first[0], ref_a[6], atol=ATOL, rtol=0)
    torch.testing.assert_close(first[1], ref_b[8], atol=ATOL, rtol=0)
    second = h.run(ForwardMode.EXTEND, [(2, PROMPT_A[7:])])
    torch.testing.assert_close(second[0], ref_a[11], atol=ATOL, rtol=0)
    assert int(second[0].argmax()) == gen_a[0] and int(first[1].argmax()) == gen_b[0]
    for step in range(4):
        out = h.run(ForwardMode.DECODE, [(2, [gen_a[step]]), (0, [gen_b[step]])])
        torch.testing.assert_close(out[0], ref_a[12 + step], atol=ATOL, rtol=0)
        torch.testing.assert_close(out[1], ref_b[9 + step], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_parameter_names_match_hf(gemma_dirs: dict[str, Path], name: str) -> None:
    stored = set(load_file(str(gemma_dirs[name] / "model.safetensors"))) - {"lm_head.weight"}
    assert {n for n, _ in _ours(gemma_dirs[name]).named_parameters()} == stored


def test_soft_capping_and_windows_take_effect(gemma_dirs: dict[str, Path]) -> None:
    """Each Gemma 2 feature changes the logits of a prompt longer than the window."""
    base = Harness(_ours(gemma_dirs["gemma2"])).run(ForwardMode.EXTEND, [(0, PROMPT_A)])
    for change in ("softcap", "layer_windows", "final"):
        model = _ours(gemma_dirs["gemma2"])
        backend = model.attn_backend
        if change == "final":
            model.arch.final_logit_softcapping = None
        else:
            setattr(backend, change, None)
        other = Harness(model).run(ForwardMode.EXTEND, [(0, PROMPT_A)])
        assert not torch.allclose(base, other, atol=1e-3), change


def test_gemma2_config_parsing() -> None:
    cfg = {
        "architectures": ["Gemma2ForCausalLM"],
        "vocab_size": 260,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 8,
    }
    arch = ModelArchConfig.from_hf(cfg)
    # transformers' defaults: soft-capping on, every other layer sliding, scalar 256, tied
    assert (arch.attn_logit_softcapping, arch.final_logit_softcapping) == (50.0, 30.0)
    assert arch.layer_windows() == [8, None, 8]
    assert arch.query_pre_attn_scalar == 256.0 and arch.tie_word_embeddings
    with pytest.raises(ValueError, match="'gelu'"):
        ModelArchConfig.from_hf({**cfg, "hidden_activation": "gelu"})


def test_gemma3_v4_config_rope() -> None:
    """A v4 config: `rope_theta`/`rope_scaling` global, `rope_local_base_freq` local,
    `sliding_window_pattern` for the layer kinds."""
    cfg = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": 260,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "head_dim": 16,
        "sliding_window": 8,
        "sliding_window_pattern": 3,
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    arch = ModelArchConfig.from_hf(cfg)
    assert arch.layer_windows() == [8, 8, None, 8, 8, None]
    assert arch.rope_theta == 1e6 and arch.rope_local_theta == 1e4
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert arch.attn_logit_softcapping is None and arch.final_logit_softcapping is None


# ---------------------------------------------------------------------------- through the engine

NEW_TOKENS = 16
PROMPTS = random_prompts(6, seed=3, lo=3, hi=40)
# page_size 4, prefill chunks of 7 tokens and a pool small enough to force retraction
STRESSED = {
    "cache": {"page_size": 4, "max_total_tokens": 160, "max_running_requests": 6},
    "scheduler": {"chunked_prefill_size": 7, "max_prefill_tokens": 16},
}


@pytest.fixture(scope="module")
def gemma_reference(gemma_dirs: dict[str, Path]) -> dict[str, list[list[int]]]:
    return {name: [hf_greedy(d, p, NEW_TOKENS) for p in PROMPTS] for name, d in gemma_dirs.items()}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("overlap", "mirrors"), MODES)
async def test_engine_greedy_equals_transformers(
    gemma_dirs: dict[str, Path],
    gemma_reference: dict[str, list[list[int]]],
    name: str,
    overlap: bool,
    mirrors: bool,
) -> None:
    cfg = engine_config(
        str(gemma_dirs[name]),
        runtime={"overlap": overlap, "cpu_mirrors": mirrors, "strict": mirrors},
        **STRESSED,
    )
    async with guarded(Engine(cfg)) as engine:
        outputs = await run_greedy(engine, PROMPTS, NEW_TOKENS)
        await engine.wait_idle()
        assert engine.pool_usage().all_free
        stats = engine.snapshot().counters
    assert stats.retractions > 0
    for i, (got, want) in enumerate(zip(outputs, gemma_reference[name], strict=True)):
        assert got == want, f"prompt {i} (len {len(PROMPTS[i])}) diverged"


def test_hisparse_is_refused_with_the_reason(gemma_dirs: dict[str, Path]) -> None:
    cfg = engine_config(str(gemma_dirs["gemma2"]), hisparse={"enabled": True})
    with pytest.raises(HisparseConfigError, match=r"sliding-window.*Gemma2ForCausalLM"):
        Engine(cfg)
    arch = ModelArchConfig.from_hf(
        {**json.loads((gemma_dirs["gemma2"] / "config.json").read_text()), "layer_types": None}
    )
    arch.sliding_window = None
    with pytest.raises(HisparseConfigError, match="soft-capped"):
        resolve_sparse_layers(HisparseConfig(enabled=True), arch)
