"""Prefill products against the machine's compute peak, per weight format.

    python benchmarks/bench_prefill.py [--formats bf16 f32 int8 q8_0 int4] [--rows 64 256 512]
        [--repeats 3] [--threads 2] [--seconds 6]

A prompt's projections are matrix-matrix products: SmolLM2-135M's five shapes (q/k/v 960x576,
o 576x576, gate/up 3072x576, down 576x1536, the tied output 49152x576; the output only on the
last row, so it is left out here) at `--rows` tokens, through the layers the engine uses for
each format: `nn.Linear` as the engine has it (bf16: `NativeLinear`, whose prompts of up to
256 rows run on the AMX tiles' product where the CPU has it, else oneDNN; on the AVX2 variant
the native kernel up to 128 rows, float32 past them (`widened_product`); f32: oneDNN), `Int8Linear` with one scale per row (int8) or per
block of 32 (q8_0, a GGUF's Q8_0), `Int4Linear` (int4). Above 16 rows the integer layers
dequantise into a workspace and run the dense product, so their figure counts that too. The
peak is the best of a 2048 x 2048 x 2048 product in the format's activation dtype (bf16 for
the integer formats; float32 on a CPU without bfloat16 arithmetic, which multiplies bfloat16
as float32 after widening it, and where torch's bfloat16 product is no peak), measured in the same process, alternating with the products: every round
times one peak product and then each row count's products, and the share of peak is taken per
round, so this machine's drifting speed (its AMX throughput swings several-fold within minutes)
cancels in the shares. Each (format, repeat) runs in a fresh process for `--seconds`, formats
interleaved; the medians over rounds, then over repeats, are printed with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def _timed(fn, min_seconds: float = 0.002) -> float:  # type: ignore[no-untyped-def]
    """Seconds per call of `fn`, over as many calls as take `min_seconds`."""
    calls, t0 = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= min_seconds:
            return elapsed / calls


def child(fmt: str, rows: list[int], threads: int, seconds: float) -> None:
    import torch

    from stallfree.runtime.model import native_layers, quant

    torch.set_num_threads(threads)
    dtype = torch.float32 if fmt == "f32" else torch.bfloat16
    # a CPU without bfloat16 arithmetic (AVX2 only) multiplies bfloat16 as float32 after
    # widening it, and torch's own bfloat16 product there is a slow path, not the peak
    peak_dtype = dtype if quant.cpu_has_bf16() else torch.float32
    a = torch.randn(2048, 2048).to(peak_dtype)
    b = torch.randn(2048, 2048).to(peak_dtype)
    a @ b
    gen = torch.Generator().manual_seed(0)
    layers = []
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen) * 0.05
        if fmt in ("bf16", "f32"):
            layer: torch.nn.Module = torch.nn.Linear(k, n, bias=False).to(dtype)
            layer.weight.data.copy_(w)
            native_layers.use_native_linears(layer)  # as the engine loads it (bf16: NativeLinear)
        elif fmt == "int8":
            layer = quant.Int8Linear(quant.quantize_int8(w), None, dtype)
        elif fmt == "q8_0":
            layer = quant.Int8Linear(quant.quantize_int8_blocks(w), None, dtype)
        else:
            layer = quant.Int4Linear(quant.quantize_int4(w), None, dtype)
        layers.append(layer)
    with torch.inference_mode():
        # (rows, way) -> (the products, their FLOPs); "layer": each layer called as the Python
        # forward calls it; "loop": the product alone, as the C++ prompt loop calls it where the
        # tiles take every product (`tile_product`, the same op through one Python call)
        cases = {}
        for m in rows:
            xs = [torch.randn(m, k, generator=gen).to(dtype) for _, k in SHAPES]
            flops = sum(2 * m * n * k for n, k in SHAPES)
            cases[m, "layer"] = (
                lambda xs=xs: [lay(x) for lay, x in zip(layers, xs, strict=True)],
                flops,
            )
            if all(lay.tiles_take(m, dtype) for lay in layers if hasattr(lay, "tiles_take")):
                cases[m, "loop"] = (
                    lambda xs=xs: [lay.tile_product(x) for lay, x in zip(layers, xs, strict=True)],
                    flops,
                )
        for fn, _ in cases.values():
            fn()
        peaks: list[float] = []
        rates: dict[tuple[int, str], list[float]] = {case: [] for case in cases}
        shares: dict[tuple[int, str], list[float]] = {case: [] for case in cases}
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline or not peaks:
            peak = 2 * 2048**3 / _timed(lambda: a @ b, 0.0)
            peaks.append(peak)
            for case, (fn, flops) in cases.items():
                rate = flops / _timed(fn)
                rates[case].append(rate)
                shares[case].append(rate / peak)
    result: dict[str, object] = {"format": fmt, "peak": statistics.median(peaks)}
    result["rounds"] = len(peaks)
    for m, way in cases:
        result[f"{way}{m}"] = statistics.median(rates[m, way])
        result[f"{way}share{m}"] = statistics.median(shares[m, way])
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", nargs="+", default=["bf16", "f32", "int8", "q8_0", "int4"])
    parser.add_argument("--rows", nargs="+", type=int, default=[64, 256, 512])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.rows, args.threads, args.seconds)
        return
    print(f"threads {args.threads}; load average at start: {os.getloadavg()[0]:.2f}")
    runs: dict[str, list[dict]] = {f: [] for f in args.formats}
    for _ in range(args.repeats):
        for fmt in args.formats:
            cmd = [sys.executable, __file__, "--child", fmt, "--threads", str(args.threads)]
            cmd += ["--seconds", str(args.seconds)]
            cmd += ["--rows", *map(str, args.rows)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[fmt].append(json.loads(out.strip().splitlines()[-1]))
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    print(
        "\n| format | rows | called | GFLOP/s | peak GFLOP/s (2048^3, same dtype or float32) "
        "| share of peak (median of rounds) | rounds |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for fmt, rs in runs.items():
        peak = statistics.median(r["peak"] for r in rs)
        n = sum(r["rounds"] for r in rs)
        for m in args.rows:
            for way, called in (("layer", "layer"), ("loop", "as the C++ loop")):
                if f"{way}{m}" not in rs[0]:
                    continue
                got = statistics.median(r[f"{way}{m}"] for r in rs)
                share = statistics.median(r[f"{way}share{m}"] for r in rs)
                print(
                    f"| {fmt} | {m} | {called} | {got / 1e9:.0f} | {peak / 1e9:.0f} "
                    f"| {100 * share:.0f}% | {n} |"
                )


if __name__ == "__main__":
    main()
