"""Decode steady state on bench-cpu against this machine's measured fp32 matmul peak.

    python benchmarks/bench_roofline.py [--threads 1] [--batch 32 128] [--steps 64] [--quick]

1. Peak: best-of-N timings of `torch.mm` in fp32 with `torch.set_num_threads(--threads)`, for a
   large square-ish shape ([1024, 1024] @ [1024, 4096]) and decode-shaped ones ([B, 1024] @
   [1024, 2816] for B = 128 and each --batch). Measured before and after the decode runs; the
   best of both is the peak.
2. Decode: the `bench-cpu` preset through the Engine (overlap on, mirrors on, the stream worker
   at --threads), B requests decoding together; after --warmup decode steps an observer marks
   `engine.snapshot()` and again --steps decode steps later.
3. Model FLOPs per decode step = 2 x (matmul weights except the embedding table, lm_head
   included) x B + attention 4 x layers x heads x head_dim x context per row. The report divides
   achieved FLOP/s (over wall time, and over device-busy time) by the peak, and gives the host's
   share: schedule time per step, and per streamed token both wall - busy and schedule time.
   A batch-1 run gives the host time per step when the device work is smallest.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import torch
from common import Window

from stallfree import Engine, SamplingParams, load_config
from stallfree.runtime.model.loader import PRESETS

MODEL = "bench-cpu"
PROMPT_LEN = 16

# ---------------------------------------------------------------------------- matmul peak


def mm_gflops(m: int, k: int, n: int, trials: int, min_seconds: float) -> float:
    """Best GFLOP/s of `a @ b` ([m, k] @ [k, n], fp32) over `trials` timed loops."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen)
    b = torch.randn(k, n, generator=gen)
    out = torch.empty(m, n)
    torch.mm(a, b, out=out)  # NOTE: first call pays for allocation and kernel selection
    t0 = time.perf_counter()
    torch.mm(a, b, out=out)
    one = max(time.perf_counter() - t0, 1e-6)
    iters = max(1, int(min_seconds / one))
    best = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(iters):
            torch.mm(a, b, out=out)
        best = min(best, (time.perf_counter() - t0) / iters)
    return 2.0 * m * k * n / best / 1e9


def measure_peaks(shapes: list[tuple[int, int, int]], trials: int, min_seconds: float) -> dict:
    return {shape: mm_gflops(*shape, trials, min_seconds) for shape in shapes}


# ---------------------------------------------------------------------------- model FLOPs


def matmul_params() -> int:
    """Weights of every matmul in a forward of bench-cpu: layers plus lm_head, no embedding."""
    a = PRESETS[MODEL]
    q = a.num_heads * a.head_dim
    kv = a.num_kv_heads * a.head_dim
    per_layer = (
        a.hidden_size * (q + 2 * kv) + q * a.hidden_size + 3 * a.hidden_size * a.intermediate_size
    )
    return a.num_layers * per_layer + a.hidden_size * a.vocab_size


def model_matmul_params(engine: Engine) -> int:
    """The same count read off the loaded model (2-D weights, embedding table excluded)."""
    model = engine.core.loaded.model
    total = sum(
        p.numel()
        for name, p in model.named_parameters()
        if p.dim() == 2 and "embed_tokens" not in name
    )
    if model.arch.tie_word_embeddings:
        total += model.arch.hidden_size * model.arch.vocab_size
    return total


def attention_flops_per_row(context: float) -> float:
    a = PRESETS[MODEL]
    return 4.0 * a.num_layers * a.num_heads * a.head_dim * context


# ---------------------------------------------------------------------------- decode run


async def decode_run(batch: int, warmup: int, steps: int, threads: int) -> dict:
    cfg = load_config(
        model={"path": MODEL, "dtype": "float32"},
        runtime={"device": "cpu", "overlap": True, "cpu_mirrors": True, "stream_threads": threads},
        cache={
            "max_total_tokens": batch * (PROMPT_LEN + warmup + steps + 8) + 64,
            "max_running_requests": batch,
        },
        scheduler={"max_prefill_tokens": PROMPT_LEN * batch},
    )
    engine = Engine(cfg)
    window = Window(engine, warmup, steps)
    engine.add_observer(window)
    async with engine:
        params = SamplingParams(max_new_tokens=warmup + steps + 4, ignore_eos=True)
        prompts = [[(i * 7 + j) % 256 for j in range(PROMPT_LEN)] for i in range(batch)]
        await asyncio.gather(*(engine.complete(p, params) for p in prompts))
    a, b = window.marks
    params_count = model_matmul_params(engine)
    # NOTE: decode step d (1-based) attends over PROMPT_LEN + d tokens; the window holds the
    # launches after mark a up to mark b.
    mean_context = PROMPT_LEN + warmup + (steps + 1) / 2
    flops_per_step = 2.0 * params_count * batch + attention_flops_per_row(mean_context) * batch
    wall, busy = b.wall - a.wall, b.busy - a.busy
    tokens = max(b.tokens - a.tokens, 1)
    return {
        "batch": batch,
        "steps": steps,
        "wall": wall,
        "busy": busy,
        "schedule": b.schedule - a.schedule,
        "tokens": tokens,
        "params": params_count,
        "flops_per_step": flops_per_step,
    }


