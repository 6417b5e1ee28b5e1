"""Metric names and label sets, in one place for the collector, the docs and the dashboard."""

from __future__ import annotations

PREFIX = "stallfree:"
BASE_LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error")
