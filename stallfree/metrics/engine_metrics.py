"""`EngineMetrics`: Prometheus families in the engine's own `CollectorRegistry`.

Counters and gauges come from one `EngineSnapshot` taken at scrape time. Histograms are built
from the engine's typed events (request timings, schedule and stall durations): hooks only add
to floats and `FastHistogram`s, and nothing on the hot path reads them back.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from stallfree.metrics.histogram import (
    HOST_TIME_BUCKETS,
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    FastHistogram,
)
from stallfree.metrics.names import BASE_LABELS, FINISH_REASONS, PREFIX
from stallfree.runtime.observer import MetricsExporter
from stallfree.runtime.sparse import SparseStats
from stallfree.runtime.stats import EngineSnapshot

if TYPE_CHECKING:
    from stallfree.config import StallfreeConfig
    from stallfree.runtime.req import Req

_engine_ids = itertools.count()
SnapshotSource = Callable[[], EngineSnapshot]


class EngineMetrics(MetricsExporter):
    def __init__(
        self,
        model_name: str,
        engine_label: str,
        snapshot: SnapshotSource,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.labels = (model_name, engine_label)
        self.snapshot = snapshot
        self.registry = registry if registry is not None else CollectorRegistry()
        self.ttft = FastHistogram(TTFT_BUCKETS)
        self.itl = FastHistogram(ITL_BUCKETS)
        self.e2e = FastHistogram(REQUEST_LATENCY_BUCKETS)
        self.queue_time = FastHistogram(REQUEST_LATENCY_BUCKETS)
        self.schedule_time = FastHistogram(HOST_TIME_BUCKETS)
        self.stall_time: dict[str, FastHistogram] = {}
        self._last_token: dict[Req, float] = {}
        self.registry.register(_Collector(self))

    @classmethod
    def for_config(cls, config: StallfreeConfig, snapshot: SnapshotSource) -> EngineMetrics:
        name = config.server.model_name(config.model.path)
        label = config.metrics.engine_label or str(next(_engine_ids))
        return cls(name, label, snapshot)

    def render(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)

    # ------------------------------------------------------------------ events (hot path)

    def on_request_scheduled(self, req: Req) -> None:
        started = req.first_scheduled_time or req.arrival_time
        self.queue_time.observe(started - req.arrival_time)

    def on_tokens(self, req: Req, count: int, now: float) -> None:
        last = self._last_token.get(req)
        if last is None:
            self.ttft.observe(now - req.arrival_time)
        else:
            self.itl.observe((now - last) / count, count)
        self._last_token[req] = now

    def on_request_finished(self, req: Req, now: float) -> None:
        self.e2e.observe(now - req.arrival_time)
        self._last_token.pop(req, None)

    def on_stall(self, site: str, seconds: float) -> None:
        hist = self.stall_time.get(site)
        if hist is None:
            hist = self.stall_time[site] = FastHistogram(HOST_TIME_BUCKETS)
        hist.observe(seconds)

    def on_schedule(self, seconds: float) -> None:
        self.schedule_time.observe(seconds)


class PrometheusPlugin:
    """The metrics plug-in the engine loads (entry point `stallfree.metrics:prometheus`)."""

    def build(self, config: StallfreeConfig, snapshot: SnapshotSource) -> EngineMetrics:
        return EngineMetrics.for_config(config, snapshot)


PLUGIN = PrometheusPlugin()


class _Collector(Collector):
    def __init__(self, metrics: EngineMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        m, labels = self.m, list(self.m.labels)
        snap = m.snapshot()
        yield from _gauges(snap, labels)
        yield from _request_counters(snap, labels)
        yield from _latency_histograms(m, labels)
        yield from _runtime_metrics(m, snap, labels)
        yield from _hisparse_metrics(snap.sparse or SparseStats(), labels)


def _gauge(name: str, doc: str, labels: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(PREFIX + name, doc, labels=BASE_LABELS)
    family.add_metric(labels, value)
    return family


def _counter(name: str, doc: str, labels: list[str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(PREFIX + name, doc, labels=BASE_LABELS)
    family.add_metric(labels, value)
    return family


def _labelled_counter(
    name: str, doc: str, labels: list[str], key: str, values: dict[str, int]
) -> CounterMetricFamily:
    family = CounterMetricFamily(PREFIX + name, doc, labels=[*BASE_LABELS, key])
    for value_label, value in list(values.items()):
        family.add_metric([*labels, value_label], value)
    return family


def _histogram(
    name: str, doc: str, labels: list[str], hists: dict[str, FastHistogram], key: str | None
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(
        PREFIX + name, doc, labels=[*BASE_LABELS, key] if key else BASE_LABELS
    )
    for value_label, hist in list(hists.items()):
        buckets, total = hist.cumulative()
        family.add_metric([*labels, value_label] if key else labels, buckets, total)
    return family


def _gauges(snap: EngineSnapshot, labels: list[str]) -> Iterator[Metric]:
    yield _gauge("num_requests_running", "Requests in the running batch.", labels, snap.running)
    yield _gauge("num_requests_waiting", "Requests waiting to be scheduled.", labels, snap.waiting)
    yield _gauge(
        "kv_cache_usage_perc",
        "Share of KV cache slots requests use, 0 to 1 (unused prefix-cache pages count as free).",
        labels,
        snap.pools.kv_usage,
    )
    yield _gauge(
        "prefix_cache_usage_perc",
        "Share of KV cache slots the prefix cache holds, in use or not, 0 to 1.",
        labels,
        snap.pools.cache_usage,
    )


def _request_counters(snap: EngineSnapshot, labels: list[str]) -> Iterator[Metric]:
    c = snap.counters
    yield _counter("prompt_tokens", "Prompt tokens of scheduled requests.", labels, c.prompt_tokens)
    yield _counter("generation_tokens", "Generated tokens.", labels, c.generation_tokens)
    finished = dict.fromkeys(FINISH_REASONS, 0) | c.finished
    yield _labelled_counter(
        "request_success", "Finished requests by reason.", labels, "finished_reason", finished
    )
    yield _counter("num_preemptions", "Requests retracted to free KV.", labels, c.retractions)
    yield _counter(
        "prefix_cache_queries",
        "Prefix cache lookups at admission, in tokens (prompt and any earlier outputs).",
        labels,
        c.prefix_cache_queries,
    )
    yield _counter(
        "prefix_cache_hits",
        "Tokens admissions found in the prefix cache.",
        labels,
        c.prefix_cache_hits,
    )
    yield _counter(
        "prefix_cache_evicted_tokens",
        "Tokens evicted from the prefix cache to make room.",
        labels,
        c.prefix_cache_evicted_tokens,
    )


def _latency_histograms(m: EngineMetrics, labels: list[str]) -> Iterator[Metric]:
    for name, doc, hist in (
        ("time_to_first_token_seconds", "Arrival to first output token.", m.ttft),
        ("inter_token_latency_seconds", "Time between output tokens.", m.itl),
        ("e2e_request_latency_seconds", "Arrival to finish.", m.e2e),
        ("request_queue_time_seconds", "Arrival to first scheduling.", m.queue_time),
    ):
        yield _histogram(name, doc, labels, {"": hist}, None)


def _runtime_metrics(m: EngineMetrics, snap: EngineSnapshot, labels: list[str]) -> Iterator[Metric]:
    yield _labelled_counter(
        "sync_stalls", "Device-to-host reads (host_read) by site.", labels, "site", snap.stalls
    )
    yield _histogram(
        "sync_stall_seconds", "Host wait per host_read, by site.", labels, m.stall_time, "site"
    )
    yield _labelled_counter(
        "host_mirror_reads",
        "Reads served by host mirrors, by field.",
        labels,
        "field",
        snap.mirror_reads,
    )
    yield _histogram(
        "schedule_seconds",
        "Host time to build and launch a batch.",
        labels,
        {"": m.schedule_time},
        None,
    )
    busy, idle = snap.device_busy_seconds, snap.device_idle_seconds
    yield _counter("device_busy_seconds", "Stream time spent executing work.", labels, busy)
    yield _counter(
        "device_idle_seconds", "Stream idle time while requests were in the engine.", labels, idle
    )
    yield _counter("steps", "Batches launched.", labels, snap.counters.steps)
    yield _counter(
        "overlap_steps",
        "Launches made while an earlier batch was in flight.",
        labels,
        snap.counters.overlap_steps,
    )


def _hisparse_metrics(stats: SparseStats, labels: list[str]) -> Iterator[Metric]:
    yield _counter(
        "hisparse_hits", "Top-k selections found in the device buffer.", labels, stats.hits
    )
    yield _counter(
        "hisparse_misses", "Top-k selections copied in from the host.", labels, stats.misses
    )
    moved = CounterMetricFamily(
        PREFIX + "hisparse_bytes_moved",
        "KV bytes moved by HiSparse.",
        labels=[*BASE_LABELS, "direction"],
    )
    moved.add_metric([*labels, "h2d"], stats.bytes_h2d)
    moved.add_metric([*labels, "d2h"], stats.bytes_d2h)
    yield moved
    yield _gauge(
        "hisparse_host_pool_used", "Host KV pool slots in use.", labels, stats.host_pool_used
    )
    yield _gauge("hisparse_host_pool_total", "Host KV pool slots.", labels, stats.host_pool_total)
