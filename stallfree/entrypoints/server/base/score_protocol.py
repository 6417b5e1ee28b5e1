"""The bodies of `/v1/score` (vLLM's) and `/v1/rerank` (Jina's and Cohere's), for cross-encoders."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr


class ScoreRequest(BaseModel):
    """vLLM's: `text_1` against `text_2`; one `text_1` scores against every `text_2`, else
    the two lists pair up in order."""

    model_config = ConfigDict(extra="ignore")

    model: str
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]
    truncate_prompt_tokens: StrictInt | None = None


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


class RerankDocument(BaseModel):
    """Cohere's document object; a plain string is accepted too."""

    model_config = ConfigDict(extra="ignore")

    text: StrictStr


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    query: StrictStr
    documents: list[StrictStr | RerankDocument]
    top_n: StrictInt | None = Field(None, ge=0)
    return_documents: bool = True
    truncate_prompt_tokens: StrictInt | None = None

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
