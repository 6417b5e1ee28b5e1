"""A model's forward with its bfloat16 weight rows padded by a cache line (padded_rows.py)
against the same model unpadded, one process per model and repeat, alternating.

    python benchmarks/bench_row_padding.py MODEL [MODEL ...] [--prompt 64 256]
        [--decode 1 4 16] [--context 256] [--rounds 20] [--repeats 3] [--threads 2]

MODEL: a GGUF file or a Hugging Face directory, loaded in bfloat16 twice in one process, once
with `STALLFREE_PAD_WEIGHT_ROWS=0` and once padded (which pads only rows of a multiple of
2 KB, so a model with none prints "no rows padded"). Each round runs every prompt length
(one prompt, the C++ prompt loop) and every decode batch (each row after `--context` cached
tokens, the C++ decode loop) through both copies, the order reversed every other round, each
forward timed whole; both give the same logits (checked once per shape, and in
tests/model/test_padded_rows.py). Prints per repeat each shape's unpadded median milliseconds
and the median over rounds of padded / unpadded, then the medians over repeats, with the
load average at start and end.
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
    model: str, prompts: list[int], decodes: list[int], context: int, rounds: int
) -> dict[str, list]:
    import torch

    from stallfree.runtime.model.compile import throwaway_batch
    from stallfree.runtime.model.forward_batch import ForwardMode
    from stallfree.runtime.model.loader import load_model
    from stallfree.runtime.model.padded_rows import is_padded

    copies = {}
    for pad in ("0", "1"):
        os.environ["STALLFREE_PAD_WEIGHT_ROWS"] = pad
        copies[pad] = load_model(model, "bfloat16", torch.device("cpu"), 0)
    padded = sum(is_padded(p) for p in copies["1"].model.parameters())
    shapes = [("prompt", n) for n in prompts] + [("decode", b) for b in decodes]
    gen = torch.Generator().manual_seed(0)
    batches: dict[str, list] = {pad: [] for pad in copies}
    for kind, n in shapes:
        vocab = copies["0"].model.arch.vocab_size
        ids = torch.randint(0, vocab, (n,), generator=gen)
        for pad, loaded in copies.items():
            if kind == "prompt":
                fb = throwaway_batch(loaded, ForwardMode.EXTEND, [n], n)
            else:
                fb = throwaway_batch(loaded, ForwardMode.DECODE, [context] * n, 1)
            fb.input_ids = ids.clone()
            batches[pad].append(fb)

    def forward(pad: str, i: int) -> float:
        t0 = time.perf_counter()
        copies[pad].model(batches[pad][i])
        return time.perf_counter() - t0

    out: dict[str, list] = {"padded": [padded]}
    with torch.inference_mode():
        for i, (kind, n) in enumerate(shapes):
            a = copies["0"].model(batches["0"][i])
            b = copies["1"].model(batches["1"][i])
            same = bool(torch.equal(a, b))
            for pad in "0101":  # warm both (the plans, the caches' pages)
                forward(pad, i)
            took: dict[str, list[float]] = {"0": [], "1": []}
            for r in range(rounds):
                for pad in "01" if r % 2 == 0 else "10":
                    took[pad].append(forward(pad, i))
            ratios = [p / u for u, p in zip(took["0"], took["1"], strict=True)]
            out[f"{kind} {n}"] = [
                statistics.median(took["0"]) * 1e3,
                statistics.median(ratios),
                same,
            ]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+")
    p.add_argument("--prompt", type=int, nargs="*", default=[64, 256])
    p.add_argument("--decode", type=int, nargs="*", default=[1, 4, 16])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    shapes = [f"prompt {n}" for n in args.prompt] + [f"decode {b}" for b in args.decode]
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        result = measure(args.models[0], args.prompt, args.decode, args.context, args.rounds)
        print(json.dumps(result))
        return
    load = os.getloadavg()[0]
    runs: dict[str, list[dict[str, list]]] = {m: [] for m in args.models}
    for repeat in range(args.repeats):
        for model in args.models:
            cmd = [sys.executable, __file__, model, "--child", "--rounds", str(args.rounds),
                   "--threads", str(args.threads), "--context", str(args.context),
                   "--prompt", *map(str, args.prompt), "--decode", *map(str, args.decode)]  # fmt: skip
            done = subprocess.run(cmd, check=True, capture_output=True, text=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            runs[model].append(result)
            name = Path(model).name
            if not result["padded"][0]:
                print(f"  repeat {repeat + 1} {name}: no rows padded", flush=True)
            for shape in shapes:
                ms, ratio, same = result[shape]
                note = "" if same else " (logits differ!)"
                print(f"  repeat {repeat + 1} {name} {shape}: unpadded {ms:.2f} ms, "
                      f"padded / unpadded {ratio:.3f}{note}", flush=True)  # fmt: skip
    print(f"bfloat16, threads {args.threads}, context {args.context} for decode, {args.rounds} "
          f"rounds a repeat, {args.repeats} repeats; load {load:.2f} at start, "
          f"{os.getloadavg()[0]:.2f} at end")  # fmt: skip
    print(
        "| model | matrices padded | step | unpadded: ms | padded / unpadded (median of repeats) |"
    )
    print("| --- | --- | --- | --- | --- |")
    for model, results in runs.items():
        for shape in shapes:
            ms = statistics.median(r[shape][0] for r in results)
            ratio = statistics.median(r[shape][1] for r in results)
            count = results[0]["padded"][0]
            print(f"| {Path(model).name} | {count} | {shape} | {ms:.2f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
