"""Log-probabilities in the OpenAI shapes: the legacy completions form (`tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`) and the chat form (`content`: one entry per
token with its text, bytes and top alternatives). Each comes as plain values too (`LegacyLists`,
`chat_logprobs_dump`), what a whole body is written from without building response models.

The engine gives token ids (`TokenLogprobs`); each id is shown as its own text and bytes. A token
that holds part of a UTF-8 character (byte-level BPE splits them) has exact `bytes`; its text
shows the bytes it cannot decode as `\\xNN`.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from stallfree.entrypoints.server.output.responses import (
    ChatLogprobs,
    ChatTokenLogprob,
    TopLogprob,
)
from stallfree.runtime.request.outputs import TokenLogprobs
from stallfree.runtime.text.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

# JSON has no -inf; a token with no probability at all is shown as vLLM shows it
_NO_PROBABILITY = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _NO_PROBABILITY


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: the inverse of the table byte-level BPE
    vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class TokenPieces:
    """Text and bytes of single tokens, cached (a vocabulary is bounded)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._special = tokenizer.special_ids
        # a Hugging Face tokenizer's `tokenizers.Tokenizer`, for the token strings and
        # the decoder kind (only it knows which bytes a byte-level token stands for)
        self._raw: Any = tokenizer.raw if isinstance(tokenizer, HFTokenizer) else None
        decoder = getattr(self._raw, "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._cache: dict[int, tuple[str, bytes]] = {}

    def piece(self, token_id: int) -> tuple[str, bytes]:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._piece(token_id)
        return cached

    def text(self, token_id: int) -> str:
        return self.piece(token_id)[0]

    def _piece(self, token_id: int) -> tuple[str, bytes]:
        tok = self.tokenizer
        if isinstance(tok, ByteTokenizer):
            if 0 <= token_id < 256:
                data = bytes([token_id])
                return data.decode("utf-8", "backslashreplace"), data
            name = {tok.BOS: tok.bos_token, tok.EOS: tok.eos_token}.get(token_id, "")
            return name, name.encode()
        if self._raw is None:
            text = tok.decode([token_id])
            return text, text.encode()
        token = self._raw.id_to_token(token_id)
        if token is None:
            return "", b""
        if token_id in self._special:
            return token, token.encode()
        data = self._token_bytes(token)
        return data.decode("utf-8", "backslashreplace"), data

    def _token_bytes(self, token: str) -> bytes:
        if self._byte_level:
            table = _byte_level_decoder()
            if all(ch in table for ch in token):
                return bytes(table[ch] for ch in token)
            return token.encode()  # an added token, written as plain text
        # sentencepiece-style: byte-fallback pieces and the word-boundary mark
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            try:
                return bytes([int(token[3:5], 16)])
            except ValueError:
                pass
        return token.replace("\u2581", " ").encode()


_PIECES: weakref.WeakKeyDictionary[Tokenizer, TokenPieces] = weakref.WeakKeyDictionary()


def token_pieces(tokenizer: Tokenizer) -> TokenPieces:
    """The (cached) `TokenPieces` of `tokenizer`."""
    pieces = _PIECES.get(tokenizer)
    if pieces is None:
        pieces = _PIECES[tokenizer] = TokenPieces(tokenizer)
    return pieces


@dataclass(slots=True)
class LegacyLists:
    """The four lists of the legacy completions form, as plain values (what a whole body
    writes without building models)."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def __add__(self, other: LegacyLists) -> LegacyLists:
        return LegacyLists(
            self.tokens + other.tokens,
            self.token_logprobs + other.token_logprobs,
            self.top_logprobs + other.top_logprobs,
            self.text_offset + other.text_offset,
        )

    def dump(self) -> dict[str, Any]:
        """`CompletionLogprobs.model_dump()` of these lists."""
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


def legacy_lists(
    pieces: TokenPieces,
    entries: Sequence[TokenLogprobs | None],
    token_ids: Sequence[int],
    offset: int,
) -> tuple[LegacyLists, int]:
    """The legacy form for `token_ids` (an entry of None, the first prompt token's, has no
    logprob), with text offsets from `offset`; returns it and the offset after the last token.

    `top_logprobs` holds the top alternatives and the chosen token, as OpenAI's does (so up to
    `logprobs + 1` entries)."""
    out = LegacyLists()
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = pieces.text(token_id)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_finite(entry.logprob))
        top = {pieces.text(t): _finite(lp) for t, lp in entry.top}
        top.setdefault(text, _finite(entry.logprob))
        out.top_logprobs.append(top)
    return out, offset


def _chat_entries(
    pieces: TokenPieces, entries: Sequence[TokenLogprobs], top_k: int
) -> Iterator[tuple[str, float, list[int], list[tuple[str, float, list[int]]]]]:
    """Each token's text, logprob and bytes, and its `top_k` top alternatives' the same."""

    def one(token_id: int, logprob: float) -> tuple[str, float, list[int]]:
        text, data = pieces.piece(token_id)
        return text, _finite(logprob), list(data)

    for entry in entries:
        top = [one(tid, tlp) for tid, tlp in entry.top[:top_k]]
        yield (*one(entry.token_id, entry.logprob), top)


def chat_logprobs(
    pieces: TokenPieces, entries: Sequence[TokenLogprobs], top_k: int
) -> ChatLogprobs:
    """The chat form: each token with its exact bytes and its `top_k` top alternatives."""
    content = [
        ChatTokenLogprob(
            token=text,
            logprob=logprob,
            bytes=data,
            top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=b) for t, lp, b in top],
        )
        for text, logprob, data, top in _chat_entries(pieces, entries, top_k)
    ]
    return ChatLogprobs(content=content)


def chat_logprobs_dump(
    pieces: TokenPieces, entries: Sequence[TokenLogprobs], top_k: int
) -> dict[str, Any]:
    """`chat_logprobs(...).model_dump()`, as plain values from the start."""
    content = [
        {
            "token": text,
            "logprob": logprob,
            "bytes": data,
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": b} for t, lp, b in top],
        }
        for text, logprob, data, top in _chat_entries(pieces, entries, top_k)
    ]
    return {"content": content}


def native_logprobs(entries: Sequence[TokenLogprobs | None]) -> list[dict[str, Any] | None]:
    """`/generate`'s form: token ids, their logprobs and `top` as [token id, logprob] pairs."""
    return [
        None
        if e is None
        else {
            "token_id": e.token_id,
            "logprob": _finite(e.logprob),
            "top": [[t, _finite(lp)] for t, lp in e.top],
        }
        for e in entries
    ]


