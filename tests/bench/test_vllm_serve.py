"""`vllm bench serve`'s flags in `stallfree bench`: goodput, burstiness and ramp-up arrivals,
chosen percentiles, the custom and sonnet datasets, detailed results, metadata and label, and
the sglang backend (SGLang's native `/generate`, which stallfree serves too)."""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics

import httpx
import pytest

from stallfree.bench.datasets import SONNET_BASE_PROMPT, build_requests
from stallfree.bench.http_targets import http_target
from stallfree.bench.results import RequestRecord, RunResult, summarize
from stallfree.bench.runner import Mode, RunSettings, run_mode, url_targets
from stallfree.bench.slo import (
    detailed_lists,
    good_requests,
    goodput_item,
    metric_percentiles,
    percentile_figures,
    percentile_key,
    request_goodput,
    run_figures,
)
from stallfree.bench.sonnet_text import sonnet_lines
from stallfree.bench.workloads import (
    WorkloadError,
    WorkloadSpec,
    arrival_offsets,
    ramp_up_rate,
)
from stallfree.cli import main


def _byte_tokenize(text: str) -> list[int]:
    return list(text.encode())


def _record(
    ttft: float, e2e: float, out: int, success: bool = True, itls: list[float] | None = None
) -> RequestRecord:
    r = RequestRecord(4, out, success=success, input_tokens=4, output_tokens=out)
    r.ttft, r.e2e, r.itls = ttft, e2e, list(itls or [])
    return r


# five requests: (ttft, e2e, output tokens); TPOT = (e2e - ttft) / (tokens - 1)
RECORDS = [
    (0.1, 0.5, 5),  # tpot 100 ms, e2el 500 ms
    (0.3, 0.7, 5),  # ttft 300 ms, tpot 100 ms
    (0.1, 1.3, 5),  # tpot 300 ms, e2el 1300 ms
    (0.1, 0.1, 1),  # one token: TPOT counts as 0 (vLLM)
]


def _records() -> list[RequestRecord]:
    out = [_record(*x) for x in RECORDS]
    out.append(_record(0.01, 0.02, 5, success=False))  # failed: never good, however fast
    return out


# ---------------------------------------------------------------- goodput


@pytest.mark.parametrize(
    ("slos", "good"),
    [
        ({"ttft": 200}, 3),  # all but the 300 ms TTFT (and the failed one)
        ({"ttft": 100}, 3),  # the limit itself passes: ttft <= MS
        ({"ttft": 99}, 0),
        ({"ttft": 200, "tpot": 150}, 2),  # the first and the one-token request
        ({"e2el": 600}, 2),
        ({"ttft": 400, "tpot": 400, "e2el": 1000}, 3),
        ({"tpot": 50}, 1),  # only the one-token request
    ],
)
def test_goodput_counts_requests_meeting_every_slo(slos, good) -> None:
    records = _records()
    assert good_requests(records, slos) == good
    assert request_goodput(records, 2.0, slos) == pytest.approx(good / 2.0)


def test_goodput_in_run_figures_and_absent_without_slos() -> None:
    records = _records()
    run = RunResult("m", {}, summarize(records, 4.0, 2), None, records)
    assert run_figures(run, {"ttft": 200}, [], [])["request_goodput"] == pytest.approx(3 / 4.0)
    assert run_figures(run, None, [], [])["request_goodput"] is None


def test_goodput_item_parsing() -> None:
    assert goodput_item("ttft:500") == ("ttft", 500.0)
    assert goodput_item("e2el:0.5") == ("e2el", 0.5)
    for bad in ("foo:1", "ttft", "ttft:abc", "tpot:-3", "itl:5", "ttft:inf"):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(bad))):
            goodput_item(bad)


