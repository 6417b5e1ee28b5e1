"""What strict mode's read guard costs per step (overlap/strict.py).

    python benchmarks/bench_strict_guard.py [--model tiny] [--batch-size 32] [--steps 200]
                                            [--repeats 5]

The guard is strict mode only: the production path neither registers stream tensors nor
enters the TorchFunctionMode. This measures what a strict run pays for it, two ways:

- engine: host schedule time per step (`schedule_seconds / steps`, which covers building and
  launching every batch, all of it inside `schedule_path()`) for the same greedy workload with
  the guard off (strict=false) and on (strict=true), CPU mirrors on, debug checks off, fresh
  engines, modes interleaved, medians of the repeats;
- micro: one decode step's batch operations (`prepare_for_decode` + `to_forward_batch`) at
  the same batch size, on a model-free batch context, guard off and on.

Both print the cost per step in microseconds and as a share of the schedule path.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch

from stallfree import Engine, SamplingParams, load_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


async def engine_schedule_us(model: str, strict: bool, batch: int, steps: int) -> float:
    config = load_config(
        model={"path": model},
        runtime={"device": "cpu", "strict": strict, "check_mirrors": False},
        cache={"prefix_caching": False},
    )
    prompts = [[(7 * i + j) % 200 + 1 for j in range(8 + i % 5)] for i in range(batch)]
    params = SamplingParams(max_new_tokens=steps, ignore_eos=True)
    async with Engine(config) as engine:
        assert (engine.core.monitor.guard is not None) == strict
        await asyncio.gather(*(engine.complete(p, params) for p in prompts))
        counters = engine.snapshot().counters
    return counters.schedule_seconds / counters.steps * 1e6


def micro_step_us(strict: bool, batch: int, steps: int) -> float:
    from stallfree.runtime.scheduling.schedule_batch import ScheduleBatch
    from tests.batch_harness import make_ctx, make_req

    ctx = make_ctx(
        num_tokens=batch * (steps + 40), num_reqs=batch, max_context=steps + 40, strict=strict
    )
    ctx.check_mirrors = False
    reqs = [make_req(f"r{i}", 8 + i % 5, max_new_tokens=steps + 8) for i in range(batch)]
    b = ScheduleBatch.init_new(reqs, ctx)
    monitor = ctx.monitor
    with monitor.schedule_path():
        b.prepare_for_extend([r.fill_len for r in reqs])
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        with monitor.schedule_path():
            b.prepare_for_decode()
            b.to_forward_batch()
        ctx.stream.record_event()  # hand the step's work to the worker, as a launch does
        times.append(time.perf_counter() - start)
    ctx.stream.synchronize()
    ctx.stream.close()
    return statistics.median(times) * 1e6


def report(name: str, off: list[float], on: list[float]) -> None:
    a, b = statistics.median(off), statistics.median(on)
    print(
        f"{name}: schedule path per step {a:8.1f} us without the guard, {b:8.1f} us with it: "
        f"guard cost {b - a:+7.1f} us per step ({(b - a) / a * 100:+5.1f}%)"
    )
    print(f"    runs off: {', '.join(f'{x:.1f}' for x in off)}")
    print(f"    runs on:  {', '.join(f'{x:.1f}' for x in on)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        f"strict read guard, {args.model}, batch {args.batch_size}, {args.steps} steps, "
        f"{args.repeats} interleaved repeats (medians)"
    )
    off: list[float] = []
    on: list[float] = []
    for _ in range(args.repeats):
        for strict, out in ((False, off), (True, on)):
            out.append(micro_step_us(strict, args.batch_size, args.steps))
    report("micro  (prepare_for_decode + to_forward_batch)", off, on)
    off, on = [], []
    for _ in range(args.repeats):
        for strict, out in ((False, off), (True, on)):
            out.append(
                asyncio.run(engine_schedule_us(args.model, strict, args.batch_size, args.steps))
            )
    report("engine (schedule_seconds / steps)", off, on)


if __name__ == "__main__":
    main()
