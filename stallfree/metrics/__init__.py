"""Prometheus metrics, one `CollectorRegistry` per engine, names prefixed `stallfree:`."""

from __future__ import annotations

from stallfree.metrics.engine_metrics import PLUGIN, EngineMetrics, PrometheusPlugin

__all__ = ["PLUGIN", "EngineMetrics", "PrometheusPlugin"]
