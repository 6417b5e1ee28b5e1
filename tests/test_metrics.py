"""Prometheus metrics: per-engine registries, stall counters by mirror mode, scrape-time reads."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from stallfree import Engine, SamplingParams
from stallfree.metrics import EngineMetrics
from stallfree.metrics.histogram import FastHistogram
from stallfree.runtime.sparse import SparseStats
from stallfree.runtime.stats import EngineCounters, EngineSnapshot, PoolUsage
from tests.engine_util import engine_config, random_prompts


def samples(text: bytes | str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels without model_name/engine): value} of a scrape."""
    if isinstance(text, bytes):
        text = text.decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
            out[(s.name, frozenset(labels.items()))] = s.value
    return out


def value(scrape: dict, name: str, **labels: str) -> float:
    return scrape.get((name, frozenset(labels.items())), 0.0)


async def run_workload(engine: Engine, n: int = 4, max_new_tokens: int = 8) -> int:
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    results = await asyncio.gather(*(engine.complete(p, params) for p in random_prompts(n)))
    await engine.wait_idle()
    return sum(r.completion_tokens for r in results)


def test_two_engines_have_separate_registries():
    host = CollectorRegistry()
    Counter("stallfree:prompt_tokens", "the host app's own metric", registry=host)
    a = EngineMetrics("m", "0", lambda: _snapshot())
    b = EngineMetrics("m", "0", lambda: _snapshot(counters=EngineCounters()))
    assert a.registry is not b.registry
    assert value(samples(a.render()), "stallfree:generation_tokens_total") == 5
    assert value(samples(b.render()), "stallfree:generation_tokens_total") == 0
    # a shared registry with the host's metrics still holds both
    c = EngineMetrics("m", "1", _snapshot, registry=CollectorRegistry())
    assert b"stallfree:prompt_tokens_total" in c.render()
    assert b"the host app" in generate_latest(host)


async def test_engines_get_distinct_labels_and_metrics_can_be_disabled():
    a = Engine(engine_config("tiny"))
    b = Engine(engine_config("tiny"))
    assert a.metrics is not None and b.metrics is not None
    assert a.metrics.labels[0] == "tiny"
    assert a.metrics.labels[1] != b.metrics.labels[1]
    assert Engine(engine_config("tiny", metrics={"enabled": False})).metrics is None
    named = Engine(
        engine_config("tiny", server={"served_model_name": "x"}, metrics={"engine_label": "e"})
    )
    assert named.metrics is not None and named.metrics.labels == ("x", "e")


@pytest.mark.parametrize("mirrors", [True, False])
async def test_stall_counters_follow_the_mirror_mode(mirrors):
    async with Engine(engine_config("tiny", runtime={"cpu_mirrors": mirrors})) as engine:
        start = time.perf_counter()
        tokens = await run_workload(engine)
        wall = time.perf_counter() - start
        assert engine.metrics is not None
        scrape = samples(engine.metrics.render())
        await asyncio.sleep(0.05)  # no request in the engine: idle time does not grow
        rescrape = samples(engine.metrics.render())
    stalls = value(scrape, "stallfree:sync_stalls_total", site="schedule.page_count")
    stall_count = value(scrape, "stallfree:sync_stall_seconds_count", site="schedule.page_count")
    mirror_reads = value(scrape, "stallfree:host_mirror_reads_total", field="seq_lens_cpu")
    if mirrors:
        assert not [k for k in scrape if k[0] == "stallfree:sync_stalls_total"]
        assert mirror_reads > 0
    else:
        assert stalls > 0 and stall_count == stalls
        assert mirror_reads == 0
    assert value(scrape, "stallfree:generation_tokens_total") == tokens
    assert value(scrape, "stallfree:request_success_total", finished_reason="length") == 4
    assert value(scrape, "stallfree:time_to_first_token_seconds_count") == 4
    assert value(scrape, "stallfree:inter_token_latency_seconds_count") == tokens - 4
    assert value(scrape, "stallfree:e2e_request_latency_seconds_count") == 4
    assert value(scrape, "stallfree:request_queue_time_seconds_count") == 4
    assert value(scrape, "stallfree:schedule_seconds_count") == value(
        scrape, "stallfree:steps_total"
    )
    assert value(scrape, "stallfree:overlap_steps_total") > 0
    assert value(scrape, "stallfree:device_busy_seconds_total") > 0
    # busy + idle is the wall time requests spent in the engine: most of the workload's wall.
    # The device idles at least while the first batch is built (and, legacy, at every stall).
    busy = value(scrape, "stallfree:device_busy_seconds_total")
    idle = value(scrape, "stallfree:device_idle_seconds_total")
    assert idle > 0
    assert 0.5 * wall <= busy + idle <= wall
    assert value(rescrape, "stallfree:device_idle_seconds_total") == idle


