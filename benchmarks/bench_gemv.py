"""The native matrix-vector kernels against the machine's read bandwidth and torch's kernels.

    python benchmarks/bench_gemv.py [--formats bf16 bf16c int8 q8_0 int4 f32]
        [--rows 1 2 4 8 16]
        [--copies N] [--repeats 3] [--threads 2] [--seconds 10]

SmolLM2-135M's five projection shapes (q/k/v 960x576, o 576x576, gate/up 3072x576, down
576x1536, the tied output 49152x576), each held in distinct copies so that every call reads
its weight from memory, not cache: by default at least 30, and as many as it takes for one
step's copies to fill twice the machine's L3 cache in the format measured (a 300 MB L3 holds
30 copies of every format but float32, and the figures then came from the cache, above the
memory's bandwidth); `--copies N` sets the least count. For each format and row count: the
time per step's worth of the five shapes (one call each), the bytes they read over that time,
and that as a share of the machine's read bandwidth (read_probe.py: a streaming AVX2 read of
1 GiB on both threads, plain and with a software prefetch, the faster of the two). The probe
and the steps alternate for `--seconds`: every round reads the bandwidth once and then times
one pass over every copy at each row count, and the share is taken per round, since this
machine's memory speed drifts by a third within minutes. torch's own kernel for the
format is timed beside it (bf16: F.linear; bf16c, the compact form of bfloat16 weights that
`--compact-decode-weights` keeps, counted at its 1.5 bytes a value and 16 a row: F.linear on
the dense weight; int8: _weight_int8pack_mm; f32: F.linear; q8_0, a GGUF's Q8_0 with a float16 scale per block of 32, and int4: the native kernel only, torch has no
kernel for block scales and its int4 weight kernel needs its own packing). Every copy has its
own scales, so they are read from memory with the weight. Each (format, repeat)
runs in a fresh process; formats interleave; medians are printed with the load average.
The weights and the probe's buffer sit on 2 MB pages, as the engine puts a model's weights
(runtime/memory/huge_pages.py); `STALLFREE_HUGE_PAGES=0` measures 4 KB pages instead.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from read_probe import Prober, on_huge_pages

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


# bytes of one copy of the five shapes, per weight format (int8: a float32 scale a row; q8_0: a
# float16 scale per 32 values; int4: half a byte a value plus a float16 scale and offset per 32
# values); the output layer counts a sixth, as `child` holds a sixth as many copies of it
_BYTES_PER_VALUE = {
    "bf16": 2.0,
    "bf16c": 1.5,
    "f32": 4.0,
    "int8": 1.0,
    "q8_0": 1.0 + 2 / 32,
    "int4": 0.5 + 4 / 32,
}


def copy_bytes(fmt: str) -> float:
    total = 0.0
    for n, k in SHAPES:
        share = 1.0 if n < 10000 else 1 / 6
        total += share * n * k * _BYTES_PER_VALUE[fmt]
    return total


def l3_bytes() -> int:
    """The largest cache's size, from sysfs (0 where the machine does not say)."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        value = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        best = max(best, value)
    return best


def copies_for(fmt: str, least: int) -> int:
    """Copies enough that one step's weights fill twice the L3 cache, at least `least`."""
    return max(least, math.ceil(2 * l3_bytes() / copy_bytes(fmt)))


