"""vLLM's `--override-pooler-config` for the pooling runner: the checkpoint's pooling and
normalisation replaced, `{"pooling_type": "MEAN", "normalize": false}`."""

from __future__ import annotations

from typing import Any

POOLING_TYPES = ("MEAN", "CLS", "LAST", "MAX", "MEAN_SQRT_LEN")
_KEYS = ("pooling_type", "normalize")


def check_pooler_override(value: object) -> dict[str, Any]:
    """The override with `pooling_type` upper-cased; ValueError naming what is wrong."""
    if not isinstance(value, dict):
        raise ValueError("the pooler override is a JSON object")
    unknown = sorted(str(k) for k in value if k not in _KEYS)
    if unknown:
        raise ValueError(
            f"unknown pooler setting(s) {', '.join(unknown)}; known: {', '.join(_KEYS)}"
        )
    out: dict[str, Any] = {}
    if "pooling_type" in value:
        kind = value["pooling_type"]
        if not isinstance(kind, str) or kind.upper() not in POOLING_TYPES:
            raise ValueError(f"pooling_type {kind!r} is not one of {', '.join(POOLING_TYPES)}")
        out["pooling_type"] = kind.upper()
    if "normalize" in value:
        if not isinstance(value["normalize"], bool):
            raise ValueError("normalize is true or false")
        out["normalize"] = value["normalize"]
    return out