@pytest.mark.parametrize(("argv", "named"), [(["foo:1"], "foo:1"), (["ttft:x"], "ttft:x")])
def test_bad_goodput_is_an_argparse_error_naming_it(argv, named, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--goodput", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--goodput" in err and named in err and "Traceback" not in err


# ---------------------------------------------------------------- arrivals


def _gaps(offsets: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(offsets)]


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_burstiness_gamma_gaps(burstiness) -> None:
    gaps = _gaps(arrival_offsets(20001, 10.0, 7, burstiness))
    mean = statistics.fmean(gaps)
    cv2 = statistics.pvariance(gaps) / mean**2
    assert mean == pytest.approx(0.1, rel=0.05)  # 1 / rate whatever the burstiness
    assert cv2 == pytest.approx(1 / burstiness, rel=0.15)  # gamma: CV^2 = 1 / shape


def test_burstiness_changes_the_variance_and_is_seeded() -> None:
    bursty = _gaps(arrival_offsets(5000, 10.0, 1, 0.25))
    steady = _gaps(arrival_offsets(5000, 10.0, 1, 4.0))
    assert statistics.pvariance(bursty) > 8 * statistics.pvariance(steady)
    assert arrival_offsets(50, 10.0, 1, 0.25) == arrival_offsets(50, 10.0, 1, 0.25)
    assert arrival_offsets(50, 10.0, 1, 0.25) != arrival_offsets(50, 10.0, 2, 0.25)
    with pytest.raises(WorkloadError, match="burstiness"):
        arrival_offsets(5, 10.0, 1, 0.0)


def test_ramp_up_rates_at_the_first_and_last_request() -> None:
    assert ramp_up_rate("linear", 2.0, 10.0, 0, 5, 99.0) == 2.0
    assert ramp_up_rate("linear", 2.0, 10.0, 4, 5, 99.0) == 10.0
    assert ramp_up_rate("linear", 2.0, 10.0, 1, 5, 99.0) == 4.0
    assert ramp_up_rate("exponential", 2.0, 32.0, 0, 5, 99.0) == 2.0
    assert ramp_up_rate("exponential", 2.0, 32.0, 4, 5, 99.0) == pytest.approx(32.0)
    assert ramp_up_rate("exponential", 2.0, 32.0, 2, 5, 99.0) == pytest.approx(8.0)
    assert ramp_up_rate(None, 2.0, 32.0, 2, 5, 99.0) == 99.0
    # a huge burstiness makes every gap its mean, 1 / the rate at that request
    gaps = _gaps(arrival_offsets(5, 0.0, 3, 1e9, ("linear", 2.0, 10.0)))
    assert gaps == pytest.approx([1 / 2, 1 / 4, 1 / 6, 1 / 8], rel=1e-3)
    gaps = _gaps(arrival_offsets(5, 0.0, 3, 1e9, ("exponential", 2.0, 32.0)))
    assert gaps == pytest.approx([1 / 2, 1 / 4, 1 / 8, 1 / 16], rel=1e-3)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            [
                "--ramp-up-strategy",
                "linear",
                "--ramp-up-start-rps",
                "1",
                "--ramp-up-end-rps",
                "5",
                "--request-rate",
                "3",
            ],
            "When using ramp-up, do not specify --request-rate",
        ),
        (
            ["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1"],
            "both --ramp-up-start-rps and --ramp-up-end-rps must be specified",
        ),
        (
            [
                "--ramp-up-strategy",
                "exponential",
                "--ramp-up-start-rps",
                "5",
                "--ramp-up-end-rps",
                "1",
            ],
            "Ramp-up start RPS must be less than end RPS",
        ),
        (["--ramp-up-start-rps", "5"], "need --ramp-up-strategy"),
        (["--burstiness", "0"], "--burstiness must be positive"),
    ],
)
def test_bad_arrival_flags(argv, message, capsys) -> None:
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


# ---------------------------------------------------------------- percentiles


def test_percentile_keys_for_a_known_list() -> None:
    ttfts = [0.01, 0.02, 0.03, 0.04, 0.05]
    records = [_record(t, t + 0.4, 5, itls=[0.1] * 4) for t in ttfts]
    got = percentile_figures(records, ["ttft", "e2el"], [50.0, 90.0, 99.9])
    assert set(got) == {
        "p50_ttft_ms",
        "p90_ttft_ms",
        "p99.9_ttft_ms",
        "p50_e2el_ms",
        "p90_e2el_ms",
        "p99.9_e2el_ms",
    }
    assert got["p50_ttft_ms"] == pytest.approx(30.0)
    assert got["p90_ttft_ms"] == pytest.approx(46.0)  # linear: 40 + 0.6 * 10
    assert got["p99.9_ttft_ms"] == pytest.approx(49.96)
    assert got["p50_e2el_ms"] == pytest.approx(430.0)
    assert percentile_key(99.0, "itl") == "p99_itl_ms" and percentile_key(99.5, "x") == "p99.5_x_ms"
    assert percentile_figures([], ["itl"], [99.0]) == {"p99_itl_ms": None}


