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
from tests.engine_util import (
    MODES,
    engine_config,
    greedy_in_mode,
    guarded,
    random_prompts,
    run_greedy,
)
from tests.hf_models import (
    BOS_ID,
    EOS_ID,
    _load_hf,
    hf_greedy,
    hf_logits,
    make_gemma2,
    make_gemma3,
)
from tests.model_harness import CPU, PROMPT_A, Harness, check_chunked_prefill_then_decode

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
    check_chunked_prefill_then_decode(_ours(model_dir), model_dir, steps=4)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.usefixtures("float32_apart")
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
    run = await greedy_in_mode(
        str(gemma_dirs[name]), PROMPTS, NEW_TOKENS, overlap, mirrors, **STRESSED
    )
    outputs = run.outputs
    assert run.counters.retractions > 0
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
    arch.attn_logit_softcapping = arch.query_pre_attn_scalar = None
    with pytest.raises(HisparseConfigError, match=r"not support Gemma2ForCausalLM$"):
        resolve_sparse_layers(HisparseConfig(enabled=True), arch)  # its Family says hisparse=False


# ---------------------------------------------------------------------------- GGUF


def write_gemma_gguf(model_dir: Path, out: Path, family: str) -> Path:
    """A GGUF of the Gemma in `model_dir` as llama.cpp's converter writes one: its metadata
    keys, the gguf package's tensor names, every norm stored as `1 + w`, no output matrix (tied),
    no query scale key (llama.cpp derives it: head_dim at these sizes)."""
    gguf = pytest.importorskip("gguf", reason="pip install 'stallfree[gguf]'")
    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), cfg["vocab_size"])]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[family.upper()], cfg["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(out), family)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_sliding_window(cfg["sliding_window"])
    if family == "gemma2":
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    else:
        rope = cfg["rope_parameters"]
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
        writer.add_sliding_window_pattern(cfg["sliding_window_pattern"])
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(False)
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        if name == "lm_head.weight":
            continue
        w = tensor.float()
        if name.endswith("norm.weight"):
            w = w + 1  # llama.cpp's Gemma converters
        writer.add_tensor(names.get_name(name, (".weight",)), w.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


_GEMMA_FIELDS = (
    "architecture",
    "hidden_act",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "layer_types",
    "sliding_window",
    "rope_theta",
    "rope_scaling",
    "rope_local_theta",
    "qk_norm",
    "tie_word_embeddings",
    "head_dim",
    "num_kv_heads",
)


@pytest.fixture(scope="module")
def gemma_ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """query_pre_attn_scalar = head_dim, which a llama.cpp file implies at these sizes."""
    root = tmp_path_factory.mktemp("gemma-gguf")
    made = {
        "gemma2": make_gemma2(root / "g2", query_pre_attn_scalar=16),
        "gemma3": make_gemma3(root / "g3", query_pre_attn_scalar=16),
    }
    return {n: (d, write_gemma_gguf(d, root / f"{n}.gguf", n)) for n, d in made.items()}


@pytest.mark.parametrize("name", NAMES)
def test_gguf_loads_the_checkpoint(gemma_ggufs: dict[str, tuple[Path, Path]], name: str) -> None:
    model_dir, path = gemma_ggufs[name]
    loaded, from_dir = (
        load_model(str(path), "float32", CPU, 0),
        load_model(str(model_dir), "float32", CPU, 0),
    )
    for field in _GEMMA_FIELDS:
        assert getattr(loaded.arch, field) == getattr(from_dir.arch, field), field
    want = from_dir.model.state_dict()
    for key, param in loaded.model.state_dict().items():
        torch.testing.assert_close(param, want[key], atol=1e-6, rtol=0)  # the +1 undone
    logits = Harness(loaded.model).run(ForwardMode.EXTEND, [(0, PROMPT_A)])
    torch.testing.assert_close(logits[0], hf_logits(model_dir, PROMPT_A)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", NAMES)
async def test_gguf_engine_greedy_matches_hf(
    gemma_ggufs: dict[str, tuple[Path, Path]], name: str
) -> None:
    model_dir, path = gemma_ggufs[name]
    cfg = engine_config(str(path), scheduler={"chunked_prefill_size": 5, "max_prefill_tokens": 8})
    async with guarded(Engine(cfg)) as engine:
        got = await run_greedy(engine, PROMPTS, NEW_TOKENS)
    assert got == [hf_greedy(model_dir, p, NEW_TOKENS) for p in PROMPTS]


# ---------------------------------------------------------------------------- other paths

REPEAT = [7, 19, 33, 41, 52, 60, 71, 85, 90, 101, 113, 127] * 3


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_logits_match_transformers_in_bfloat16(
    gemma_dirs: dict[str, Path], name: str
) -> None:
    """Fused projections, the embedding scale rounded to bfloat16, norms cast after scaling."""
    model_dir = gemma_dirs[name]
    ours = Harness(load_model(str(model_dir), "bfloat16", CPU, 0).model)
    got = ours.run(ForwardMode.EXTEND, [(0, PROMPT_A)])[0]
    with torch.no_grad():
        hf = _load_hf(str(model_dir), torch.bfloat16)
        want = hf(torch.tensor([PROMPT_A])).logits[0, -1].float()
    assert int(got.argmax()) == int(want.argmax())
    assert (got - want).abs().max().item() <= 0.05 * want.std().item()


@pytest.mark.parametrize("name", NAMES)
def test_int8_weights_stay_close(gemma_dirs: dict[str, Path], name: str) -> None:
    model_dir = gemma_dirs[name]
    quant = load_model(str(model_dir), "float32", CPU, 0, quantization="int8").model
    assert quant.tied_head is not None  # the tied int8 matrix serves the (scaled) embedding
    got = Harness(quant).run(ForwardMode.EXTEND, [(0, PROMPT_A)])[0]
    want = Harness(_ours(model_dir)).run(ForwardMode.EXTEND, [(0, PROMPT_A)])[0]
    assert int(got.argmax()) == int(want.argmax())
    assert (got - want).abs().max().item() <= 0.2 * want.std().item()


@pytest.mark.parametrize("name", NAMES)
async def test_ngram_speculation_equals_transformers(
    gemma_dirs: dict[str, Path], name: str
) -> None:
    """Verify steps (several queries per row) through the windows, the scale and the caps."""
    model_dir = gemma_dirs[name]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    cfg = engine_config(str(model_dir), speculative={"cost_aware": False, **spec})
    async with guarded(Engine(cfg)) as engine:
        got = await run_greedy(engine, [REPEAT, PROMPT_A], NEW_TOKENS)
        accepted = engine.snapshot().counters.spec_num_accepted_tokens
    assert accepted > 0
    assert got == [hf_greedy(model_dir, p, NEW_TOKENS) for p in (REPEAT, PROMPT_A)]


@pytest.mark.slow  # inductor compiles C++ on first use
async def test_torch_compile_serves_gemma(gemma_dirs: dict[str, Path]) -> None:
    """Gemma's own graph after attention (its two extra norms) under runtime.torch_compile."""
    torch._dynamo.reset()
    model_dir = gemma_dirs["gemma2"]
    cfg = engine_config(str(model_dir), runtime={"torch_compile": True})
    async with Engine(cfg) as engine:
        got = await run_greedy(engine, PROMPTS, NEW_TOKENS)
    want = [hf_greedy(model_dir, p, NEW_TOKENS) for p in PROMPTS]
    # inductor may sum in another order than eager: all but one prompt agree token for token
    assert sum(a == b for a, b in zip(got, want, strict=True)) >= len(PROMPTS) - 1


@pytest.mark.parametrize("name", NAMES)
async def test_prefix_cache_hits_equal_transformers(gemma_dirs: dict[str, Path], name: str) -> None:
    """Later prompts extend a cached prefix longer than the window: the sliding layers read
    the cached keys that are still inside it."""
    model_dir = gemma_dirs[name]
    base = random_prompts(1, seed=9, lo=20, hi=20)[0]
    prompts = [base, [*base, 65, 66, 67], [*base[:14], 70, 71, 72, 73, 74]]
    cfg = engine_config(str(model_dir), cache={"page_size": 2})
    async with guarded(Engine(cfg)) as engine:
        got = [(await run_greedy(engine, [p], NEW_TOKENS))[0] for p in prompts]
        hits = engine.snapshot().counters.prefix_cache_hits
    assert hits >= 20
    assert got == [hf_greedy(model_dir, p, NEW_TOKENS) for p in prompts]
