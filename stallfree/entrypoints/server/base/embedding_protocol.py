"""The bodies of `/v1/embeddings`: OpenAI's request, and its answer's shape; vLLM's
`/pooling` takes the same request."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr


class EmbeddingRequest(BaseModel):
    """OpenAI's fields, plus vLLM's `truncate_prompt_tokens`; unknown fields are ignored, as
    on the other OpenAI routes (`user` among them)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    truncate_prompt_tokens: StrictInt | None = None

    def inputs(self) -> list[str] | list[list[int]]:
        """The inputs as a list: one string, or one list of token ids, each."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and isinstance(value[0], int):
            return [value]
        return value  # type: ignore[return-value]


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the float32 values' little-endian bytes


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(BaseModel):
    """vLLM's `/pooling` answer."""

    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[PoolingData]
    usage: EmbeddingUsage