def test_percentile_flag_values(capsys) -> None:
    assert metric_percentiles("50,90,99.9") == [50.0, 90.0, 99.9]
    for bad in ("", "x", "101", "50,-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            metric_percentiles(bad)
    with pytest.raises(SystemExit):
        main(["bench", "--percentile-metrics", "ttft,latency"])
    assert "latency" in capsys.readouterr().err


# ---------------------------------------------------------------- datasets


def _custom(tmp_path, lines: list[str]) -> str:
    path = tmp_path / "custom.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_custom_dataset(tmp_path) -> None:
    path = _custom(
        tmp_path,
        [
            json.dumps({"prompt": "hello there", "output_tokens": 7}),
            "",
            json.dumps({"prompt": "what is a stall?"}),
            json.dumps({"prompt": "zzz", "output_tokens": 3, "other": 1}),
        ],
    )
    spec = WorkloadSpec(kind="custom", num_prompts=3, dataset_path=path, output_len=11)
    reqs = build_requests(spec, _byte_tokenize)
    got = sorted((r.prompt, r.prompt_len, r.output_len) for r in reqs)
    assert got == [("hello there", 11, 7), ("what is a stall?", 16, 11), ("zzz", 3, 3)]
    spec.custom_output_len = 5
    assert {r.output_len for r in build_requests(spec, _byte_tokenize) if r.prompt[0] == "w"} == {5}
    spec.num_prompts = 8  # more than the file: drawn again
    reqs = build_requests(spec, _byte_tokenize)
    assert len(reqs) == 8 and {r.prompt for r in reqs} == {"hello there", "what is a stall?", "zzz"}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "line 3: not JSON"),
        ("[1, 2]", "line 3: expected a JSON object"),
        ('{"text": "no prompt"}', 'line 3: "prompt" must be a non-empty string'),
        ('{"prompt": "x", "output_tokens": 0}', 'line 3: "output_tokens" must be a positive'),
        ('{"prompt": "x", "output_tokens": "4"}', 'line 3: "output_tokens" must be a positive'),
    ],
)
def test_custom_dataset_bad_line_is_named(tmp_path, bad, message) -> None:
    path = _custom(tmp_path, [json.dumps({"prompt": "a"}), json.dumps({"prompt": "b"}), bad])
    with pytest.raises(WorkloadError, match=re.escape(message)):
        build_requests(
            WorkloadSpec(kind="custom", num_prompts=2, dataset_path=path), _byte_tokenize
        )


