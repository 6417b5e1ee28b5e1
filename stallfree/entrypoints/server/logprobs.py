"""Log-probabilities in the OpenAI shapes: the legacy completions form (`tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`) and the chat form (`content`: one entry per
token with its text, bytes and top alternatives).

The engine gives token ids (`TokenLogprobs`); each id is shown as its own text and bytes. A token
that holds part of a UTF-8 character (byte-level BPE splits them) has exact `bytes`; its text
shows the bytes it cannot decode as `\\xNN`.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from stallfree.entrypoints.server.responses import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
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


def completion_logprobs(
    pieces: TokenPieces,
    entries: Sequence[TokenLogprobs | None],
    token_ids: Sequence[int],
    offset: int,
) -> tuple[CompletionLogprobs, int]:
    """The legacy form for `token_ids` (an entry of None, the first prompt token's, has no
    logprob), with text offsets from `offset`; returns it and the offset after the last token.

    `top_logprobs` holds the top alternatives and the chosen token, as OpenAI's does (so up to
    `logprobs + 1` entries)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = pieces.text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(_finite(entry.logprob))
        top = {pieces.text(t): _finite(lp) for t, lp in entry.top}
        top.setdefault(text, _finite(entry.logprob))
        tops.append(top)
    out = CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=tops, text_offset=offsets
    )
    return out, offset


def merge_completion_logprobs(parts: Sequence[CompletionLogprobs]) -> CompletionLogprobs:
    merged = CompletionLogprobs()
    for part in parts:
        merged.tokens += part.tokens
        merged.token_logprobs += part.token_logprobs
        merged.top_logprobs += part.top_logprobs
        merged.text_offset += part.text_offset
    return merged


def chat_logprobs(
    pieces: TokenPieces, entries: Sequence[TokenLogprobs], top_k: int
) -> ChatLogprobs:
    """The chat form: each token with its exact bytes and its `top_k` top alternatives."""

    def one(token_id: int, logprob: float) -> tuple[str, float, list[int]]:
        text, data = pieces.piece(token_id)
        return text, _finite(logprob), list(data)

    content = []
    for entry in entries:
        text, logprob, data = one(entry.token_id, entry.logprob)
        top = [TopLogprob(token=t, logprob=lp, bytes=b) for t, lp, b in (
            one(tid, tlp) for tid, tlp in entry.top[:top_k]
        )]  # fmt: skip
        content.append(ChatTokenLogprob(token=text, logprob=logprob, bytes=data, top_logprobs=top))
    return ChatLogprobs(content=content)


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
