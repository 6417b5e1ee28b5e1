"""Text prompts tokenise exactly as transformers' AutoTokenizer does (BOS included), chat
templates add one BOS, and streaming detokenisation equals a full decode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from stallfree import Engine
from stallfree.runtime.text.detokenizer import StreamDetokenizer
from stallfree.runtime.text.tokenizer import HFTokenizer
from tests.engine_util import engine_config
from tests.hf_models import hf_greedy, make_llama, write_byte_tokenizer_json

LLAMA3_STYLE_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = 1 %}{% else %}"
    "{% set first = 0 %}{% endif %}<|system|>Today is {{ strftime_now('%d %b %Y') }}.\n"
    "{% for m in messages[first:] %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _add_bos_post_processor(directory: Path) -> None:
    """Make the byte-level tokenizer.json Llama-style: its post-processor prepends <s>."""
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": LLAMA3_STYLE_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def llama_bos(tmp_path_factory) -> Path:
    path = make_llama(tmp_path_factory.mktemp("llama-bos"))
    _add_bos_post_processor(path)
    return path


def test_text_and_chat_prompts_tokenise_as_transformers(llama_bos: Path) -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(llama_bos)
    ours = HFTokenizer(llama_bos)
    for text in ["Hello, world", " leading space", "日本語 and 🎉"]:
        assert ours.encode(text) == ref(text).input_ids
        assert ours.encode(text)[0] == ours.bos_token_id  # the BOS a Llama tokenizer adds
    messages = [{"role": "user", "content": "hi there"}]
    want = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    got = ours.encode_chat(messages)
    assert got == list(want)
    assert got.count(ours.bos_token_id) == 1  # the template's BOS, not a second one


async def test_engine_text_prompt_gets_bos_and_matches_transformers(llama_bos: Path) -> None:
    from transformers import AutoTokenizer

    text = "a prompt"
    ids = AutoTokenizer.from_pretrained(llama_bos)(text).input_ids
    async with Engine(engine_config(str(llama_bos))) as engine:
        out = await engine.complete(text, {"max_new_tokens": 8, "ignore_eos": True})
    assert out.prompt_tokens == len(ids)
    assert out.token_ids == hf_greedy(llama_bos, ids, 8)


def _metaspace_tokenizer(directory: Path) -> Path:
    """A SentencePiece-style tokenizer: words with a leading '▁', byte fallback."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for word in ["▁hello", "▁world", "▁a", "▁b", "hello", "world", "▁", "!"]:
        vocab[word] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(["<s>", "</s>"])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    return directory


@pytest.mark.parametrize("tokenizer_kind", ["byte-level", "metaspace"])
def test_stream_detokenizer_equals_a_full_decode(tmp_path: Path, tokenizer_kind: str) -> None:
    if tokenizer_kind == "byte-level":
        directory = write_byte_tokenizer_json(tmp_path)
    else:
        directory = _metaspace_tokenizer(tmp_path / "sp")
    tok = HFTokenizer(directory)
    prompt = tok.encode("hello world", add_special_tokens=False)
    for text in ["hello world!", " a b hello", "héllo 🎉 world"]:
        ids = tok.encode(text, add_special_tokens=False)
        detok = tok.detokenizer(prompt)
        assert isinstance(detok, StreamDetokenizer)
        deltas = [detok.step([i]) for i in ids]
        tail = detok.flush()
        assert all("\ufffd" not in d for d in deltas)
        full = tok.decode(prompt + ids)
        assert full.endswith("".join(deltas) + tail), (text, deltas)
        assert "".join(deltas) + tail == tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
