"""`stallfree bench`: workloads, counters, a short --compare in process and over HTTP (real
`stallfree serve` subprocesses), JSON checks, the plot, and clear errors without tracebacks."""

from __future__ import annotations

import json
import math
import re
import socket
import statistics
import subprocess
import sys
from typing import Any

import httpx
import pytest

from stallfree.bench.counters import snapshot_prometheus, stall_figures
from stallfree.bench.datasets import build_requests
from stallfree.bench.http_targets import HttpTarget
from stallfree.bench.runner import Mode, RunSettings, run_mode
from stallfree.bench.workloads import (
    TOKEN_ID_LIMIT,
    WorkloadError,
    WorkloadSpec,
    arrival_offsets,
)
from stallfree.cli import main

NUM_PROMPTS = 6
SHORT_RUN = [
    "bench",
    "--compare",
    "--num-prompts",
    str(NUM_PROMPTS),
    "--input-len",
    "24",
    "--output-len",
    "12",
    "--ignore-eos",
    "--warmup-requests",
    "1",
    "--max-concurrency",
    "4",
    "--no-progress",
]
ONE_RUN = [*SHORT_RUN, "--repeats", "1"]
MIRRORS_OFF, MIRRORS_ON = "overlap, mirrors off", "overlap, mirrors on"
MODES = ["overlap off", MIRRORS_OFF, MIRRORS_ON]


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------- workloads


def test_random_workload_is_seeded_and_in_range() -> None:
    spec = WorkloadSpec(num_prompts=50, input_len=40, output_len=20, range_ratio=0.5, seed=3)
    a, b = build_requests(spec), build_requests(spec)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    for r in a:
        assert 20 <= r.prompt_len <= 40 and 10 <= r.output_len <= 20
        assert len(r.prompt) == r.prompt_len
        assert all(0 <= t < TOKEN_ID_LIMIT for t in r.prompt)
    other = build_requests(WorkloadSpec(num_prompts=50, input_len=40, output_len=20, seed=4))
    assert [r.prompt for r in a] != [r.prompt for r in other]


def test_shared_prefix_workload_shares_prefixes() -> None:
    spec = WorkloadSpec(kind="shared-prefix", num_prompts=12, prefix_groups=3, prefix_len=16)
    reqs = build_requests(spec)
    assert len({tuple(r.prompt[:16]) for r in reqs}) == 3
    assert all(r.prompt_len == len(r.prompt) > 16 for r in reqs)


def test_sharegpt_workload(tmp_path) -> None:
    convs = [
        {
            "conversations": [
                {"from": "human", "value": f"question {i} " * 3},
                {"from": "gpt", "value": "an answer " * (i + 1)},
            ]
        }
        for i in range(5)
    ]
    convs.append({"conversations": [{"from": "human", "value": "hi"}]})  # no reply: skipped
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    spec = WorkloadSpec(kind="sharegpt", num_prompts=4, dataset_path=str(path))

    def tokenize(text: str) -> list[int]:
        return list(text.encode())

    reqs = build_requests(spec, tokenize)
    assert len(reqs) == 4
    assert all(isinstance(r.prompt, str) and r.prompt_len == len(r.prompt) for r in reqs)
    with pytest.raises(WorkloadError, match="only 5 usable"):
        build_requests(
            WorkloadSpec(kind="sharegpt", num_prompts=9, dataset_path=str(path)), tokenize
        )


def test_arrivals_poisson_and_all_at_once() -> None:
    assert arrival_offsets(5, math.inf, 0) == [0.0] * 5
    offsets = arrival_offsets(4000, 10.0, 1)
    assert offsets == sorted(offsets) and offsets == arrival_offsets(4000, 10.0, 1)
    assert 0.09 < offsets[-1] / len(offsets) < 0.11  # mean gap 1 / rate


# ---------------------------------------------------------------- counters

