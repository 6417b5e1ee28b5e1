"""What a JSON-schema constraint costs, with overlap on and off.

    python benchmarks/bench_structured.py [--rounds 3] [--requests 8] [--max-tokens 128]
        [--layout inprocess|workers|tp2|spec] [--systems json/overlap plain/overlap ...]

One workload (`--requests` random 32-byte prompts, all submitted at once and streamed, each
sampled at temperature 1.0 with its own seed, `--max-tokens` new tokens, EOS ignored) on four
systems, each run in a fresh process (this script with `--worker`), interleaved over the rounds
(the order rotates each round) so machine noise hits every system alike:

  plain/overlap      no constraint, runtime.overlap on
  json/overlap       a JSON schema (llguidance), overlap on
  plain/no-overlap   no constraint, overlap off
  json/no-overlap    the schema, overlap off

The schema (`schema()`) ends in a string of at least `--max-tokens` characters, so a constrained
reply cannot complete its grammar (which ends it with `stop`, even under ignore_eos) before
`--max-tokens`: both kinds generate the same tokens per request, and the finish reasons are
printed to show it. A short warm-up request with
the same parameters runs first in every process, so the schema's one compile (cached per
grammar) is not in the timed window.

`--layout` picks where the model runs, for every system alike: `inprocess` (the default),
`workers` (one worker process, `runtime.worker=process`: the matchers live in the worker),
`tp2` (two tensor-parallel worker processes over gloo: each rank masks alike) or `spec` (n-gram
speculative decoding with 3 drafts: each draft position masked at the state its drafts reach).
`--systems` runs a subset of the four (the ratios need both of their pair).

Figures (medians over the rounds): output tokens per second; per-token inter-token latency
(ITL: the gap between two streamed chunks of a request over the tokens in the chunk) p50 and
p99; share of launches made while an earlier batch was in flight (overlap_steps / steps: did
overlap stay on for the constrained batches?) and host reads per step (stalls); the grammar's
stream time per consumed token (grammar_seconds / grammar_tokens, in µs) and its share of the
stream's busy time; the host's schedule time per step (building and launching a batch, the
grammar plan included). Then the json / plain throughput ratio per round (median; target with overlap
on: 0.90 or more) and what overlap buys each kind. The load average is printed before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from typing import Any

RESULT_TAG = "@@bench_structured "
# name: (constrained, overlap)
SYSTEMS: dict[str, tuple[bool, bool]] = {
    "plain/overlap": (False, True),
    "json/overlap": (True, True),
    "plain/no-overlap": (False, False),
    "json/no-overlap": (True, False),
}


def schema(max_tokens: int) -> dict[str, Any]:
    """A record of a few bounded fields and a `text` of at least `max_tokens` characters (a
    character is one byte token or more), so no reply completes its grammar early. llguidance
    emits the properties in the order of the schema text it compiles, and `text` is last both
    as declared and sorted (`StructuredOutputs.schema_text` sorts the keys)."""
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "id": {"type": "integer", "minimum": 0, "maximum": 99999},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
            "text": {"type": "string", "minLength": max_tokens},
        },
        "required": ["name", "id", "tags", "text"],
        "additionalProperties": False,
    }


PROMPT_LEN = 32
# where the model runs: the config sections each layout adds
LAYOUTS: dict[str, dict[str, dict[str, Any]]] = {
    "inprocess": {},
    "workers": {"runtime": {"worker": "process"}},
    "tp2": {"parallel": {"tp_size": 2}},
    "spec": {"speculative": {"method": "ngram", "num_speculative_tokens": 3}},
}


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0 to 100) by linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _params(constrained: bool, max_tokens: int, seed: int, spec: dict[str, Any]) -> Any:
    from stallfree import SamplingParams

    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=1.0,
        seed=seed,
        ignore_eos=True,
        structured_outputs={"json": spec} if constrained else None,
    )


async def _worker(args: argparse.Namespace) -> dict[str, Any]:
    from stallfree import Engine, load_config

    constrained, overlap = SYSTEMS[args.system]
    sections = {k: dict(v) for k, v in LAYOUTS[args.layout].items()}
    runtime = {**sections.pop("runtime", {}), "device": args.device, "overlap": overlap}
    cfg = load_config(model={"path": args.model}, runtime=runtime, **sections)
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(PROMPT_LEN)] for _ in range(args.requests)]
    itl: list[float] = []
    ttft: list[float] = []
    reasons: Counter[str] = Counter()
    spec = schema(args.max_tokens)

    async def one(engine: Engine, prompt: list[int], seed: int) -> int:
        start = time.perf_counter()
        last: float | None = None
        count = 0
        async for chunk in engine.generate(
            prompt, _params(constrained, args.max_tokens, seed, spec)
        ):
            if chunk.error:
                raise RuntimeError(chunk.error)
            if chunk.finish_reason:
                reasons[chunk.finish_reason] += 1
            n = len(chunk.token_ids)
            if not n:
                continue
            now = time.perf_counter()
            if last is None:
                ttft.append(now - start)
            else:
                itl.extend([(now - last) / n] * n)
            last = now
            count += n
        return count

    async with Engine(cfg) as engine:
        await engine.complete([7] * PROMPT_LEN, _params(constrained, 8, 12345, spec))
        await engine.wait_idle()
        engine.flush_cache()
        before = engine.snapshot()
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(engine, p, i) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - t0
        await engine.wait_idle()
        after = engine.snapshot()
    ca, cb = before.counters, after.counters
    steps = cb.steps - ca.steps
    stalls = sum(after.stalls.values()) - sum(before.stalls.values())
    busy = after.device_busy_seconds - before.device_busy_seconds
    g_seconds = cb.grammar_seconds - ca.grammar_seconds
    g_tokens = cb.grammar_tokens - ca.grammar_tokens
    tokens = sum(counts)
    return {
        "system": args.system,
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tok_s": tokens / wall,
        "itl_p50_ms": 1e3 * percentile(itl, 50),
        "itl_p99_ms": 1e3 * percentile(itl, 99),
        "ttft_median_ms": 1e3 * statistics.median(ttft) if ttft else 0.0,
        "steps": steps,
        "overlap_share": (cb.overlap_steps - ca.overlap_steps) / steps if steps else 0.0,
        "stalls_per_step": stalls / steps if steps else 0.0,
        "sched_us_per_step": 1e6 * (cb.schedule_seconds - ca.schedule_seconds) / max(steps, 1),
        "grammar_us_per_token": 1e6 * g_seconds / g_tokens if g_tokens else 0.0,
        "grammar_share_of_busy": g_seconds / busy if busy else 0.0,
        "grammar_tokens": g_tokens,
        "finish_reasons": dict(reasons),
    }


def _run_one(args: argparse.Namespace, system: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", "--system", system, "--model", args.model]
    cmd += ["--device", args.device, "--requests", str(args.requests)]
    cmd += ["--max-tokens", str(args.max_tokens), "--layout", args.layout]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    raise RuntimeError(f"{system} run failed:\n{proc.stderr[-3000:]}")


def _ratio(runs: dict[str, list[dict[str, Any]]], num: str, den: str) -> tuple[float, list[float]]:
    """num / den throughput, paired by round: the median and each round's."""
    per_round = [
        a["output_tok_s"] / b["output_tok_s"] for a, b in zip(runs[num], runs[den], strict=True)
    ]
    return statistics.median(per_round), per_round


