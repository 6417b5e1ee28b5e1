from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stallfree.runtime.model.loader import load_tokenizer
from stallfree.runtime.text.chat_template import ChatTemplateError
from stallfree.runtime.text.detokenizer import ByteDetokenizer, IncrementalDetokenizer
from stallfree.runtime.text.output_processor import find_stop
from stallfree.runtime.text.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    TokenizerLoadError,
)
from tests.hf_models import write_byte_tokenizer_json

TEXTS = ["hello, world", "naïve café", "日本語のテキスト", "emoji 🎉👩‍👩‍👧 mix ✓", ""]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)


def _write_hf_tokenizer(directory: Path, config: dict | None = None) -> Path:
    write_byte_tokenizer_json(directory)
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture
def hf_tok(tmp_path: Path) -> HFTokenizer:
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": TEMPLATE}
    return HFTokenizer(_write_hf_tokenizer(tmp_path, config), eos_token_ids=[42])


@pytest.fixture(params=["byte", "hf"])
def tok(request: pytest.FixtureRequest, tmp_path: Path) -> Tokenizer:
    if request.param == "byte":
        return ByteTokenizer()
    return HFTokenizer(_write_hf_tokenizer(tmp_path))


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_specials_and_bos(hf_tok: HFTokenizer) -> None:
    assert hf_tok.bos_token_id == 256
    assert hf_tok.eos_token_ids == [257, 42]
    assert hf_tok.vocab_size == 258
    assert hf_tok.encode("a") == [97]  # no post-processor: nothing added, as transformers does
    assert hf_tok.decode([256, 104, 105, 257]) == "hi"

    byte = ByteTokenizer()
    assert (byte.bos_token_id, byte.eos_token_ids, byte.vocab_size) == (256, [257], 260)
    assert byte.encode("a") == [97]
    assert byte.decode([256, 104, 105, 257, 258]) == "hi"
    assert byte.decode([0xE6, 0x97]) == "\ufffd"


def test_load_tokenizer(tmp_path: Path) -> None:
    assert isinstance(load_tokenizer("tiny"), ByteTokenizer)
    assert isinstance(load_tokenizer("bench-cpu"), ByteTokenizer)
    assert isinstance(load_tokenizer(str(_write_hf_tokenizer(tmp_path))), HFTokenizer)
    missing = tmp_path / "nowhere"
    with pytest.raises(TokenizerLoadError, match="nowhere"):
        load_tokenizer(str(missing))


def _stream(detok: Any, tok: Tokenizer, text: str) -> list[str]:
    return [detok.step([i]) for i in tok.encode(text)]


@pytest.mark.parametrize("kind", ["window", "native"])
@pytest.mark.parametrize("text", TEXTS)
def test_streaming_never_splits_characters(tok: Tokenizer, text: str, kind: str) -> None:
    prompt = tok.encode("prompt 日本")
    detok = IncrementalDetokenizer(tok, prompt) if kind == "window" else tok.detokenizer(prompt)
    deltas = _stream(detok, tok, text)
    assert all("\ufffd" not in d for d in deltas)
    assert detok.flush() == ""
    assert "".join(deltas) == detok.text == tok.decode(tok.encode(text))


@pytest.mark.parametrize("kind", ["window", "native"])
def test_streaming_skips_special_tokens_and_flushes_partial(kind: str) -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, []) if kind == "window" else tok.detokenizer([])
    if kind == "native":
        assert isinstance(detok, ByteDetokenizer)
    ids = [*"é".encode(), 257, *"🎉".encode()[:2]]
    deltas = [detok.step([i]) for i in ids]
    assert deltas == ["", "é", "", "", ""]
    assert detok.flush() == "\ufffd"
    assert detok.text == "é\ufffd"


def test_streaming_window_stays_small() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, list(range(97, 123)) * 10)
    for _ in range(500):
        detok.step([ord("x")])
    assert len(detok._ids) < 10
    assert detok.text == "x" * 500


def test_chat_template(hf_tok: HFTokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert hf_tok.apply_chat_template(messages) == "<s>[user]hi</s>[assistant]"

    byte = ByteTokenizer()
    assert byte.apply_chat_template(messages) == "<|user|>\nhi\n<|assistant|>\n"


def test_chat_template_missing_or_raising(tmp_path: Path) -> None:
    plain = HFTokenizer(_write_hf_tokenizer(tmp_path))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ByteTokenizer(chat_template=None).apply_chat_template([])

    strict = ByteTokenizer(chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        strict.apply_chat_template([])


def test_find_stop() -> None:
    assert find_stop("hello world", ["wor"], 0) == 6
    assert find_stop("hello world", ["xyz"], 0) is None
    # a stop split across the old/new boundary is still found
    assert find_stop("hello world", ["lo w"], 5) == 3
    # a stop entirely inside old text was already reported; it is not scanned again
    assert find_stop("abcabc", ["ab"], 5) is None
    assert find_stop("abcabc", ["ab"], 4) == 3
    # earliest among several stops
    assert find_stop("one two three", ["three", "two"], 4) == 4


def test_saved_padding_and_truncation_are_ignored(tmp_path: Path) -> None:
    """A tokenizer.json saved with padding and truncation on (as BERT checkpoints often are)
    encodes a prompt as it is: no pad ids appended, nothing cut."""
    directory = _write_hf_tokenizer(tmp_path)
    path = directory / "tokenizer.json"
    data = json.loads(path.read_text())
    data["padding"] = {
        "strategy": {"Fixed": 16},
        "direction": "Right",
        "pad_to_multiple_of": None,
        "pad_id": 0,
        "pad_type_id": 0,
        "pad_token": "\u0000",
    }
    data["truncation"] = {
        "direction": "Right",
        "max_length": 4,
        "strategy": "LongestFirst",
        "stride": 0,
    }
    path.write_text(json.dumps(data))
    tok = HFTokenizer(directory)
    assert tok.encode("abcdefgh") == list(b"abcdefgh")
    assert tok.encode("ab") == list(b"ab")
