"""vLLM's example Grafana dashboard, with `vllm:` changed to `stallfree:`, finds its series.

The expressions below are the queries of vLLM's
`examples/online_serving/prometheus_grafana/grafana.json`, by panel title (percentile variants
of one query are listed once; the dashboard itself is not copied here). An older version of that dashboard also charted `num_requests_swapped` and
`cpu_cache_usage_perc`; those are kept, and are the two stallfree has no equivalent for.
"""

from __future__ import annotations

import asyncio
import re

from prometheus_client.parser import text_string_to_metric_families

from stallfree import Engine, SamplingParams
from tests.engine_util import engine_config, random_prompts

VLLM_PANELS: dict[str, list[str]] = {
    "E2E Request Latency": [
        'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
        'rate(vllm:e2e_request_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\nrate(vllm:e2e_request_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',
    ],
    "Token Throughput": [
        'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
        'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    ],
    "Time Per Output Token Latency": [
        'histogram_quantile(0.99, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
        'rate(vllm:time_per_output_token_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\nrate(vllm:time_per_output_token_seconds_count{model_name="$model_name"}[$__rate_interval])',
    ],
    "Scheduler State": [
        'vllm:num_requests_running{model_name="$model_name"}',
        'vllm:num_requests_swapped{model_name="$model_name"}',
        'vllm:num_requests_waiting{model_name="$model_name"}',
    ],
    "Time To First Token Latency": [
        'histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
        'rate(vllm:time_to_first_token_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\nrate(vllm:time_to_first_token_seconds_count{model_name="$model_name"}[$__rate_interval])',
    ],
    "Cache Utilization": [
        'vllm:gpu_cache_usage_perc{model_name="$model_name"}',
        'vllm:cpu_cache_usage_perc{model_name="$model_name"}',
    ],
    "Request Prompt Length": [
        'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    ],
    "Request Generation Length": [
        'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    ],
    "Finish Reason": [
        'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))',
    ],
    "Queue Time": [
        'rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    ],
    "Requests Prefill and Decode Time": [
        'rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
        'rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    ],
    "Max Generation Token in Sequence Group": [
        'rate(vllm:request_max_num_generation_tokens_sum{model_name="$model_name"}[$__rate_interval])',
    ],
}
# the dashboard's variable: label_values({__name__=~"vllm:.*"}, model_name)

# what stallfree has no equivalent for (docs/serving.md says why)
NOT_EXPORTED = {
    "num_requests_swapped",  # no swapping: a retracted request frees its KV and recomputes it
    "cpu_cache_usage_perc",  # no CPU KV cache tier (HiSparse's host pool has its own gauges)
}

METRIC = re.compile(r"\bvllm:([a-zA-Z_][a-zA-Z0-9_]*)")


def dashboard_metrics() -> dict[str, set[str]]:
    """{sample name without prefix: panels that query it}."""
    out: dict[str, set[str]] = {}
    for title, exprs in VLLM_PANELS.items():
        for expr in exprs:
            for name in METRIC.findall(expr):
                out.setdefault(name, set()).add(title)
    return out


def test_the_expressions_name_what_the_panels_chart():
    names = dashboard_metrics()
    assert len(names) == 23
    assert names["request_prefill_time_seconds_sum"] == {"Requests Prefill and Decode Time"}
    assert names.keys() >= NOT_EXPORTED


async def test_stallfree_exports_every_vllm_dashboard_metric_it_has():
    config = engine_config("tiny", server={"served_model_name": "my-model"})
    async with Engine(config) as engine:
        params = SamplingParams(max_new_tokens=5, ignore_eos=True)
        await asyncio.gather(*(engine.complete(p, params) for p in random_prompts(4)))
        await engine.wait_idle()
        assert engine.metrics is not None
        text = engine.metrics.render().decode()
    series: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            series.setdefault(s.name, []).append((s.labels, s.value))
    # the dashboard's model_name variable lists the model from every stallfree series
    assert all(
        labels.get("model_name") == "my-model" for rows in series.values() for labels, _ in rows
    )

    missing, empty = [], []
    for name, panels in sorted(dashboard_metrics().items()):
        if name in NOT_EXPORTED:
            assert "stallfree:" + name not in series, f"{name} is exported: map it"
            continue
        rows = series.get("stallfree:" + name)
        if not rows:
            missing.append((name, sorted(panels)))
            continue
        # after a workload every counter and histogram the dashboard charts has moved
        moves = name.endswith(("_total", "_bucket", "_sum", "_count"))
        if moves and not any(v > 0 for _, v in rows):
            empty.append(name)
    assert not missing, missing
    assert not empty, empty
    # a panel shows data when at least one of its metrics is exported: every panel does
    exported = {n for n in dashboard_metrics() if n not in NOT_EXPORTED}
    assert all(
        any(n in exported for e in exprs for n in METRIC.findall(e))
        for exprs in VLLM_PANELS.values()
    )
