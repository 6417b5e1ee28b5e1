"""How many torch threads the CPU stream worker should use: a measurement, not a guess.

Each (model, runtime.stream_threads, overlap) cell runs in a fresh process; cells are
interleaved over `--repeats` rounds and the medians are printed with ratios to 1 thread.

python benchmarks/bench_stream_threads.py [--models tiny bench-cpu] [--threads 1 2 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time


async def worker(model: str, threads: int, overlap: bool, batch: int, new_tokens: int) -> dict:
    from stallfree import Engine, SamplingParams, load_config

    cfg = load_config(
        model={"path": model},
        runtime={"device": "cpu", "stream_threads": threads, "overlap": overlap},
        cache={"max_total_tokens": batch * (32 + new_tokens + 8), "max_running_requests": batch},
        scheduler={"max_prefill_tokens": 32 * batch},
    )
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    prompts = [[(i * 31 + j) % 256 for j in range(32)] for i in range(batch)]
    async with Engine(cfg) as engine:
        await engine.complete(prompts[0], SamplingParams(max_new_tokens=4))  # warm-up
        start, cpu = time.perf_counter(), time.process_time()
        results = await asyncio.gather(*(engine.complete(p, params) for p in prompts))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(r.completion_tokens for r in results)
    return {"tok_s": tokens / wall, "tok_per_cpu_s": tokens / cpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["tiny", "bench-cpu"])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--worker", nargs=3, metavar=("MODEL", "THREADS", "OVERLAP"))
    args = p.parse_args()
    if args.worker:
        model, threads, overlap = args.worker
        out = asyncio.run(worker(model, int(threads), overlap == "1", args.batch, args.new_tokens))
        print(json.dumps(out))
        return
    cells = [(m, t, o) for m in args.models for o in (True, False) for t in args.threads]
    runs: dict[tuple, list[dict]] = {c: [] for c in cells}
    print(f"load average at start: {os.getloadavg()}; cores: {os.cpu_count()}")
    for _ in range(args.repeats):
        for model, threads, overlap in cells:
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                model,
                str(threads),
                "1" if overlap else "0",
            ]
            cmd += ["--batch", str(args.batch), "--new-tokens", str(args.new_tokens)]
            line = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            runs[(model, threads, overlap)].append(json.loads(line.strip().splitlines()[-1]))
    print(f"batch {args.batch} x {args.new_tokens} new tokens; medians of {args.repeats}")
    print(f"{'model':<10}{'overlap':>8}{'threads':>8}{'tok/s':>10}{'vs 1':>7}{'tok/CPU-s':>11}")
    for model, threads, overlap in cells:
        med = statistics.median(r["tok_s"] for r in runs[(model, threads, overlap)])
        one = (
            statistics.median(r["tok_s"] for r in runs[(model, 1, overlap)])
            if 1 in args.threads
            else med
        )
        per_cpu = statistics.median(r["tok_per_cpu_s"] for r in runs[(model, threads, overlap)])
        label = "default" if threads == 0 else str(threads)
        print(f"{model:<10}{overlap!s:>8}{label:>8}{med:>10.0f}{med / one:>6.2f}x{per_cpu:>11.0f}")
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