def summarise(run: dict) -> dict:
    n, tokens = run["steps"], run["tokens"]
    flops = run["flops_per_step"] * n
    return {
        "wall_ms": run["wall"] / n * 1e3,
        "busy_ms": run["busy"] / n * 1e3,
        "sched_ms": run["schedule"] / n * 1e3,
        "host_us_per_step": (run["wall"] - run["busy"]) / n * 1e6,
        "sched_us_per_step": run["schedule"] / n * 1e6,
        "host_us_per_tok": (run["wall"] - run["busy"]) / tokens * 1e6,
        "sched_us_per_tok": run["schedule"] / tokens * 1e6,
        "gflops_wall": flops / run["wall"] / 1e9,
        "gflops_busy": flops / max(run["busy"], 1e-9) / 1e9,
        "tok_s": tokens / run["wall"],
        "gflop_per_step": run["flops_per_step"] / 1e9,
    }


def median_summary(runs: list[dict]) -> dict:
    sums = [summarise(r) for r in runs]
    return {k: statistics.median(s[k] for s in sums) for k in sums[0]}


# ---------------------------------------------------------------------------- main


def loadavg() -> str:
    return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


async def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads, matmuls and stream")
    p.add_argument("--batch", type=int, nargs="+", default=[32, 128], help="decode batch sizes")
    p.add_argument("--steps", type=int, default=64, help="decode steps in the measured window")
    p.add_argument("--warmup", type=int, default=8, help="decode steps before the window")
    p.add_argument("--repeats", type=int, default=1, help="decode runs per batch; medians shown")
    p.add_argument("--mm-trials", type=int, default=5, help="timed loops per matmul shape")
    p.add_argument("--mm-seconds", type=float, default=0.5, help="length of one timed loop")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    args = p.parse_args()
    if args.quick:
        args.batch, args.steps, args.warmup = [4], 8, 3
        args.mm_trials, args.mm_seconds = 2, 0.05
    if args.threads < 1 or args.repeats < 1:
        p.error("--threads and --repeats must be at least 1")
    torch.set_num_threads(args.threads)
    print(
        f"bench_roofline: {MODEL}, torch {torch.__version__}, {os.cpu_count()} cores, "
        f"threads={args.threads}, batches={args.batch}, steps={args.steps}, "
        f"warmup={args.warmup}, repeats={args.repeats}"
    )
    print(f"load average at start: {loadavg()}")

    arch = PRESETS[MODEL]
    large = (1024, 1024, 4096)
    shapes = [large] + [
        (b, arch.hidden_size, arch.intermediate_size) for b in sorted({128, *args.batch})
    ]
    before = measure_peaks(shapes, args.mm_trials, args.mm_seconds)

    runs: dict[int, list[dict]] = {b: [] for b in [1, *args.batch]}
    await decode_run(args.batch[0], 2, 2, args.threads)  # NOTE: process warm-up, discarded
    for _ in range(args.repeats):
        for b in runs:
            runs[b].append(await decode_run(b, args.warmup, args.steps, args.threads))

    after = measure_peaks(shapes, args.mm_trials, args.mm_seconds)
    peaks = {s: max(before[s], after[s]) for s in shapes}
    peak = max(peaks.values())

    print("\nfp32 torch.mm, GFLOP/s (before decode / after / best)")
    for s in shapes:
        m, k, n = s
        print(f"  [{m:>4}, {k}] @ [{k}, {n}]   {before[s]:8.1f} {after[s]:8.1f} {peaks[s]:8.1f}")
    print(f"  peak used below: {peak:.1f} GFLOP/s")

    params = runs[args.batch[0]][0]["params"]
    if params != matmul_params():
        print(f"  note: loaded model has {params} matmul weights, formula says {matmul_params()}")
    print(
        f"\nmodel: {params / 1e6:.2f} M matmul weights (embedding excluded, lm_head included); "
        f"FLOPs/step = 2 x weights x B + 4 x {arch.num_layers} x {arch.num_heads} x "
        f"{arch.head_dim} x context x B"
    )
    header = (
        f"{'B':>4}{'GFLOP/step':>11}{'wall/step':>11}{'busy/step':>11}{'sched/step':>12}"
        f"{'tok/s':>9}{'GFLOP/s':>9}{'wall/peak':>10}{'busy/peak':>10}"
        f"{'host us/tok':>12}{'sched us/tok':>13}"
    )
    print(header)
    print("-" * len(header))
    for b in args.batch:
        r = median_summary(runs[b])
        print(
            f"{b:>4}{r['gflop_per_step']:>11.3f}{r['wall_ms']:>9.2f}ms{r['busy_ms']:>9.2f}ms"
            f"{r['sched_ms']:>10.3f}ms{r['tok_s']:>9.1f}{r['gflops_wall']:>9.1f}"
            f"{r['gflops_wall'] / peak:>10.1%}{r['gflops_busy'] / peak:>10.1%}"
            f"{r['host_us_per_tok']:>12.1f}{r['sched_us_per_tok']:>13.1f}"
        )
    one = median_summary(runs[1])
    print(
        f"\nbatch 1: wall {one['wall_ms']:.2f} ms/step, device busy {one['busy_ms']:.2f} ms/step, "
        f"host (wall - busy) {one['host_us_per_step']:.0f} us/step, "
        f"schedule {one['sched_us_per_step']:.0f} us/step, "
        f"{one['gflops_busy'] / peak:.1%} of peak while busy"
    )
    print(
        "host us/tok = (wall - device busy) / streamed tokens; sched us/tok = host time to build "
        "and launch batches / streamed tokens (with overlap it runs while the device is busy)"
    )
    print(f"\nload average at end: {loadavg()}")


if __name__ == "__main__":
    try:
        import uvloop
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())
