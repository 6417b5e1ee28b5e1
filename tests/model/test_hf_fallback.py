"""The transformers fallback (`model.model_impl`, `--model-impl`): architectures with no native
family run through transformers' own modelling code with stallfree's paged KV cache and
attention; greedy outputs equal transformers' `generate` through the Engine in every overlap x
mirrors mode, with the prefix cache hitting (GPT-2, GPT-NeoX, Granite); a Llama run through it equals the native run; what
it cannot run is refused, and an unsupported architecture's error names the supported ones."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from stallfree import Engine
from stallfree.runtime.model.arch import FAMILIES, ModelLoadError
from stallfree.runtime.model.hf_fallback import TransformersForCausalLM, resolve_impl
from stallfree.runtime.model.loader import load_model, model_impl_for
from tests.engine_util import MODES, engine_config, guarded, random_prompts, run_greedy
from tests.hf_models import BOS_ID, EOS_ID, VOCAB_SIZE, _perturb, hf_greedy, write_tokenizer

NEW_TOKENS = 16
SHARED = random_prompts(1, seed=7, lo=40, hi=40)[0]
# concurrent prompts of varied length with SHARED among them, then one that extends SHARED
PROMPTS = random_prompts(5, seed=3, lo=3, hi=50)
FOLLOW_UP = [*SHARED, 5, 6, 7]


def _tiny(kind: str) -> tuple[object, object]:
    import transformers as hf

    common = {"vocab_size": VOCAB_SIZE, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID}
    if kind == "gpt2":  # learned positions, no RoPE, fused c_attn, LayerNorm, GELU
        config = hf.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, n_positions=512, initializer_range=0.15, **common
        )
        return config, hf.GPT2LMHeadModel
    if kind == "granite":  # attention scaled by attention_multiplier, not head_dim ** -0.5; GQA
        config = hf.GraniteConfig(
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            attention_multiplier=0.3,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            logits_scaling=2.0,
            initializer_range=0.15,
            **common,
        )
        return config, hf.GraniteForCausalLM
    # partial rotary (half of each head), parallel residual, untied output
    config = hf.GPTNeoXConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=512,
        rotary_pct=0.5,
        initializer_range=0.15,
        tie_word_embeddings=False,
        **common,
    )
    return config, hf.GPTNeoXForCausalLM


def make_fallback_model(out: Path, kind: str) -> Path:
    config, cls = _tiny(kind)
    torch.manual_seed(0)
    model = cls(config).to(torch.float32).eval()  # type: ignore[operator]
    _perturb(model, 0.15)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out)
    return out


@pytest.fixture(scope="module", params=["gpt2", "gpt_neox", "granite"])
def fallback_model(request, tmp_path_factory):
    path = make_fallback_model(tmp_path_factory.mktemp(request.param), request.param)
    reference = [hf_greedy(path, p, NEW_TOKENS) for p in [*PROMPTS, SHARED, FOLLOW_UP]]
    return str(path), reference


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> str:
    return str(make_fallback_model(tmp_path_factory.mktemp("gpt2"), "gpt2"))


@pytest.mark.parametrize(("overlap", "mirrors"), MODES)
async def test_greedy_equals_transformers_with_the_prefix_cache(fallback_model, overlap, mirrors):
    path, reference = fallback_model
    cfg = engine_config(
        path,
        runtime={"overlap": overlap, "cpu_mirrors": mirrors, "strict": mirrors},
        cache={"page_size": 4, "prefix_caching": True},
        scheduler={"chunked_prefill_size": 16},
    )
    async with guarded(Engine(cfg)) as engine:
        assert isinstance(engine.core.runner.executor.model, TransformersForCausalLM)
        outputs = await run_greedy(engine, [*PROMPTS, SHARED], NEW_TOKENS)
        hits_before = engine.snapshot().counters.prefix_cache_hits
        outputs += await run_greedy(engine, [FOLLOW_UP], NEW_TOKENS)
        counters = engine.snapshot().counters
        await engine.wait_idle()
        assert engine.pool_usage().all_free
        monitor = engine.core.monitor
    for i, (got, want) in enumerate(zip(outputs, reference, strict=True)):
        assert got == want, f"prompt {i} diverged"
    # the follow-up found the shared prompt's pages (all but its last partial page)
    assert counters.prefix_cache_hits - hits_before >= len(SHARED) - 4
    if mirrors:
        assert monitor.schedule_path_reads == 0


async def test_llama_through_transformers_equals_native(llama):
    prompts = random_prompts(4, seed=5)
    reference = [hf_greedy(Path(llama), p, NEW_TOKENS) for p in prompts]
    results = {}
    for impl in ("native", "transformers"):
        cfg = engine_config(llama, model={"model_impl": impl}, runtime={"strict": True})
        async with Engine(cfg) as engine:
            model = engine.core.runner.executor.model
            assert isinstance(model, TransformersForCausalLM) == (impl == "transformers")
            results[impl] = await run_greedy(engine, prompts, NEW_TOKENS)
    assert results["transformers"] == results["native"] == reference


async def test_ngram_speculation_through_the_fallback_equals_transformers(gpt2):
    """Verify steps (each request's drafts at device-decided positions) through transformers."""
    prompt = [*SHARED[:12], *SHARED[:12], *SHARED[:12]]  # repeats: the n-gram proposer drafts
    reference = hf_greedy(Path(gpt2), prompt, NEW_TOKENS)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    async with Engine(engine_config(gpt2, speculative=spec, runtime={"strict": True})) as engine:
        (out,) = await run_greedy(engine, [prompt], NEW_TOKENS)
        proposed = engine.snapshot().counters.spec_num_draft_tokens
    assert out == reference
    assert proposed > 0


def test_auto_picks_native_for_a_family_and_transformers_for_the_rest(llama, gpt2):
    assert model_impl_for(llama) == "native"
    assert model_impl_for(gpt2) == "transformers"
    assert model_impl_for("tiny") == "native"
    loaded = load_model(gpt2, "float32", torch.device("cpu"), 0)
    assert isinstance(loaded.model, TransformersForCausalLM)
    arch = loaded.arch
    assert (arch.num_layers, arch.num_kv_heads, arch.head_dim) == (2, 4, 16)
    assert (arch.vocab_size, arch.max_position_embeddings) == (VOCAB_SIZE, 512)
    assert arch.architecture == "GPT2LMHeadModel" and arch.eos_token_ids == [EOS_ID]


def test_native_on_a_fallback_only_model_names_the_supported_architectures(gpt2):
    with pytest.raises(ModelLoadError) as err:
        load_model(gpt2, "float32", torch.device("cpu"), 0, model_impl="native")
    message = str(err.value)
    assert "GPT2LMHeadModel" in message
    assert all(name in message for name in FAMILIES)
    assert "--model-impl transformers" in message


def test_an_architecture_transformers_cannot_build_suggests_the_flag(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["NoSuchForCausalLM"], "model_type": "no_such"})
    )
    assert model_impl_for(str(tmp_path)) == "native"  # auto: nothing else can build it
    with pytest.raises(ModelLoadError, match="--model-impl transformers") as err:
        load_model(str(tmp_path), "float32", torch.device("cpu"), 0)
    assert "NoSuchForCausalLM" in str(err.value) and "LlamaForCausalLM" in str(err.value)
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_model(str(tmp_path), "float32", torch.device("cpu"), 0, model_impl="transformers")