METRICS_BEFORE = """\
# TYPE stallfree:steps counter
stallfree:steps_total{model_name="m",engine="0"} 10
# TYPE stallfree:sync_stalls counter
stallfree:sync_stalls_total{model_name="m",engine="0",site="schedule.page_count"} 4
# TYPE stallfree:sync_stall_seconds histogram
stallfree:sync_stall_seconds_bucket{model_name="m",engine="0",site="schedule.page_count",le="+Inf"} 4
stallfree:sync_stall_seconds_sum{model_name="m",engine="0",site="schedule.page_count"} 0.5
stallfree:sync_stall_seconds_count{model_name="m",engine="0",site="schedule.page_count"} 4
# TYPE stallfree:device_busy_seconds counter
stallfree:device_busy_seconds_total{model_name="m",engine="0"} 1.0
# TYPE stallfree:device_idle_seconds counter
stallfree:device_idle_seconds_total{model_name="m",engine="0"} 1.0
"""
METRICS_AFTER = (
    METRICS_BEFORE.replace(
        'steps_total{model_name="m",engine="0"} 10', 'steps_total{model_name="m",engine="0"} 30'
    )
    .replace(
        'page_count"} 4\n# TYPE stallfree:sync_stall_seconds',
        'page_count"} 44\n# TYPE stallfree:sync_stall_seconds',
    )
    .replace("} 0.5", "} 2.5")
    .replace(
        'busy_seconds_total{model_name="m",engine="0"} 1.0',
        'busy_seconds_total{model_name="m",engine="0"} 4.0',
    )
    .replace(
        'idle_seconds_total{model_name="m",engine="0"} 1.0',
        'idle_seconds_total{model_name="m",engine="0"} 2.0',
    )
)


def test_prometheus_deltas_and_absent_figures() -> None:
    before, after = snapshot_prometheus(METRICS_BEFORE), snapshot_prometheus(METRICS_AFTER)
    assert before is not None and after is not None
    f = stall_figures(before, after)
    assert f.steps == 20 and f.stalls_total == 40
    assert f.stalls_per_step == {"schedule.page_count": 2.0}
    assert f.stall_seconds == pytest.approx(2.0)
    assert f.device_idle_fraction == pytest.approx(1.0 / 4.0)
    # not exposed by this target: absent, never zero
    assert f.overlap_steps is None and f.mean_schedule_seconds is None
    assert snapshot_prometheus("# TYPE other_metric counter\nother_metric_total 3\n") is None


# ---------------------------------------------------------------- --compare, checked from JSON


def _check_one_run(run: dict, mode: str) -> None:
    """One run's figures agree with its own request records."""
    s, reqs = run["summary"], run["requests"]
    assert len(reqs) == NUM_PROMPTS
    assert s["completed"] == NUM_PROMPTS and s["failed"] == 0, run["errors"]
    for key in ("ttft", "itl", "tpot", "e2e"):
        d = s[key]
        assert d["median"] <= d["p90"] <= d["p99"], (mode, key, d)
    ok = [r for r in reqs if r["success"]]
    tokens_out = sum(r["output_tokens"] for r in ok)
    tokens_in = sum(r["input_tokens"] for r in ok)
    assert tokens_out == sum(r["output_len"] for r in reqs)  # --ignore-eos: every token
    duration = s["duration_s"]
    assert s["output_throughput"] == pytest.approx(tokens_out / duration, rel=1e-9)
    assert s["input_throughput"] == pytest.approx(tokens_in / duration, rel=1e-9)
    assert s["total_throughput"] == pytest.approx((tokens_in + tokens_out) / duration, rel=1e-9)
    assert s["request_throughput"] == pytest.approx(len(ok) / duration, rel=1e-9)
    assert 1 <= s["peak_concurrency"] <= 4


def _check_stalls(stalls: dict[str, dict]) -> None:
    assert stalls[MIRRORS_OFF]["stalls_total"] > 0
    assert stalls[MIRRORS_OFF]["stalls_per_step"]["schedule.page_count"] > 0
    assert stalls[MIRRORS_ON]["stalls_total"] == 0
    assert stalls[MIRRORS_ON]["stalls_per_step"] == {}
    assert stalls[MIRRORS_ON]["stall_seconds"] == 0
    for figures in stalls.values():
        assert 0.0 <= figures["device_idle_fraction"] <= 1.0
        assert figures["mean_schedule_seconds"] > 0


def _check_run_json(data: dict) -> None:
    assert [r["mode"] for r in data["runs"]] == MODES
    assert data["config"]["workload"]["num_prompts"] == NUM_PROMPTS
    assert data["repeats"] == 1
    for run in data["runs"]:
        _check_one_run(run, run["mode"])
        # the one run, also in the shape that --repeats N uses
        (only,) = run["repeats"]
        assert only["requests"] == run["requests"] and only["summary"] == run["summary"]
        assert only["repeat"] == 1 and only["started_at"] < only["finished_at"]
    _check_stalls({r["mode"]: r["stallfree"] for r in data["runs"]})


