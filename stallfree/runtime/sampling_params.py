"""Sampling parameters, validated by pydantic so bad values fail with the field's name.

Every field is bounded here, so no value a client can send overflows a tensor or the admission
arithmetic. Bounds that depend on the model (top_k and stop token ids against the vocabulary,
max_new_tokens against the context and the KV cache) are checked by `Engine.check_params` and
`Engine.check_prompt`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

INT64_MAX = (1 << 63) - 1
MAX_NEW_TOKENS = (1 << 31) - 1  # far beyond any context; the engine caps to the context anyway
MAX_TEMPERATURE = 100.0
# Below this a temperature is read as 0 (greedy): logits divided by it overflow float32 to inf,
# and the softmax of inf is NaN, so there is no well-defined distribution left to sample from.
MIN_TEMPERATURE = 1e-5
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 256


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

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int]) -> list[int]:
        if any(not 0 <= t <= INT64_MAX for t in v):
            raise ValueError(f"stop_token_ids must be in [0, {INT64_MAX}]")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
