"""A prompt's MLP on the AMX tiles, the two products apart against the packed hand-off, in one
process, alternating.

    python benchmarks/bench_mlp_handoff.py [--model smollm2 1b] [--rows 64 128 256]
        [--copies N] [--threads 2] [--seconds 10]

"apart": the gate/up product with silu(gate) * up in its epilogue, written row-major, then the
down product, which packs it again (`native_layers.gate_up_silu`, then the down layer), as a
prompt's MLP ran before the hand-off. "hand-off": `native_layers.mlp_on_tiles`, where the
gate/up product writes its output in the down product's packed order. Both give the same bits
(tests/model/test_amx_packed_handoff.py). The shapes are a model's gate/up and down projections
(SmolLM2-135M: 3072 x 576 and 576 x 1536; a 1B Llama: 16384 x 2048 and 2048 x 8192), bfloat16,
`--copies` layers with different weights (so they come from memory). Every round runs each way
once over all copies, the order reversed every other round, for `--seconds` per row count; it
prints each way's median milliseconds and the median over rounds of hand-off / apart. Needs a
CPU with AMX.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

SHAPES = {"smollm2": (576, 1536), "1b": (2048, 8192)}  # hidden, intermediate
COPIES = {"smollm2": 30, "1b": 4}


def measure(model: str, rows_list: list[int], copies: int, seconds: float) -> None:
    import torch
    from torch import nn

    from stallfree.runtime.model import native_layers

    hidden, inter = SHAPES[model]
    gen = torch.Generator().manual_seed(0)

    def layer(n: int, k: int) -> nn.Linear:
        lin = nn.Linear(k, n, bias=False).to(torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.05)
        native_layers.use_native_linears(lin)
        return lin

    mlps = [(layer(2 * inter, hidden), layer(hidden, inter)) for _ in range(copies)]
    print(f"{model}: {copies} copies of gate/up {2 * inter} x {hidden} and down {hidden} x {inter}")
    print("| rows | apart: ms | hand-off: ms | hand-off / apart (median of rounds) |")
    print("| --- | --- | --- | --- |")
    for rows in rows_list:
        x = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
        if native_layers.mlp_on_tiles(*mlps[0], x) is None:
            raise SystemExit(f"{rows} rows do not take the tiles here (AMX, 17-256 rows)")

        def apart(x: torch.Tensor = x) -> None:
            for gate_up, down in mlps:
                down(native_layers.gate_up_silu(gate_up, x))

        def handoff(x: torch.Tensor = x) -> None:
            for gate_up, down in mlps:
                native_layers.mlp_on_tiles(gate_up, down, x)

        ways = {"apart": apart, "hand-off": handoff}
        for fn in ways.values():
            fn()
        times: dict[str, list[float]] = {w: [] for w in ways}
        end, rnd = time.monotonic() + seconds, 0
        while time.monotonic() < end or rnd < 3:
            for way in list(ways) if rnd % 2 == 0 else list(ways)[::-1]:
                t0 = time.perf_counter()
                ways[way]()
                times[way].append(time.perf_counter() - t0)
            rnd += 1
        ratio = statistics.median(
            b / a for a, b in zip(times["apart"], times["hand-off"], strict=True)
        )
        a_ms, b_ms = (1e3 * statistics.median(times[w]) for w in ways)
        print(f"| {rows} | {a_ms:.2f} | {b_ms:.2f} | {ratio:.3f} |  ({rnd} rounds)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--rows", nargs="+", type=int, default=[64, 128, 256])
    p.add_argument("--copies", type=int, default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=10.0, help="per row count")
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}; load average at start {os.getloadavg()[0]:.2f}")
    with torch.inference_mode():
        for model in args.model:
            measure(model, args.rows, args.copies or COPIES[model], args.seconds)
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
