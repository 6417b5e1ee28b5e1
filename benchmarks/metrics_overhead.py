"""Per-decode-step cost of the metrics observer hooks.

1. Hooks alone: replays one decode step's hook calls (schedule, step, mirror reads, one
   `on_tokens` per request) against `EngineMetrics` and against no observer.
2. End to end: decode steps on the `tiny` preset with metrics on and off.

    python benchmarks/metrics_overhead.py [--batch 1 8 32] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from stallfree import Engine, SamplingParams, load_config
from stallfree.metrics import EngineMetrics
from stallfree.runtime.request.req import Req
from stallfree.runtime.telemetry.observer import ObserverFanout


def hook_step_seconds(fanout: ObserverFanout, reqs: list[Req], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fanout.on_schedule(1e-4)
        fanout.on_step(len(reqs), True, True)
        now = time.perf_counter()
        for req in reqs:
            fanout.on_tokens(req, 1, now)
    return (time.perf_counter() - start) / steps


def hooks_alone(batch: int, steps: int = 20_000) -> tuple[float, float]:
    params = SamplingParams()
    reqs = [
        Req(rid=str(i), origin_input_ids=[1, 2, 3], sampling_params=params) for i in range(batch)
    ]
    bare = ObserverFanout()
    measured = ObserverFanout()
    engine = Engine(load_config(model={"path": "tiny"}, runtime={"device": "cpu"}))
    measured.observers.append(EngineMetrics("bench", "0", engine.snapshot))
    best_bare = min(hook_step_seconds(bare, reqs, steps) for _ in range(3))
    best_metrics = min(hook_step_seconds(measured, reqs, steps) for _ in range(3))
    return best_bare, best_metrics


async def engine_step_seconds(batch: int, tokens: int, metrics: bool) -> float:
    config = load_config(
        model={"path": "tiny"}, runtime={"device": "cpu"}, metrics={"enabled": metrics}
    )
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    prompts = [[(7 * i + j) % 256 for j in range(16)] for i in range(batch)]
    async with Engine(config) as engine:
        await asyncio.gather(*(engine.complete(p, params) for p in prompts))  # warm up
        best = float("inf")
        for _ in range(3):
            steps_before = engine.snapshot().counters.steps
            start = time.perf_counter()
            await asyncio.gather(*(engine.complete(p, params) for p in prompts))
            elapsed = time.perf_counter() - start
            best = min(best, elapsed / (engine.snapshot().counters.steps - steps_before))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print("hooks alone, per decode step (best of 3):")
    print(f"{'batch':>6} {'no observer us':>15} {'metrics us':>11} {'added us':>9}")
    for batch in args.batch:
        bare, measured = hooks_alone(batch)
        print(
            f"{batch:>6} {bare * 1e6:>15.2f} {measured * 1e6:>11.2f} {(measured - bare) * 1e6:>9.2f}"
        )
    print(
        f"\nengine on the tiny preset, wall time per step (median of {args.rounds} alternated runs):"
    )
    print(f"{'batch':>6} {'off ms':>8} {'on ms':>8} {'ratio':>6}")
    for batch in args.batch:
        off, on = [], []
        for _ in range(args.rounds):
            off.append(asyncio.run(engine_step_seconds(batch, args.tokens, False)))
            on.append(asyncio.run(engine_step_seconds(batch, args.tokens, True)))
        off_s, on_s = statistics.median(off), statistics.median(on)
        print(f"{batch:>6} {off_s * 1e3:>8.3f} {on_s * 1e3:>8.3f} {on_s / off_s:>6.3f}")


if __name__ == "__main__":
    main()
