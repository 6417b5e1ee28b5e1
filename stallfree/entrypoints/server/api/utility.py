"""The routes beside generation, behind the API key like the rest:

- vLLM's `POST /tokenize` (`prompt`, or chat `messages` with the chat's `tools`, `documents`
  and `chat_template_kwargs`; `add_special_tokens`) and
  `POST /detokenize` (`tokens`);
- `GET /version`, and `GET /server_info`: the configuration, without its secrets, beside
  SGLang's flat keys (`model_path`, `served_model_name`, `tp_size`, ...);
- SGLang's `POST /abort_request` (`rid`, or `abort_all`) and vLLM's `POST /abort_requests`
  (`request_ids`): each names requests by the id the client knows, its `X-Request-Id` (the id
  every answer echoes), or an engine request id (`/generate`'s `rid`, `cmpl-...-0`);
- the Rust routers' worker probes (probes.py), included here.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field, model_validator

from stallfree import __version__
from stallfree.entrypoints.server.api.probes import probe_routes, sglang_server_info
from stallfree.entrypoints.server.base.errors import ApiError
from stallfree.entrypoints.server.base.protocol import (
    MAX_DOCUMENTS,
    MAX_TOOLS,
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    _Body,
    _StrictRequest,
)
from stallfree.entrypoints.server.base.state import server_state
from stallfree.entrypoints.server.chat.tools import template_kwargs
from stallfree.entrypoints.server.intake.requests import (
    chat_prompt_ids_async,
    converting,
    encode_async,
    read_body,
)
from stallfree.entrypoints.server.intake.screening import check_prefill, model_adapter

# the settings `/server_info` never shows
SECRETS = {"server": ("api_key",), "disaggregation": ("secret",)}
REDACTED = "<redacted>"


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # a chat's other template variables, as /v1/chat/completions passes them
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    documents: list[dict[str, Any]] | None = Field(None, max_length=MAX_DOCUMENTS)
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's defaults: special tokens for a prompt; none for a chat (its template writes them)
    add_special_tokens: bool | None = None
    # vLLM's: true unless `continue_final_message` continues the final message (prefill);
    # false alone renders the chat without opening the assistant's turn
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


class AbortRequest(_StrictRequest):
    """SGLang's body: one id, or every request."""

    rid: str | None = Field(None, max_length=256)
    abort_all: bool = False

    @model_validator(mode="after")
    def _one_target(self) -> AbortRequest:
        if (self.rid is None) == (not self.abort_all):
            raise ValueError("send rid, or abort_all: true")
        return self


class AbortRequests(_StrictRequest):
    """vLLM's body: the ids to abort."""

    request_ids: list[str] = Field(min_length=1, max_length=4096)


router = APIRouter()
router.include_router(probe_routes())


@router.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    body = await read_body(request, TokenizeRequest)
    state = server_state(request)
    if body.model is not None:
        model_adapter(state.engine, state.model_name, body.model)
    engine = state.engine
    with converting():
        if body.prompt is not None:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await encode_async(engine, body.prompt, add_special_tokens=special)
        else:
            check_prefill(body.add_generation_prompt, body.continue_final_message)
            chat = ChatCompletionRequest(
                model=state.model_name,
                messages=body.messages,
                tools=body.tools,
                documents=body.documents,
                chat_template_kwargs=body.chat_template_kwargs,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
            )
            ids = await chat_prompt_ids_async(
                engine, chat, bool(body.add_special_tokens), template_kwargs(chat)
            )
    answer: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": engine.max_context_len,
        "tokens": ids,
    }
    if body.return_token_strs:
        answer["token_strs"] = [engine.tokenizer.decode([i]) for i in ids]
    return JSONResponse(answer)


@router.post("/detokenize")
async def detokenize(request: Request) -> JSONResponse:
    body = await read_body(request, DetokenizeRequest)
    state = server_state(request)
    if body.model is not None:
        model_adapter(state.engine, state.model_name, body.model)
    vocab = state.engine.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(
            400,
            f"tokens: {bad} is not a token id of this model (0 to {vocab - 1})",
            param="tokens",
        )
    return JSONResponse({"prompt": state.engine.tokenizer.decode(body.tokens)})


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})


@router.get("/server_info")
async def server_info(request: Request) -> JSONResponse:
    config = server_state(request).engine.config.model_dump(mode="json")
    for section, keys in SECRETS.items():
        for key in keys:
            if config[section].get(key) is not None:
                config[section][key] = REDACTED
    # SGLang's flat keys beside stallfree's own: sglang-router reads them (probes.py)
    flat = sglang_server_info(server_state(request))
    return JSONResponse({**flat, "version": __version__, "config": config})


@router.post("/abort_request")
async def abort_request(request: Request) -> JSONResponse:
    body = await read_body(request, AbortRequest)
    lifecycle = server_state(request).lifecycle
    if body.abort_all:
        aborted = lifecycle.abort_matching(None)
    else:
        assert body.rid is not None
        aborted = lifecycle.abort_matching({body.rid})
    return JSONResponse({"aborted": aborted})


@router.post("/abort_requests")
async def abort_requests(request: Request) -> JSONResponse:
    body = await read_body(request, AbortRequests)
    aborted = server_state(request).lifecycle.abort_matching(set(body.request_ids))
    return JSONResponse({"aborted": aborted})


def utility_routes() -> APIRouter:
    """The utility routes (the probes among them), for the app to include."""
    return router
