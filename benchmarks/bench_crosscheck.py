"""`stallfree bench` against an independent load generator (guidellm) on the same server and
the same workload: request and output-token throughput from each, and their ratio.

One `stallfree serve` subprocess on the `tiny` preset (CPU). The workload is one JSON lines
file of text prompts (sonnet lines) with a fixed output length each, read by both tools:
`stallfree bench --dataset-name custom` reads `prompt` and `output_tokens`, guidellm's
`json_file` data reads `prompt` and `output_tokens_count` (it then sends `max_tokens` and
`ignore_eos`, as `stallfree bench --ignore-eos` does). Both keep the same number of requests in
flight over `/v1/completions`. The tools run one after the other, `--rounds` times,
interleaved, after one warm-up run of each; the script prints each round and the medians.

On a small machine the client's own CPU time slows the server (guidellm spends several times
the CPU of `stallfree bench` per request), so with two or more cores the server is pinned to
core 0 with one torch thread and the clients to the other cores (`--no-pin` to share them).
Beside each tool's figures the script prints the server's own for the same run, from its
`/metrics`: tokens generated and the mean arrival-to-finish latency, so that a gap between
the tools can be told apart from a server that ran slower under one of them.

guidellm is not a dependency of stallfree: the script uses `--guidellm PATH` if given, else
`guidellm` on PATH, else installs guidellm==0.8.1 into a virtual environment under
`~/.cache/stallfree-bench/guidellm` (its own environment, so that its pins cannot touch this
one). Not run in CI.

    python benchmarks/bench_crosscheck.py [--requests 64] [--concurrency 8] [--output-len 32]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import httpx
from common import serve_process

from stallfree.bench.sonnet_text import sonnet_lines

GUIDELLM_VERSION = "0.8.1"
CACHE = Path.home() / ".cache" / "stallfree-bench" / "guidellm"


@contextlib.contextmanager
def server_process(model: str, threads: int | None, cores: str | None) -> Iterator[str]:
    """The server under test, pinned to `cores` with `threads` torch threads when given."""
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    prefix = ["taskset", "-c", cores] if cores else []
    with serve_process(model, prefix=prefix, env=env) as url:
        yield url


def server_figures(url: str) -> tuple[float, float, float]:
    """The server's generated tokens, and the sum and count of its e2e request latencies."""
    totals = {"generation_tokens_total": 0.0, "sum": 0.0, "count": 0.0}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition("{")
        if name == "stallfree:generation_tokens_total":
            totals["generation_tokens_total"] += float(value.rsplit(" ", 1)[1])
        elif name == "stallfree:e2e_request_latency_seconds_sum":
            totals["sum"] += float(value.rsplit(" ", 1)[1])
        elif name == "stallfree:e2e_request_latency_seconds_count":
            totals["count"] += float(value.rsplit(" ", 1)[1])
    return totals["generation_tokens_total"], totals["sum"], totals["count"]


def measured(url: str, run: Callable[[], dict[str, float]]) -> dict[str, float]:
    """A tool's figures with the server's for the same run: tokens generated and mean e2e."""
    tokens0, sum0, count0 = server_figures(url)
    figures = run()
    tokens1, sum1, count1 = server_figures(url)
    figures["server tokens"] = tokens1 - tokens0
    figures["server e2e (s)"] = (sum1 - sum0) / max(count1 - count0, 1)
    return figures


def write_workload(
    directory: Path, n: int, lines_per_prompt: int, output_len: int
) -> tuple[Path, Path]:
    """The same prompts and output lengths in each tool's column names."""
    rng = random.Random(0)
    lines = sonnet_lines()
    prompts = ["".join(rng.choices(lines, k=lines_per_prompt)) for _ in range(n)]
    ours, theirs = directory / "stallfree.jsonl", directory / "guidellm.jsonl"
    ours.write_text(
        "".join(json.dumps({"prompt": p, "output_tokens": output_len}) + "\n" for p in prompts)
    )
    theirs.write_text(
        "".join(
            json.dumps({"prompt": p, "output_tokens_count": output_len}) + "\n" for p in prompts
        )
    )
    return ours, theirs


