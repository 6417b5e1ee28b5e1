"""Prefix caching on and off: a shared-prefix workload, and a random one that shares nothing.

    python benchmarks/bench_prefix_cache.py [--model bench-cpu] [--repeats 3] [--quick]
        [--workloads shared random] [--json runs.json]

Workloads (all requests submitted at once, greedy, EOS ignored):

  shared   64 requests: one 512-token prefix, then a 32-token suffix of their own; 32 new tokens
  random   64 requests: random prompts of 32 to 256 tokens that share nothing; 32 new tokens
           (they fit the default KV pool together, so retraction does not blur the cost)

Every run is a fresh process (this script with `--worker`) with the engine's default settings
but `cache.prefix_caching`; it does one small warm-up request, flushes the cache, then runs the
workload. Modes alternate inside each repeat (off-on, then on-off, and so on), so machine noise
and drift hit both alike; the table shows medians. Figures: mean and p50 time to first token (submission to first chunk),
total throughput ((prompt + generated tokens) / wall), output throughput, prefill tokens
computed, the hit rate (cached tokens / tokens looked up, at admission), tokens evicted, and the
host time spent building and launching batches (`sched`, where the cache's own cost shows without
the device's noise), and the CPU time of the whole process (every thread: the stream worker's
compute and the scheduler's). The greedy tokens of the first requests are compared between modes. The load
average is printed before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

RESULT_TAG = "@@bench_prefix_cache "
CHECKED = 8  # requests whose tokens are compared between modes

# name -> (requests, shared prefix, (suffix or prompt length range), new tokens)
WORKLOADS: dict[str, tuple[int, int, tuple[int, int], int]] = {
    "shared": (64, 512, (32, 32), 32),
    "random": (64, 0, (32, 256), 32),
}
QUICK: dict[str, tuple[int, int, tuple[int, int], int]] = {
    "shared": (16, 128, (16, 16), 8),
    "random": (16, 0, (16, 128), 8),
}


def make_prompts(name: str, quick: bool, seed: int = 0) -> tuple[list[list[int]], int]:
    n, prefix_len, (lo, hi), new_tokens = (QUICK if quick else WORKLOADS)[name]
    rng = random.Random(f"{seed}:{name}")
    prefix = [rng.randrange(256) for _ in range(prefix_len)]
    prompts = [prefix + [rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    return prompts, new_tokens


async def _worker(args: argparse.Namespace) -> dict[str, Any]:
    from stallfree import Engine, SamplingParams, load_config

    cfg = load_config(
        model={"path": args.model},
        runtime={"device": args.device},
        cache={"prefix_caching": args.caching},
    )
    prompts, new_tokens = make_prompts(args.workload, args.quick)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    async with Engine(cfg) as engine:
        await engine.complete([7] * 16, SamplingParams(max_new_tokens=2, ignore_eos=True))
        await engine.wait_idle()
        assert engine.flush_cache()
        before = engine.snapshot().counters

        async def one(prompt: list[int]) -> tuple[float, list[int]]:
            start = time.perf_counter()
            ttft = None
            tokens: list[int] = []
            async for chunk in engine.generate(prompt, params):
                if ttft is None and chunk.token_ids:
                    ttft = time.perf_counter() - start
                tokens.extend(chunk.token_ids)
                assert chunk.error is None, chunk.error
            assert ttft is not None
            return ttft, tokens

        wall0, cpu0 = time.perf_counter(), time.process_time()
        results = await asyncio.gather(*(one(p) for p in prompts))
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        after = engine.snapshot().counters
    ttfts = [t for t, _ in results]
    generated = sum(len(toks) for _, toks in results)
    prompt_tokens = sum(len(p) for p in prompts)
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    digest = hashlib.sha256(json.dumps([toks for _, toks in results[:CHECKED]]).encode())
    return {
        "workload": args.workload,
        "caching": args.caching,
        "wall_s": wall,
        "cpu_s": cpu,
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": statistics.median(ttfts),
        "total_tok_s": (prompt_tokens + generated) / wall,
        "output_tok_s": generated / wall,
        "prefill_tokens": after.prefill_tokens - before.prefill_tokens,
        "hit_rate": hits / queries if queries else 0.0,
        "evicted_tokens": after.prefix_cache_evicted_tokens - before.prefix_cache_evicted_tokens,
        "schedule_s": after.schedule_seconds - before.schedule_seconds,
        "tokens_sha": digest.hexdigest()[:16],
    }


def _run_worker(args: argparse.Namespace, workload: str, caching: bool) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        "--model",
        args.model,
        "--device",
        args.device,
        "--workload",
        workload,
        "--caching" if caching else "--no-caching",
    ]
    if args.quick:
        cmd.append("--quick")
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    for line in out.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    raise RuntimeError(f"worker failed ({out.returncode}):\n{out.stderr[-3000:]}")


def _fmt_load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} ({os.cpu_count()} CPUs)"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="bench-cpu")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small workloads (a smoke test)")
    p.add_argument("--json", help="write every run here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--caching", action=argparse.BooleanOptionalAction, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        import uvloop

        result = uvloop.run(_worker(args))
        print(RESULT_TAG + json.dumps(result), flush=True)
        return

    print(f"model={args.model} device={args.device} repeats={args.repeats} quick={args.quick}")
    print(f"before: {_fmt_load()}")
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for workload in args.workloads:
            # NOTE: off-on, then on-off (ABBA): a drift in the machine's load favours neither
            for caching in (False, True) if repeat % 2 == 0 else (True, False):
                runs.append(_run_worker(args, workload, caching))
    print(f"after:  {_fmt_load()}")
    header = (
        f"{'workload':<9}{'cache':<6}{'TTFT mean':>10}{'TTFT p50':>10}{'total tok/s':>12}"
        f"{'out tok/s':>10}{'prefill tok':>12}{'hit rate':>9}{'evicted':>8}{'sched':>8}{'CPU':>8}"
        f"{'wall':>8}"
    )
    print(header)
    print("-" * len(header))
    for workload in args.workloads:
        medians = {}
        for caching in (False, True):
            mine = [r for r in runs if r["workload"] == workload and r["caching"] == caching]
            med = {
                k: statistics.median(r[k] for r in mine)
                for k in mine[0]
                if isinstance(mine[0][k], float | int) and not isinstance(mine[0][k], bool)
            }
            medians[caching] = med
            print(
                f"{workload:<9}{'on' if caching else 'off':<6}{med['ttft_mean_s']:>9.3f}s"
                f"{med['ttft_p50_s']:>9.3f}s{med['total_tok_s']:>12.1f}{med['output_tok_s']:>10.1f}"
                f"{med['prefill_tokens']:>12.0f}{med['hit_rate']:>9.1%}{med['evicted_tokens']:>8.0f}"
                f"{med['schedule_s']:>7.3f}s{med['cpu_s']:>7.1f}s{med['wall_s']:>7.1f}s"
            )
        off, on = medians[False], medians[True]
        same = {r["tokens_sha"] for r in runs if r["workload"] == workload}
        print(
            f"{workload:<9}on/off: TTFT mean {off['ttft_mean_s'] / on['ttft_mean_s']:.2f}x lower, "
            f"total throughput {on['total_tok_s'] / off['total_tok_s']:.2f}x; "
            f"greedy tokens {'identical' if len(same) == 1 else 'DIFFER'} across modes and runs"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=2)


if __name__ == "__main__":
    main()
