"""The HTTP server: OpenAI-compatible routes, native `/generate`, `/health` and `/metrics`.

Streaming is Server-Sent Events everywhere: `data: {json}` events, closed by `data: [DONE]`.

Its modules sit in rooms by job, top to bottom; a room imports only the rooms below it (the
"server rooms" contract in `pyproject.toml`):

| room | job |
| --- | --- |
| `launch` | `serve`, `start_server`, uvicorn settings, signal handling and drain |
| `app` | `create_app`: lifespan, app state, error handlers, API-key auth |
| `transport/` | the middleware in front (request ids, body and concurrency limits, drain refusals) and the HTTP protocol (connection budget, request-head deadline) |
| `api/` | the route handlers: completions, chat, `/generate`, utility routes, the disaggregated role |
| `chat/` | a chat's tools, tool-call and reasoning parsers, a choice's text split as it grows |
| `output/` | admission, merged engine streams, SSE bodies, response models, logprobs, tracing |
| `intake/` | request bodies screened (dense ones in a separate process), costed and turned into prompt ids and `SamplingParams`; structured-output spellings |
| `base/` | pydantic request models, `ApiError`, the app's state, the model's sampling defaults |
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
