"""Prometheus metrics, one `CollectorRegistry` per engine, names prefixed `stallfree:`."""

from __future__ import annotations

from stallfree.metrics.engine_metrics import EngineMetrics
from stallfree.metrics.hisparse_stats import read_hisparse_stats

__all__ = ["EngineMetrics", "read_hisparse_stats"]
