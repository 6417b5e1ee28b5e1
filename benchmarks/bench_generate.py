"""Throughput of `stallfree generate`-style serving: a batch of concurrent prompts.

python benchmarks/bench_generate.py [--models tiny bench-cpu] [--num-prompts 32]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from stallfree import Engine, SamplingParams, load_config


async def run(model: str, num_prompts: int, prompt_len: int, new_tokens: int) -> dict:
    cfg = load_config(model={"path": model}, runtime={"device": "cpu"})
    async with Engine(cfg) as engine:
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        prompts = [[(i * 31 + j) % 256 for j in range(prompt_len)] for i in range(num_prompts)]
        await engine.complete(prompts[0], SamplingParams(max_new_tokens=2))  # warm-up
        start = time.perf_counter()
        results = await asyncio.gather(*(engine.complete(p, params) for p in prompts))
        wall = time.perf_counter() - start
    out = sum(r.completion_tokens for r in results)
    return {
        "wall": wall,
        "out_tps": out / wall,
        "total_tps": (out + num_prompts * prompt_len) / wall,
    }


async def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", nargs="+", default=["tiny", "bench-cpu"])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print(
        f"{args.num_prompts} prompts x {args.prompt_len} tokens, {args.new_tokens} new tokens each; median of {args.repeats}"
    )
    print(f"{'model':<10}{'wall s':>9}{'output tok/s':>14}{'total tok/s':>13}")
    for model in args.models:
        runs = [
            await run(model, args.num_prompts, args.prompt_len, args.new_tokens)
            for _ in range(args.repeats)
        ]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"{model:<10}{med['wall']:>9.2f}{med['out_tps']:>14.1f}{med['total_tps']:>13.1f}")


if __name__ == "__main__":
    import uvloop

    uvloop.run(main())
