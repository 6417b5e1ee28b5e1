"""Sampling parameters, validated by pydantic so bad values fail with the field's name.

Every field is bounded here, so no value a client can send overflows a tensor or the admission
arithmetic. Bounds that depend on the model (top_k and stop token ids against the vocabulary,
max_new_tokens against the context and the KV cache) are checked by `RequestValidator`
(`text/validation.py`).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from stallfree.runtime.request.structured import StructuredOutputs

INT64_MAX = (1 << 63) - 1
MAX_NEW_TOKENS = (1 << 31) - 1  # far beyond any context; the engine caps to the context anyway
MAX_TEMPERATURE = 100.0
# Below this a temperature is read as 0 (greedy): logits divided by it overflow float32 to inf,
# and the softmax of inf is NaN, so there is no well-defined distribution left to sample from.
MIN_TEMPERATURE = 1e-5
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 256
MAX_PENALTY = 2.0  # presence and frequency, as OpenAI bounds them
MAX_REPETITION_PENALTY = 100.0
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGPROBS = 20  # top alternatives per token, as vLLM bounds them by default
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
# each tokenized bad word (execution/bad_words.py keeps this many output tokens per slot), and
# all of a request's tokenized bad words together (text/validation.py checks both)
MAX_BAD_WORD_TOKENS = 32
MAX_BAD_WORDS_TOTAL_TOKENS = 2048


def is_valid_unicode(text: str) -> bool:
    """False for text holding a lone surrogate (e.g. "\\ud800"): it has no UTF-8 encoding."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int = Field(
        128,
        ge=1,
        le=MAX_NEW_TOKENS,
        description="Most tokens to generate; more than the context leaves is capped to what fits",
    )
    temperature: float = Field(
        0.0,
        ge=0.0,
        le=MAX_TEMPERATURE,
        allow_inf_nan=False,
        description=f"0 means greedy; values below {MIN_TEMPERATURE:g} are treated as 0",
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    min_p: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="Drop tokens less likely than min_p times the likeliest one (after "
        "temperature, top-k and top-p, as transformers' MinPLogitsWarper); 0 disables",
    )
    top_k: int = Field(
        -1, le=INT64_MAX, description="-1 disables; otherwise >= 1 and at most the vocabulary"
    )
    seed: int | None = Field(None, ge=0, le=INT64_MAX)
    stop_token_ids: list[int] = Field(
        default_factory=list,
        max_length=MAX_STOP_TOKEN_IDS,
        description=f"At most {MAX_STOP_TOKEN_IDS} token ids, each within the vocabulary",
    )
    stop: list[str] = Field(
        default_factory=list,
        max_length=MAX_STOP_STRINGS,
        description=f"Stop strings (not included in text): at most {MAX_STOP_STRINGS}, "
        f"each of 1 to {MAX_STOP_STRING_CHARS} characters",
    )
    ignore_eos: bool = False
    include_stop_str_in_output: bool = Field(
        False,
        description="Keep the stop string that ended the output in its text (vLLM's name; "
        "SGLang's no_stop_trim)",
    )
    min_tokens: int = Field(
        0,
        ge=0,
        le=MAX_NEW_TOKENS,
        description="Outputs before EOS, a stop token id or a stop string may end the request",
    )
    presence_penalty: float = Field(
        0.0,
        ge=-MAX_PENALTY,
        le=MAX_PENALTY,
        allow_inf_nan=False,
        description="Subtracted from the logit of every token already in the output",
    )
    frequency_penalty: float = Field(
        0.0,
        ge=-MAX_PENALTY,
        le=MAX_PENALTY,
        allow_inf_nan=False,
        description="Subtracted from a token's logit once per time it is in the output",
    )
    repetition_penalty: float = Field(
        1.0,
        # as far below 1 as above: at 1e-300 a penalised logit overflows to inf and sampling
        # returns token 0 forever
        ge=1.0 / MAX_REPETITION_PENALTY,
        le=MAX_REPETITION_PENALTY,
        allow_inf_nan=False,
        description="Logits of tokens in the prompt or the output: positive ones divided by "
        "it, negative ones multiplied (1 disables)",
    )
    logit_bias: dict[int, float] = Field(
        default_factory=dict,
        max_length=MAX_LOGIT_BIAS_ENTRIES,
        description=f"token id -> bias in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] added to "
        "its logit before sampling",
    )
    allowed_token_ids: list[int] | None = Field(
        None,
        min_length=1,
        max_length=1 << 18,
        description="vLLM's: only these token ids may be sampled (none: any)",
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Return each output token's log-probability and this many top "
        "alternatives (log-softmax of the model's logits, before penalties and temperature)",
    )
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="The same for every prompt token after the first",
    )
    structured_outputs: StructuredOutputs | None = Field(
        None,
        description="Constrain the output to a JSON schema, a regex, a choice or a grammar "
        "(llguidance; docs/structured.md)",
    )
    bad_words: list[str] = Field(
        default_factory=list,
        max_length=MAX_BAD_WORDS,
        description="vLLM's: words never generated (each tokenized as is and with a leading "
        "space); a word's last token is banned wherever the output ends with its other tokens",
    )
    skip_special_tokens: bool = Field(True, description="Leave special tokens out of the text")
    spaces_between_special_tokens: bool = Field(
        True,
        description="With skip_special_tokens false: whether adjacent special tokens are "
        "separated by a space in the text (vLLM's and transformers' option)",
    )
    # the bad words' token ids, set once the engine has tokenized them (text/validation.py)
    _bad_words_ids: tuple[tuple[int, ...], ...] = PrivateAttr(default=())

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        return 0.0 if v < MIN_TEMPERATURE else v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: list[str]) -> list[str]:
        for s in v:
            if s == "":
                raise ValueError("stop strings must be non-empty")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters "
                    f"(got one of {len(s)})"
                )
            if not is_valid_unicode(s):
                raise ValueError("stop strings must be valid Unicode (no lone surrogates)")
        return v

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, v: list[str]) -> list[str]:
        for word in v:
            if not word.strip():
                raise ValueError("bad_words must be non-empty words (not only whitespace)")
            if len(word) > MAX_BAD_WORD_CHARS:
                raise ValueError(
                    f"bad_words must be at most {MAX_BAD_WORD_CHARS} characters each "
                    f"(got one of {len(word)})"
                )
            if not is_valid_unicode(word):
                raise ValueError("bad_words must be valid Unicode (no lone surrogates)")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int]) -> list[int]:
        if any(not 0 <= t <= INT64_MAX for t in v):
            raise ValueError(f"stop_token_ids must be in [0, {INT64_MAX}]")
        return v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias_exact(cls, v: object) -> object:
        """Keys are token ids written one way only ("1", not "0001" or " 1", which would alias
        it silently); values are numbers, not strings pydantic would coerce."""
        if not isinstance(v, dict):
            return v
        seen: set[int] = set()
        for key, value in v.items():
            if isinstance(key, bool) or not isinstance(key, (int, str)):
                raise ValueError("logit_bias keys must be token ids")
            if isinstance(key, str) and not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias keys must be token ids, not {key[:32]!r}")
            if isinstance(key, str) and key != str(int(key)):
                raise ValueError(f"logit_bias key {key[:32]!r} must be written {str(int(key))!r}")
            if int(key) in seen:
                raise ValueError(f"logit_bias has token id {int(key)} twice")
            seen.add(int(key))
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"logit_bias values must be numbers, not {type(value).__name__}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[int, float]) -> dict[int, float]:
        for tok, bias in v.items():
            if not 0 <= tok <= INT64_MAX:
                raise ValueError(f"logit_bias keys must be token ids in [0, {INT64_MAX}]")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # NaN fails both comparisons
                raise ValueError(
                    f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
                )
        return v

    @property
    def has_penalties(self) -> bool:
        """Some logit processing that needs per-request token counts on the device."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def bad_words_ids(self) -> tuple[tuple[int, ...], ...]:
        """The bad words' token ids (empty until the engine tokenized them)."""
        return self._bad_words_ids

    def with_bad_words_ids(self, ids: tuple[tuple[int, ...], ...]) -> SamplingParams:
        """A copy holding the tokenized bad words."""
        out = self.model_copy()
        out._bad_words_ids = ids
        return out

    @property
    def needs_logits_plan(self) -> bool:
        """Something between the forward and the sampler: bias, masks, penalties, logprobs."""
        return (
            bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or self.min_tokens > 0
            or self.has_penalties
            or self.logprobs is not None
            or self.prompt_logprobs is not None
            or self.structured_outputs is not None
            or bool(self.bad_words)
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
