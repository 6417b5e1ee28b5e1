"""stallfree: an async overlap-scheduling runtime for LLM serving."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "stallfree.runtime.engine",
    "EngineClosedError": "stallfree.runtime.request.errors",
    "EngineOverloadedError": "stallfree.runtime.request.errors",
    "EngineSnapshot": "stallfree.runtime.telemetry.stats",
    "EngineUnhealthyError": "stallfree.runtime.request.errors",
    "GenerationChunk": "stallfree.runtime.request.outputs",
    "GenerationResult": "stallfree.runtime.request.outputs",
    "InvalidRequestError": "stallfree.runtime.request.errors",
    "SamplingParams": "stallfree.runtime.request.sampling_params",
    "StallfreeConfig": "stallfree.config",
    "load_config": "stallfree.config",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    # lazy, so `import stallfree.config` does not pull in the model stack.
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'stallfree' has no attribute {name!r}")
