"""Response bodies of the OpenAI-compatible routes, and a whole body sent as the pieces it was
written in (`json_pieces`, `PiecesResponse`)."""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Iterable
from typing import Any, Literal

from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import Receive, Scope, Send


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens the prefix cache served


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int | None = None) -> UsageInfo:
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=None
            if cached is None
            else PromptTokensDetails(cached_tokens=cached),
        )


class CompletionLogprobs(BaseModel):
    """The legacy completions form; `None` entries belong to the first prompt token (echo)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # with a reasoning parser: the thinking (`chat_output.ChoiceText.message`)
    reasoning_content: str | None = None
    # OpenAI's tool calls: {"id", "type": "function", "function": {"name", "arguments"}}
    tool_calls: list[dict[str, Any]] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    # entries {"index", and "id", "type", "function": {"name", "arguments"}} as far as known
    tool_calls: list[dict[str, Any]] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    # a LoRA adapter's card adds vLLM's `root` (its checkpoint) and `parent` (the base model)
    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "stallfree"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------- a whole body, in pieces


def dumps(content: Any) -> bytes:
    """JSON as `JSONResponse` writes it (so a body written in pieces is the same bytes)."""
    return json.dumps(
        content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode("utf-8")


def json_pieces(envelope: BaseModel, key: str, items: Iterable[dict[str, Any]]) -> list[bytes]:
    """`envelope` as JSON with its (empty) list field `key` holding `items` (each as
    `model_dump()` gives it), written one item at a time: the bytes of `dumps` of the whole
    dump, but no item's values outlive their own piece."""
    fields = envelope.model_dump()
    names = list(fields)
    at = names.index(key)
    before = dumps({k: fields[k] for k in names[:at]})[:-1]  # without its closing brace
    after = dumps({k: fields[k] for k in names[at + 1 :]})
    pieces = [before + (b"," if at else b"") + dumps(key) + b":["]
    for i, item in enumerate(items):
        pieces.append((b"," if i else b"") + dumps(item))
    pieces.append(b"]" + (b"," + after[1:] if len(after) > 2 else b"}"))
    return pieces


class PiecesResponse(Response):
    """A JSON body sent as the pieces `json_pieces` wrote, each let go once it is sent; the
    headers are `JSONResponse`'s (with the whole body's `content-length`)."""

    media_type = "application/json"

    def __init__(self, pieces: list[bytes], status_code: int = 200) -> None:
        self._pieces = collections.deque(pieces)
        length = sum(map(len, pieces))
        super().__init__(status_code=status_code, headers={"content-length": str(length)})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        pieces = self._pieces
        while pieces:
            piece = pieces.popleft()
            await send({"type": "http.response.body", "body": piece, "more_body": bool(pieces)})
        if self.background is not None:
            await self.background()