def test_custom_dataset_errors_through_the_cli(tmp_path, capsys) -> None:
    path = _custom(tmp_path, [json.dumps({"prompt": "a"}), "oops"])
    argv = ["bench", "--dataset-name", "custom", "--dataset-path", path, "--num-prompts", "2"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "line 2: not JSON" in err and "Traceback" not in err
    assert main(["bench", "--dataset-name", "custom", "--num-prompts", "2"]) == 1
    assert "needs --dataset-path" in capsys.readouterr().err


def test_sonnet_prompt_lengths() -> None:
    lines = sonnet_lines()
    assert len(lines) >= 100 and all(x.endswith("\n") for x in lines)
    spec = WorkloadSpec(
        kind="sonnet", num_prompts=20, sonnet_input_len=400, sonnet_prefix_len=150, seed=2
    )
    spec.sonnet_output_len = 33
    reqs = build_requests(spec, _byte_tokenize)
    assert len(reqs) == 20
    avg = sum(len(x) for x in lines) / len(lines)
    n_prefix = round((150 - len(SONNET_BASE_PROMPT)) / avg)
    prefix = SONNET_BASE_PROMPT + "".join(lines[:n_prefix])
    for r in reqs:
        assert isinstance(r.prompt, str) and r.prompt.startswith(prefix)
        assert r.prompt_len == len(r.prompt.encode())
        assert 400 - 3 * avg <= r.prompt_len <= 400  # about the input length, never above
        assert r.output_len == 33
    assert len({r.prompt for r in reqs}) > 15  # the lines after the prefix are drawn
    assert [r.prompt for r in reqs] == [r.prompt for r in build_requests(spec, _byte_tokenize)]
    with pytest.raises(WorkloadError, match="sonnet-input-len"):
        build_requests(
            WorkloadSpec(kind="sonnet", num_prompts=1, sonnet_input_len=10), _byte_tokenize
        )


def test_sonnet_from_a_file(tmp_path) -> None:
    path = tmp_path / "poem.txt"
    path.write_text("roses are red\n\nviolets are blue\n", encoding="utf-8")
    spec = WorkloadSpec(
        kind="sonnet",
        num_prompts=4,
        dataset_path=str(path),
        sonnet_input_len=120,
        sonnet_prefix_len=60,
    )
    for r in build_requests(spec, _byte_tokenize):
        body = r.prompt.removeprefix(SONNET_BASE_PROMPT)
        assert set(body.splitlines()) <= {"roses are red", "violets are blue"}
        assert r.prompt_len <= 120


# ---------------------------------------------------------------- the result file


def test_result_file_has_the_new_keys(tmp_path, capsys) -> None:
    """A tiny in-process run with every new output flag, and a linear ramp-up."""
    argv = [
        "bench",
        "--num-prompts",
        "5",
        "--input-len",
        "16",
        "--output-len",
        "6",
        "--ignore-eos",
        "--num-warmups",
        "1",
        "--disable-tqdm",
        "--ramp-up-strategy",
        "linear",
        "--ramp-up-start-rps",
        "200",
        "--ramp-up-end-rps",
        "400",
        "--burstiness",
        "2",
        "--goodput",
        "ttft:60000",
        "e2el:60000",
        "--percentile-metrics",
        "ttft,e2el",
        "--metric-percentiles",
        "50,99.9",
        "--save-detailed",
        "--metadata",
        "gpu=none",
        "run = 3",
        "--label",
        "mylab",
        "--save-result",
        "--result-dir",
        str(tmp_path),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "request goodput (req/s):" in out and "p99.9_ttft" in out
    (path,) = tmp_path.iterdir()
    assert re.fullmatch(
        r"mylab-ramp-up-linear-200\.0qps-400\.0qps-tiny-\d{8}-\d{6}\.json", path.name
    )
    data = json.loads(path.read_text())
    assert data["label"] == "mylab" and data["backend"] == "stallfree"
    assert data["gpu"] == "none" and data["run"] == "3"
    assert data["burstiness"] == 2.0 and data["ramp_up_strategy"] == "linear"
    assert (data["ramp_up_start_rps"], data["ramp_up_end_rps"]) == (200.0, 400.0)
    assert data["completed"] == 5
    # every request meets SLOs of a minute: goodput is the request throughput
    assert data["request_goodput"] == pytest.approx(data["request_throughput"], rel=1e-9)
    assert data["runs"][0]["summary"]["request_goodput"] == data["request_goodput"]
    assert data["p50_ttft_ms"] == pytest.approx(data["median_ttft_ms"], rel=1e-9)
    assert data["median_e2el_ms"] <= data["p99.9_e2el_ms"]
    assert "p50_itl_ms" not in data and "p99.9_tpot_ms" not in data
    assert data["p99_itl_ms"] is not None  # the keys written before stay
    reqs = data["runs"][0]["requests"]
    assert "generated_text" not in reqs[0]
    assert data["input_lens"] == [r["prompt_len"] for r in reqs]
    assert (
        data["output_lens"] == [r["output_tokens"] for r in reqs] == [r["output_len"] for r in reqs]
    )
    assert data["ttfts"] == [r["ttft"] for r in reqs]
    assert data["itls"] == [r["itls"] for r in reqs]
    assert data["errors"] == [""] * 5
    assert all(isinstance(t, str) and t for t in data["generated_texts"])
    assert len(data["generated_texts"]) == 5


def test_without_the_new_flags_goodput_is_null_and_lists_absent() -> None:
    records = _records()
    run = RunResult("m", {}, summarize(records, 1.0, 1), None, records)
    from stallfree.bench.report import to_json

    data = to_json([run], {}, {"backend": "x"}, lambda r: run_figures(r, None, ["ttft"], [99.0]))
    assert data["request_goodput"] is None and "ttfts" not in data
    lists = detailed_lists(run)
    assert lists["output_lens"] == [5, 5, 5, 1, 0] and lists["ttfts"][-1] == 0.0
    assert lists["errors"] == [""] * 5


# ---------------------------------------------------------------- the sglang backend


def _fake_sglang(request: httpx.Request) -> httpx.Response:
    """SGLang's own stream: the text so far in each event, finish_reason as a dict."""
    if request.url.path == "/v1/models":
        return httpx.Response(404)
    assert request.url.path == "/generate"
    body = json.loads(request.content)
    assert body["stream"] is True and body["text"] == "hi there"
    n = body["sampling_params"]["max_new_tokens"]
    assert body["sampling_params"]["ignore_eos"] is True
    events = []
    for i in range(1, n + 1):
        reason = {"type": "length", "length": n} if i == n else None
        meta = {"prompt_tokens": 9, "completion_tokens": i, "finish_reason": reason}
        events.append({"text": "ab" * i, "meta_info": meta})
    sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})


