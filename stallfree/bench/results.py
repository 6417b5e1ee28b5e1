"""Per-request records and the figures of one run: throughput, latency distributions, peaks;
and the median of several runs of one mode."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, fields, is_dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from stallfree.bench.counters import StallFigures

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


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
    generated_text: str = ""  # kept for --save-detailed; not in each request's JSON entry

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(slots=True)
class Distribution:
    """Mean, percentiles and the population standard deviation (numpy's default, as vLLM
    reports it) of some latencies, in seconds; None when there were none."""

    mean: float | None = None
    median: float | None = None
    p90: float | None = None
    p99: float | None = None
    std: float | None = None

    @classmethod
    def of(cls, values: list[float]) -> Distribution:
        if not values:
            return cls()
        import numpy as np  # here, not at the top: the base install has no numpy

        arr = np.asarray(values, dtype=np.float64)
        p50, p90, p99 = np.percentile(arr, [50, 90, 99])
        return cls(float(arr.mean()), float(p50), float(p90), float(p99), float(arr.std()))


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
    target) and every request record.

    A run of its own has `repeats` empty; `repeat` (1-based), `sequence` (its place among all
    runs of the bench, 0-based) and `started_at`/`finished_at` (Unix time) say when it ran. The
    result of `median_result` holds the median figures, every repeat's records pooled, and
    the runs themselves in `repeats`."""

    mode: str
    settings: dict[str, Any]
    summary: RunSummary
    stallfree: StallFigures | None
    requests: list[RequestRecord]
    errors: list[str] = field(default_factory=list)
    repeat: int = 1
    sequence: int = 0
    started_at: float | None = None
    finished_at: float | None = None
    repeats: list[RunResult] = field(default_factory=list)

    @property
    def runs(self) -> list[RunResult]:
        """The individual runs behind these figures: the repeats, or this run alone."""
        return self.repeats or [self]


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


T = TypeVar("T", bound="DataclassInstance")


def median_number(values: list[Any]) -> float | int | None:
    """The median of the values present; counts stay counts (the lower middle one when even)."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    if all(isinstance(v, int) for v in present):
        low: int = statistics.median_low(present)
        return low
    return float(statistics.median(present))


def _median_by_key(dicts: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Per key; a key a run lacks counts as 0 there (a site that never stalled). Dataclass
    values (a worker rank's figures) are medians field by field over the runs that have them."""
    present = [d for d in dicts if d is not None]
    if not present:
        return None
    keys = sorted({k for d in present for k in d})
    out: dict[str, Any] = {}
    for k in keys:
        values = [d[k] for d in present if k in d]
        if is_dataclass(values[0]) and not isinstance(values[0], type):
            out[k] = median_of(type(values[0]), values)
        else:
            out[k] = float(statistics.median([d.get(k, 0.0) for d in present]))
    return out


def _median_value(values: list[Any]) -> Any:
    sample = next((v for v in values if v is not None), None)
    if isinstance(sample, dict):
        return _median_by_key(values)
    if isinstance(sample, list):
        return sorted({x for v in values if v is not None for x in v})
    if is_dataclass(sample) and not isinstance(sample, type):
        return median_of(type(sample), [v for v in values if v is not None])
    return median_number(values)


def median_of(cls: type[T], items: list[T]) -> T:
    """A dataclass whose every field is the median of that field over `items`."""
    return cls(**{f.name: _median_value([getattr(x, f.name) for x in items]) for f in fields(cls)})


def median_result(runs: list[RunResult]) -> RunResult:
    """One mode over several runs: each figure the median of the runs' figures."""
    stalls = [r.stallfree for r in runs if r.stallfree is not None]
    return RunResult(
        mode=runs[0].mode,
        settings=runs[0].settings,
        summary=median_of(RunSummary, [r.summary for r in runs]),
        stallfree=median_of(StallFigures, stalls) if stalls else None,
        requests=[x for r in runs for x in r.requests],
        errors=sorted({e for r in runs for e in r.errors})[:10],
        repeat=0,
        sequence=runs[0].sequence,
        started_at=runs[0].started_at,
        finished_at=runs[-1].finished_at,
        repeats=list(runs),
    )
