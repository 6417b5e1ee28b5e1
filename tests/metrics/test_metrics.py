"""Prometheus metrics: per-engine registries, stall counters by mirror mode, scrape-time reads."""

from __future__ import annotations

import asyncio
import gc
import re
import time
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

import stallfree
from stallfree import Engine, SamplingParams
from stallfree.metrics import EngineMetrics
from stallfree.metrics.histogram import (
    ITERATION_TOKEN_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    FastHistogram,
    one_two_five_buckets,
)
from stallfree.metrics.names import MIRROR_FIELDS, SPEC_DECODE_FAMILIES, STALL_SITES
from stallfree.runtime.request.req import Req
from stallfree.runtime.telemetry.observer import EngineObserver
from stallfree.runtime.telemetry.stats import EngineCounters, SparseStats, SpecStats
from tests.engine_util import engine_config, random_prompts
from tests.metrics_util import fake_snapshot, samples, value


async def run_workload(engine: Engine, n: int = 4, max_new_tokens: int = 8) -> int:
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    results = await asyncio.gather(*(engine.complete(p, params) for p in random_prompts(n)))
    await engine.wait_idle()
    return sum(r.completion_tokens for r in results)


def test_two_engines_have_separate_registries():
    host = CollectorRegistry()
    Counter("stallfree:prompt_tokens", "the host app's own metric", registry=host)
    a = EngineMetrics("m", "0", lambda: fake_snapshot())
    b = EngineMetrics("m", "0", lambda: fake_snapshot(counters=EngineCounters()))
    assert a.registry is not b.registry
    assert value(samples(a.render()), "stallfree:generation_tokens_total") == 5
    assert value(samples(b.render()), "stallfree:generation_tokens_total") == 0
    # a shared registry with the host's metrics still holds both
    c = EngineMetrics("m", "1", fake_snapshot, registry=CollectorRegistry())
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
    # every known site is a series from the start, at 0 until it stalls
    sites = {dict(k[1])["site"] for k in scrape if k[0] == "stallfree:sync_stalls_total"}
    assert sites == set(STALL_SITES)
    if mirrors:
        assert all(
            value(scrape, "stallfree:sync_stalls_total", site=site) == 0 for site in STALL_SITES
        )
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


def test_counters_and_gauges_come_from_one_snapshot():
    snap = fake_snapshot()
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
    scrape = samples(EngineMetrics("m", "0", lambda: fake_snapshot()).render())
    for name in (
        "stallfree:hisparse_hits_total",
        "stallfree:hisparse_misses_total",
        "stallfree:hisparse_host_pool_used",
        "stallfree:hisparse_host_pool_capacity",
    ):
        assert scrape[(name, frozenset())] == 0  # exported, at 0
    assert "stallfree:hisparse_host_pool_total" not in {name for name, _ in scrape}
    sparse = SparseStats(hits=30, misses=10, bytes_h2d=4096, bytes_d2h=1024)
    sparse = replace(sparse, host_pool_used=7, host_pool_total=64)
    scrape = samples(EngineMetrics("m", "0", lambda: fake_snapshot(sparse=sparse)).render())
    assert value(scrape, "stallfree:hisparse_hits_total") == 30
    assert value(scrape, "stallfree:hisparse_misses_total") == 10
    assert value(scrape, "stallfree:hisparse_bytes_moved_total", direction="h2d") == 4096
    assert value(scrape, "stallfree:hisparse_bytes_moved_total", direction="d2h") == 1024
    assert value(scrape, "stallfree:hisparse_host_pool_used") == 7
    assert value(scrape, "stallfree:hisparse_host_pool_capacity") == 64


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
    assert value(scrape, "stallfree:hisparse_host_pool_capacity") == stats.host_pool_total


SPEC = "stallfree:spec_decode_"


def _spec_families(text: bytes) -> dict[str, list]:
    return {
        f.name.removeprefix("stallfree:"): f.samples
        for f in text_string_to_metric_families(text.decode())
        if f.name.startswith(SPEC)
    }


def test_spec_series_are_zero_with_speculation_off_and_follow_its_stats():
    text = EngineMetrics("m", "0", lambda: fake_snapshot()).render()
    families = _spec_families(text)
    assert tuple(families) == SPEC_DECODE_FAMILIES  # every family declared, speculation off
    scrape = samples(text)
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "requests_disabled"):
        assert scrape[(f"{SPEC}{name}_total", frozenset())] == 0  # exported, at 0
    assert families["spec_decode_num_accepted_tokens_per_pos"] == []  # no draft position
    spec = SpecStats("ngram", 3, 5, 12, 7, (5, 2, 0), requests_disabled=1)
    scrape = samples(EngineMetrics("m", "0", lambda: fake_snapshot(spec=spec)).render())
    assert value(scrape, SPEC + "num_drafts_total") == 5
    assert value(scrape, SPEC + "num_draft_tokens_total") == 12
    assert value(scrape, SPEC + "num_accepted_tokens_total") == 7
    assert value(scrape, SPEC + "requests_disabled_total") == 1
    per_pos = {
        dict(labels)["position"]: v
        for (name, labels), v in scrape.items()
        if name == SPEC + "num_accepted_tokens_per_pos_total"
    }
    assert per_pos == {"0": 5, "1": 2, "2": 0}  # every position, the unused last one at 0