def child(fmt: str, rows: list[int], copies: int, threads: int, seconds: float) -> None:
    import torch

    from stallfree.runtime.model import cpu_kernels, quant

    torch.set_num_threads(threads)
    isa = cpu_kernels.isa()
    ops = torch.ops.stallfree
    copies = copies_for(fmt, copies)
    result: dict[str, object] = {"format": fmt, "isa": isa, "copies": copies}
    # m -> ([native calls per shape], [torch's calls per shape], bytes of one step)
    steps: dict[int, tuple[list[list], list[list], int]] = {}  # type: ignore[type-arg]
    for m in rows:
        natives: list[list] = []  # type: ignore[type-arg]
        refs: list[list] = []  # type: ignore[type-arg]
        nbytes = 0
        for n, k in SHAPES:
            count = copies if n < 10000 else max(4, copies // 6)
            gen = torch.Generator().manual_seed(n)
            x = torch.randn(m, k, generator=gen).bfloat16()
            if fmt in ("bf16", "f32"):
                dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
                x = x.to(dtype)
                ws = on_huge_pages(
                    [torch.randn(n, k, generator=gen).to(dtype) for _ in range(count)]
                )
                native = [lambda w=w, x=x: ops.linear(x, w, None) for w in ws]
                ref = [lambda w=w, x=x: torch.nn.functional.linear(x, w) for w in ws]
                nbytes += n * k * ws[0].element_size()
            elif fmt == "bf16c":
                # the compact form (--compact-decode-weights) of trained-like rows: Gaussian
                # values of 0.02's scale, whose high bytes fit a row's table but for a few rows
                # (those are read from their dense copy, which the count leaves out)
                ws = [(torch.randn(n, k, generator=gen) * 0.02).bfloat16() for _ in range(count)]
                forms = [ops.compact_bf16(w) for w in ws]
                codes = on_huge_pages([c for c, _ in forms])
                tables = on_huge_pages([t for _, t in forms])
                native = [
                    lambda w=w, c=c, t=t, x=x: ops.linear_compact(x, w, c, t, None)
                    for w, c, t in zip(ws, codes, tables, strict=True)
                ]
                ref = [lambda w=w, x=x: torch.nn.functional.linear(x, w) for w in ws]
                nbytes += n * (k + k // 2) + n * 16
            elif fmt in ("int8", "q8_0"):
                qs = on_huge_pages(
                    [
                        torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
                        for _ in range(count)
                    ]
                )
                # the native kernel's copies in the layout the engine gives them (16 rows in
                # the lanes on AVX-512 without tiles: quant.rows_in_lanes, STALLFREE_INT_LANES),
                # torch's row-major
                lanes = quant.rows_in_lanes((n, k))
                nqs = on_huge_pages([quant.to_lanes(q) for q in qs]) if lanes else qs
                if fmt == "int8":
                    scales = [torch.rand(n, generator=gen) / 100 for _ in qs]
                    native = [
                        lambda q=q, x=x, s=s: ops.linear_q8(x, q, s, None)
                        for q, s in zip(nqs, scales, strict=True)
                    ]
                    ref = [
                        lambda q=q, x=x, s=s.bfloat16(): torch.ops.aten._weight_int8pack_mm(x, q, s)
                        for q, s in zip(qs, scales, strict=True)
                    ]
                    nbytes += n * k + n * 4
                else:
                    blocks = on_huge_pages(
                        [(torch.rand(n, k // 32, generator=gen) / 100).half() for _ in qs]
                    )
                    if lanes:
                        blocks = on_huge_pages([quant.scales_to_lanes(b) for b in blocks])
                    native = [
                        lambda q=q, x=x, b=b: ops.linear_q8_blocks(x, q, b, None)
                        for q, b in zip(nqs, blocks, strict=True)
                    ]
                    ref = []
                    nbytes += n * k + n * (k // 32) * 2
            else:  # int4: codes plus float16 scale and offset per group of 32
                g = k // 32
                cs = on_huge_pages(
                    [
                        torch.randint(0, 256, (n, g, 16), dtype=torch.uint8, generator=gen)
                        for _ in range(count)
                    ]
                )
                scs = on_huge_pages([torch.rand(n, g, generator=gen).half() for _ in cs])
                ofs = on_huge_pages([torch.rand(n, g, generator=gen).half() for _ in cs])
                if quant.rows_in_lanes((n, k)):  # the engine's layout on this CPU
                    cs = on_huge_pages([quant.codes_to_lanes(c) for c in cs])
                    scs = on_huge_pages([quant.scales_to_lanes(s) for s in scs])
                    ofs = on_huge_pages([quant.scales_to_lanes(o) for o in ofs])
                native = [
                    lambda c=c, x=x, s=s, o=o: ops.linear_q4(x, c, s, o, None)
                    for c, s, o in zip(cs, scs, ofs, strict=True)
                ]
                ref = []
                nbytes += n * k // 2 + n * g * 4
            natives.append(native)
            refs.append(ref)
        steps[m] = (natives, refs, nbytes)
    # rounds: the probe's bandwidth, then each row count's step (one pass over every copy),
    # the share of the bandwidth taken per round
    prober = Prober()
    for natives, _, _ in steps.values():
        for calls in natives:
            _pass(calls[:2])
    bandwidths: list[float] = []
    times: dict[int, list[float]] = {m: [] for m in rows}
    shares: dict[int, list[float]] = {m: [] for m in rows}
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(bandwidths) < 3:
        bw = prober.read(1) * 1e9
        bandwidths.append(bw)
        for m, (natives, _, nbytes) in steps.items():
            step = sum(_pass(calls) for calls in natives)
            times[m].append(step)
            shares[m].append(nbytes / step / bw)
    result["bandwidth"] = statistics.median(bandwidths) / 1e9
    result["rounds"] = len(bandwidths)
    for m, (_, refs, nbytes) in steps.items():
        torch_s = sum(_per_call(calls) for calls in refs if calls)
        result[f"m{m}"] = {
            "native_s": statistics.median(times[m]),
            "share": statistics.median(shares[m]),
            "torch_s": torch_s or None,
            "bytes": nbytes,
        }
    print(json.dumps(result))


def _pass(calls: list) -> float:  # type: ignore[type-arg]
    """Seconds per call over one pass through `calls`."""
    t0 = time.perf_counter()
    for c in calls:
        c()
    return (time.perf_counter() - t0) / len(calls)


def _per_call(calls: list) -> float:  # type: ignore[type-arg]
    for c in calls[:2]:
        c()
    return min(_pass(calls) for _ in range(3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", nargs="+", default=["bf16", "int8", "int4", "f32"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--copies", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.rows, args.copies, args.threads, args.seconds)
        return
    print(f"threads {args.threads}; load average at start: {os.getloadavg()[0]:.2f}")
    runs: dict[str, list[dict]] = {f: [] for f in args.formats}
    for _ in range(args.repeats):
        for fmt in args.formats:
            cmd = [sys.executable, __file__, "--child", fmt, "--copies", str(args.copies)]
            cmd += ["--threads", str(args.threads), "--rows", *map(str, args.rows)]
            cmd += ["--seconds", str(args.seconds)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[fmt].append(json.loads(out.strip().splitlines()[-1]))
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    print(
        "\n| format | rows | native: us per step of 5 shapes | GB/s | % of read bandwidth "
        "(median of rounds) | torch: us | native / torch speed |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for fmt, rs in runs.items():
        bw = statistics.median(r["bandwidth"] for r in rs)
        for m in args.rows:
            key = f"m{m}"
            nat = statistics.median(r[key]["native_s"] for r in rs)
            nbytes = rs[0][key]["bytes"]
            tor = [r[key]["torch_s"] for r in rs if r[key]["torch_s"]]
            tor_s = statistics.median(tor) if tor else None
            gbs = nbytes / nat / 1e9
            tcol = f"{tor_s * 1e6:.0f}" if tor_s else "–"
            ratio = f"{tor_s / nat:.2f}x" if tor_s else "–"
            share = statistics.median(r[key]["share"] for r in rs)
            print(
                f"| {fmt} | {m} | {nat * 1e6:.0f} | {gbs:.1f} | {100 * share:.0f}% of {bw:.1f} "
                f"| {tcol} | {ratio} |"
            )
    print(f"\nISA: {runs[args.formats[0]][0]['isa']}")
    held = ", ".join(f"{fmt} {rs[0]['copies']}" for fmt, rs in runs.items())
    print(f"L3 cache: {l3_bytes() / 2**20:.0f} MB; copies of each shape held: {held}")


if __name__ == "__main__":
    main()