def guidellm_command(given: str | None) -> str:
    if given:
        return given
    found = shutil.which("guidellm")
    if found:
        return found
    exe = CACHE / "bin" / "guidellm"
    if not exe.exists():
        print(f"installing guidellm=={GUIDELLM_VERSION} into {CACHE}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(CACHE)], check=True)
        pip = [str(CACHE / "bin" / "pip"), "install", "-q", f"guidellm=={GUIDELLM_VERSION}"]
        subprocess.run(pip, check=True)
    return str(exe)


def run_stallfree(url: str, data: Path, args: argparse.Namespace, out: Path) -> dict[str, float]:
    cmd = [*args.client_prefix, sys.executable, "-m", "stallfree.cli", "bench", "--base-url", url]
    cmd += ["--backend", "openai", "--dataset-name", "custom", "--dataset-path", str(data)]
    cmd += ["--tokenizer", args.model, "--num-prompts", str(args.requests)]
    cmd += ["--max-concurrency", str(args.concurrency), "--ignore-eos", "--num-warmups", "0"]
    cmd += ["--disable-tqdm", "--output-json", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    if result["failed"]:
        raise RuntimeError(f"stallfree bench: {result['failed']} requests failed")
    return {
        "requests/s": result["request_throughput"],
        "output tok/s": result["output_throughput"],
        "completed": result["completed"],
        "client e2e (s)": result["mean_e2el_ms"] / 1e3,
    }


def run_guidellm(
    exe: str, url: str, data: Path, args: argparse.Namespace, out: Path
) -> dict[str, float]:
    cmd = [
        *args.client_prefix,
        exe,
        "run",
        "--backend",
        f"kind=openai_http,target={url},request_format=/v1/completions",
    ]
    cmd += ["--profile", f"kind=concurrent,streams={args.concurrency}"]
    cmd += ["--constraint", f"kind=max_requests,count={args.requests}"]
    cmd += ["--data", f"kind=json_file,path={data}"]
    cmd += ["--output", f"kind=json,path={out}", "--disable-console"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"guidellm failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return guidellm_figures(json.loads(out.read_text()))


def guidellm_figures(report: dict) -> dict[str, float]:
    """Request and output-token throughput of the (single) benchmark in a guidellm report:
    its successful requests and their output tokens (the server's usage counts) over the
    benchmark's duration (the same as its `requests_per_second` and
    `output_tokens_per_second` means)."""
    (bench,) = report["benchmarks"]
    metrics = bench["metrics"]
    done = metrics["request_totals"]["successful"]
    if metrics["request_totals"]["errored"]:
        raise RuntimeError(f"guidellm: {metrics['request_totals']['errored']} requests failed")
    tokens = metrics["output_token_count"]["successful"]["total_sum"]
    return {
        "requests/s": done / bench["duration"],
        "output tok/s": tokens / bench["duration"],
        "completed": done,
        "client e2e (s)": metrics["request_latency"]["successful"]["mean"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64, help="requests per run (default: 64)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default: 8)")
    p.add_argument("--output-len", type=int, default=32, help="output tokens (default: 32)")
    p.add_argument(
        "--prompt-lines", type=int, default=4, help="sonnet lines per prompt (default: 4)"
    )
    p.add_argument(
        "--rounds", type=int, default=3, help="measured rounds of each tool (default: 3)"
    )
    p.add_argument(
        "--model",
        default="bench-cpu",
        help="the preset served (default: bench-cpu, slow enough per token that neither "
        "client's own cost sets the pace; tiny is client-bound on a small machine)",
    )
    p.add_argument("--guidellm", help="the guidellm executable (default: found or installed)")
    p.add_argument(
        "--threads", type=int, help="OMP_NUM_THREADS of the server (default: 1 when pinned)"
    )
    p.add_argument(
        "--no-pin",
        action="store_true",
        help="let the server and the clients share every core (default: pinned apart)",
    )
    args = p.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    pin = not args.no_pin and len(cpus) >= 2 and shutil.which("taskset") is not None
    server_cores = str(cpus[0]) if pin else None
    args.client_prefix = ["taskset", "-c", ",".join(map(str, cpus[1:]))] if pin else []
    if pin and args.threads is None:
        args.threads = 1
    exe = guidellm_command(args.guidellm)
    with (
        tempfile.TemporaryDirectory() as tmp,
        server_process(args.model, args.threads, server_cores) as url,
    ):
        work = Path(tmp)
        ours, theirs = write_workload(work, args.requests, args.prompt_lines, args.output_len)
        run_stallfree(url, ours, args, work / "warm-s.json")  # warm-up of each, not counted
        run_guidellm(exe, url, theirs, args, work / "warm-g.json")
        rows: dict[str, list[dict[str, float]]] = {"stallfree bench": [], "guidellm": []}
        for i in range(args.rounds):
            rows["stallfree bench"].append(
                measured(url, partial(run_stallfree, url, ours, args, work / f"s{i}.json"))
            )
            rows["guidellm"].append(
                measured(url, partial(run_guidellm, exe, url, theirs, args, work / f"g{i}.json"))
            )
            print(
                f"round {i + 1}: "
                + "; ".join(
                    f"{tool} {r[-1]['requests/s']:.2f} req/s {r[-1]['output tok/s']:.1f} tok/s"
                    for tool, r in rows.items()
                ),
                flush=True,
            )
    print(
        f"\n{args.requests} requests, concurrency {args.concurrency}, {args.output_len} output "
        f"tokens, {args.prompt_lines} sonnet lines per prompt, {args.model} on CPU, median of "
        f"{args.rounds} interleaved rounds; "
        + (f"server on core {server_cores}, clients on the others" if pin else "cores shared")
        + f"; load average {os.getloadavg()[0]:.2f}"
    )
    keys = ("requests/s", "output tok/s", "client e2e (s)", "server e2e (s)", "server tokens")
    med = {
        tool: {k: statistics.median(r[k] for r in runs) for k in keys}
        for tool, runs in rows.items()
    }
    print(f"{'figure':<16}{'stallfree bench':>18}{'guidellm':>12}{'ratio':>8}")
    for key in keys:
        a, b = med["stallfree bench"][key], med["guidellm"][key]
        print(f"{key:<16}{a:>18.2f}{b:>12.2f}{a / b:>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