async def test_spec_positions_are_exported_at_zero_from_the_start():
    config = engine_config("tiny", speculative={"method": "ngram", "num_speculative_tokens": 4})
    async with Engine(config) as engine:
        assert engine.metrics is not None
        scrape = samples(engine.metrics.render())
    positions = {
        dict(labels)["position"]: v
        for (name, labels), v in scrape.items()
        if name == SPEC + "num_accepted_tokens_per_pos_total"
    }
    assert positions == {"0": 0, "1": 0, "2": 0, "3": 0}
    assert value(scrape, SPEC + "num_drafts_total") == 0


def test_every_spec_family_has_a_doc_row_and_a_panel():
    root = Path(stallfree.__file__).parents[1]
    serving = (root / "docs" / "serving.md").read_text()
    dashboard = (root / "deploy" / "grafana-dashboard.json").read_text()
    for family in SPEC_DECODE_FAMILIES:
        assert f"| `{family}_total`" in serving, family
        assert f"stallfree:{family}_total" in dashboard, family


# ---------------------------------------------------------------------- vLLM's request histograms


def test_one_two_five_buckets():
    assert one_two_five_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert one_two_five_buckets(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    assert one_two_five_buckets(1) == (1,)


def _le(text: bytes, name: str) -> list[str]:
    """The `le` values of histogram `name`, in scrape order."""
    family = next(f for f in text_string_to_metric_families(text.decode()) if f.name == name)
    return [s.labels["le"] for s in family.samples if s.name == name + "_bucket"]


def test_request_phase_times_follow_the_request_timestamps():
    metrics = EngineMetrics("m", "0", lambda: fake_snapshot(), max_model_len=1000)
    params = SamplingParams()
    done = Req(rid="a", origin_input_ids=[1] * 7, sampling_params=params)
    done.arrival_time, done.first_scheduled_time = 10.0, 11.0
    metrics.on_request_scheduled(done)
    for now in (12.5, 13.0, 14.0):
        metrics.on_tokens(done, 1, now)
        done.output_ids.append(5)
    metrics.on_request_finished(done, 14.5)
    # scheduled, then failed before its first token: all its running time is prefill
    failed = Req(rid="b", origin_input_ids=[1] * 3, sampling_params=params)
    failed.arrival_time, failed.first_scheduled_time = 20.0, 20.5
    metrics.on_request_scheduled(failed)
    metrics.on_request_finished(failed, 21.0)
    # aborted while waiting: no queue end, so no prefill, decode or inference time
    waiting = Req(rid="c", origin_input_ids=[1] * 2, sampling_params=params)
    waiting.arrival_time = 30.0
    metrics.on_request_finished(waiting, 32.0)

    text = metrics.render()
    scrape = samples(text)

    def stat(name: str) -> tuple[float, float]:
        return value(scrape, name + "_count"), value(scrape, name + "_sum")

    assert stat("stallfree:e2e_request_latency_seconds") == (3, 4.5 + 1.0 + 2.0)
    assert stat("stallfree:request_queue_time_seconds") == (2, 1.0 + 0.5)
    assert stat("stallfree:time_to_first_token_seconds") == (1, 2.5)
    assert stat("stallfree:inter_token_latency_seconds") == (2, 1.5)
    assert stat("stallfree:request_prefill_time_seconds") == (2, 1.5 + 0.5)
    assert stat("stallfree:request_decode_time_seconds") == (2, 1.5 + 0.0)
    assert stat("stallfree:request_inference_time_seconds") == (2, 3.0 + 0.5)
    assert stat("stallfree:request_prompt_tokens") == (3, 7 + 3 + 2)
    assert stat("stallfree:request_generation_tokens") == (3, 3)
    # vLLM's older names carry the same observations
    assert stat("stallfree:time_per_output_token_seconds") == (2, 1.5)
    assert stat("stallfree:request_max_num_generation_tokens") == (3, 3)
    assert value(scrape, "stallfree:request_prompt_tokens_bucket", le="2.0") == 1
    assert value(scrape, "stallfree:request_prompt_tokens_bucket", le="5.0") == 2
    assert value(scrape, "stallfree:request_prompt_tokens_bucket", le="10.0") == 3
    # vLLM's bucket sets: request phases, token counts (1-2-5 up to the model's length)
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert _le(text, "stallfree:" + name) == [
            floatToGoString(b) for b in (*REQUEST_LATENCY_BUCKETS, float("inf"))
        ]
    assert REQUEST_LATENCY_BUCKETS[:3] == (0.3, 0.5, 0.8) and REQUEST_LATENCY_BUCKETS[-1] == 7680
    assert _le(text, "stallfree:request_prompt_tokens")[-2:] == ["1000.0", "+Inf"]
    assert _le(text, "stallfree:iteration_tokens_total") == [
        floatToGoString(b) for b in (*ITERATION_TOKEN_BUCKETS, float("inf"))
    ]


class _StepRecorder(EngineObserver):
    def __init__(self) -> None:
        self.decode_rows = 0

    def on_step(self, num_reqs: int, decode: bool, overlapped: bool) -> None:
        if decode:
            self.decode_rows += num_reqs


async def test_request_histograms_on_a_real_workload():
    async with Engine(engine_config("tiny")) as engine:
        recorder = _StepRecorder()
        engine.add_observer(recorder)
        prompts = random_prompts(5)
        tokens = await run_workload(engine, n=5, max_new_tokens=6)
        assert engine.metrics is not None
        text = engine.metrics.render()
        snap = engine.snapshot()
    scrape = samples(text)
    for name in (
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert value(scrape, f"stallfree:{name}_count") == 5, name
    assert value(scrape, "stallfree:request_prompt_tokens_sum") == sum(map(len, prompts))
    assert value(scrape, "stallfree:request_generation_tokens_sum") == tokens == 30
    prefill = value(scrape, "stallfree:request_prefill_time_seconds_sum")
    decode = value(scrape, "stallfree:request_decode_time_seconds_sum")
    inference = value(scrape, "stallfree:request_inference_time_seconds_sum")
    assert prefill > 0 and decode > 0
    assert prefill + decode == pytest.approx(inference)
    assert inference < value(scrape, "stallfree:e2e_request_latency_seconds_sum")
    # the prompt buckets end at the engine's context length
    top = max(b for b in one_two_five_buckets(engine.max_context_len))
    assert _le(text, "stallfree:request_prompt_tokens")[-2] == floatToGoString(top)
    # tokens per step: one sample per launched batch; prompt tokens plus one per decode row
    assert value(scrape, "stallfree:iteration_tokens_total_count") == snap.counters.steps
    assert value(scrape, "stallfree:iteration_tokens_total_sum") == (
        snap.counters.prefill_tokens + recorder.decode_rows
    )


# ---------------------------------------------------------------------- one registry, many engines


def test_engines_sharing_a_registry_share_each_family():
    shared = CollectorRegistry()
    a = EngineMetrics("m", "a", lambda: fake_snapshot(), registry=shared)
    b = EngineMetrics("m", "b", lambda: fake_snapshot(counters=EngineCounters()), registry=shared)
    text = generate_latest(shared).decode()
    helps = [line for line in text.splitlines() if line.startswith("# HELP ")]
    assert len(helps) == len(set(helps)) > 30
    assert helps.count("# HELP stallfree:generation_tokens_total Generated tokens.") == 1
    by_engine = {
        s.labels["engine"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "stallfree:generation_tokens_total"
    }
    assert by_engine == {"a": 5, "b": 0}
    assert a.render() == b.render() == generate_latest(shared)
    # the same labels twice in one registry would be one series from two engines
    with pytest.raises(ValueError, match="engine_label"):
        EngineMetrics("m", "a", lambda: fake_snapshot(), registry=shared)
    # an engine that is gone leaves the scrape
    del b
    gc.collect()
    engines = {
        s.labels["engine"]
        for f in text_string_to_metric_families(generate_latest(shared).decode())
        for s in f.samples
    }
    assert engines == {"a"}


# ---------------------------------------------------------------------- series exported at 0


def test_every_stall_site_and_mirror_field_is_exported_before_it_happens():
    quiet = fake_snapshot(stalls={}, stall_seconds={}, mirror_reads={})
    scrape = samples(EngineMetrics("m", "0", lambda: quiet).render())
    for site in STALL_SITES:
        assert scrape[("stallfree:sync_stalls_total", frozenset({("site", site)}))] == 0
        key = ("stallfree:sync_stall_seconds_count", frozenset({("site", site)}))
        assert scrape[key] == 0
    for field in MIRROR_FIELDS:
        assert scrape[("stallfree:host_mirror_reads_total", frozenset({("field", field)}))] == 0


def test_the_known_sites_are_every_site_the_source_names():
    """STALL_SITES and MIRROR_FIELDS list every literal the runtime and HiSparse pass."""
    root = Path(stallfree.__file__).parent
    sites, fields = set(), set()
    for path in root.rglob("*.py"):
        text = path.read_text()
        sites |= set(re.findall(r'host_(?:seq_lens|req_pool_indices)\(\s*"([^"]+)"', text))
        sites |= set(re.findall(r'host_read\([^()]*?,\s*"([^"]+)"\s*\)', text))
        sites |= set(re.findall(r'^STALL_SITE\s*=\s*"([^"]+)"', text, re.M))
        fields |= set(re.findall(r'mirror_read\(\s*"([^"]+)"', text))
    assert {"schedule.page_count", "hisparse.map_last_loc"} <= sites  # the scan finds them
    assert sites == set(STALL_SITES)
    assert fields == set(MIRROR_FIELDS)
