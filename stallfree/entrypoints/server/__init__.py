"""The HTTP server: OpenAI-compatible routes, native `/generate`, `/health` and `/metrics`.

Streaming is Server-Sent Events everywhere: `data: {json}` events, closed by `data: [DONE]`.

| module | job |
| --- | --- |
| `app` | `create_app`: lifespan, app state, error handlers, API-key auth |
| `guard` | the middleware in front: request ids, body limit, concurrency limit, drain refusals |
| `connections` | the HTTP protocol: connection budget, request-head deadline |
| `routes` | the route handlers |
| `requests` | request bodies → prompt ids and `SamplingParams`; unsupported-field rejection |
| `streaming` | admission, merged engine streams, SSE bodies, client-disconnect aborts |
| `errors` | `ApiError` and the mapping of validation and engine errors to it |
| `state` | what the app keeps for its routes: engine, limits, lifecycle (drain) |
| `protocol` | pydantic request and response models |
| `launch` | `serve`, `start_server`, uvicorn settings, signal handling and drain |
"""

from stallfree.entrypoints.server.app import create_app
from stallfree.entrypoints.server.launch import (
    RunningServer,
    Server,
    serve,
    start_server,
    uvicorn_config,
)

__all__ = ["RunningServer", "Server", "create_app", "serve", "start_server", "uvicorn_config"]
