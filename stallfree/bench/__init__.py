"""The load generator behind `stallfree bench`: workloads, targets, runner, reports."""

from __future__ import annotations

from stallfree.bench.datasets import build_requests
from stallfree.bench.results import Distribution, RequestRecord, RunResult, RunSummary
from stallfree.bench.runner import Mode, RunSettings, compare_modes, run_mode, run_modes
from stallfree.bench.workloads import BenchRequest, WorkloadSpec

__all__ = [
    "BenchRequest",
    "Distribution",
    "Mode",
    "RequestRecord",
    "RunResult",
    "RunSettings",
    "RunSummary",
    "WorkloadSpec",
    "build_requests",
    "compare_modes",
    "run_mode",
    "run_modes",
]
