"""The sampler on the CPU: a sampled row's top-k/top-p cut and its draw, two ways each.

    python benchmarks/bench_sampler.py [--vocab 49152] [--rows 1 4 16] [--rounds 15]
        [--spread 4.0] [--threads 2]

For each batch size and sampling setting, in one process, alternating round by round (this
machine's speed drifts between minutes, so each round's pair is compared):

  cut     `_filter_top_k_top_p` (the CPU's cut from each row's top candidates, a full sort
          only where a top-p nucleus reaches past them) against `_filter_sorted` (every row
          sorted whole, as on a GPU)
  draw    `Sampler.inverse_cdf` (one uniform a row against the cumulative sum) against the
          GPU's draw with torch's `exponential_` (a noise value per token, then the argmax)
  sample  `Sampler.sample` whole against the sampler as it was (the full sort, then the
          noise and argmax)

Logits are N(0, 1) times `--spread` (4: a few hundred tokens hold most of the mass at
temperature 0.7; lower is flatter, and a flat row's nucleus sends the cut to the full sort).
Prints medians in ms and the median of per-round ratios, with the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from stallfree.runtime.execution import sampler as sampler_mod
from stallfree.runtime.execution.sampler import Sampler, SamplingBatch
from stallfree.runtime.request.sampling_params import SamplingParams

SETTINGS = {
    "t=0.7 top_p=0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "t=0.8 top_k=40": SamplingParams(temperature=0.8, top_k=40),
    "t=1.0": SamplingParams(temperature=1.0),
}


def paired(
    a: Callable[[], object], b: Callable[[], object], rounds: int
) -> tuple[float, float, float]:
    """Medians (ms) of a and b, and the median of b / a per round, the order alternating."""
    a(), b()
    ta: list[float] = []
    tb: list[float] = []
    for r in range(rounds):
        for which in "ab" if r % 2 == 0 else "ba":
            t0 = time.perf_counter()
            (a if which == "a" else b)()
            (ta if which == "a" else tb).append((time.perf_counter() - t0) * 1e3)
    ratio = statistics.median(y / x for x, y in zip(ta, tb, strict=True))
    return statistics.median(ta), statistics.median(tb), ratio


def one_setting(
    logits: torch.Tensor, params: SamplingParams, rounds: int
) -> list[tuple[str, tuple[float, float, float]]]:
    """The figures for one batch of `logits` rows sampled with `params`."""
    rows = logits.shape[0]
    sb = SamplingBatch.build([params] * rows, [0] * rows, lambda t: t)
    sampler = Sampler(0, "cpu")
    scaled = logits / params.temperature
    assert sb.top_ks is not None and sb.top_ps is not None
    ks, ps = sb.top_ks, sb.top_ps
    figures = []
    if sb.needs_filter:
        figures.append(("cut", paired(
            lambda: sampler_mod._filter_sorted(scaled, ks, ps),
            lambda: sampler_mod._filter_top_k_top_p(scaled, ks, ps),
            rounds,
        )))  # fmt: skip
    probs = torch.softmax(scaled, dim=-1)

    def noise_argmax() -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_(generator=sampler._gen)
        return (probs / noise.clamp_min_(torch.finfo(probs.dtype).tiny)).argmax(dim=-1)

    figures.append(("draw", paired(noise_argmax, lambda: sampler.inverse_cdf(probs, sb), rounds)))
    real = sampler_mod._filter_top_k_top_p

    def before() -> torch.Tensor:
        """The sampler as it was: every row sorted whole, a noise value per token."""
        sampler_mod._filter_top_k_top_p = sampler_mod._filter_sorted
        try:
            p = sampler.probs(logits, sb)
        finally:
            sampler_mod._filter_top_k_top_p = real
        noise = torch.empty_like(p).exponential_(generator=sampler._gen)
        return (p / noise.clamp_min_(torch.finfo(p.dtype).tiny)).argmax(dim=-1)

    figures.append(("sample", paired(before, lambda: sampler.sample(logits, sb), rounds)))
    return figures


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--spread", type=float, default=4.0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    print(f"vocab {args.vocab}, spread {args.spread}, {args.threads} threads; load {load:.2f}")
    print("| rows | setting | what | before: ms | now: ms | now / before |")
    print("| --- | --- | --- | --- | --- | --- |")
    gen = torch.Generator().manual_seed(0)
    for rows in args.rows:
        logits = torch.randn(rows, args.vocab, generator=gen) * args.spread
        for name, params in SETTINGS.items():
            for what, (old, new, ratio) in one_setting(logits, params, args.rounds):
                print(f"| {rows} | {name} | {what} | {old:.2f} | {new:.2f} | {ratio:.3f} |")
    print(f"load at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
