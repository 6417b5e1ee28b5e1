"""Tokenizers (byte-level presets and Hugging Face `tokenizer.json`), streaming detokenization
and stop-string search."""

from __future__ import annotations

import codecs
import datetime
import functools
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

    def apply_chat_template(self, messages: list[dict[str, Any]], **extra: Any) -> str:
        """The chat template rendered for `messages`; `extra` are the template's other
        variables (`tools`, `documents`, a request's `chat_template_kwargs`)."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        template = _compile_template(self.chat_template)
        try:
            rendered: str = template.render(
                **extra,
                messages=messages,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                add_generation_prompt=True,
            )
            return rendered
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


class Detokenizer(ABC):
    """Streams text deltas; never emits half a character."""

    @abstractmethod
    def step(self, new_ids: list[int]) -> str: ...

    @abstractmethod
    def flush(self) -> str:
        """Whatever was held back, at the end (replacement characters for broken bytes)."""


class ByteDetokenizer(Detokenizer):
    """For byte-level ids: an incremental UTF-8 decoder, O(1) per token and no windows.

    A kept special token (`skip_special_tokens=False`) ends the bytes before it, as a decode of
    each run of bytes would (an unfinished character there becomes U+FFFD), then adds its
    name."""

    def __init__(self, tokenizer: ByteTokenizer | None = None, skip_special_tokens: bool = True):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text: list[str] = []
        self._names = None if skip_special_tokens or tokenizer is None else tokenizer

    @property
    def text(self) -> str:
        return "".join(self._text)

    def step(self, new_ids: list[int]) -> str:
        names = self._names
        if names is None or all(0 <= i < 256 for i in new_ids):
            delta = self._decoder.decode(bytes(i for i in new_ids if 0 <= i < 256))
        else:
            parts: list[str] = []
            run = bytearray()
            for i in new_ids:
                if 0 <= i < 256:
                    run.append(i)
                    continue
                parts.append(self._decoder.decode(bytes(run), final=True))
                run.clear()
                parts.append(names.special_text(i))
            parts.append(self._decoder.decode(bytes(run)))
            delta = "".join(parts)
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

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        # kept special tokens stay in the window (decoded with the same options)
        self._special = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._options = (skip_special_tokens, spaces_between_special_tokens)
        special = tokenizer.special_ids
        self._ids = [i for i in prompt_ids[-_PREFIX_WINDOW:] if i not in special]
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
        head = window[: self._read - self._prefix]
        return self._tok.decode(head, *self._options), self._tok.decode(window, *self._options)

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

    Kept special tokens (`skip_special_tokens=False`) read as `tokenizers` writes them, as
    transformers' `decode(..., skip_special_tokens=False)` does. `tokenizers` has no
    `spaces_between_special_tokens`; off, an added token right after another is written as its
    bare content, without the space a decoder may put before it (vLLM's fast detokenizer).
    """

    def __init__(
        self,
        raw: Any,
        tokenizer: HFTokenizer,
        prompt_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        from tokenizers.decoders import DecodeStream

        self._raw = raw
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        # added tokens, when their spaces are suppressed; None: as the library writes them
        self._added = (
            None if skip_special_tokens or spaces_between_special_tokens else tokenizer.added_tokens
        )
        self._last_added = False
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
        if self._added is not None:
            return "".join(self._step_one(i) for i in new_ids)
        self._pending.extend(new_ids)
        delta = self._stream.step(self._raw, list(new_ids)) if new_ids else None
        if delta is None:
            return ""
        self._pending = []
        self._text.append(delta)
        return delta

    def _step_one(self, token_id: int) -> str:
        assert self._added is not None
        self._pending.append(token_id)
        delta = self._stream.step(self._raw, token_id)
        content = self._added.get(token_id)
        if content is not None and self._last_added:
            delta = content
        self._last_added = content is not None
        if delta is None:
            return ""
        self._pending = []
        self._text.append(delta)
        return delta

    def flush(self) -> str:
        # ids still held are an incomplete character: decode them as replacements
        delta = self._tok.decode(self._pending, self._skip) if self._pending else ""
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