def _config_only(tmp_path: Path, config: object) -> str:
    config.save_pretrained(tmp_path)  # type: ignore[attr-defined]
    return str(tmp_path)


def test_refusals(tmp_path, gpt2):
    from transformers import BloomConfig, T5Config

    cpu = torch.device("cpu")
    t5 = _config_only(tmp_path / "t5", T5Config(num_layers=1, d_model=16))
    with pytest.raises(ModelLoadError, match=r"encoder-decoder.*LlamaForCausalLM"):
        load_model(t5, "float32", cpu, 0, model_impl="transformers")
    assert resolve_impl(json.loads(Path(t5, "config.json").read_text()), "auto") == "native"
    bloom = _config_only(tmp_path / "bloom", BloomConfig(n_layer=1, hidden_size=16, n_head=2))
    with pytest.raises(ModelLoadError, match=r"attention interface.*LlamaForCausalLM"):
        load_model(bloom, "float32", cpu, 0)
    with pytest.raises(ModelLoadError, match="quantization=int8"):
        load_model(gpt2, "float32", cpu, 0, quantization="int8")
    with pytest.raises(ModelLoadError, match="natively only"):
        load_model("tiny", "float32", cpu, 0, model_impl="transformers")
    with pytest.raises(ValueError, match="one rank without HiSparse"):
        engine_config(gpt2, model={"model_impl": "transformers"}, parallel={"tp_size": 2})
    with pytest.raises(ValueError, match="one rank without HiSparse"):
        engine_config(gpt2, model={"model_impl": "transformers"}, hisparse={"enabled": True})
    with pytest.raises(ModelLoadError, match="one rank without HiSparse"):
        Engine(engine_config(gpt2, hisparse={"enabled": True}, cache={"prefix_caching": False}))
    loaded = load_model(gpt2, "float32", cpu, 0)
    with pytest.raises(ValueError, match="torch_compile"):
        loaded.model.compile_layers()
    assert loaded.model.fuse_projections() == 0


def test_without_transformers_the_error_says_how_to_install(gpt2, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "transformers.models.auto.modeling_auto", None)
    assert model_impl_for(gpt2) == "native"  # auto cannot fall back: the native error follows
    with pytest.raises(ModelLoadError, match="pip install transformers"):
        load_model(gpt2, "float32", torch.device("cpu"), 0, model_impl="transformers")


def test_the_model_impl_flag_sets_the_config():
    from stallfree.entrypoints.cli import build_parser, config_from_args

    args = build_parser().parse_args(["generate", "hi", "--model-impl", "transformers"])
    assert config_from_args(args).model.model_impl == "transformers"
    assert config_from_args(build_parser().parse_args(["generate", "hi"])).model.model_impl == (
        "auto"
    )
