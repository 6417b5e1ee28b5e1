"""`stallfree serve --data-parallel-size N`: N replicas of one model behind one HTTP front.

Each replica is a whole `stallfree serve` in a process of its own (its scheduler, KV pool,
mirrors and tensor-parallel ranks), listening on a loopback port; the front places each request
on one replica and relays the answer, reusing the prefill/decode router's relay, client and
health cache (docs/replicas.md).

| module | job |
| --- | --- |
| `placement` | which replica a request goes to: the per-replica prefix index, the load |
| `children` | the replica processes: their configuration, start, stop, orphan watch |
| `relay` | one request relayed to one replica (the router's relay with one leg) |
| `metrics` | the replicas' expositions merged, and the front's `stallfree:replica_*` families |
| `front` | `Front`: the replicas, the router parts it reuses, the watch over the processes |
| `app` | `create_front_app`: `/health`, `/metrics`, every other route relayed |
| `launch` | `serve_replicas`: bind, start, wait until up, serve, drain |
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Front": "stallfree.entrypoints.replicas.front",
    "create_front_app": "stallfree.entrypoints.replicas.app",
    "serve_replicas": "stallfree.entrypoints.replicas.launch",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    # lazy: the placement and the replicas' entry point import without the server's app
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
