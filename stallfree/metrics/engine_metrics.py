"""`EngineMetrics`: Prometheus families in the engine's own `CollectorRegistry`.

Counters and gauges come from one `EngineSnapshot` taken at scrape time (their families are in
`snapshot_families`). Histograms are built from the engine's typed events (request timings,
schedule and stall durations): hooks only add to floats and `FastHistogram`s, and nothing on
the hot path reads them back.

Engines that share a registry share one collector: each name is one family (one `# HELP`), with
a sample per engine.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import HistogramMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from stallfree.metrics.histogram import (
    HOST_TIME_BUCKETS,
    ITERATION_TOKEN_BUCKETS,
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    FastHistogram,
    one_two_five_buckets,
)
from stallfree.metrics.names import BASE_LABELS, MIRROR_FIELDS, PREFIX, STALL_SITES
from stallfree.metrics.operator import config_info_labels
from stallfree.metrics.snapshot_families import (
    counter,
    gauges,
    hisparse_metrics,
    labelled_counter,
    request_counters,
    spec_metrics,
    worker_metrics,
)
from stallfree.runtime.telemetry.observer import MetricsExporter
from stallfree.runtime.telemetry.stats import EngineSnapshot, SparseStats

if TYPE_CHECKING:
    from stallfree.config import StallfreeConfig
    from stallfree.runtime.request.req import Req

_engine_ids = itertools.count()
SnapshotSource = Callable[[], EngineSnapshot]

# the token-count histograms' top bound when the engine does not say its context length
DEFAULT_MAX_MODEL_LEN = 1 << 17


class EngineMetrics(MetricsExporter):
    def __init__(
        self,
        model_name: str,
        engine_label: str,
        snapshot: SnapshotSource,
        registry: CollectorRegistry | None = None,
        max_model_len: int = 0,
        info: Mapping[str, str] | None = None,
    ) -> None:
        self.labels = (model_name, engine_label)
        # the info metric's labels (`operator.config_info_labels`); none: no info metric
        self.info = dict(info or {})
        self.snapshot = snapshot
        self.registry = registry if registry is not None else CollectorRegistry()
        self.ttft = FastHistogram(TTFT_BUCKETS)
        self.itl = FastHistogram(ITL_BUCKETS)
        self.e2e = FastHistogram(REQUEST_LATENCY_BUCKETS)
        self.queue_time = FastHistogram(REQUEST_LATENCY_BUCKETS)
        self.prefill_time = FastHistogram(REQUEST_LATENCY_BUCKETS)
        self.decode_time = FastHistogram(REQUEST_LATENCY_BUCKETS)
        self.inference_time = FastHistogram(REQUEST_LATENCY_BUCKETS)
        token_bounds = one_two_five_buckets(max_model_len or DEFAULT_MAX_MODEL_LEN)
        self.prompt_len = FastHistogram(token_bounds)
        self.generation_len = FastHistogram(token_bounds)
        self.iteration_tokens = FastHistogram(ITERATION_TOKEN_BUCKETS)
        self.schedule_time = FastHistogram(HOST_TIME_BUCKETS)
        self.stall_time = {site: FastHistogram(HOST_TIME_BUCKETS) for site in STALL_SITES}
        # per request in flight: [first token time, last token time]
        self._token_times: dict[Req, list[float]] = {}
        _shared_collector(self.registry).add(self)

    @classmethod
    def for_config(cls, config: StallfreeConfig, snapshot: SnapshotSource) -> EngineMetrics:
        name = config.server.model_name(config.model.path)
        label = config.metrics.engine_label or str(next(_engine_ids))
        snap = snapshot()
        info = config_info_labels(config, snap)
        return cls(name, label, snapshot, max_model_len=snap.max_context_len, info=info)

    def render(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)

    # ------------------------------------------------------------------ events (hot path)

    def on_request_scheduled(self, req: Req) -> None:
        started = req.first_scheduled_time or req.arrival_time
        self.queue_time.observe(started - req.arrival_time)

    def on_tokens(self, req: Req, count: int, now: float) -> None:
        times = self._token_times.get(req)
        if times is None:
            self._token_times[req] = [now, now]
            self.ttft.observe(now - req.arrival_time)
        else:
            self.itl.observe((now - times[1]) / count, count)
            times[1] = now

    def on_request_finished(self, req: Req, now: float) -> None:
        self.e2e.observe(now - req.arrival_time)
        self.prompt_len.observe(len(req.origin_input_ids))
        self.generation_len.observe(len(req.output_ids))
        times = self._token_times.pop(req, None)
        scheduled = req.first_scheduled_time
        if scheduled is None:
            return  # never left the queue: no prefill, decode or inference time
        # prefill: scheduling to first token (to the finish, without one); decode: first token
        # to last; inference: both
        first, last = times if times is not None else (now, now)
        self.prefill_time.observe(first - scheduled)
        self.decode_time.observe(last - first)
        self.inference_time.observe(last - scheduled)

    def on_step_tokens(self, num_tokens: int) -> None:
        self.iteration_tokens.observe(num_tokens)

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


# ---------------------------------------------------------------------- one collector per registry

_collectors: weakref.WeakKeyDictionary[CollectorRegistry, _RegistryCollector] = (
    weakref.WeakKeyDictionary()
)


def _shared_collector(registry: CollectorRegistry) -> _RegistryCollector:
    collector = _collectors.get(registry)
    if collector is None:
        collector = _collectors[registry] = _RegistryCollector()
        registry.register(collector)
    return collector


class _RegistryCollector(Collector):
    """Every engine in one registry: a family per name, holding each engine's samples.

    Engines are held weakly: an engine that is gone leaves the scrape.
    """

    def __init__(self) -> None:
        self._engines: list[weakref.ref[EngineMetrics]] = []

    def engines(self) -> list[EngineMetrics]:
        live = [m for m in (ref() for ref in self._engines) if m is not None]
        if len(live) != len(self._engines):
            self._engines = [weakref.ref(m) for m in live]
        return live

    def add(self, metrics: EngineMetrics) -> None:
        for other in self.engines():
            if other.labels == metrics.labels:
                model, engine = metrics.labels
                raise ValueError(
                    f"this registry already has an engine labelled model_name={model!r}, "
                    f"engine={engine!r}; give each engine its own metrics.engine_label"
                )
        self._engines.append(weakref.ref(metrics))

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for m in self.engines():
            for family in _families(m):
                first = merged.setdefault(family.name, family)
                if first is not family:
                    first.samples.extend(family.samples)
        yield from merged.values()


def _families(m: EngineMetrics) -> Iterator[Metric]:
    labels = list(m.labels)
    snap = m.snapshot()
    yield from gauges(snap, labels)
    yield from request_counters(snap, labels)
    yield from _latency_histograms(m, labels)
    yield from _request_histograms(m, labels)
    yield from _runtime_metrics(m, snap, labels)
    yield from hisparse_metrics(snap.sparse or SparseStats(), labels)
    yield from spec_metrics(snap.spec, labels)
    yield from worker_metrics(snap, labels)
    if m.info:
        info = InfoMetricFamily(
            PREFIX + "config", "The engine's version and configuration.", labels=BASE_LABELS
        )
        info.add_metric(labels, m.info)
        yield info


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


def _latency_histograms(m: EngineMetrics, labels: list[str]) -> Iterator[Metric]:
    for name, doc, hist in (
        ("time_to_first_token_seconds", "Arrival to first output token.", m.ttft),
        ("inter_token_latency_seconds", "Time between output tokens.", m.itl),
        (
            "time_per_output_token_seconds",
            "Time between output tokens (the same observations as inter_token_latency_seconds, "
            "under vLLM's earlier name).",
            m.itl,
        ),
        ("e2e_request_latency_seconds", "Arrival to finish.", m.e2e),
        (
            "request_queue_time_seconds",
            "Arrival to first scheduling (WAITING phase).",
            m.queue_time,
        ),
        (
            "request_prefill_time_seconds",
            "First scheduling to first output token (PREFILL phase), per finished request.",
            m.prefill_time,
        ),
        (
            "request_decode_time_seconds",
            "First to last output token (DECODE phase), per finished request.",
            m.decode_time,
        ),
        (
            "request_inference_time_seconds",
            "First scheduling to last output token (RUNNING phase), per finished request.",
            m.inference_time,
        ),
    ):
        yield _histogram(name, doc, labels, {"": hist}, None)


def _request_histograms(m: EngineMetrics, labels: list[str]) -> Iterator[Metric]:
    for name, doc, hist in (
        ("request_prompt_tokens", "Prompt tokens per finished request.", m.prompt_len),
        ("request_generation_tokens", "Output tokens per finished request.", m.generation_len),
        (
            "request_max_num_generation_tokens",
            "Most output tokens of one sequence per finished request (a request is one "
            "sequence, so the same as request_generation_tokens).",
            m.generation_len,
        ),
        (
            "iteration_tokens_total",
            "Tokens per engine step: prompt tokens an extend batch computes, one per request "
            "in decode.",
            m.iteration_tokens,
        ),
    ):
        yield _histogram(name, doc, labels, {"": hist}, None)


def _runtime_metrics(m: EngineMetrics, snap: EngineSnapshot, labels: list[str]) -> Iterator[Metric]:
    stalls = dict.fromkeys(STALL_SITES, 0) | snap.stalls
    yield labelled_counter(
        "sync_stalls", "Device-to-host reads (host_read) by site.", labels, "site", stalls
    )
    yield _histogram(
        "sync_stall_seconds", "Host wait per host_read, by site.", labels, m.stall_time, "site"
    )
    yield labelled_counter(
        "host_mirror_reads",
        "Reads served by host mirrors, by field.",
        labels,
        "field",
        dict.fromkeys(MIRROR_FIELDS, 0) | snap.mirror_reads,
    )
    yield _histogram(
        "schedule_seconds",
        "Host time to build and launch a batch.",
        labels,
        {"": m.schedule_time},
        None,
    )
    busy, idle = snap.device_busy_seconds, snap.device_idle_seconds
    yield counter("device_busy_seconds", "Stream time spent executing work.", labels, busy)
    yield counter(
        "device_idle_seconds", "Stream idle time while requests were in the engine.", labels, idle
    )
    yield counter("steps", "Batches launched.", labels, snap.counters.steps)
    yield counter(
        "overlap_steps",
        "Launches made while an earlier batch was in flight.",
        labels,
        snap.counters.overlap_steps,
    )
    # structured outputs: the stream's grammar work, 0 until a constrained request runs
    yield counter(
        "grammar_seconds",
        "Stream time spent advancing grammars and filling token masks.",
        labels,
        snap.counters.grammar_seconds,
    )
    yield counter(
        "grammar_tokens",
        "Sampled tokens consumed by grammars.",
        labels,
        snap.counters.grammar_tokens,
    )
