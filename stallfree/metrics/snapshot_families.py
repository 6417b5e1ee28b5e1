"""Counter and gauge families read from one `EngineSnapshot` at scrape time: queue lengths
and pool usage, request and token counts, worker ranks, HiSparse and speculative decoding.

Each family carries the engine's base labels (model name, engine), so engines that share a
registry add their samples to one family (`engine_metrics`' collector merges them).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from stallfree.metrics.names import (
    BASE_LABELS,
    FINISH_REASONS,
    PREFIX,
    SPEC_DECODE_PER_POS,
)
from stallfree.runtime.telemetry.stats import EngineSnapshot, SparseStats, SpecStats


def gauge(name: str, doc: str, labels: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(PREFIX + name, doc, labels=BASE_LABELS)
    family.add_metric(labels, value)
    return family


def counter(name: str, doc: str, labels: list[str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(PREFIX + name, doc, labels=BASE_LABELS)
    family.add_metric(labels, value)
    return family


def labelled_counter(
    name: str, doc: str, labels: list[str], key: str, values: Mapping[str, float]
) -> CounterMetricFamily:
    family = CounterMetricFamily(PREFIX + name, doc, labels=[*BASE_LABELS, key])
    for value_label, value in list(values.items()):
        family.add_metric([*labels, value_label], value)
    return family


def gauges(snap: EngineSnapshot, labels: list[str]) -> Iterator[Metric]:
    yield gauge("num_requests_running", "Requests in the running batch.", labels, snap.running)
    yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", labels, snap.waiting)
    kv_usage = snap.pools.kv_usage
    yield gauge(
        "kv_cache_usage_perc",
        "Share of KV cache slots requests use, 0 to 1 (unused prefix-cache pages count as free).",
        labels,
        kv_usage,
    )
    yield gauge(
        "gpu_cache_usage_perc",
        "Same as kv_cache_usage_perc (vLLM's earlier name, which its example dashboard charts).",
        labels,
        kv_usage,
    )
    yield gauge(
        "prefix_cache_usage_perc",
        "Share of KV cache slots the prefix cache holds, in use or not, 0 to 1.",
        labels,
        snap.pools.cache_usage,
    )


def request_counters(snap: EngineSnapshot, labels: list[str]) -> Iterator[Metric]:
    c = snap.counters
    yield counter("prompt_tokens", "Prompt tokens of scheduled requests.", labels, c.prompt_tokens)
    yield counter("generation_tokens", "Generated tokens.", labels, c.generation_tokens)
    finished = dict.fromkeys(FINISH_REASONS, 0) | c.finished
    yield labelled_counter(
        "request_success", "Finished requests by reason.", labels, "finished_reason", finished
    )
    yield counter("num_preemptions", "Requests retracted to free KV.", labels, c.retractions)
    yield counter(
        "prefix_cache_queries",
        "Prefix cache lookups at admission, in tokens (prompt and any earlier outputs).",
        labels,
        c.prefix_cache_queries,
    )
    yield counter(
        "prefix_cache_hits",
        "Tokens admissions found in the prefix cache.",
        labels,
        c.prefix_cache_hits,
    )
    yield counter(
        "prefix_cache_evicted_tokens",
        "Tokens evicted from the prefix cache to make room.",
        labels,
        c.prefix_cache_evicted_tokens,
    )


def worker_metrics(snap: EngineSnapshot, labels: list[str]) -> Iterator[Metric]:
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
        yield labelled_counter(
            name, doc, labels, "rank", {str(rank): v for rank, v in values.items()}
        )
    yield counter(
        "worker_message_bytes",
        "Bytes of step messages the scheduler sent to the workers.",
        labels,
        sum(w.message_bytes for w in workers),
    )


def hisparse_metrics(stats: SparseStats, labels: list[str]) -> Iterator[Metric]:
    yield counter(
        "hisparse_hits", "Top-k selections found in the device buffer.", labels, stats.hits
    )
    yield counter(
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
    yield gauge(
        "hisparse_host_pool_used", "Host KV pool slots in use.", labels, stats.host_pool_used
    )
    yield gauge(
        "hisparse_host_pool_capacity",
        "Host KV pool slots in all (0 without HiSparse).",
        labels,
        stats.host_pool_total,
    )


def spec_metrics(spec: SpecStats | None, labels: list[str]) -> Iterator[Metric]:
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
        yield counter(name, doc, labels, value)
    per_pos = {str(i): n for i, n in enumerate(stats.accepted_per_pos)}
    doc = "Draft tokens accepted, by draft position."
    yield labelled_counter(SPEC_DECODE_PER_POS, doc, labels, "position", per_pos)
