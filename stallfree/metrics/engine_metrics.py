"""`EngineMetrics`: Prometheus families in the engine's own `CollectorRegistry`.

Counters and gauges come from one `EngineSnapshot` taken at scrape time. Histograms are built
from the engine's typed events (request timings, schedule and stall durations): hooks only add
to floats and `FastHistogram`s, and nothing on the hot path reads them back.

Engines that share a registry share one collector: each name is one family (one `# HELP`), with
a sample per engine.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
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
from stallfree.metrics.names import (
    BASE_LABELS,
    FINISH_REASONS,
    MIRROR_FIELDS,
    PREFIX,
    SPEC_DECODE_PER_POS,
    STALL_SITES,
)
from stallfree.metrics.operator import config_info_labels
from stallfree.runtime.telemetry.observer import MetricsExporter
from stallfree.runtime.telemetry.stats import EngineSnapshot, SparseStats, SpecStats

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
    yield from _gauges(snap, labels)
    yield from _request_counters(snap, labels)
    yield from _latency_histograms(m, labels)
    yield from _request_histograms(m, labels)
    yield from _runtime_metrics(m, snap, labels)
    yield from _hisparse_metrics(snap.sparse or SparseStats(), labels)
    yield from _spec_metrics(snap.spec, labels)
    yield from _worker_metrics(snap, labels)
    if m.info:
        info = InfoMetricFamily(
            PREFIX + "config", "The engine's version and configuration.", labels=BASE_LABELS
        )
        info.add_metric(labels, m.info)
        yield info


def _gauge(name: str, doc: str, labels: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(PREFIX + name, doc, labels=BASE_LABELS)
    family.add_metric(labels, value)
    return family


def _counter(name: str, doc: str, labels: list[str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(PREFIX + name, doc, labels=BASE_LABELS)
    family.add_metric(labels, value)
    return family


def _labelled_counter(
    name: str, doc: str, labels: list[str], key: str, values: Mapping[str, float]
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
    kv_usage = snap.pools.kv_usage
    yield _gauge(
        "kv_cache_usage_perc",
        "Share of KV cache slots requests use, 0 to 1 (unused prefix-cache pages count as free).",
        labels,
        kv_usage,
    )
    yield _gauge(
        "gpu_cache_usage_perc",
        "Same as kv_cache_usage_perc (vLLM's earlier name, which its example dashboard charts).",
        labels,
        kv_usage,
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
    yield _labelled_counter(
        "sync_stalls", "Device-to-host reads (host_read) by site.", labels, "site", stalls
    )
    yield _histogram(
        "sync_stall_seconds", "Host wait per host_read, by site.", labels, m.stall_time, "site"
    )
    yield _labelled_counter(
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
    # structured outputs: the stream's grammar work, 0 until a constrained request runs
    yield _counter(
        "grammar_seconds",
        "Stream time spent advancing grammars and filling token masks.",
        labels,
        snap.counters.grammar_seconds,
    )
    yield _counter(
        "grammar_tokens",
        "Sampled tokens consumed by grammars.",
        labels,
        snap.counters.grammar_tokens,
    )


def _worker_metrics(snap: EngineSnapshot, labels: list[str]) -> Iterator[Metric]:
    """Per tensor-parallel rank, when the model runs in worker processes (this node's ranks)."""
    workers = snap.workers
    if not workers:
        return
    for name, doc, values in (
        ("worker_steps", "Steps a worker rank ran.", {w.rank: w.steps for w in workers}),
        (
            "worker_step_seconds",
            "Time a worker rank spent running steps (forward, sampling, copies).",
            {w.rank: w.step_seconds for w in workers},
        ),
        (
            "tp_collective_seconds",
            "Time a rank spent in tensor-parallel all-reduce and all-gather.",
            {w.rank: w.comm_seconds for w in workers},
        ),
        (
            "tp_collective_bytes",
            "Bytes a rank passed to tensor-parallel all-reduce and all-gather.",
            {w.rank: w.comm_bytes for w in workers},
        ),
    ):
        yield _labelled_counter(
            name, doc, labels, "rank", {str(rank): v for rank, v in values.items()}
        )
    yield _counter(
        "worker_message_bytes",
        "Bytes of step messages the scheduler sent to the workers.",
        labels,
        sum(w.message_bytes for w in workers),
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
    yield _gauge(
        "hisparse_host_pool_capacity",
        "Host KV pool slots in all (0 without HiSparse).",
        labels,
        stats.host_pool_total,
    )


def _spec_metrics(spec: SpecStats | None, labels: list[str]) -> Iterator[Metric]:
    """Speculative decoding (vLLM's names): the counters at 0 with speculation off; the
    per-position family has a series per draft position (0 is the first) only while it is on."""
    stats = spec or SpecStats(method="none", num_speculative_tokens=0)
    for name, doc, value in (
        ("spec_decode_num_drafts", "Verify rows that carried drafts.", stats.num_drafts),
        ("spec_decode_num_draft_tokens", "Draft tokens proposed.", stats.num_draft_tokens),
        ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", stats.num_accepted_tokens),
        (
            "spec_decode_requests_disabled",
            "Requests that stopped proposing because their drafts were mostly rejected.",
            stats.requests_disabled,
        ),
    ):
        yield _counter(name, doc, labels, value)
    per_pos = {str(i): n for i, n in enumerate(stats.accepted_per_pos)}
    doc = "Draft tokens accepted, by draft position."
    yield _labelled_counter(SPEC_DECODE_PER_POS, doc, labels, "position", per_pos)
