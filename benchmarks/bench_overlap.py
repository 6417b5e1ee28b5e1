"""Decode steady state in the four modes: what overlap and CPU mirrors buy.

    python benchmarks/bench_overlap.py [--model bench-cpu] [--batch-sizes 8 32 128] [--steps 48]

Per mode it prints, per decode step: wall time, device busy time, host schedule time, stalls,
stall seconds, and wall / device-busy (1.00 is the physical limit: the device never waits),
and the speedup of wall time per step over the plain legacy loop, measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

from common import Window

from stallfree import Engine, SamplingParams, load_config

MODES = [
    ("plain, legacy", False, False),
    ("plain, mirrors", False, True),
    ("overlap, legacy", True, False),
    ("overlap, mirrors", True, True),
]


async def run_mode(args: argparse.Namespace, batch: int, overlap: bool, mirrors: bool) -> dict:
    steps, warmup = args.steps, args.warmup
    cfg = load_config(
        model={"path": args.model, "dtype": args.dtype},
        runtime={
            "device": args.device,
            "overlap": overlap,
            "cpu_mirrors": mirrors,
            "strict": args.strict and mirrors,
        },
        cache={
            "max_total_tokens": batch * (16 + warmup + steps + 8) + 64,
            "max_running_requests": batch,
        },
        scheduler={"max_prefill_tokens": 16 * batch},
    )
    engine = Engine(cfg)
    window = Window(engine, warmup, steps)
    engine.add_observer(window)
    async with engine:
        params = SamplingParams(max_new_tokens=warmup + steps + 4, ignore_eos=True)
        prompts = [[(i * 7 + j) % 256 for j in range(16)] for i in range(batch)]
        await asyncio.gather(*(engine.complete(p, params) for p in prompts))
    a, b = window.marks
    n = steps
    return {
        "wall_ms": (b.wall - a.wall) / n * 1e3,
        "busy_ms": (b.busy - a.busy) / n * 1e3,
        "sched_ms": (b.schedule - a.schedule) / n * 1e3,
        "stalls": (b.stalls - a.stalls) / n,
        "stall_ms": (b.stall_seconds - a.stall_seconds) / n * 1e3,
        "ratio": (b.wall - a.wall) / max(b.busy - a.busy, 1e-9),
    }


def median_runs(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


async def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="bench-cpu")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1, help="runs per cell; the median is shown")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument(
        "--strict", action="store_true", help="mirrors-on modes raise on any schedule-path sync"
    )
    args = p.parse_args()
    print(
        f"model={args.model} device={args.device} dtype={args.dtype} steps={args.steps} "
        f"warmup={args.warmup} repeats={args.repeats}"
    )
    header = f"{'batch':>5}  {'mode':<17}{'wall/step':>10}{'busy/step':>10}{'sched/step':>11}{'stalls/step':>12}{'stall ms/step':>14}{'wall/busy':>10}{'speedup':>9}"
    print(header)
    print("-" * len(header))
    # NOTE: one discarded run first, so process-level warm-up (allocator, thread pools) is not
    # charged to whichever mode happens to run first.
    await run_mode(args, args.batch_sizes[0], True, True)
    for batch in args.batch_sizes:
        runs: dict[str, list[dict]] = {name: [] for name, _, _ in MODES}
        for _ in range(args.repeats):  # NOTE: modes interleaved, so machine noise hits all alike
            for name, overlap, mirrors in MODES:
                runs[name].append(await run_mode(args, batch, overlap, mirrors))
        base = median_runs(runs[MODES[0][0]])["wall_ms"]
        for name, _, _ in MODES:
            r = median_runs(runs[name])
            print(
                f"{batch:>5}  {name:<17}{r['wall_ms']:>8.2f}ms{r['busy_ms']:>8.2f}ms{r['sched_ms']:>9.2f}ms"
                f"{r['stalls']:>12.2f}{r['stall_ms']:>12.2f}ms{r['ratio']:>10.3f}{base / r['wall_ms']:>9.2f}x"
            )
        print()


if __name__ == "__main__":
    import uvloop

    uvloop.run(main())
