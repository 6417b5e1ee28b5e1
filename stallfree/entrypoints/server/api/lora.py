"""LoRA adapters over HTTP, as vLLM serves them: `POST /v1/load_lora_adapter` and
`POST /v1/unload_lora_adapter` (bodies `{"lora_name", "lora_path"}` and `{"lora_name"}`; a
plain-text success line), and the adapters' cards in `/v1/models` (`parent`: the base model)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from stallfree.entrypoints.server.base.errors import ApiError, from_invalid_request
from stallfree.entrypoints.server.base.state import server_state
from stallfree.entrypoints.server.intake.requests import read_body
from stallfree.entrypoints.server.output.responses import ModelCard
from stallfree.runtime.lora.registry import LoraRegistry
from stallfree.runtime.request.errors import InvalidRequestError


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    base_model_name: str | None = None


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's; the name is what counts here


def _registry(request: Request) -> LoraRegistry:
    lora = server_state(request).engine.lora
    if lora is None:
        raise ApiError(
            400,
            "LoRA adapters are not enabled on this server (start it with --enable-lora)",
            code="lora_disabled",
        )
    return lora


async def load_lora_adapter(request: Request) -> Response:
    body = await read_body(request, LoadLoraAdapterRequest)
    lora = _registry(request)
    try:
        await lora.load(body.lora_name, body.lora_path, body.base_model_name)
    except InvalidRequestError as exc:
        raise from_invalid_request(exc) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    body = await read_body(request, UnloadLoraAdapterRequest)
    lora = _registry(request)
    try:
        lora.unload(body.lora_name)
    except InvalidRequestError as exc:
        raise from_invalid_request(exc) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def adapter_cards(request: Request, created: int) -> list[ModelCard]:
    """A card per loaded adapter, its `parent` the base model (vLLM's listing)."""
    state = server_state(request)
    lora = state.engine.lora
    if lora is None:
        return []
    return [
        ModelCard(
            id=info.name,
            created=created,
            root=info.path,
            parent=state.model_name,
            max_model_len=state.engine.max_context_len,
        )
        for info in lora.adapters.values()
    ]


def lora_routes() -> APIRouter:
    router = APIRouter()
    router.add_api_route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"])
    router.add_api_route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"])
    return router


def created_time(request: Request) -> int:
    """One creation time per app (its first model answer), so lists and cards agree."""
    app_state = request.app.state
    if getattr(app_state, "models_created", None) is None:
        app_state.models_created = int(time.time())
    created: int = app_state.models_created
    return created
