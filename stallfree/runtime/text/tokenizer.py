"""Tokenizers (byte-level presets and Hugging Face `tokenizer.json`), streaming detokenization
and stop-string search."""

from __future__ import annotations

import codecs
import datetime
import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

_REPLACEMENT = "\ufffd"
# tokens decoded before the read offset so context-dependent decoders (leading spaces) agree
_PREFIX_WINDOW = 5

_BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class TokenizerLoadError(ValueError):
    """The tokenizer files are missing or unreadable."""


class ChatTemplateError(ValueError):
    """The model has no chat template, or rendering it failed."""


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
    def decode(self, ids: list[int]) -> str:
        """Decodes, dropping special tokens; incomplete UTF-8 becomes U+FFFD."""

    @property
    @abstractmethod
    def special_ids(self) -> frozenset[int]: ...

    def detokenizer(self, prompt_ids: list[int]) -> Detokenizer:
        """A per-request streaming decoder."""
        return IncrementalDetokenizer(self, prompt_ids)

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Render the chat template and tokenize it. The template writes its own special
        tokens (BOS included), so none are added: one BOS, as transformers gives."""
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        template = _compile_template(self.chat_template)
        try:
            return template.render(
                messages=messages,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                add_generation_prompt=True,
            )
        except ChatTemplateError:
            raise
        except Exception as e:
            raise ChatTemplateError(f"chat template failed to render: {e}") from e


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


_TEMPLATE_CACHE: dict[str, Any] = {}


def _compile_template(source: str) -> Any:
    cached = _TEMPLATE_CACHE.get(source)
    if cached is not None:
        return cached
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise ChatTemplateError(
            "chat templates need jinja2: pip install 'stallfree[server]' (or jinja2)"
        ) from e
    # same environment settings as transformers, so templates render identically
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now  # Llama 3.x templates date their system prompt
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    try:
        template = env.from_string(source)
    except Exception as e:
        raise ChatTemplateError(f"invalid chat template: {e}") from e
    _TEMPLATE_CACHE[source] = template
    return template


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

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(range(256, self.vocab_size))

    def detokenizer(self, prompt_ids: list[int]) -> Detokenizer:
        return ByteDetokenizer()


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

    def detokenizer(self, prompt_ids: list[int]) -> Detokenizer:
        return StreamDetokenizer(self._tok, self, prompt_ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

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


class Detokenizer(ABC):
    """Streams text deltas; never emits half a character."""

    @abstractmethod
    def step(self, new_ids: list[int]) -> str: ...

    @abstractmethod
    def flush(self) -> str:
        """Whatever was held back, at the end (replacement characters for broken bytes)."""


class ByteDetokenizer(Detokenizer):
    """For byte-level ids: an incremental UTF-8 decoder, O(1) per token and no windows."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._text)

    def step(self, new_ids: list[int]) -> str:
        delta = self._decoder.decode(bytes(i for i in new_ids if 0 <= i < 256))
        self._text.append(delta)
        return delta

    def flush(self) -> str:
        delta = self._decoder.decode(b"", final=True)
        self._text.append(delta)
        return delta


class IncrementalDetokenizer(Detokenizer):
    """Per-request streaming decode: O(1) work per step, never emits half a character.

    Decodes the window `ids[prefix:read]` (already emitted) and `ids[prefix:]`; the difference
    is the new text. Decoding from a few tokens back keeps context-dependent decoders (leading
    spaces, byte fallback) consistent with a full decode.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
        self._tok = tokenizer
        self._special = tokenizer.special_ids
        self._ids = [i for i in prompt_ids[-_PREFIX_WINDOW:] if i not in self._special]
        self._read = len(self._ids)
        self._prefix = 0
        self._text: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._text)

    def step(self, new_ids: list[int]) -> str:
        # special tokens decode to nothing; keeping them out bounds the window
        self._ids.extend(i for i in new_ids if i not in self._special)
        prefix_text, full = self._decode_window()
        if len(full) <= len(prefix_text) or full.endswith(_REPLACEMENT):
            return ""
        return self._emit(full[len(prefix_text) :])

    def flush(self) -> str:
        prefix_text, full = self._decode_window()
        if len(full) <= len(prefix_text):
            return ""
        return self._emit(full[len(prefix_text) :])

    def _decode_window(self) -> tuple[str, str]:
        window = self._ids[self._prefix :]
        return self._tok.decode(window[: self._read - self._prefix]), self._tok.decode(window)

    def _emit(self, delta: str) -> str:
        self._prefix = self._read
        self._read = len(self._ids)
        # drop ids the window will never look at again
        del self._ids[: self._prefix]
        self._read -= self._prefix
        self._prefix = 0
        self._text.append(delta)
        return delta


class StreamDetokenizer(Detokenizer):
    """`tokenizers`' own `DecodeStream`: the decoder pipeline run incrementally in Rust.

    A few prompt tokens are fed first (their text discarded), so context-dependent decoders
    (a leading space, byte fallback) start the output as a full decode would.
    """

    def __init__(self, raw: Any, tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
        from tokenizers.decoders import DecodeStream

        self._raw = raw
        self._tok = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        special = tokenizer.special_ids
        context = [i for i in prompt_ids[-_PREFIX_WINDOW:] if i not in special]
        if context:
            self._stream.step(raw, context)
        self._pending: list[int] = []  # fed since the last emitted text
        self._text: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._text)

    def step(self, new_ids: list[int]) -> str:
        self._pending.extend(new_ids)
        delta = self._stream.step(self._raw, list(new_ids)) if new_ids else None
        if delta is None:
            return ""
        self._pending = []
        self._text.append(delta)
        return delta

    def flush(self) -> str:
        # ids still held are an incomplete character: decode them as replacements
        delta = self._tok.decode(self._pending) if self._pending else ""
        self._pending = []
        self._text.append(delta)
        return delta


def find_stop(text: str, stops: list[str], start: int) -> int | None:
    """Earliest index of a stop string in `text` that ends in the new text `text[start:]`."""
    best: int | None = None
    for s in stops:
        idx = text.find(s, max(0, start - len(s) + 1))
        if idx != -1 and (best is None or idx < best):
            best = idx
    return best