def test_compare_in_process(tmp_path, capsys) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main([*ONE_RUN, "--output-json", str(out), "--plot", str(png)]) == 0
    table = capsys.readouterr().out
    assert MIRRORS_ON in table and "stalls per step" in table and "x)" in table
    data = json.loads(out.read_text())
    _check_run_json(data)
    assert data["config"]["target"]["kind"] == "inprocess"
    assert data["runs"][0]["settings"]["target"]["engine_config"]["runtime"]["overlap"] is False
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_compare_over_http(tmp_path, capsys) -> None:
    """Each mode gets its own `stallfree serve` subprocess; figures come from /metrics."""
    out = tmp_path / "bench.json"
    assert main([*ONE_RUN, "--target", "http", "--output-json", str(out)]) == 0
    data = json.loads(out.read_text())
    _check_run_json(data)
    assert data["runs"][0]["settings"]["target"]["kind"] == "http"


def _median_check(run: dict, path: tuple[str, ...]) -> None:
    """The mode's figure at `path` is exactly the median of its runs' figures."""

    def at(d: Any) -> Any:
        for key in path:
            d = d[key]
        return d

    assert at(run) == statistics.median(at(rep) for rep in run["repeats"]), (run["mode"], path)


def test_compare_repeats_interleaved_medians(tmp_path, capsys) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    args = [*SHORT_RUN, "--repeats", "2", "--output-json", str(out), "--plot", str(png)]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "median of 2 runs, modes interleaved" in table
    assert "spread over runs (tok/s)" in table  # the lowest and highest run of each mode
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # CDFs of the pooled runs
    data = json.loads(out.read_text())
    assert data["repeats"] == 2 and data["config"]["repeats"] == 2
    assert [r["mode"] for r in data["runs"]] == MODES
    # every run in full, in the order A1 B1 C1 A2 B2 C2, one after another
    runs = sorted(
        (rep["sequence"], run["mode"], rep["repeat"], rep["started_at"], rep["finished_at"])
        for run in data["runs"]
        for rep in run["repeats"]
    )
    assert [(mode, k) for _, mode, k, _, _ in runs] == [(m, k) for k in (1, 2) for m in MODES]
    assert [seq for seq, *_ in runs] == list(range(6))
    times = [t for *_, start, end in runs for t in (start, end)]
    assert times == sorted(times) and len(set(times)) == len(times)
    for run in data["runs"]:
        assert "requests" not in run  # the records live in each repeat
        assert [rep["repeat"] for rep in run["repeats"]] == [1, 2]
        for rep in run["repeats"]:
            _check_one_run(rep, run["mode"])
        # counts are per-run values, not sums
        s = run["summary"]
        assert s["completed"] == NUM_PROMPTS and s["failed"] == 0
        tokens = {rep["summary"]["total_output_tokens"] for rep in run["repeats"]}
        assert tokens == {s["total_output_tokens"]}  # same seeded workload every repeat
        for path in (
            ("summary", "duration_s"),
            ("summary", "output_throughput"),
            ("summary", "ttft", "median"),
            ("summary", "itl", "p99"),
            ("stallfree", "stall_seconds"),
            ("stallfree", "device_idle_fraction"),
            ("stallfree", "mean_schedule_seconds"),
        ):
            _median_check(run, path)
    for k in (0, 1):
        _check_stalls({r["mode"]: r["repeats"][k]["stallfree"] for r in data["runs"]})
    _check_stalls({r["mode"]: r["stallfree"] for r in data["runs"]})
    base, mirrors = data["runs"][0]["summary"], data["runs"][2]
    ratio = mirrors["ratios_to_baseline"]["output throughput (tok/s)"]
    assert ratio == mirrors["summary"]["output_throughput"] / base["output_throughput"]


def test_median_of_runs_keeps_counts_and_sites() -> None:
    from stallfree.bench.counters import StallFigures
    from stallfree.bench.results import Distribution, median_of

    d = median_of(
        Distribution, [Distribution(1.0, 2.0, 3.0, 4.0), Distribution(3.0, 4.0, 5.0, 6.0)]
    )
    assert d == Distribution(2.0, 3.0, 4.0, 5.0)
    figures = median_of(
        StallFigures,
        [
            StallFigures(steps=10.0, stalls_per_step={"a": 1.0}, sites=["a"]),
            StallFigures(steps=30.0, stalls_per_step={"b": 3.0}, sites=["b"]),
            StallFigures(steps=20.0, stalls_per_step={"a": 2.0, "b": 1.0}, sites=["a", "b"]),
        ],
    )
    assert figures.steps == 20.0 and figures.overlap_steps is None  # absent stays absent
    assert figures.stalls_per_step == {"a": 1.0, "b": 1.0}  # a site a run lacks counts as 0
    assert figures.sites == ["a", "b"]


