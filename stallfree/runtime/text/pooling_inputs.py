"""The pooling runner's inputs as token ids: texts or token lists for an embedder, text pairs
for a cross-encoder; checked against the vocabulary and the length limit, and cut only when
the request set `truncate_prompt_tokens`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stallfree.runtime.request.errors import InvalidRequestError
from stallfree.runtime.text.tokenizer import HFTokenizer, Tokenizer

# inputs one request may carry: OpenAI's limit for /v1/embeddings, kept for pairs too
MAX_INPUTS = 2048


@dataclass(frozen=True, slots=True)
class PoolingInputs:
    """One input's ids each; `second[i]` is where input i's segment B (the pair's second
    text) starts, its length for a single text."""

    ids: list[list[int]]
    second: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(len(row) for row in self.ids)


@dataclass(frozen=True, slots=True)
class InputReader:
    tokenizer: Tokenizer
    vocab_size: int
    max_len: int

    def truncation(self, value: int | None) -> int | None:
        """`truncate_prompt_tokens`: None (refuse what is too long), -1 (the model's limit),
        or a positive count up to the limit."""
        if value is None:
            return None
        if value == -1:
            return self.max_len
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidRequestError(
                "truncate_prompt_tokens must be -1 or a positive integer",
                param="truncate_prompt_tokens",
            )
        if value > self.max_len:
            raise InvalidRequestError(
                f"truncate_prompt_tokens {value} is over the model's limit of "
                f"{self.max_len} tokens",
                param="truncate_prompt_tokens",
            )
        return value

    def singles(
        self, inputs: Sequence[str | Sequence[int]], truncate: int | None, param: str = "input"
    ) -> PoolingInputs:
        if not inputs:
            raise InvalidRequestError(f"{param} must not be empty", param=param)
        _check_count(len(inputs), param)
        limit = self.truncation(truncate)
        ids = [self._single(f"{param}[{i}]", item, limit, param) for i, item in enumerate(inputs)]
        return PoolingInputs(ids, [len(row) for row in ids])

    def pairs(self, pairs: Sequence[tuple[str, str]], truncate: int | None) -> PoolingInputs:
        """Each (a, b) as the tokenizer's pair template writes it ([CLS] a [SEP] b [SEP])."""
        if not isinstance(self.tokenizer, HFTokenizer):
            raise InvalidRequestError("this model's tokenizer cannot encode text pairs")
        _check_count(len(pairs), "input")
        limit = self.truncation(truncate)
        raw = self.tokenizer.raw
        ids: list[list[int]] = []
        second: list[int] = []
        for i, (a, b) in enumerate(pairs):
            if not a or not b:
                raise InvalidRequestError(f"pair {i} has an empty text", param="input")
            encoding = raw.encode(a, b)
            if len(encoding.ids) > self.max_len and limit is None:
                raise InvalidRequestError(
                    f"pair {i} is {len(encoding.ids)} tokens, over the model's limit of "
                    f"{self.max_len}; set truncate_prompt_tokens to cut it",
                    param="input",
                )
            if limit is not None and len(encoding.ids) > limit:
                encoding = _truncated_pair(raw, a, b, limit)
            types = list(encoding.type_ids)
            ids.append(list(encoding.ids))
            second.append(types.index(1) if 1 in types else len(types))
        return PoolingInputs(ids, second)

    def _single(
        self, where: str, item: str | Sequence[int], limit: int | None, param: str
    ) -> list[int]:
        if isinstance(item, str):
            if not item:
                raise InvalidRequestError(f"{where} is an empty string", param=param)
            ids = self.tokenizer.encode(item)
        else:
            ids = list(item)
            if not ids:
                raise InvalidRequestError(f"{where} is an empty list of tokens", param=param)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"{where} has token id {bad[0]} outside the vocabulary "
                    f"(0..{self.vocab_size - 1})",
                    param=param,
                )
        if len(ids) > self.max_len and limit is None:
            raise InvalidRequestError(
                f"{where} is {len(ids)} tokens, over the model's limit of "
                f"{self.max_len}; set truncate_prompt_tokens to cut it",
                param=param,
            )
        if limit is None or len(ids) <= limit:
            return ids
        # a text keeps its closing special token (BERT's [SEP]), as sentence-transformers'
        # truncation does
        if isinstance(item, str) and limit > 1 and ids[-1] in self.tokenizer.special_ids:
            return ids[: limit - 1] + ids[-1:]
        return ids[:limit]


def _check_count(count: int, param: str) -> None:
    if count > MAX_INPUTS:
        raise InvalidRequestError(
            f"{param} has {count} items; one request takes at most {MAX_INPUTS}", param=param
        )


def _truncated_pair(raw: Any, a: str, b: str, limit: int) -> Any:
    """The pair cut to `limit` tokens, the longer text first (sentence-transformers' cross-
    encoders truncate so); the tokenizer's own truncation, switched off again after."""
    raw.enable_truncation(max_length=limit, strategy="longest_first")
    try:
        return raw.encode(a, b)
    finally:
        raw.no_truncation()