def prompt_logprobs_dump(
    pieces: TokenPieces,
    entries: Sequence[TokenLogprobs | None] | None,
    prompt_ids: Sequence[int],
    top_k: int,
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` of a choice: None for the first prompt token (nothing predicts
    it), then for each later token a dict keyed by token id (as a string) holding the token
    itself and its `top_k` top alternatives, each `{"logprob", "rank", "decoded_token"}`.

    `entries` are the engine's (one per prompt token, the first None). A rank is the token's
    place among the top alternatives (1 the likeliest); the prompt's own token, when outside
    them, has rank None. A token with no entry (a prompt cut before it was scored) is None."""
    given = list(entries or [])[: len(prompt_ids)]
    given += [None] * (len(prompt_ids) - len(given))
    out: list[dict[str, dict[str, Any]] | None] = [None] if prompt_ids else []
    for token_id, entry in zip(prompt_ids[1:], given[1:], strict=True):
        if entry is None:
            out.append(None)
            continue
        top = {
            str(tid): {"logprob": _finite(lp), "rank": rank, "decoded_token": pieces.text(tid)}
            for rank, (tid, lp) in enumerate(entry.top[:top_k], start=1)
        }
        own = top.pop(str(token_id), None) or {
            "logprob": _finite(entry.logprob),
            "rank": None,
            "decoded_token": pieces.text(token_id),
        }
        out.append({str(token_id): own, **top})
    return out


@dataclass(slots=True)
class SharedPromptLogprobs:
    """The `prompt_logprobs` of a request's prompts, each made once from its first choice's
    entries (the only choice that computes them) and given to all of its choices."""

    pieces: TokenPieces
    prompts: list[list[int]]
    top_k: int
    _made: dict[int, list[dict[str, dict[str, Any]] | None]] = field(default_factory=dict)

    @classmethod
    def of(
        cls, tokenizer: Tokenizer, top_k: int | None, prompts: list[list[int]]
    ) -> SharedPromptLogprobs | None:
        """None when the request did not ask for them."""
        return None if top_k is None else cls(token_pieces(tokenizer), prompts, top_k)

    def get(
        self, prompt: int, entries: Sequence[TokenLogprobs | None] | None
    ) -> list[dict[str, dict[str, Any]] | None]:
        """Prompt `prompt`'s list; its first choice passes its `entries`, the others None."""
        made = self._made.get(prompt)
        if made is None:
            made = prompt_logprobs_dump(self.pieces, entries, self.prompts[prompt], self.top_k)
            self._made[prompt] = made
        return made