# ---------------------------------------------------------------- any OpenAI-compatible server


def _fake_openai(request: httpx.Request) -> httpx.Response:
    """A server with the completions protocol and no stallfree metrics."""
    if request.url.path == "/v1/models":
        return httpx.Response(200, json={"object": "list", "data": [{"id": "fake"}]})
    if request.url.path == "/metrics":
        return httpx.Response(404)
    body = json.loads(request.content)
    events = [{"choices": [{"index": 0, "text": "x", "finish_reason": None}]}] * body["max_tokens"]
    events.append({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    events.append(
        {
            "choices": [],
            "usage": {
                "prompt_tokens": len(body["prompt"]),
                "completion_tokens": body["max_tokens"],
            },
        }
    )
    sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})


async def test_foreign_server_reports_stall_figures_as_absent() -> None:
    import contextlib

    @contextlib.asynccontextmanager
    async def open_target(mode: Mode):
        target = HttpTarget("http://fake/v1", transport=httpx.MockTransport(_fake_openai))
        await target.start()
        try:
            yield target
        finally:
            await target.stop()

    reqs = build_requests(WorkloadSpec(num_prompts=5, input_len=8, output_len=6))
    result = await run_mode(Mode("target"), open_target, reqs, RunSettings(warmup_requests=0))
    assert result.summary.completed == 5
    assert result.summary.total_output_tokens == sum(r.output_len for r in reqs)
    assert result.stallfree is None
    assert result.settings["target"]["model"] == "fake"

    from stallfree.bench.report import render_table, to_json

    assert to_json([result], {})["runs"][0]["stallfree"] is None
    rows = {row: cells for row, *cells in _table_cells(render_table([result], "t"))}
    assert rows["stall time (s)"] == ["—"] and rows["device idle fraction"] == ["—"]


def _table_cells(table) -> list[list[str]]:
    columns = [list(c.cells) for c in table.columns]
    return [list(row) for row in zip(*columns, strict=True)]


# ---------------------------------------------------------------- vLLM's result keys and the chat backend

LATENCIES = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2el": "e2e"}


def test_save_result_carries_vllms_keys(tmp_path, capsys) -> None:
    """A tiny in-process run written as `vllm bench serve --save-result` names it."""
    results = tmp_path / "results"
    args = [
        "bench",
        "--dataset-name",
        "random",
        "--random-input-len",
        "24",
        "--random-output-len",
        "12",
        "--num-prompts",
        str(NUM_PROMPTS),
        "--ignore-eos",
        "--num-warmups",
        "1",
        "--max-concurrency",
        "4",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(results),
    ]
    assert main(args) == 0
    (path,) = results.iterdir()
    assert re.fullmatch(r"stallfree-infqps-concurrency4-tiny-\d{8}-\d{6}\.json", path.name)
    data = json.loads(path.read_text())
    assert data["backend"] == "stallfree" and data["model_id"] == "tiny"
    assert data["num_prompts"] == NUM_PROMPTS and data["request_rate"] == "inf"
    assert data["max_concurrency"] == 4 and re.fullmatch(r"\d{8}-\d{6}", data["date"])
    reqs = data["runs"][0]["requests"]
    assert data["completed"] == NUM_PROMPTS and data["failed"] == 0
    assert data["total_output_tokens"] == sum(r["output_len"] for r in reqs)  # --ignore-eos
    assert data["total_input_tokens"] == sum(r["input_tokens"] for r in reqs)
    duration = data["duration"]
    assert 0 < duration < 60
    tokens = data["total_input_tokens"] + data["total_output_tokens"]
    assert data["total_token_throughput"] == pytest.approx(tokens / duration, rel=1e-9)
    assert data["output_throughput"] == pytest.approx(
        data["total_output_tokens"] / duration, rel=1e-9
    )
    assert data["request_throughput"] == pytest.approx(NUM_PROMPTS / duration, rel=1e-9)
    assert 1 <= data["max_concurrent_requests"] <= 4
    per_request = {
        "ttft": [r["ttft"] for r in reqs],
        "tpot": [r["tpot"] for r in reqs],
        "itl": [x for r in reqs for x in r["itls"]],
        "e2el": [r["e2e"] for r in reqs],
    }
    for name, values in per_request.items():
        mean, median = data[f"mean_{name}_ms"], data[f"median_{name}_ms"]
        assert mean == pytest.approx(statistics.fmean(values) * 1e3, rel=1e-9), name
        assert median == pytest.approx(statistics.median(values) * 1e3, rel=1e-9), name
        assert data[f"std_{name}_ms"] == pytest.approx(statistics.pstdev(values) * 1e3, rel=1e-6)
        assert 0 < median <= data[f"p99_{name}_ms"] <= max(values) * 1e3 + 1e-9, name
    assert data["median_e2el_ms"] > data["median_ttft_ms"]
    # the run's own summary keeps today's keys beside vLLM's
    summary = data["runs"][0]["summary"]
    assert summary["duration"] == summary["duration_s"] == duration
    assert summary["total_token_throughput"] == summary["total_throughput"]
    for name, key in LATENCIES.items():
        assert summary[f"mean_{name}_ms"] == pytest.approx(summary[key]["mean"] * 1e3)
        assert summary[f"p99_{name}_ms"] == pytest.approx(summary[key]["p99"] * 1e3)


