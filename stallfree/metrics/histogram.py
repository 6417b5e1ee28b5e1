"""A write-cheap histogram: the hot path bumps one list slot; the scrape builds the family."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from prometheus_client.utils import floatToGoString

# bucket sets, in seconds, sized to what each histogram times. The request-phase set (e2e,
# queue, prefill, decode, inference) and the TTFT set are vLLM's, so queries and alerts written
# for vLLM read the same `le` values.
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
HOST_TIME_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1,
    0.25, 1.0,
)  # fmt: skip

# tokens a batch computes (vLLM's `iteration_tokens_total` set)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` inclusive (the token-count histograms)."""
    out: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            bound = mantissa * scale
            if bound > max_value:
                return tuple(out)
            out.append(bound)
        scale *= 10


class FastHistogram:
    """Per-bucket (not cumulative) counts; the last slot is +Inf. Single writer, no lock."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(sorted(bounds))
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        # bisect_left: a value equal to a bound belongs to that bound's bucket (le is inclusive)
        self.counts[bisect_left(self.bounds, value)] += n
        self.sum += value * n

    def cumulative(self) -> tuple[list[tuple[str, float]], float]:
        """(le, cumulative count) pairs ending with +Inf, and the sum, for a HistogramMetricFamily."""
        counts = list(self.counts)
        total_sum = self.sum
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*self.bounds, float("inf")), counts, strict=True):
            running += count
            out.append((floatToGoString(bound), running))  # type: ignore[no-untyped-call]
        return out, total_sum