def report(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> None:
    def med(system: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[system])

    print(
        f"\nmodel {args.model}, layout {args.layout}, {args.requests} requests x "
        f"{args.max_tokens} tokens, {args.rounds} rounds, medians"
    )
    header = (
        f"{'system':<17}{'out tok/s':>10}{'ITL p50':>10}{'ITL p99':>10}{'TTFT':>9}"
        f"{'overlapped':>11}{'stalls/step':>12}{'sched/step':>11}{'grammar us/tok':>15}"
        f"{'of busy':>8}  finish"
    )
    print(header)
    print("-" * len(header))
    for system in runs:
        reasons: Counter[str] = Counter()
        for r in runs[system]:
            reasons.update(r["finish_reasons"])
        finish = " ".join(f"{k}:{v // len(runs[system])}" for k, v in sorted(reasons.items()))
        constrained = SYSTEMS[system][0]
        grammar = f"{med(system, 'grammar_us_per_token'):>15.1f}" if constrained else f"{'-':>15}"
        share = f"{med(system, 'grammar_share_of_busy'):>8.1%}" if constrained else f"{'-':>8}"
        print(
            f"{system:<17}{med(system, 'output_tok_s'):>10.0f}"
            f"{med(system, 'itl_p50_ms'):>8.1f}ms{med(system, 'itl_p99_ms'):>8.1f}ms"
            f"{med(system, 'ttft_median_ms'):>7.0f}ms{med(system, 'overlap_share'):>11.1%}"
            f"{med(system, 'stalls_per_step'):>12.2f}{med(system, 'sched_us_per_step'):>9.0f}us"
            f"{grammar}{share}  {finish}"
        )
    print()
    for label, num, den in (
        ("json / plain, overlap on (target >= 0.90)", "json/overlap", "plain/overlap"),
        ("json / plain, overlap off", "json/no-overlap", "plain/no-overlap"),
        ("overlap on / off, plain", "plain/overlap", "plain/no-overlap"),
        ("overlap on / off, json", "json/overlap", "json/no-overlap"),
    ):
        if num not in runs or den not in runs:
            continue
        m, per_round = _ratio(runs, num, den)
        rounds = " ".join(f"{x:.3f}" for x in per_round)
        print(f"{label:<43} {m:.3f}x  (rounds: {rounds})")
    if "json/overlap" not in runs or "plain/overlap" not in runs:
        return
    json_on, plain_on = runs["json/overlap"], runs["plain/overlap"]
    kept = all(
        r["overlap_share"] >= p["overlap_share"] - 0.05
        for r, p in zip(json_on, plain_on, strict=True)
    )
    stalls = max(r["stalls_per_step"] for r in json_on)
    print(
        f"overlap stayed on for constrained batches: {'yes' if kept else 'NO'} "
        f"(json {med('json/overlap', 'overlap_share'):.1%} of launches overlapped against "
        f"plain {med('plain/overlap', 'overlap_share'):.1%}; most stalls per step {stalls:.2f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", default="bench-cpu", help="model or preset (default: bench-cpu)")
    parser.add_argument("--device", default="cpu", help="runtime.device (default: cpu)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds of the 4 systems (default: 3)"
    )
    parser.add_argument(
        "--requests", type=int, default=8, help="concurrent requests per run (default: 8)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=128, help="new tokens per request (default: 128)"
    )
    parser.add_argument(
        "--layout",
        choices=list(LAYOUTS),
        default="inprocess",
        help="where the model runs (default: inprocess)",
    )
    parser.add_argument(
        "--systems",
        nargs="+",
        choices=list(SYSTEMS),
        default=list(SYSTEMS),
        help="the systems to run (default: all four)",
    )
    parser.add_argument("--json", help="write every run to this file (default: none)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", choices=list(SYSTEMS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(RESULT_TAG + json.dumps(asyncio.run(_worker(args))), flush=True)
        return
    print(f"load average before: {os.getloadavg()}")
    names = list(args.systems)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in names}
    for rnd in range(args.rounds):
        for system in names[rnd % len(names) :] + names[: rnd % len(names)]:
            runs[system].append(_run_one(args, system))
    print(f"load average after: {os.getloadavg()}")
    report(args, runs)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(runs, fh, indent=2)


if __name__ == "__main__":
    main()
