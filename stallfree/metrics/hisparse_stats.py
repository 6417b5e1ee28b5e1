"""Reads HiSparse statistics at scrape time, without importing `stallfree.hisparse`.

The coordinator (`engine.ctx.hisparse`) exposes `stats()` returning a mapping, a dataclass or
an object with these fields (missing ones read as zero):

| field | meaning |
| --- | --- |
| `hits`, `misses` | top-k selections found in / copied into the device buffer (cumulative) |
| `bytes_h2d`, `bytes_d2h` | KV bytes moved host→device and device→host (cumulative) |
| `host_pool_used`, `host_pool_total` | host KV pool slots in use and in all |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from stallfree.metrics.names import HISPARSE_FIELDS

_ALIASES = {
    "hits": ("hits", "buffer_hits", "num_hits"),
    "misses": ("misses", "buffer_misses", "num_misses"),
    "bytes_h2d": ("bytes_h2d", "bytes_host_to_device", "h2d_bytes"),
    "bytes_d2h": ("bytes_d2h", "bytes_device_to_host", "d2h_bytes"),
    "host_pool_used": ("host_pool_used", "host_slots_used", "host_used"),
    "host_pool_total": ("host_pool_total", "host_slots_total", "host_total", "host_pool_size"),
}


def read_hisparse_stats(engine: Any) -> dict[str, float]:
    """The six fields as floats; all zero when the engine has no HiSparse coordinator."""
    ctx = getattr(engine, "ctx", None)
    coordinator = getattr(ctx, "hisparse", None)
    stats_fn = getattr(coordinator, "stats", None)
    if stats_fn is None:
        return dict.fromkeys(HISPARSE_FIELDS, 0.0)
    raw = _as_mapping(stats_fn())
    return {name: _pick(raw, _ALIASES[name]) for name in HISPARSE_FIELDS}


def _as_mapping(stats: Any) -> Mapping[str, Any]:
    if isinstance(stats, Mapping):
        return stats
    if dataclasses.is_dataclass(stats) and not isinstance(stats, type):
        return dataclasses.asdict(stats)
    return {name: getattr(stats, name) for name in dir(stats) if not name.startswith("_")}


def _pick(raw: Mapping[str, Any], names: tuple[str, ...]) -> float:
    for name in names:
        value = raw.get(name)
        if isinstance(value, int | float):
            return float(value)
    return 0.0