def test_compare_json_has_vllm_keys_per_mode_only(tmp_path) -> None:
    """Several modes: vLLM's figures in each run's summary, none at the top level."""
    from stallfree.bench.counters import StallFigures
    from stallfree.bench.report import to_json
    from stallfree.bench.results import RequestRecord, RunResult, summarize

    def run(mode: str, ttft: float) -> RunResult:
        record = RequestRecord(4, 3, success=True, input_tokens=4, output_tokens=3)
        record.ttft, record.e2e, record.itls = ttft, ttft + 0.2, [0.1, 0.1]
        return RunResult(mode, {}, summarize([record], 1.0, 1), StallFigures(), [record])

    data = to_json([run("a", 0.5), run("b", 0.25)], {}, {"backend": "stallfree"})
    assert data["backend"] == "stallfree" and "mean_ttft_ms" not in data
    assert [r["summary"]["mean_ttft_ms"] for r in data["runs"]] == [500.0, 250.0]
    assert data["runs"][0]["summary"]["mean_tpot_ms"] == pytest.approx(100.0)
    assert data["runs"][0]["summary"]["std_itl_ms"] == 0.0


def _fake_chat(request: httpx.Request) -> httpx.Response:
    """A chat server: a role chunk with empty content first, one chunk per token, usage last."""
    if request.url.path == "/v1/models":
        return httpx.Response(200, json={"object": "list", "data": [{"id": "fake"}]})
    if request.url.path != "/v1/chat/completions":
        return httpx.Response(404)
    body = json.loads(request.content)
    (message,) = body["messages"]
    assert message["role"] == "user" and message["content"].isprintable()
    n = body["max_completion_tokens"]
    events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    events += [{"choices": [{"index": 0, "delta": {"content": "y"}}]}] * n
    events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
    usage = {"prompt_tokens": len(message["content"]) + 5, "completion_tokens": n}
    events.append({"choices": [], "usage": usage})
    sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})


async def test_chat_target_times_content_chunks_only() -> None:
    import contextlib

    from stallfree.bench.http_targets import chat_text, http_target

    @contextlib.asynccontextmanager
    async def open_target(mode: Mode):
        target = http_target(
            "openai-chat", "http://fake", transport=httpx.MockTransport(_fake_chat)
        )
        await target.start()
        try:
            yield target
        finally:
            await target.stop()

    reqs = build_requests(WorkloadSpec(num_prompts=3, input_len=8, output_len=6))
    result = await run_mode(Mode("target"), open_target, reqs, RunSettings(warmup_requests=0))
    assert result.summary.completed == 3, result.errors
    for req, rec in zip(reqs, result.requests, strict=True):
        assert rec.output_tokens == req.output_len
        assert len(rec.itls) == req.output_len - 1  # the empty role chunk is not a token
        assert rec.input_tokens == req.prompt_len + 5  # the server's count (its template)
    assert result.settings["target"]["backend"] == "openai-chat"
    text = chat_text([0, 65, 94, 255])
    assert len(text) == 4 and text.isprintable() and chat_text("as is") == "as is"


