"""Mixed steps (`--enable-mixed-chunk`): what the running streams see while a long prompt is
prefilled.

    python benchmarks/bench_mixed_chunk.py [--model bench-cpu] [--streams 4] [--prompt-len 1024]
        [--chunk 256] [--new-tokens 64] [--repeats 3] [--threads 2]

`--streams` requests decode (short prompts, `--new-tokens` each, EOS ignored). Once every one has
made `--warmup` tokens, a prompt of `--prompt-len` tokens arrives (one output token), prefilled in
chunks of `--chunk`. Per system (mixing off, on) it prints, from the streams' token arrival times
on the host:

- the prompt's time to first token (the prefill window: from its arrival to its token);
- the streams' tokens made inside that window (per stream, the mean);
- the largest gap between two tokens of one stream that overlaps the window, and the 90th
  percentile of those gaps (tokens that come in one chunk count as one arrival);
- total output tok/s over the whole workload (every stream's tokens and the prompt's one, over
  the time from the first request to the last token).

Each (system, repeat) runs in a fresh process, systems interleaved; medians are printed, with
the load average at the start and the end.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

SYSTEMS = [("off", False), ("on", True)]


def _p90(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def _window_gaps(arrivals: list[float], start: float, end: float) -> list[float]:
    """Gaps between a stream's consecutive arrivals whose interval overlaps [start, end]."""
    return [b - a for a, b in itertools.pairwise(arrivals) if b >= start and a <= end]


async def child(args: argparse.Namespace, mixed: bool) -> dict[str, float]:
    import torch

    from stallfree import Engine, SamplingParams, load_config

    torch.set_num_threads(args.threads)
    cfg = load_config(
        model={"path": args.model, "dtype": args.dtype},
        runtime={"device": "cpu", "stream_threads": args.threads},
        cache={
            "max_total_tokens": args.streams * (32 + args.new_tokens + 16) + args.prompt_len + 256,
            "max_running_requests": args.streams + 1,
        },
        scheduler={
            "chunked_prefill_size": args.chunk,
            "max_prefill_tokens": args.chunk,
            "enable_mixed_chunk": mixed,
        },
    )
    stream_params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    prompt_params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    arrivals: list[list[float]] = [[] for _ in range(args.streams)]
    warm = [asyncio.Event() for _ in range(args.streams)]
    async with Engine(cfg) as engine:

        async def stream(i: int) -> int:
            made = 0
            prompt = [(i * 13 + j) % 256 for j in range(32)]
            async for chunk in engine.generate(prompt, stream_params):
                if chunk.token_ids:
                    arrivals[i].append(time.perf_counter())
                    made += len(chunk.token_ids)
                if made >= args.warmup:
                    warm[i].set()
            return made

        begin = time.perf_counter()
        tasks = [asyncio.create_task(stream(i)) for i in range(args.streams)]
        await asyncio.gather(*(e.wait() for e in warm))
        long_prompt = [(7 * j + 3) % 256 for j in range(args.prompt_len)]
        sent = time.perf_counter()
        result = await engine.complete(long_prompt, prompt_params)
        first = time.perf_counter()
        made = await asyncio.gather(*tasks)
        end = time.perf_counter()
        mixed_batches = engine.snapshot().counters.mixed_batches
    assert result.error is None, result.error
    gaps = [g for a in arrivals for g in _window_gaps(a, sent, first)]
    inside = [sum(1 for t in a if sent < t <= first) for a in arrivals]
    return {
        "ttft_ms": (first - sent) * 1e3,
        "window_tokens": statistics.mean(inside),
        "gap_max_ms": max(gaps, default=0.0) * 1e3,
        "gap_p90_ms": _p90(gaps) * 1e3,
        "tok_s": (sum(made) + 1) / (end - begin),
        "mixed_batches": float(mixed_batches),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="bench-cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=4, help="tokens each stream makes first")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", choices=[name for name, _ in SYSTEMS], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(asyncio.run(child(args, dict(SYSTEMS)[args.child]))))
        return
    print(
        f"model={args.model} dtype={args.dtype} streams={args.streams} "
        f"prompt_len={args.prompt_len} chunk={args.chunk} new_tokens={args.new_tokens} "
        f"threads={args.threads} repeats={args.repeats}"
    )
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in SYSTEMS}
    passthrough = ["--model", args.model, "--dtype", args.dtype, "--streams", str(args.streams)]
    passthrough += ["--prompt-len", str(args.prompt_len), "--chunk", str(args.chunk)]
    passthrough += ["--new-tokens", str(args.new_tokens), "--warmup", str(args.warmup)]
    passthrough += ["--threads", str(args.threads)]
    for _ in range(args.repeats):  # NOTE: systems interleaved, so machine noise hits both alike
        for name, _ in SYSTEMS:
            cmd = [sys.executable, __file__, "--child", name, *passthrough]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    keys = ["ttft_ms", "window_tokens", "gap_max_ms", "gap_p90_ms", "tok_s", "mixed_batches"]
    print("| mixing | " + " | ".join(keys) + " |")
    print("| --- |" + " --- |" * len(keys))
    for name, _ in SYSTEMS:
        med = {k: statistics.median(r[k] for r in runs[name]) for k in keys}
        print(f"| {name} | " + " | ".join(f"{med[k]:.1f}" for k in keys) + " |")


if __name__ == "__main__":
    main()
