"""`EngineMetrics`: an `EngineObserver` that keeps plain counters on the hot path and turns
them into Prometheus families, in the engine's own `CollectorRegistry`, only when scraped."""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from stallfree.metrics.hisparse_stats import read_hisparse_stats
from stallfree.metrics.histogram import (
    HOST_TIME_BUCKETS,
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    FastHistogram,
)
from stallfree.metrics.names import BASE_LABELS, FINISH_REASONS, PREFIX
from stallfree.runtime.observer import EngineObserver

if TYPE_CHECKING:
    from stallfree.config import StallfreeConfig
    from stallfree.runtime.engine import Engine
    from stallfree.runtime.req import Req

_engine_ids = itertools.count()


class EngineMetrics(EngineObserver):
    """Hooks only add to ints, floats and `FastHistogram`s; the scrape reads them."""

    def __init__(
        self, model_name: str, engine_label: str, registry: CollectorRegistry | None = None
    ) -> None:
        self.labels = (model_name, engine_label)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.engine: Engine | None = None
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.preemptions = 0
        self.steps = 0
        self.overlap_steps = 0
        self.finished: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)
        self.stalls: dict[str, int] = defaultdict(int)
        self.mirror_reads: dict[str, int] = defaultdict(int)
        self.ttft = FastHistogram(TTFT_BUCKETS)
        self.itl = FastHistogram(ITL_BUCKETS)
        self.e2e = FastHistogram(REQUEST_LATENCY_BUCKETS)
        self.queue_time = FastHistogram(REQUEST_LATENCY_BUCKETS)
        self.schedule_time = FastHistogram(HOST_TIME_BUCKETS)
        self.stall_time: dict[str, FastHistogram] = {}
        self._last_token: dict[Req, float] = {}
        self._active = 0
        self._active_since = 0.0
        self._active_wall = 0.0
        self._idle_reported = 0.0
        self.registry.register(_Collector(self))

    @classmethod
    def for_config(cls, config: StallfreeConfig) -> EngineMetrics:
        name = config.server.model_name(config.model.path)
        label = config.metrics.engine_label or str(next(_engine_ids))
        return cls(name, label)

    def render(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)

    # ------------------------------------------------------------------ hooks (hot path)

    def on_start(self, engine: Engine) -> None:
        self.engine = engine

    def on_request_added(self, req: Req) -> None:
        if self._active == 0:
            self._active_since = time.perf_counter()
        self._active += 1

    def on_request_scheduled(self, req: Req) -> None:
        self.prompt_tokens += len(req.origin_input_ids)
        started = req.first_scheduled_time or time.perf_counter()
        self.queue_time.observe(started - req.arrival_time)

    def on_tokens(self, req: Req, count: int, now: float) -> None:
        self.generation_tokens += count
        last = self._last_token.get(req)
        if last is None:
            self.ttft.observe(now - req.arrival_time)
        else:
            self.itl.observe((now - last) / count, count)
        self._last_token[req] = now

    def on_request_finished(self, req: Req, now: float) -> None:
        reason = req.finished_reason.value if req.finished_reason is not None else "abort"
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.e2e.observe(now - req.arrival_time)
        self._last_token.pop(req, None)
        self._active -= 1
        if self._active <= 0:
            self._active = 0
            self._active_wall += now - self._active_since

    def on_retracted(self, req: Req) -> None:
        self.preemptions += 1

    def on_step(self, num_reqs: int, decode: bool, overlapped: bool) -> None:
        self.steps += 1
        if overlapped:
            self.overlap_steps += 1

    def on_stall(self, site: str, seconds: float) -> None:
        self.stalls[site] += 1
        hist = self.stall_time.get(site)
        if hist is None:
            hist = self.stall_time[site] = FastHistogram(HOST_TIME_BUCKETS)
        hist.observe(seconds)

    def on_mirror_read(self, field: str) -> None:
        self.mirror_reads[field] += 1

    def on_schedule(self, seconds: float) -> None:
        self.schedule_time.observe(seconds)

    # ------------------------------------------------------------------ scrape side

    def device_seconds(self) -> tuple[float, float]:
        """(busy, idle): idle is wall time with requests in the engine minus stream busy time."""
        stream = getattr(self.engine, "stream", None)
        busy = float(stream.busy_seconds) if stream is not None else 0.0
        wall = self._active_wall
        if self._active > 0:
            wall += time.perf_counter() - self._active_since
        # NOTE: CUDA settles busy time when an event is waited on, so the difference can
        # dip; a counter must never go down.
        self._idle_reported = max(self._idle_reported, wall - busy)
        return busy, self._idle_reported


