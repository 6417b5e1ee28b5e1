"""Tiny random Hugging Face models (with a byte-level tokenizer) for tests."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

BOS_ID = 256
EOS_ID = 257
VOCAB_SIZE = 260

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "initializer_range": 0.15,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "tie_word_embeddings": False,
}

# A tiny model whose bfloat16 prompts the AMX tiles take whole (runtime/model/
# native_prompt_loop.py): head dim 32 for the tiles' prompt attention, every width a whole
# number of tile blocks
TILES_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_llama(tmp_path: Path, **overrides: Any) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    return _save(tmp_path / "llama", LlamaConfig, LlamaForCausalLM, overrides)


def make_qwen2(tmp_path: Path, **overrides: Any) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _save(tmp_path / "qwen2", Qwen2Config, Qwen2ForCausalLM, overrides)


def make_mistral(tmp_path: Path, **overrides: Any) -> Path:
    from transformers import MistralConfig, MistralForCausalLM

    return _save(tmp_path / "mistral", MistralConfig, MistralForCausalLM, overrides)


def make_qwen3(tmp_path: Path, **overrides: Any) -> Path:
    """Qwen3: per-head q/k norms; head_dim 32 with hidden 64 (wider heads than hidden/heads)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    overrides = {"head_dim": 32, **overrides}
    return _save(tmp_path / "qwen3", Qwen3Config, Qwen3ForCausalLM, overrides)


def make_phi3(tmp_path: Path, **overrides: Any) -> Path:
    """Phi-3: fused qkv_proj and gate_up_proj in the checkpoint."""
    from transformers import Phi3Config, Phi3ForCausalLM

    overrides = {"pad_token_id": EOS_ID, **overrides}
    return _save(tmp_path / "phi3", Phi3Config, Phi3ForCausalLM, overrides)


# mixture of experts: 4 experts, top 2, narrow experts
_MOE: dict[str, Any] = {"num_experts_per_tok": 2, "num_hidden_layers": 3}


def make_mixtral(tmp_path: Path, **overrides: Any) -> Path:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = {**_MOE, "num_local_experts": 4, "intermediate_size": 48, **overrides}
    return _save(tmp_path / "mixtral", MixtralConfig, MixtralForCausalLM, cfg)


def make_qwen2_moe(tmp_path: Path, **overrides: Any) -> Path:
    """Layer 1 dense (`mlp_only_layers`), the others routed, each with a shared expert."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = {
        **_MOE,
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 96,
        "mlp_only_layers": [1],
        **overrides,
    }
    return _save(tmp_path / "qwen2_moe", Qwen2MoeConfig, Qwen2MoeForCausalLM, cfg)


def make_qwen3_moe(tmp_path: Path, **overrides: Any) -> Path:
    """Per-head q/k norms; experts renormalised over the top k, as Qwen3-MoE checkpoints set."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = {
        **_MOE,
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "head_dim": 16,
        **overrides,
    }
    return _save(tmp_path / "qwen3_moe", Qwen3MoeConfig, Qwen3MoeForCausalLM, cfg)


# Gemma: 4 layers so sliding and full layers alternate, a window of 4 that prompts outgrow,
# a query scale unlike head_dim's, tied embeddings (Gemma's default)
_GEMMA: dict[str, Any] = {
    "num_hidden_layers": 4,
    "head_dim": 16,
    "sliding_window": 4,
    "query_pre_attn_scalar": 24,
    "tie_word_embeddings": True,
    "pad_token_id": EOS_ID,
}


def make_gemma2(tmp_path: Path, **overrides: Any) -> Path:
    """Gemma 2 with soft-capping small enough to bite (scores and logits of this size)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = {**_GEMMA, "attn_logit_softcapping": 1.0, "final_logit_softcapping": 2.0, **overrides}
    return _save(tmp_path / "gemma2", Gemma2Config, Gemma2ForCausalLM, cfg)


def make_gemma3(tmp_path: Path, **overrides: Any) -> Path:
    """Gemma 3 text: q/k norms, every other layer sliding with its own RoPE base (the full
    layers' linearly scaled)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = {
        **_GEMMA,
        "sliding_window_pattern": 2,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        "rope_theta": 100_000.0,
        **overrides,
    }
    return _save(tmp_path / "gemma3", Gemma3TextConfig, Gemma3ForCausalLM, cfg)


def _save(out: Path, config_cls: Any, model_cls: Any, overrides: dict[str, Any]) -> Path:
    seed = overrides.pop("seed", 0)
    config = config_cls(**{**_COMMON, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    _perturb(model, config.initializer_range)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out)
    return out


def _perturb(model: Any, std: float) -> None:
    """HF starts biases at 0 and norms at 1; randomise them so tests notice if one is ignored."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, std)
            elif name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (what ByteLevel emits)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def write_byte_tokenizer_json(out: Path) -> Path:
    """tokenizer.json where byte b is token b, plus <s>=256 and </s>=257."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(out / "tokenizer.json"))
    return out


def write_tokenizer(out: Path) -> None:
    """The byte-level tokenizer.json and a tokenizer_config.json with a chat template."""
    write_byte_tokenizer_json(out)
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": True,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": _COMMON["max_position_embeddings"],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


@functools.cache
def _load_hf(model_dir: str, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def hf_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """HF float32 logits [len(ids), vocab] of one full-sequence forward."""
    model = _load_hf(str(model_dir))
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Exactly `max_new_tokens` greedy tokens from `generate` (EOS cannot stop it early)."""
    return list(_hf_greedy(str(model_dir), tuple(prompt_ids), max_new_tokens)[0])


def hf_greedy_top(
    model_dir: Path | str, prompt_ids: list[int], max_new_tokens: int, dtype: torch.dtype, k: int
) -> tuple[list[int], list[list[int]]]:
    """`hf_greedy` in `dtype`, and the top-k token ids at each step."""
    ids, tops = _hf_greedy(str(model_dir), tuple(prompt_ids), max_new_tokens, dtype, k)
    return list(ids), [list(t) for t in tops]


@functools.cache
def _hf_greedy(
    model_dir: str,
    prompt_ids: tuple[int, ...],
    max_new_tokens: int,
    dtype: torch.dtype = torch.float32,
    k: int = 0,
) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    from transformers import GenerationConfig

    model = _load_hf(model_dir, dtype)
    model.generation_config.eos_token_id = None  # the saved default would still stop on EOS
    gen = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=EOS_ID,
        output_scores=k > 0,
        return_dict_in_generate=True,
    )
    inputs = torch.tensor([list(prompt_ids)])
    with torch.no_grad():
        out = model.generate(inputs, attention_mask=torch.ones_like(inputs), generation_config=gen)
    new = tuple(int(t) for t in out.sequences[0, len(prompt_ids) :])
    # NOTE: no min_new_tokens: it masks the EOS logit, which the engine (ignore_eos) does not.
    assert len(new) == max_new_tokens, "generate stopped early; eos_token_id=None should prevent it"
    tops = (
        tuple(tuple(s[0].float().topk(k).indices.tolist()) for s in out.scores or ()) if k else ()
    )
    return new, tops