async def test_gauges_are_read_at_scrape_time():
    config = engine_config("tiny", cache={"max_running_requests": 2})
    async with Engine(config) as engine:
        assert engine.metrics is not None
        params = SamplingParams(max_new_tokens=200, ignore_eos=True)
        started = asyncio.Event()

        async def consume(prompt: list[int]) -> None:
            async for _ in engine.generate(prompt, params):
                started.set()

        tasks = [asyncio.create_task(consume(p)) for p in random_prompts(4)]
        await started.wait()
        await asyncio.sleep(0.05)
        scrape = samples(engine.metrics.render())
        assert value(scrape, "stallfree:num_requests_running") == 2
        assert value(scrape, "stallfree:num_requests_waiting") == 2
        assert 0 < value(scrape, "stallfree:kv_cache_usage_perc") < 1
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await engine.wait_idle()
        scrape = samples(engine.metrics.render())
    assert value(scrape, "stallfree:num_requests_running") == 0
    assert value(scrape, "stallfree:kv_cache_usage_perc") == 0
    assert value(scrape, "stallfree:request_success_total", finished_reason="abort") == 4


def test_fast_histogram_matches_prometheus_client():
    bounds = (0.1, 0.5, 1.0)
    reference = Histogram("ref", "", buckets=bounds, registry=CollectorRegistry())
    fast = FastHistogram(bounds)
    for v in (0.05, 0.1, 0.3, 0.5, 0.9, 1.0, 7.0):
        reference.observe(v)
        fast.observe(v)
    buckets, total = fast.cumulative()
    want = {
        s.labels["le"]: s.value for s in reference.collect()[0].samples if s.name == "ref_bucket"
    }
    assert dict(buckets) == want
    assert total == pytest.approx(sum((0.05, 0.1, 0.3, 0.5, 0.9, 1.0, 7.0)))


def _snapshot(**fields) -> EngineSnapshot:
    base = dict(
        running=2,
        waiting=3,
        pools=PoolUsage(
            req_slots_free=4, req_slots_total=8, kv_tokens_free=25, kv_tokens_total=100
        ),
        counters=EngineCounters(prompt_tokens=11, generation_tokens=5, steps=9, overlap_steps=4),
        stalls={"schedule.page_count": 6},
        stall_seconds={"schedule.page_count": 0.5},
        mirror_reads={"seq_lens_cpu": 7},
        device_busy_seconds=1.5,
        device_idle_seconds=0.25,
    )
    return EngineSnapshot(**(base | fields))


def test_counters_and_gauges_come_from_one_snapshot():
    snap = _snapshot()
    metrics = EngineMetrics("m", "0", lambda: snap)
    scrape = samples(metrics.render())
    assert value(scrape, "stallfree:num_requests_running") == 2
    assert value(scrape, "stallfree:num_requests_waiting") == 3
    assert value(scrape, "stallfree:kv_cache_usage_perc") == 0.75
    assert value(scrape, "stallfree:prompt_tokens_total") == 11
    assert value(scrape, "stallfree:generation_tokens_total") == 5
    assert value(scrape, "stallfree:steps_total") == 9
    assert value(scrape, "stallfree:overlap_steps_total") == 4
    assert value(scrape, "stallfree:sync_stalls_total", site="schedule.page_count") == 6
    assert value(scrape, "stallfree:host_mirror_reads_total", field="seq_lens_cpu") == 7
    assert value(scrape, "stallfree:device_busy_seconds_total") == 1.5
    assert value(scrape, "stallfree:device_idle_seconds_total") == 0.25
    # every finish reason is exported, even before the first request of that kind
    assert value(scrape, "stallfree:request_success_total", finished_reason="error") == 0


def test_hisparse_series_are_zero_without_a_plugin_and_follow_its_stats():
    scrape = samples(EngineMetrics("m", "0", lambda: _snapshot()).render())
    assert value(scrape, "stallfree:hisparse_hits_total") == 0
    assert value(scrape, "stallfree:hisparse_host_pool_total") == 0
    sparse = SparseStats(hits=30, misses=10, bytes_h2d=4096, bytes_d2h=1024)
    sparse = replace(sparse, host_pool_used=7, host_pool_total=64)
    scrape = samples(EngineMetrics("m", "0", lambda: _snapshot(sparse=sparse)).render())
    assert value(scrape, "stallfree:hisparse_hits_total") == 30
    assert value(scrape, "stallfree:hisparse_misses_total") == 10
    assert value(scrape, "stallfree:hisparse_bytes_moved_total", direction="h2d") == 4096
    assert value(scrape, "stallfree:hisparse_bytes_moved_total", direction="d2h") == 1024
    assert value(scrape, "stallfree:hisparse_host_pool_used") == 7
    assert value(scrape, "stallfree:hisparse_host_pool_total") == 64


async def test_hisparse_series_follow_a_real_coordinator():
    config = engine_config("tiny", hisparse={"enabled": True, "top_k": 8, "device_buffer_size": 16})
    async with Engine(config) as engine:
        params = SamplingParams(max_new_tokens=8, ignore_eos=True)
        prompts = random_prompts(3, lo=30, hi=40)
        await asyncio.gather(*(engine.complete(p, params) for p in prompts))
        await engine.wait_idle()
        assert engine.metrics is not None
        scrape = samples(engine.metrics.render())
        stats = engine.core.ctx.sparse.stats()
    hits = value(scrape, "stallfree:hisparse_hits_total")
    misses = value(scrape, "stallfree:hisparse_misses_total")
    assert (hits, misses) == (stats.hits, stats.misses) and hits + misses > 0
    h2d = value(scrape, "stallfree:hisparse_bytes_moved_total", direction="h2d")
    assert h2d == stats.bytes_h2d > 0
    assert value(scrape, "stallfree:hisparse_host_pool_total") == stats.host_pool_total
