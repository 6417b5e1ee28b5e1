"""Streaming detokenization: a request's output ids to text deltas that never end in half a
character and add up to a full decode of the same ids.

`ByteDetokenizer` is the byte-level presets' UTF-8 decoder, `IncrementalDetokenizer` the
two-window decode that works with any tokenizer, and `StreamDetokenizer` `tokenizers`' own
`DecodeStream`. `Tokenizer.detokenizer` picks the one that fits the tokenizer."""

from __future__ import annotations

import codecs
from abc import ABC, abstractmethod
from typing import Any, Protocol

_REPLACEMENT = "\ufffd"
# tokens decoded before the read offset so context-dependent decoders (leading spaces) agree
PREFIX_WINDOW = 5


class Decodes(Protocol):
    """What the windowed decoder needs of a tokenizer."""

    @property
    def special_ids(self) -> frozenset[int]: ...

    def decode(
        self,
        ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str: ...


class NamesSpecials(Protocol):
    """A byte-level tokenizer's names for its special ids."""

    def special_text(self, token_id: int) -> str: ...


class HasAddedTokens(Decodes, Protocol):
    """A `tokenizers` tokenizer's added tokens, for `StreamDetokenizer`."""

    @property
    def added_tokens(self) -> dict[int, str]: ...


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

    def __init__(self, tokenizer: NamesSpecials | None = None, skip_special_tokens: bool = True):
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
        tokenizer: Decodes,
        prompt_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        # kept special tokens stay in the window (decoded with the same options)
        self._special = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._options = (skip_special_tokens, spaces_between_special_tokens)
        special = tokenizer.special_ids
        self._ids = [i for i in prompt_ids[-PREFIX_WINDOW:] if i not in special]
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
        tokenizer: HasAddedTokens,
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
        context = [i for i in prompt_ids[-PREFIX_WINDOW:] if i not in special]
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
