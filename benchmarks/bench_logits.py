"""What the logits features cost: plain sampling against penalties, logit bias and logprobs.

    python benchmarks/bench_logits.py [--model bench-cpu] [--repeats 3] [--quick] [--json F]

One workload (64 requests of 64 to 192 random prompt tokens, 64 new tokens each, all submitted
at once, EOS ignored) in five modes, each in a fresh process (this script with `--worker`),
interleaved over the repeats (the order rotates each repeat) so noise hits every mode alike:

  plain       greedy
  penalties   presence 0.5, frequency 0.5, repetition 1.1
  bias        logit_bias on 8 tokens and min_tokens 8
  logprobs    logprobs 5
  prompt_lp   prompt_logprobs 1 (no prefix cache for these requests)

Figures: output tokens per second (medians over the repeats), the ratio to `plain` measured
in the same run, and the host time per step building and launching batches (`sched`). The load
average is printed before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

RESULT_TAG = "@@bench_logits "
MODES: dict[str, dict[str, Any]] = {
    "plain": {},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
    "bias": {"logit_bias": {t: 2.0 for t in range(40, 48)}, "min_tokens": 8},
    "logprobs": {"logprobs": 5},
    "prompt_lp": {"prompt_logprobs": 1},
}


def make_prompts(quick: bool) -> tuple[list[list[int]], int]:
    rng = random.Random(0)
    n, new = (16, 16) if quick else (64, 64)
    return [[rng.randrange(256) for _ in range(rng.randint(64, 192))] for _ in range(n)], new


async def _worker(args: argparse.Namespace) -> dict[str, Any]:
    from stallfree import Engine, SamplingParams, load_config

    cfg = load_config(model={"path": args.model}, runtime={"device": args.device})
    prompts, new_tokens = make_prompts(args.quick)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, **MODES[args.mode])
    async with Engine(cfg) as engine:
        await engine.complete([7] * 16, SamplingParams(max_new_tokens=2, ignore_eos=True))
        await engine.wait_idle()
        engine.flush_cache()
        before = engine.snapshot().counters
        start = time.perf_counter()
        results = await asyncio.gather(*(engine.complete(p, params) for p in prompts))
        wall = time.perf_counter() - start
        after = engine.snapshot().counters
    out = sum(len(r.token_ids) for r in results)
    steps = after.steps - before.steps
    return {
        "mode": args.mode,
        "output_tok_s": out / wall,
        "wall_s": wall,
        "sched_us_per_step": 1e6 * (after.schedule_seconds - before.schedule_seconds) / steps,
        "steps": steps,
    }


def _run_one(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", "--mode", mode, "--model", args.model]
    cmd += ["--device", args.device] + (["--quick"] if args.quick else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    raise RuntimeError(f"{mode} run failed:\n{proc.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", default="bench-cpu")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--json", help="write every run here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(RESULT_TAG + json.dumps(asyncio.run(_worker(args))), flush=True)
        return
    print(f"load average before: {os.getloadavg()}")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in args.modes}
    for rep in range(args.repeats):
        order = args.modes[rep % len(args.modes) :] + args.modes[: rep % len(args.modes)]
        for mode in order:
            runs[mode].append(_run_one(args, mode))
    print(f"load average after: {os.getloadavg()}")
    base = statistics.median(r["output_tok_s"] for r in runs[args.modes[0]])
    print(f"\nmodel {args.model}, {args.repeats} repeats, medians")
    print(f"{'mode':<10} {'out tok/s':>10} {'ratio':>7} {'sched us/step':>14} {'spread':>16}")
    for mode, rs in runs.items():
        tps = [r["output_tok_s"] for r in rs]
        med = statistics.median(tps)
        sched = statistics.median(r["sched_us_per_step"] for r in rs)
        spread = f"{min(tps):.0f}-{max(tps):.0f}"
        print(f"{mode:<10} {med:>10.0f} {med / base:>6.2f}x {sched:>14.0f} {spread:>16}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(runs, fh, indent=2)


if __name__ == "__main__":
    main()
