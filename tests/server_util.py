"""A live HTTP server on a loopback port around an Engine, with the official `openai` client
and httpx, for the serving tests. The module-scoped `live` server is a fixture in
tests/serving/conftest.py."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from stallfree import Engine
from stallfree.entrypoints.server import RunningServer, create_app, start_server
from tests.engine_util import engine_config

# the module-scoped live server and every test that talks to it share one event loop
module_loop = pytest.mark.asyncio(loop_scope="module")


@dataclass
class Live:
    engine: Engine
    server: RunningServer
    client: AsyncOpenAI
    http: httpx.AsyncClient


@contextlib.asynccontextmanager
async def serving(model: str, api_key: str | None = None, **sections: Any) -> AsyncIterator[Live]:
    section = sections.setdefault("server", {})
    section.setdefault("api_key", api_key)
    section["served_model_name"] = "test-model"
    engine = Engine(engine_config(model, **sections))
    server = await start_server(create_app(engine))
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key=api_key or "unused", max_retries=0)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    http = httpx.AsyncClient(base_url=server.url, headers=headers, timeout=30)
    try:
        yield Live(engine, server, client, http)
    finally:
        await client.close()
        await http.aclose()
        await server.stop()
        await engine.shutdown()