async def test_sglang_target_reads_cumulative_text() -> None:
    from stallfree.bench.targets import RequestOptions
    from stallfree.bench.workloads import BenchRequest

    target = http_target("sglang", "http://fake", transport=httpx.MockTransport(_fake_sglang))
    await target.start()  # no /v1/models: SGLang's /generate needs no model name
    try:
        rec = await target.send(BenchRequest("hi there", 8, 4), RequestOptions(ignore_eos=True))
    finally:
        await target.stop()
    assert rec.success and rec.error is None, rec.error
    assert rec.generated_text == "abababab"  # not "ab" + "abab" + ...
    assert rec.output_tokens == 4 and len(rec.itls) == 3 and rec.input_tokens == 9
    assert rec.finish_reason == "length"


async def test_sglang_backend_against_a_live_server() -> None:
    """`--backend sglang` drives stallfree's own `/generate` stream, token ids and text."""
    from stallfree.config import load_config
    from stallfree.entrypoints.server import create_app, start_server

    server = await start_server(create_app(load_config(model={"path": "tiny"})))
    try:
        ids = build_requests(WorkloadSpec(num_prompts=3, input_len=16, output_len=8, seed=1))
        text = build_requests(
            WorkloadSpec(kind="sonnet", num_prompts=2, sonnet_input_len=200, sonnet_prefix_len=80),
            _byte_tokenize,
        )
        for r in text:
            r.output_len = 6
        reqs = ids + text
        rs = RunSettings(warmup_requests=1, ignore_eos=True, max_concurrency=2)
        open_target = url_targets(server.url, None, None, "sglang")
        result = await run_mode(Mode("target"), open_target, reqs, rs)
    finally:
        await server.stop()
    s = result.summary
    assert s.completed == 5 and s.failed == 0, result.errors
    assert s.total_output_tokens == sum(r.output_len for r in reqs)
    for req, rec in zip(reqs, result.requests, strict=True):
        assert rec.finish_reason == "length"
        assert rec.output_tokens == req.output_len
        assert rec.input_tokens == req.prompt_len  # the server's count: byte tokens, no template
        assert rec.ttft is not None and rec.e2e is not None and 0 < rec.ttft < rec.e2e
        assert 1 <= len(rec.itls) <= req.output_len - 1
        assert rec.generated_text
    assert result.settings["target"] == {
        "kind": "http",
        "backend": "sglang",
        "base_url": server.url,
        "model": "tiny",
    }


def test_generate_endpoint_means_the_sglang_backend(capsys) -> None:
    from stallfree.bench.cli import build_parser
    from stallfree.bench.flag_checks import check_flags

    args = build_parser().parse_args(["--endpoint", "/generate", "--base-url", "http://x"])
    check_flags(args)
    assert args.backend == "sglang"
    assert main(["bench", "--endpoint", "/generate", "--backend", "openai"]) == 2
    assert "does not go with --backend openai" in capsys.readouterr().err
