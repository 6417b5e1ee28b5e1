"""One prepared script for a lent GPU: run it once, paste its output into the closing note.

    python benchmarks/gpu_check.py

1. Streams and events overlap: the host returns from a launch long before the device finishes.
2. `torch.cuda.set_sync_debug_mode("error")` stays silent through batch preparation in overlap
   mode with mirrors on (strict mode), over a real decode workload.
3. Worker processes on CUDA: the process worker (tp_size 1) gives the in-process engine's greedy
   tokens; with two or more GPUs, tensor parallelism over NCCL (tp_size 2) gives them too, and
   the per-rank step and collective figures are printed.
4. wall / device-busy for the four modes on a small model in bf16 (benchmarks/bench_overlap.py).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import torch


def check_stream_overlap() -> None:
    from stallfree.overlap.stream import CudaStream

    stream = CudaStream(torch.device("cuda"))
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(50):
        stream.submit(torch.matmul, a, a)
    event = stream.record_event()
    launched = time.perf_counter() - start
    pending = not event.query()
    event.synchronize()
    total = time.perf_counter() - start
    print(
        f"[1] launch {launched * 1e3:.2f} ms, device done after {total * 1e3:.2f} ms, "
        f"event pending right after launch: {pending}"
    )
    assert pending and launched < total / 5, "launches did not return before the device finished"


async def check_sync_debug_mode() -> None:
    from stallfree import Engine, SamplingParams, load_config

    cfg = load_config(
        model={"path": "bench-cpu", "dtype": "bfloat16"},
        runtime={"device": "cuda", "overlap": True, "cpu_mirrors": True, "strict": True},
    )
    async with Engine(cfg) as engine:
        params = SamplingParams(max_new_tokens=200, ignore_eos=True)
        prompts = [[(i * 7 + j) % 256 for j in range(32)] for i in range(16)]
        results = await asyncio.gather(*(engine.complete(p, params) for p in prompts))
        errors = [r.error for r in results if r.error]
        steps = engine.snapshot().counters.steps
        print(
            f"[2] strict overlap+mirrors on CUDA: {steps} steps, "
            f"schedule-path reads {engine.core.monitor.schedule_path_reads}, errors {errors[:1]}"
        )
        assert not errors and engine.core.monitor.schedule_path_reads == 0


async def _greedy(**sections: object) -> tuple[list[list[int]], float, object]:
    from stallfree import Engine, SamplingParams, load_config

    cfg = load_config(model={"path": "bench-cpu", "dtype": "bfloat16"}, **sections)
    async with Engine(cfg) as engine:
        params = SamplingParams(max_new_tokens=64, ignore_eos=True)
        prompts = [[(i * 11 + j) % 256 for j in range(48)] for i in range(32)]
        start = time.perf_counter()
        results = await asyncio.gather(*(engine.complete(p, params) for p in prompts))
        wall = time.perf_counter() - start
        return [r.token_ids for r in results], wall, engine.snapshot().workers


async def check_workers() -> None:
    want, wall_in, _ = await _greedy(runtime={"device": "cuda", "worker": "inprocess"})
    got, wall_proc, workers = await _greedy(runtime={"device": "cuda", "worker": "process"})
    same = sum(a == b for a, b in zip(want, got, strict=True))
    print(
        f"[3] process worker, tp 1: {same}/{len(want)} greedy outputs equal in-process; "
        f"wall {wall_in:.2f}s in-process, {wall_proc:.2f}s process; {workers}"
    )
    if torch.cuda.device_count() < 2:
        print("[3] one GPU: tensor parallelism over NCCL not checked")
        return
    got2, wall_tp, workers = await _greedy(runtime={"device": "cuda"}, parallel={"tp_size": 2})
    same2 = sum(a == b for a, b in zip(want, got2, strict=True))
    print(f"[3] tp 2 over NCCL: {same2}/{len(want)} equal tp 1; wall {wall_tp:.2f}s")
    for w in workers:
        share = w.comm_seconds / w.step_seconds if w.step_seconds else 0.0
        print(
            f"    rank {w.rank}: {w.steps} steps, {1e3 * w.step_seconds / max(w.steps, 1):.2f} "
            f"ms/step, collectives {share:.0%} of step time (host-side launch time on NCCL), "
            f"{w.comm_bytes / max(w.steps, 1) / 1024:.1f} KiB/step"
        )


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: this script is for a lent GPU machine")
        return 2
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    check_stream_overlap()
    asyncio.run(check_sync_debug_mode())
    asyncio.run(check_workers())
    bench = Path(__file__).with_name("bench_overlap.py")
    cmd = [
        sys.executable,
        str(bench),
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
        "--model",
        "bench-cpu",
        "--batch-sizes",
        "8",
        "32",
        "128",
        "--steps",
        "64",
        "--repeats",
        "3",
        "--strict",
    ]
    print("[4]", " ".join(cmd[1:]), flush=True)
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
