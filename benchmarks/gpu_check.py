"""One prepared script for a lent GPU: run it once, paste its output into the closing note.

    python benchmarks/gpu_check.py

1. Streams and events overlap: the host returns from a launch long before the device finishes.
2. `torch.cuda.set_sync_debug_mode("error")` stays silent through batch preparation in overlap
   mode with mirrors on (strict mode), over a real decode workload.
3. wall / device-busy for the four modes on a small model in bf16 (benchmarks/bench_overlap.py).
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


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: this script is for a lent GPU machine")
        return 2
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    check_stream_overlap()
    asyncio.run(check_sync_debug_mode())
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
    print("[3]", " ".join(cmd[1:]), flush=True)
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
