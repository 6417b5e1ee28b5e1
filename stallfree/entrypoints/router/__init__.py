"""`stallfree router`: an OpenAI-compatible front for prefill/decode disaggregated serving.

Each completions or chat request goes to one prefill server and one decode server at once,
paired by a bootstrap room; the client gets the decode server's answer, streamed through as it
arrives. Either leg failing, or the client leaving, cancels the other at once.

| module | job |
| --- | --- |
| `flags` | the command's flags (SGLang's spellings) and `RouterSettings` (no server extra needed) |
| `pool` | the servers, the pick of one of each kind per request, the health probe cache |
| `dispatch` | `Router` and `Relay`: the two legs of a request, run and failed together |
| `startup` | the checks before listening: every server up, every pair's handshake |
| `app` | `create_app`: the routes, the API-key check, the body limit and parse |
| `metrics` | the router's own Prometheus registry |
| `launch` | `serve_router`, `start_router`, signals |
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Router": "stallfree.entrypoints.router.dispatch",
    "RouterSettings": "stallfree.entrypoints.router.flags",
    "RunningRouter": "stallfree.entrypoints.router.launch",
    "StartupError": "stallfree.entrypoints.router.startup",
    "create_app": "stallfree.entrypoints.router.app",
    "serve_router": "stallfree.entrypoints.router.launch",
    "start_router": "stallfree.entrypoints.router.launch",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    # lazy: `stallfree --help` builds this command's flags without the server extra installed
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
