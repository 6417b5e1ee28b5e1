"""A prompt's forward with its layer loop in Python against the loop in C++
(`torch.ops.stallfree.prefill_layers`), one process per model and repeat, alternating.

    python benchmarks/bench_prompt_loop.py MODEL [MODEL ...] [--quantization none]
        [--dtype bfloat16|float32] [--rows 32 64 128 256] [--rounds 30] [--repeats 3]
        [--threads 2]

MODEL: a GGUF file or a Hugging Face directory, loaded in `--dtype` (bfloat16 by default;
`--quantization gguf` keeps a GGUF's Q8_0 / Q4 blocks as they are). Each repeat starts a fresh process per model,
the models interleaved; in it every round runs one prompt of each row count through the model
both ways (`STALLFREE_NATIVE_LOOP=0`, then `=1`, the order reversed every other round), each
forward timed whole (embedding, layers, the last row's logits). Both ways give the same bits
(tests/model/test_native_prompt_loop.py). Prints each way's median milliseconds and the
median over rounds of C++ / Python, per repeat, then the medians over repeats, with the load
average. In bfloat16 the C++ loop runs where the AMX tiles take every product (17-256 rows), and
past them for dense layers (oneDNN's products); in float32 past the grouped native call's rows
(oneDNN's products, the projections kept apart as the Python loop keeps them); elsewhere both
ways are the Python loop.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def measure(
    model: str, quantization: str, dtype: str, rows_list: list[int], rounds: int
) -> dict[str, list]:
    import torch

    from stallfree.runtime.model.compile import throwaway_batch
    from stallfree.runtime.model.forward_batch import ForwardMode
    from stallfree.runtime.model.loader import load_model

    loaded = load_model(model, dtype, torch.device("cpu"), 0, quantization=quantization)
    gen = torch.Generator().manual_seed(0)
    batches = []
    for rows in rows_list:
        fb = throwaway_batch(loaded, ForwardMode.EXTEND, [rows], rows)
        fb.input_ids = torch.randint(0, loaded.model.arch.vocab_size, (rows,), generator=gen)
        batches.append(fb)

    def forward(fb: object, loop: str) -> float:
        os.environ["STALLFREE_NATIVE_LOOP"] = loop
        t0 = time.perf_counter()
        loaded.model(fb)
        return time.perf_counter() - t0

    out: dict[str, list] = {}
    for rows, fb in zip(rows_list, batches, strict=True):
        for loop in "0101":  # warm both ways (the library, the plans)
            forward(fb, loop)
        took: dict[str, list[float]] = {"0": [], "1": []}
        for r in range(rounds):
            for loop in "01" if r % 2 == 0 else "10":
                took[loop].append(forward(fb, loop))
        taken = any(step for (r, *_), step in loaded.model._prompt_plans.items() if r == rows)
        ratios = [c / p for p, c in zip(took["0"], took["1"], strict=True)]
        out[str(rows)] = [
            statistics.median(took["0"]) * 1e3,
            statistics.median(took["1"]) * 1e3,
            statistics.median(ratios),
            taken,
        ]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+")
    p.add_argument("--quantization", default="none", choices=["none", "gguf", "int8", "int4"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--rows", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        result = measure(args.models[0], args.quantization, args.dtype, args.rows, args.rounds)
        print(json.dumps(result))
        return
    load = os.getloadavg()[0]
    runs: dict[str, list[dict[str, list]]] = {m: [] for m in args.models}
    for repeat in range(args.repeats):
        for model in args.models:
            cmd = [sys.executable, __file__, model, "--child", "--quantization", args.quantization,
                   "--dtype", args.dtype, "--rounds", str(args.rounds), "--threads", str(args.threads),
                   "--rows", *map(str, args.rows)]  # fmt: skip
            done = subprocess.run(cmd, check=True, capture_output=True, text=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            runs[model].append(result)
            name = Path(model).name
            for rows in args.rows:
                py, cc, ratio, taken = result[str(rows)]
                note = "" if taken else " (the C++ loop did not take it)"
                print(f"  repeat {repeat + 1} {name} {rows} rows: python {py:.2f} ms, "
                      f"C++ {cc:.2f} ms, C++ / python {ratio:.3f}{note}", flush=True)  # fmt: skip
    print(f"{args.dtype}, quantization {args.quantization}, threads {args.threads}, {args.rounds} rounds a "
          f"repeat, {args.repeats} repeats; load {load:.2f} at start, "
          f"{os.getloadavg()[0]:.2f} at end")  # fmt: skip
    print("| model | rows | python: ms | C++: ms | C++ / python (median of repeats) |")
    print("| --- | --- | --- | --- | --- |")
    for model, results in runs.items():
        for rows in args.rows:
            cells = [r[str(rows)] for r in results]
            py, cc, ratio = (statistics.median(c[i] for c in cells) for i in range(3))
            print(f"| {Path(model).name} | {rows} | {py:.2f} | {cc:.2f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
