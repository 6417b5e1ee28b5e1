"""What the app keeps for its routes: the engine, the served model name and the API key."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from stallfree.runtime.engine import Engine


@dataclass(slots=True)
class ServerState:
    engine: Engine
    model_name: str
    api_key: str | None


def server_state(request: Request) -> ServerState:
    return request.app.state.sf
