"""The prefix cache at the front ends: serve flags in vLLM's and SGLang's spellings,
`POST /flush_cache`, and `stallfree bench` (hit rate, --compare-prefix-caching)."""

from __future__ import annotations

import asyncio
import json

import pytest

from stallfree.cli import main
from stallfree.entrypoints.cli import build_parser, config_from_args
from tests.server_util import serving


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        ([], None),
        (["--enable-prefix-caching"], True),
        (["--no-enable-prefix-caching"], False),
        (["--disable-radix-cache"], False),
    ],
)
def test_serve_flags_set_prefix_caching(flags, want):
    config = config_from_args(build_parser().parse_args(["serve", *flags]))
    assert config.cache.prefix_caching is want


def test_schedule_policy_flag():
    config = config_from_args(build_parser().parse_args(["serve", "--schedule-policy", "lpm"]))
    assert config.scheduler.policy == "lpm"


async def test_flush_cache_endpoint(llama):
    async with serving(llama, api_key="k", cache={"page_size": 4}) as live:
        body = {"text": "a shared system prompt, then a question", "sampling_params": {}}
        body["sampling_params"] = {"max_new_tokens": 4, "ignore_eos": True}
        assert (await live.http.post("/generate", json=body)).status_code == 200
        await asyncio.wait_for(live.engine.wait_idle(), timeout=10)
        assert live.engine.pool_usage().kv_tokens_cached > 0
        flushed = await live.http.post("/flush_cache")
        assert flushed.status_code == 200 and flushed.json() == {"flushed": True}
        usage = live.engine.pool_usage()
        assert usage.kv_tokens_cached == 0 and usage.kv_tokens_free == usage.kv_tokens_total
        # the API key guards it like every API route
        anonymous = await live.http.post("/flush_cache", headers={"Authorization": "Bearer x"})
        assert anonymous.status_code == 401

        # refused while a request runs
        long = {"text": "x", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
        task = asyncio.create_task(live.http.post("/generate", json=long))
        for _ in range(200):
            if live.engine.core.scheduler.queues.num_running:
                break
            await asyncio.sleep(0.01)
        busy = await live.http.post("/flush_cache")
        assert busy.status_code == 400
        assert busy.json()["error"]["code"] == "engine_busy"
        await task


def test_bench_compares_prefix_caching_and_reports_the_hit_rate(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = [
        "bench",
        "--compare",
        "--modes",
        "mirrors",
        "--compare-prefix-caching",
        "--repeats",
        "1",
        "--workload",
        "shared-prefix",
        "--prefix-groups",
        "2",
        "--prefix-len",
        "64",
        "--num-prompts",
        "8",
        "--input-len",
        "16",
        "--output-len",
        "4",
        "--ignore-eos",
        "--warmup-requests",
        "0",
        "--no-progress",
        "--output-json",
        str(out),
    ]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "prefix cache hit rate" in table
    runs = {r["mode"]: r for r in json.loads(out.read_text())["runs"]}
    off = runs["overlap, mirrors on, prefix cache off"]["stallfree"]
    on = runs["overlap, mirrors on, prefix cache on"]["stallfree"]
    assert off["prefix_cache_hit_rate"] is None
    assert on["prefix_cache_hit_rate"] > 0.5


def test_bench_prefix_caching_flag_errors(capsys):
    assert main(["bench", "--compare-prefix-caching"]) == 2
    assert main(["bench", "--compare", "--compare-prefix-caching", "--disable-radix-cache"]) == 2
    assert main(["bench", "--compare", "--compare-prefix-caching", "--hisparse", "both"]) == 2
    assert "--compare-prefix-caching" in capsys.readouterr().err