class _Collector(Collector):
    def __init__(self, metrics: EngineMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        m, labels = self.m, list(self.m.labels)
        yield from _gauges(m, labels)
        yield from _request_counters(m, labels)
        yield from _latency_histograms(m, labels)
        yield from _runtime_metrics(m, labels)
        yield from _hisparse_metrics(m, labels)


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


def _gauges(m: EngineMetrics, labels: list[str]) -> Iterator[Metric]:
    running = waiting = 0
    usage = 0.0
    engine = m.engine
    if engine is not None and getattr(engine, "_started", False):
        running = engine.scheduler.num_running
        waiting = len(engine.scheduler.waiting)
        allocator = engine.ctx.allocator
        usage = 1.0 - allocator.available_size() / allocator.size
    yield _gauge("num_requests_running", "Requests in the running batch.", labels, running)
    yield _gauge("num_requests_waiting", "Requests waiting to be scheduled.", labels, waiting)
    yield _gauge("kv_cache_usage_perc", "Share of KV cache slots in use, 0 to 1.", labels, usage)


def _request_counters(m: EngineMetrics, labels: list[str]) -> Iterator[Metric]:
    yield _counter("prompt_tokens", "Prompt tokens of scheduled requests.", labels, m.prompt_tokens)
    yield _counter("generation_tokens", "Generated tokens.", labels, m.generation_tokens)
    yield _labelled_counter(
        "request_success", "Finished requests by reason.", labels, "finished_reason", m.finished
    )
    yield _counter("num_preemptions", "Requests retracted to free KV.", labels, m.preemptions)


def _latency_histograms(m: EngineMetrics, labels: list[str]) -> Iterator[Metric]:
    for name, doc, hist in (
        ("time_to_first_token_seconds", "Arrival to first output token.", m.ttft),
        ("inter_token_latency_seconds", "Time between output tokens.", m.itl),
        ("e2e_request_latency_seconds", "Arrival to finish.", m.e2e),
        ("request_queue_time_seconds", "Arrival to first scheduling.", m.queue_time),
    ):
        yield _histogram(name, doc, labels, {"": hist}, None)


def _runtime_metrics(m: EngineMetrics, labels: list[str]) -> Iterator[Metric]:
    yield _labelled_counter(
        "sync_stalls", "Device-to-host reads (host_read) by site.", labels, "site", m.stalls
    )
    yield _histogram(
        "sync_stall_seconds", "Host wait per host_read, by site.", labels, m.stall_time, "site"
    )
    yield _labelled_counter(
        "host_mirror_reads",
        "Reads served by host mirrors, by field.",
        labels,
        "field",
        m.mirror_reads,
    )
    yield _histogram(
        "schedule_seconds",
        "Host time to build and launch a batch.",
        labels,
        {"": m.schedule_time},
        None,
    )
    busy, idle = m.device_seconds()
    yield _counter("device_busy_seconds", "Stream time spent executing work.", labels, busy)
    yield _counter(
        "device_idle_seconds", "Stream idle time while requests were in the engine.", labels, idle
    )
    yield _counter("steps", "Batches launched.", labels, m.steps)
    yield _counter(
        "overlap_steps",
        "Launches made while an earlier batch was in flight.",
        labels,
        m.overlap_steps,
    )


def _hisparse_metrics(m: EngineMetrics, labels: list[str]) -> Iterator[Metric]:
    stats = read_hisparse_stats(m.engine)
    yield _counter(
        "hisparse_hits", "Top-k selections found in the device buffer.", labels, stats["hits"]
    )
    yield _counter(
        "hisparse_misses", "Top-k selections copied in from the host.", labels, stats["misses"]
    )
    moved = CounterMetricFamily(
        PREFIX + "hisparse_bytes_moved",
        "KV bytes moved by HiSparse.",
        labels=[*BASE_LABELS, "direction"],
    )
    moved.add_metric([*labels, "h2d"], stats["bytes_h2d"])
    moved.add_metric([*labels, "d2h"], stats["bytes_d2h"])
    yield moved
    yield _gauge(
        "hisparse_host_pool_used", "Host KV pool slots in use.", labels, stats["host_pool_used"]
    )
    yield _gauge(
        "hisparse_host_pool_total", "Host KV pool slots.", labels, stats["host_pool_total"]
    )
