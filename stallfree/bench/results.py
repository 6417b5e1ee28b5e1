"""Per-request records and the figures of one run: throughput, latency distributions, peaks."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from stallfree.bench.counters import StallFigures


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it. Times in seconds; `start` is from the run's start."""

    prompt_len: int
    output_len: int
    start: float = 0.0
    success: bool = False
    error: str | None = None
    finish_reason: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(slots=True)
class Distribution:
    mean: float | None = None
    median: float | None = None
    p90: float | None = None
    p99: float | None = None

    @classmethod
    def of(cls, values: list[float]) -> Distribution:
        if not values:
            return cls()
        arr = np.asarray(values, dtype=np.float64)
        p50, p90, p99 = np.percentile(arr, [50, 90, 99])
        return cls(float(arr.mean()), float(p50), float(p90), float(p99))


@dataclass(slots=True)
class RunSummary:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    ttft: Distribution
    itl: Distribution
    tpot: Distribution
    e2e: Distribution
    peak_concurrency: int


@dataclass(slots=True)
class RunResult:
    """One mode's run: its name, settings, summary, stall figures (None: not a stallfree
    target) and every request record."""

    mode: str
    settings: dict
    summary: RunSummary
    stallfree: StallFigures | None
    requests: list[RequestRecord]
    errors: list[str] = field(default_factory=list)


def summarize(records: list[RequestRecord], duration: float, peak: int) -> RunSummary:
    ok = [r for r in records if r.success]
    tokens_in = sum(r.input_tokens for r in ok)
    tokens_out = sum(r.output_tokens for r in ok)
    per_s = 1.0 / duration if duration > 0 else 0.0
    return RunSummary(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration,
        total_input_tokens=tokens_in,
        total_output_tokens=tokens_out,
        request_throughput=len(ok) * per_s,
        input_throughput=tokens_in * per_s,
        output_throughput=tokens_out * per_s,
        total_throughput=(tokens_in + tokens_out) * per_s,
        ttft=Distribution.of([r.ttft for r in ok if r.ttft is not None]),
        itl=Distribution.of([x for r in ok for x in r.itls]),
        tpot=Distribution.of([t for r in ok if (t := r.tpot) is not None]),
        e2e=Distribution.of([r.e2e for r in ok if r.e2e is not None]),
        peak_concurrency=peak,
    )
