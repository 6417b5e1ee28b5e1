"""Request validation: the one place a request is checked against the model and the pools.

Every check raises `InvalidRequestError` with the offending `param` and a machine-readable
`code`, so a front end reports it without re-deriving anything. `Engine` calls these before a
request exists; the HTTP server calls `Engine.validator.check_prompt` for the lengths it knows first.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from stallfree.runtime.memory.pool import KVCacheShape
from stallfree.runtime.request.errors import InvalidRequestError
from stallfree.runtime.request.sampling_params import (
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS_TOTAL_TOKENS,
    SamplingParams,
    is_valid_unicode,
)
from stallfree.runtime.text.tokenizer import Tokenizer


def show(value: object) -> str:
    """A short rendering of a client-sent value for an error message (ints may be huge)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<{value.bit_length()}-bit integer>"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class RequestValidator:
    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, max_context_len: int, kv_tokens: int
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_context_len = max_context_len
        self.kv_tokens = kv_tokens  # usable KV slots in all

    def check_import(
        self,
        prompt_len: int,
        kv: object,
        first_token_id: object,
        shape: KVCacheShape,
    ) -> None:
        """An imported request's KV and first token (decode-side disaggregation): `kv[layer]` is
        (k, v), each [prompt_len, num_kv_heads, head_dim] floating point; the token is in the
        vocabulary."""
        if (
            isinstance(first_token_id, bool)
            or not isinstance(first_token_id, int)
            or not 0 <= first_token_id < self.vocab_size
        ):
            raise InvalidRequestError(
                f"first_token_id must be a token id in [0, {self.vocab_size}), "
                f"not {show(first_token_id)}",
                param="first_token_id",
            )
        want = (prompt_len, shape.num_kv_heads, shape.head_dim)

        def well_formed(layer: object) -> bool:
            if not isinstance(layer, (tuple, list)) or len(layer) != 2:
                return False
            return all(
                isinstance(t, torch.Tensor) and t.is_floating_point() and tuple(t.shape) == want
                for t in layer
            )

        if (
            not isinstance(kv, (list, tuple))
            or len(kv) != shape.num_layers
            or not all(well_formed(layer) for layer in kv)
        ):
            raise InvalidRequestError(
                f"imported KV must be {shape.num_layers} layers of (k, v) floating-point tensors "
                f"of shape {want}",
                param="kv",
            )

    def max_new_tokens_limit(self, prompt_len: int) -> int:
        """The most new tokens a prompt of `prompt_len` tokens can get: the context's rest, or
        the KV cache's if that is smaller."""
        kv_tokens = self.kv_tokens
        return max(0, min(self.max_context_len, kv_tokens) - prompt_len)

    def check_prompt(
        self,
        ids: Sequence[int],
        max_new_tokens: int | None = None,
        param: str = "prompt",
        params: SamplingParams | None = None,
    ) -> None:
        """Raise `InvalidRequestError` unless `ids` (and `max_new_tokens` more) can be served.

        The one place requests are checked against the model: token ids are integers in the
        vocabulary; the prompt leaves room for a new token in the context; `max_new_tokens`
        more fit in the context (`context_length_exceeded`) and in the KV cache
        (`kv_capacity_exceeded`); and, when `params` is given, `check_params` holds.
        """
        self._check_ids(ids, param)
        limit = self.max_context_len
        n = len(ids)
        if n >= limit:
            raise InvalidRequestError(
                f"this model's maximum context length is {limit} tokens, and the {param} has "
                f"{n} tokens (it must leave room for at least one new token)",
                param=param,
                code="context_length_exceeded",
            )
        kv_tokens = self.kv_tokens
        if n + 1 > kv_tokens:
            raise InvalidRequestError(
                f"the {param} has {n} tokens; the KV cache holds {kv_tokens} tokens in all, "
                "so it could never be served",
                param=param,
                code="kv_capacity_exceeded",
            )
        if max_new_tokens is not None:
            self._check_max_new_tokens(n, max_new_tokens, param)
        if params is not None:
            self.check_params(params)

    def _check_max_new_tokens(self, prompt_len: int, max_new_tokens: int, param: str) -> None:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise InvalidRequestError("max_tokens must be an integer", param="max_tokens")
        if max_new_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be at least 1, not {show(max_new_tokens)}", param="max_tokens"
            )
        limit = self.max_context_len
        if prompt_len + max_new_tokens > limit:
            raise InvalidRequestError(
                f"max_tokens is too large: {show(max_new_tokens)}. This model's maximum context "
                f"length is {limit} tokens and the {param} has {prompt_len} tokens, so at most "
                f"{limit - prompt_len} new tokens fit",
                param="max_tokens",
                code="context_length_exceeded",
            )
        kv_tokens = self.kv_tokens
        if prompt_len + max_new_tokens > kv_tokens:
            raise InvalidRequestError(
                f"max_tokens is too large: {max_new_tokens}. The KV cache holds {kv_tokens} tokens "
                f"in all and the {param} has {prompt_len} tokens, so this request could never "
                f"finish; at most {self.max_new_tokens_limit(prompt_len)} new tokens fit",
                param="max_tokens",
                code="kv_capacity_exceeded",
            )

    def check_params(self, params: SamplingParams) -> None:
        """The sampling bounds that depend on the model: top_k, stop token ids, logit_bias,
        allowed_token_ids."""
        vocab = self.vocab_size
        if params.top_k > vocab:
            raise InvalidRequestError(
                f"top_k must be -1 (disabled) or between 1 and the vocabulary size ({vocab}), "
                f"not {show(params.top_k)}",
                param="top_k",
            )
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise InvalidRequestError(
                f"stop_token_ids out of range [0, {vocab}): {', '.join(map(show, bad[:5]))}",
                param="stop_token_ids",
            )
        bad = [t for t in params.logit_bias if t >= vocab]
        if bad:
            raise InvalidRequestError(
                f"logit_bias token ids out of range [0, {vocab}): {', '.join(map(show, bad[:5]))}",
                param="logit_bias",
            )
        allowed = params.allowed_token_ids or ()
        bad = [t for t in allowed if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"allowed_token_ids out of range [0, {vocab}): {', '.join(map(show, bad[:5]))}",
                param="allowed_token_ids",
            )
        if params.min_tokens > params.max_new_tokens:
            raise InvalidRequestError(
                f"min_tokens ({params.min_tokens}) must not exceed max_tokens "
                f"({params.max_new_tokens})",
                param="min_tokens",
            )

    def _check_ids(self, ids: Sequence[int], param: str) -> None:
        if isinstance(ids, (str, bytes, bytearray)) or not isinstance(ids, Sequence):
            raise InvalidRequestError(
                f"{param} must be a list of token ids, not {type(ids).__name__}", param=param
            )
        if not ids:
            raise InvalidRequestError(f"{param} is empty", param=param)
        if not all(type(t) is int for t in ids):
            for i, t in enumerate(ids):
                if isinstance(t, bool) or not isinstance(t, int):
                    raise InvalidRequestError(
                        f"{param} token ids must be integers; item {i} is "
                        f"{type(t).__name__} {show(t)}",
                        param=param,
                    )
        vocab = self.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            bad = [t for t in ids if not 0 <= t < vocab][:5]
            raise InvalidRequestError(
                f"token ids out of range [0, {vocab}): {', '.join(map(show, bad))}", param=param
            )

    def encode(self, text: str, param: str = "prompt") -> list[int]:
        """Tokenize client text; text the tokenizer cannot take is an `InvalidRequestError`."""
        if not isinstance(text, str):
            raise InvalidRequestError(
                f"{param} must be a string, not {type(text).__name__}", param=param
            )
        if not is_valid_unicode(text):
            raise InvalidRequestError(
                f"{param} is not valid Unicode: it holds a lone surrogate code point",
                param=param,
                code="invalid_unicode",
            )
        try:
            return self.tokenizer.encode(text)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(
                f"{param} could not be tokenized: {exc}", param=param
            ) from exc

    def prompt_ids(self, prompt: object) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", param="prompt")
            return self.encode(prompt)
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.is_complex():
                raise InvalidRequestError(
                    "a tensor prompt must be one-dimensional and of an integer dtype",
                    param="prompt",
                )
            return [int(t) for t in prompt.tolist()]
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
            raise InvalidRequestError(
                f"prompt must be a string or a sequence of token ids, not {type(prompt).__name__}",
                param="prompt",
            )
        ids = list(prompt)
        if not all(type(t) is int for t in ids):
            for i, t in enumerate(ids):
                if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                    raise InvalidRequestError(
                        f"prompt token ids must be integers; item {i} is "
                        f"{type(t).__name__} {show(t)}",
                        param="prompt",
                    )
                ids[i] = int(t)
        return ids

    def params(self, params: object) -> SamplingParams:
        if params is None:
            return SamplingParams()
        if isinstance(params, dict):
            return SamplingParams.model_validate(params)  # a ValidationError names the field
        if isinstance(params, SamplingParams):
            return params
        raise InvalidRequestError(
            f"params must be SamplingParams or a dict, not {type(params).__name__}",
            param="params",
        )

    def admit_params(self, ids: list[int], params: SamplingParams) -> SamplingParams:
        """Check `params` against the model and cap `max_new_tokens` to what can ever fit.

        Everything the context leaves, or more, reads as "as many as fit" and is capped to the
        context's (or the KV cache's) rest, so the admission arithmetic only sees sizes that can
        happen. A smaller value that the KV cache cannot hold is refused.
        """
        self.check_params(params)
        if params.bad_words:
            params = params.with_bad_words_ids(self.bad_words_ids(params.bad_words))
        requested = params.max_new_tokens
        if len(ids) + requested >= self.max_context_len:
            capped = self.max_new_tokens_limit(len(ids))
            update = {"max_new_tokens": capped, "min_tokens": min(params.min_tokens, capped)}
            return params.model_copy(update=update)
        self._check_max_new_tokens(len(ids), requested, "prompt")
        return params

    def bad_words_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's tokenization of `bad_words`: each word (leading spaces stripped) as is, and
        with one leading space where that gives as many tokens, starting differently (a word in
        mid-text); no special tokens added. Bounded per word and in all."""
        out: list[tuple[int, ...]] = []
        total = 0
        for word in words:
            plain: tuple[int, ...] = ()
            for prefix in ("", " "):
                try:
                    ids = tuple(
                        self.tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
                    )
                except (ValueError, TypeError) as exc:
                    raise InvalidRequestError(
                        f"bad_words could not be tokenized: {exc}", param="bad_words"
                    ) from exc
                if not prefix:
                    plain = ids
                    if not ids:
                        raise InvalidRequestError(
                            f"bad_words: {show(word)} has no tokens", param="bad_words"
                        )
                elif not (ids and ids[0] != plain[0] and len(ids) == len(plain)):
                    continue
                if len(ids) > MAX_BAD_WORD_TOKENS:
                    raise InvalidRequestError(
                        f"bad_words: {show(word)} is {len(ids)} tokens; a bad word may be at "
                        f"most {MAX_BAD_WORD_TOKENS}",
                        param="bad_words",
                    )
                total += len(ids)
                if total > MAX_BAD_WORDS_TOTAL_TOKENS:
                    raise InvalidRequestError(
                        f"bad_words: the words are more than {MAX_BAD_WORDS_TOTAL_TOKENS} "
                        "tokens in all",
                        param="bad_words",
                    )
                if max(ids) >= self.vocab_size or min(ids) < 0:
                    raise InvalidRequestError(
                        f"bad_words: {show(word)} has token ids outside the model's vocabulary",
                        param="bad_words",
                    )
                out.append(ids)
        return tuple(out)
