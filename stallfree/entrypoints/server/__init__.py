"""The HTTP server: OpenAI-compatible routes, native `/generate`, `/health` and `/metrics`.

Streaming is Server-Sent Events everywhere: `data: {json}` events, closed by `data: [DONE]`.

| module | job |
| --- | --- |
| `app` | `create_app`: lifespan, app state, error handlers, API-key auth |
| `guard` | the middleware in front: request ids, body limit, concurrency limit, drain refusals |
| `connections` | the HTTP protocol: connection budget, request-head deadline |
| `routes` | the route handlers |
| `requests` | request bodies → prompt ids and `SamplingParams` |
| `screening` | the checks before a body is used (model name, unsupported fields, chat size); dense bodies parsed and checked in a separate process |
| `streaming` | admission, merged engine streams, SSE bodies, client-disconnect aborts |
| `errors` | `ApiError` and the mapping of validation and engine errors to it |
| `state` | what the app keeps for its routes: engine, limits, lifecycle (drain) |
| `protocol` | pydantic request and response models |
| `launch` | `serve`, `start_server`, uvicorn settings, signal handling and drain |
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RunningServer": "stallfree.entrypoints.server.launch",
    "Server": "stallfree.entrypoints.server.launch",
    "create_app": "stallfree.entrypoints.server.app",
    "serve": "stallfree.entrypoints.server.launch",
    "start_server": "stallfree.entrypoints.server.launch",
    "uvicorn_config": "stallfree.entrypoints.server.launch",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    # lazy, so a light module here (the body screen's process) does not pull in the engine
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
