"""Tokenizers: the byte-level presets' and a Hugging Face `tokenizer.json`'s (with the
`tokenizer_config.json` beside it), behind the one interface the runtime uses."""

from __future__ import annotations

import functools
import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from stallfree.runtime.text.chat_template import ChatTemplateError as ChatTemplateError
from stallfree.runtime.text.chat_template import render_chat_template
from stallfree.runtime.text.detokenizer import (
    ByteDetokenizer,
    Detokenizer,
    IncrementalDetokenizer,
    StreamDetokenizer,
)

_BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class TokenizerLoadError(ValueError):
    """The tokenizer files are missing or unreadable."""


class Tokenizer(ABC):
    """What the runtime needs from a tokenizer."""

    bos_token_id: int | None = None
    eos_token_ids: list[int]
    vocab_size: int
    chat_template: str | None = None
    bos_token: str = ""
    eos_token: str = ""

    @abstractmethod
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, exactly as `AutoTokenizer.from_pretrained(dir)(text)` gives them:
        with `add_special_tokens` the tokenizer's own post-processor adds what it adds (BOS for
        Llama-style tokenizers)."""

    @abstractmethod
    def decode(
        self,
        ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        """Decodes, dropping special tokens unless told to keep them; incomplete UTF-8 becomes
        U+FFFD."""

    @property
    @abstractmethod
    def special_ids(self) -> frozenset[int]: ...

    def detokenizer(
        self,
        prompt_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> Detokenizer:
        """A per-request streaming decoder (its deltas add up to `decode` of the outputs with
        the same options)."""
        return IncrementalDetokenizer(
            self, prompt_ids, skip_special_tokens, spaces_between_special_tokens
        )

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Render the chat template and tokenize it. The template writes its own special
        tokens (BOS included), so none are added: one BOS, as transformers gives."""
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The chat template rendered for `messages`, opening the assistant's turn at its end
        unless `add_generation_prompt` is false; `extra` are the template's other variables
        (`tools`, `documents`, a request's `chat_template_kwargs`)."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        return render_chat_template(
            self.chat_template,
            messages,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            extra=extra,
            add_generation_prompt=add_generation_prompt,
        )


class ByteTokenizer(Tokenizer):
    """Ids 0..255 are bytes; 256 is `<s>`, 257 is `</s>`; 258 and 259 are unused padding."""

    BOS = 256
    EOS = 257

    def __init__(self, chat_template: str | None = _BYTE_CHAT_TEMPLATE) -> None:
        self.bos_token_id = self.BOS
        self.eos_token_ids = [self.EOS]
        self.vocab_size = 260
        self.chat_template = chat_template
        self.bos_token = "<s>"
        self.eos_token = "</s>"

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        # like a tokenizer.json with no post-processor: no special tokens are added
        return list(text.encode("utf-8"))

    def decode(
        self,
        ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        if skip_special_tokens:
            return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
        detok = ByteDetokenizer(self, skip_special_tokens=False)
        return detok.step(ids) + detok.flush()

    def special_text(self, token_id: int) -> str:
        """What a special token reads as when kept: `<s>` and `</s>`; the unused padding ids
        read as nothing."""
        return {self.BOS: self.bos_token, self.EOS: self.eos_token}.get(token_id, "")

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(range(256, self.vocab_size))

    def detokenizer(
        self,
        prompt_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> Detokenizer:
        # byte tokens decode to no spaces of their own: the option changes nothing here
        return ByteDetokenizer(self, skip_special_tokens)


def _token_content(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


class HFTokenizer(Tokenizer):
    """A `tokenizers` tokenizer.json plus the optional tokenizer_config.json beside it."""

    def __init__(self, directory: str | Path, eos_token_ids: list[int] | None = None) -> None:
        from tokenizers import Tokenizer as _RawTokenizer

        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise TokenizerLoadError(f"tokenizer.json not found at {path}")
        try:
            self._tok = _RawTokenizer.from_file(str(path))
        except Exception as e:
            raise TokenizerLoadError(f"cannot load {path}: {e}") from e
        # a tokenizer.json saved with padding or truncation on (BERT checkpoints often are)
        # would pad every prompt to a fixed length or cut it silently; the engine sizes and
        # refuses prompts itself
        self._tok.no_padding()
        self._tok.no_truncation()
        config = _read_json(directory / "tokenizer_config.json")
        self.bos_token = _token_content(config.get("bos_token")) or ""
        self.eos_token = _token_content(config.get("eos_token")) or ""
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_ids = _merge_eos(self._tok, self.eos_token, eos_token_ids)
        self.chat_template = _chat_template(config, directory)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._special = frozenset(
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        )

    @property
    def raw(self) -> Any:
        """The underlying `tokenizers.Tokenizer` (token strings, the decoder's kind)."""
        return self._tok

    @classmethod
    def from_raw(
        cls,
        raw: Any,
        *,
        bos_token: str = "",
        eos_token: str = "",
        chat_template: str | None = None,
        eos_token_ids: list[int] | None = None,
    ) -> HFTokenizer:
        """Wraps a built `tokenizers.Tokenizer` (one read from a GGUF file, say)."""
        self = cls.__new__(cls)
        self._tok = raw
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = raw.token_to_id(bos_token) if bos_token else None
        self.eos_token_ids = _merge_eos(raw, eos_token, eos_token_ids)
        self.chat_template = chat_template
        self.vocab_size = raw.get_vocab_size(with_added_tokens=True)
        self._special = frozenset(i for i, t in raw.get_added_tokens_decoder().items() if t.special)
        return self

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def detokenizer(
        self,
        prompt_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> Detokenizer:
        return StreamDetokenizer(
            self._tok, self, prompt_ids, skip_special_tokens, spaces_between_special_tokens
        )

    def decode(
        self,
        ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        if skip_special_tokens or spaces_between_special_tokens:
            return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        # the streaming rule (StreamDetokenizer) over the whole sequence, so both agree
        detok = StreamDetokenizer(self._tok, self, [], False, False)
        return detok.step(ids) + detok.flush()

    @functools.cached_property
    def added_tokens(self) -> dict[int, str]:
        """Every added token's id and content (special or not), as vLLM's detokenizer keeps."""
        return {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise TokenizerLoadError(f"cannot read {path}: {e}") from e
    return data if isinstance(data, dict) else {}


def _merge_eos(tok: Any, eos_token: str, extra: list[int] | None) -> list[int]:
    ids = list(extra or [])
    eos_id = tok.token_to_id(eos_token) if eos_token else None
    if eos_id is not None and eos_id not in ids:
        ids.insert(0, eos_id)
    return ids


def _chat_template(config: dict[str, Any], directory: Path) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):
        # the named-template form: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template:
        return str(template)
    jinja = directory / "chat_template.jinja"
    return jinja.read_text(encoding="utf-8") if jinja.is_file() else None
