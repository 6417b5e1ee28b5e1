"""Data-parallel replicas against one engine, and what the front costs per request.

Two systems, each started afresh per round, rounds interleaved: one `stallfree serve MODEL` and
`stallfree serve MODEL --data-parallel-size 2`. For each: streaming requests at a fixed
concurrency (random prompts, EOS ignored): output tok/s, TTFT p50 and p99; the replicas also
without the front (the client sends request i to replica i mod 2 directly). Then, on the
replicas' system, the front's overhead: the same one-token request sent in turn straight to a
replica (its URL from the front's /health) and through the front, alternating, medians of each
and their difference per request.

    python benchmarks/bench_replicas.py                  # tiny, 64 requests at concurrency 8
    python benchmarks/bench_replicas.py --model bench-cpu --rounds 3

Prints figures; asserts nothing. On a machine with fewer cores than engines, two replicas share
the cores one engine had, so expect the throughput flat or lower (docs/replicas.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import httpx
from pd_processes import Processes


def prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "theta"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(8, 24))) for _ in range(count)]


async def one_stream(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, out: int
) -> tuple[float, int]:
    """TTFT in seconds and output tokens of one streamed completion."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": out,
        "temperature": 0,
        "ignore_eos": True,
    }
    body["stream_options"] = {"include_usage": True}
    start, ttft, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if ttft is None and event.get("choices"):
                ttft = time.perf_counter() - start
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return ttft or float("nan"), tokens


async def load(urls: list[str], args: argparse.Namespace, seed: int) -> dict[str, float]:
    """The workload against `urls`, request i to `urls[i % len(urls)]`."""
    gate = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:

        async def run(i: int, prompt: str) -> tuple[float, int]:
            url = urls[i % len(urls)]
            async with gate:
                return await one_stream(client, url, args.model, prompt, args.output_len)

        start = time.perf_counter()
        work = enumerate(prompts(args.num_prompts, seed))
        results = await asyncio.gather(*(run(i, p) for i, p in work))
        wall = time.perf_counter() - start
    ttfts = sorted(t for t, _ in results)
    return {
        "tok_s": sum(n for _, n in results) / wall,
        "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2],
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
    }


def replica_urls(front: str) -> list[str]:
    with urllib.request.urlopen(f"{front}/health", timeout=10) as r:
        return [replica["url"] for replica in json.load(r)["replicas"]]


def overhead(front: str, args: argparse.Namespace) -> dict[str, float]:
    replica = replica_urls(front)[0]
    body = {"model": args.model, "prompt": "hello there", "max_tokens": 1, "temperature": 0}
    times: dict[str, list[float]] = {"direct": [], "front": []}
    with httpx.Client(timeout=60, trust_env=False) as client:
        for _ in range(args.overhead_requests):
            for name, url in (("direct", replica), ("front", front)):
                start = time.perf_counter()
                client.post(f"{url}/v1/completions", json=body).raise_for_status()
                times[name].append(time.perf_counter() - start)
    direct, through = (statistics.median(times[k]) * 1000 for k in ("direct", "front"))
    return {"direct_ms": direct, "front_ms": through, "overhead_ms": through - direct}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--overhead-requests", type=int, default=100)
    args = parser.parse_args()
    systems = {"1 engine": [], "2 replicas": ["--data-parallel-size", "2"]}
    figures: dict[str, list[dict[str, float]]] = {name: [] for name in systems}
    figures["2 replicas, direct"] = []
    costs: list[dict[str, float]] = []
    print(f"load average at start: {os.getloadavg()[0]:.2f}; {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as logs:
        for round_ in range(args.rounds):
            for name, flags in systems.items():
                procs = Processes(Path(logs))
                try:
                    url = procs.start(name.replace(" ", "-"), ["serve", args.model, *flags])
                    figures[name].append(asyncio.run(load([url], args, seed=round_)))
                    if flags:
                        # the same replicas without the front: the client takes turns
                        direct = asyncio.run(load(replica_urls(url), args, seed=round_))
                        figures["2 replicas, direct"].append(direct)
                        costs.append(overhead(url, args))
                finally:
                    procs.stop()
    print(f"{args.num_prompts} streamed requests at concurrency {args.concurrency}, "
          f"{args.output_len} tokens each, {args.model}; medians over {args.rounds} rounds")  # fmt: skip
    print("| system | output tok/s | TTFT p50 ms | TTFT p99 ms |\n| --- | --- | --- | --- |")
    for name, runs in figures.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"| {name} | {med['tok_s']:.1f} | {med['ttft_p50_ms']:.1f} | {med['ttft_p99_ms']:.1f} |"
        )
    med = {k: statistics.median(c[k] for c in costs) for k in costs[0]}
    print(f"front overhead, one-token completions, {args.overhead_requests} per path per round: "
          f"direct {med['direct_ms']:.2f} ms, through the front {med['front_ms']:.2f} ms, "
          f"+{med['overhead_ms']:.2f} ms per request")  # fmt: skip
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