async def test_chat_backend_against_a_live_server() -> None:
    """`--backend openai-chat` drives a real `/v1/chat/completions` stream."""
    from stallfree.bench.runner import url_targets
    from stallfree.config import load_config
    from stallfree.entrypoints.server import create_app, start_server

    server = await start_server(create_app(load_config(model={"path": "tiny"})))
    try:
        reqs = build_requests(WorkloadSpec(num_prompts=4, input_len=16, output_len=8, seed=1))
        rs = RunSettings(warmup_requests=1, ignore_eos=True, max_concurrency=2)
        open_target = url_targets(server.url + "/v1", None, None, "openai-chat")
        result = await run_mode(Mode("target"), open_target, reqs, rs)
    finally:
        await server.stop()
    s = result.summary
    assert s.completed == 4 and s.failed == 0, result.errors
    assert s.total_output_tokens == sum(r.output_len for r in reqs)
    for req, rec in zip(reqs, result.requests, strict=True):
        assert rec.finish_reason == "length"
        assert rec.ttft is not None and rec.e2e is not None and 0 < rec.ttft < rec.e2e
        assert len(rec.itls) <= req.output_len - 1
        # the chat template wraps the message: more prompt tokens than the bare prompt
        assert rec.input_tokens > req.prompt_len
    assert s.ttft.median is not None and s.itl.median is not None
    assert result.settings["target"] == {
        "kind": "http",
        "backend": "openai-chat",
        "base_url": server.url,
        "model": "tiny",
    }
    assert result.stallfree is not None and result.stallfree.steps  # from /metrics


# ---------------------------------------------------------------- errors: message, exit code, no traceback


def test_compare_with_base_url_is_a_usage_error(capsys) -> None:
    assert main(["bench", "--compare", "--base-url", "http://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "--compare" in err and "--base-url" in err and "Traceback" not in err


def test_repeats_below_one_is_a_usage_error(capsys) -> None:
    assert main(["bench", "--compare", "--repeats", "0"]) == 2
    assert main(["bench", "--repeats", "-3"]) == 2
    err = capsys.readouterr().err
    assert "stallfree bench: error: --repeats must be at least 1 (got 0)" in err
    assert "(got -3)" in err and "Traceback" not in err


def test_plot_flag_and_other_bad_flags(capsys) -> None:
    assert main(["bench", "--compare", "--overlap"]) == 2
    assert main(["bench", "--modes", "mirrors"]) == 2
    assert main(["bench", "--compare", "--modes", "bogus"]) == 2
    err = capsys.readouterr().err
    assert err.count("stallfree bench: error:") == 3 and "Traceback" not in err


def test_unreachable_url_subprocess() -> None:
    url = f"http://127.0.0.1:{_dead_port()}"
    proc = subprocess.run(
        [sys.executable, "-m", "stallfree.cli", "bench", "--base-url", url, "--num-prompts", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert f"cannot reach {url}" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_bad_flag_combination_subprocess() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "stallfree.cli",
            "bench",
            "--compare",
            "--base-url",
            "http://127.0.0.1:1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--compare" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_sharegpt_file(capsys, tmp_path) -> None:
    missing = str(tmp_path / "nope.json")
    assert main(["bench", "--workload", "sharegpt", "--dataset-path", missing]) == 1
    err = capsys.readouterr().err
    assert "not found" in err and "Traceback" not in err


def test_plot_without_matplotlib_is_a_clear_error(capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    assert main(["bench", "--num-prompts", "1", "--plot", "out.png"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'stallfree[bench]'" in err and "Traceback" not in err


def test_compare_defaults_to_three_interleaved_repeats() -> None:
    """One run per mode cannot tell overlap from noise on a shared machine."""
    from stallfree.bench.flag_checks import check_flags
    from stallfree.cli import build_parser

    compare = build_parser().parse_args(["bench", "--compare"])
    check_flags(compare)
    single = build_parser().parse_args(["bench"])
    check_flags(single)
    assert (compare.repeats, single.repeats) == (3, 1)


# ---------------------------------------------------------------- worker processes and TP sizes

WORKER_RUN = [a for a in ONE_RUN if a != "--compare"]


def _worker_figures(run: dict) -> dict | None:
    return run["stallfree"]["workers"]


def test_compare_workers_in_process(tmp_path, capsys) -> None:
    """The same workload with the model in process, then in a worker process: a column each,
    and the worker's per-rank figures (absent in process)."""
    out = tmp_path / "bench.json"
    assert (
        main([*WORKER_RUN, "--compare-workers", "--device", "cpu", "--output-json", str(out)]) == 0
    )
    table = capsys.readouterr().out
    assert "worker process (x base)" in table and "rank 0 step time (ms)" in table
    assert "bytes per step sent to the workers" in table
    data = json.loads(out.read_text())
    assert [r["mode"] for r in data["runs"]] == ["worker inprocess", "worker process"]
    inproc, proc = data["runs"]
    for run, worker in ((inproc, "inprocess"), (proc, "process")):
        _check_one_run(run, run["mode"])
        assert run["settings"]["target"]["engine_config"]["runtime"]["worker"] == worker
    assert _worker_figures(inproc) is None
    (rank0,) = _worker_figures(proc).values()
    assert list(_worker_figures(proc)) == ["0"]
    steps = proc["stallfree"]["steps"]
    # overlap: the last launched step may still be on the worker when the run ends
    assert steps - 1 <= rank0["steps"] <= steps
    assert 0 < rank0["mean_step_seconds"] < proc["summary"]["duration_s"]
    assert rank0["comm_seconds"] == 0 and rank0["comm_share"] == 0  # one rank: no collectives
    assert rank0["message_bytes_per_step"] > 0
    ratios = proc["ratios_to_baseline"]
    assert ratios["rank 0 step time (ms)"] is None  # nothing to compare it with in process
    assert ratios["output throughput (tok/s)"] == (
        proc["summary"]["output_throughput"] / inproc["summary"]["output_throughput"]
    )


def test_worker_modes_compose_with_the_overlap_modes() -> None:
    from stallfree.bench.runner import CONFIGURED, compare_modes, worker_modes

    modes = worker_modes(compare_modes(keys=["off", "mirrors"]), compare_workers=True)
    assert [m.name for m in modes] == [
        "overlap off, worker inprocess",
        "overlap, mirrors on, worker inprocess",
        "overlap off, worker process",
        "overlap, mirrors on, worker process",
    ]
    assert modes[2].settings == {
        "runtime": {"overlap": False, "cpu_mirrors": False, "worker": "process"}
    }
    tp = worker_modes([Mode(CONFIGURED)], tp_sizes=[1, 2])
    assert [(m.name, m.settings) for m in tp] == [
        ("tp 1", {"runtime": {"worker": "process"}, "parallel": {"tp_size": 1}}),
        ("tp 2", {"runtime": {"worker": "process"}, "parallel": {"tp_size": 2}}),
    ]
    as_configured = worker_modes([Mode(CONFIGURED)], tp_sizes=[2, 4], set_worker=False)
    assert [m.settings for m in as_configured] == [
        {"parallel": {"tp_size": 2}},
        {"parallel": {"tp_size": 4}},
    ]
    assert worker_modes([Mode(CONFIGURED)]) == [Mode(CONFIGURED)]


def test_rank_figures_from_two_snapshots_and_their_median() -> None:
    from stallfree.bench.counters import (
        CounterSnapshot,
        RankCounters,
        RankFigures,
        StallFigures,
    )
    from stallfree.bench.report import table_rows
    from stallfree.bench.results import median_of

    def snap(wall: float, steps: float, r0: RankCounters, r1: RankCounters) -> CounterSnapshot:
        return CounterSnapshot(wall=wall, steps=steps, workers={"0": r0, "1": r1})

    before = snap(
        0.0, 10, RankCounters(10, 1.0, 0.25, 1000, 5000), RankCounters(10, 1.5, 0.5, 1000, 0)
    )
    after = snap(
        1.0, 30, RankCounters(30, 3.0, 0.75, 3000, 9000), RankCounters(30, 3.5, 1.0, 3000, 0)
    )
    figures = stall_figures(before, after)
    assert figures.workers == {
        "0": RankFigures(20, 0.1, 0.5, 0.25, 100.0, 200.0),
        "1": RankFigures(20, 0.1, 0.5, 0.25, 100.0, 0.0),
    }
    # a target without workers has none
    assert stall_figures(CounterSnapshot(wall=0.0), CounterSnapshot(wall=1.0)).workers is None
    runs = [
        StallFigures(workers={"0": RankFigures(steps=s, mean_step_seconds=s / 100)})
        for s in (10.0, 30.0, 20.0)
    ]
    median = median_of(StallFigures, runs)
    assert median.workers == {"0": RankFigures(steps=20.0, mean_step_seconds=0.2)}
    assert median_of(StallFigures, [StallFigures(), StallFigures()]).workers is None

    from stallfree.bench.results import RunResult

    result = RunResult("tp 2", {}, None, figures, [])  # type: ignore[arg-type]
    rows = {label: get for label, get, _, _ in table_rows([result])}
    assert rows["rank 1 step time (ms)"](result) == 0.1
    assert rows["rank 0 all-reduce + gather share of step"](result) == 0.25
    assert rows["bytes per step sent to the workers"](result) == 200.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--compare-workers", "--compare-tp", "1,2"], "cannot go together"),
        (["--compare-workers", "--worker", "process"], "drop --worker"),
        (["--compare-tp", "1,2", "--tp-size", "2"], "drop --tp-size"),
        (["--compare-workers", "--hisparse", "on"], "HiSparse"),
        (["--compare-workers", "--base-url", "http://127.0.0.1:1"], "--base-url"),
        (["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", "h:1"], "--base-url"),
    ],
)
def test_bad_worker_bench_combinations(argv, message, capsys) -> None:
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert "stallfree bench: error:" in err and message in err and "Traceback" not in err


@pytest.mark.parametrize("sizes", ["2", "1,1", "0,2", "1,x"])
def test_compare_tp_needs_two_different_sizes(sizes, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--compare-tp", sizes])
    assert exc.value.code == 2
    assert "tensor-parallel sizes" in capsys.readouterr().err


def test_worker_comparisons_default_to_three_repeats() -> None:
    from stallfree.bench.flag_checks import check_flags
    from stallfree.cli import build_parser

    for flags in (["--compare-workers"], ["--compare-tp", "1,2"]):
        args = build_parser().parse_args(["bench", *flags])
        check_flags(args)
        assert args.repeats == 3


@pytest.mark.slow
def test_compare_tp_sizes_in_process(tmp_path, capsys) -> None:
    """tp 1 and tp 2, both in worker processes: per-rank figures for every rank, and
    collectives only where the model is split."""
    out = tmp_path / "bench.json"
    argv = [*WORKER_RUN, "--compare-tp", "1,2", "--device", "cpu", "--output-json", str(out)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "tp 2 (x base)" in table and "rank 1 all-reduce + gather share of step" in table
    data = json.loads(out.read_text())
    tp1, tp2 = data["runs"]
    assert [tp1["mode"], tp2["mode"]] == ["tp 1", "tp 2"]
    for run, size in ((tp1, 1), (tp2, 2)):
        _check_one_run(run, run["mode"])
        engine = run["settings"]["target"]["engine_config"]
        assert engine["parallel"]["tp_size"] == size and engine["runtime"]["worker"] == "process"
    assert list(_worker_figures(tp1)) == ["0"] and _worker_figures(tp1)["0"]["comm_share"] == 0
    ranks = _worker_figures(tp2)
    assert list(ranks) == ["0", "1"]
    for rank in ranks.values():
        assert 0 < rank["comm_share"] < 1 and rank["comm_bytes_per_step"] > 0
        # every rank runs every step (one may still be on a rank when the run ends)
        assert abs(rank["steps"] - ranks["0"]["steps"]) <= 1
    assert ranks["0"]["message_bytes_per_step"] > 0 and ranks["1"]["message_bytes_per_step"] == 0
    assert tp2["ratios_to_baseline"]["rank 0 step time (ms)"] == pytest.approx(
        ranks["0"]["mean_step_seconds"] / _worker_figures(tp1)["0"]["mean_step_seconds"]
    )


def test_a_scrape_gives_the_per_rank_figures_over_http():
    """`--target http` reads the worker families from /metrics as the in-process bench reads
    `EngineSnapshot.workers`."""
    from stallfree.bench.counters import RankCounters, snapshot_prometheus
    from stallfree.metrics import EngineMetrics
    from stallfree.runtime.telemetry.stats import WorkerRankStats
    from tests.metrics_util import fake_snapshot

    ranks = (
        WorkerRankStats(0, 10, 1.5, 0.25, 1024, message_bytes=4096),
        WorkerRankStats(1, 10, 1.25, 0.5, 1024),
    )
    text = EngineMetrics("m", "0", lambda: fake_snapshot(workers=ranks)).render().decode()
    got = snapshot_prometheus(text)
    assert got is not None and got.workers == {
        "0": RankCounters(10, 1.5, 0.25, 1024, 4096),
        "1": RankCounters(10, 1.25, 0.5, 1024, 0),
    }
    plain = snapshot_prometheus(EngineMetrics("m", "0", fake_snapshot).render().decode())
    assert plain is not None and plain.workers is None
