"""A disaggregated soak: N streaming requests at once through the router; prints failures and
the longest a request went without progress.

    python benchmarks/pd_soak.py [--requests 1000] [--model tiny] [--stall-timeout 60]
        [--max-tokens 4 24] [--json FILE] [--log-dir DIR]

Starts a prefill server, a decode server and `stallfree router` (`pd_processes.py`), both
servers with `disaggregation.stall_timeout_s` = `--stall-timeout` (a request without progress
that long ends with a 504) and room for every request to wait (`scheduler.max_waiting_requests`
= `--requests`), sends one warm-up request, then all `--requests` at once: streaming
`/v1/completions`, distinct text prompts, greedy, `ignore_eos`, `max_tokens` drawn from
`--max-tokens` (seeded).

A request fails when its status is not 200, its stream carries an error event, it ends without
`[DONE]`, or it brings fewer tokens than asked. Its progress gaps are the time from sending to
its first event and between its events; the stall figures are over every request's longest
gap. Afterwards both servers' `/metrics` must show nothing running and an empty KV pool.
Exit status 1 when a request failed, a gap reached the deadline, or a pool is not free.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from pd_processes import metric, pd_deployment

MODEL = "tiny"


async def one(client: httpx.AsyncClient, url: str, i: int, max_tokens: int) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "prompt": f"request {i}: " + " ".join(str(i * 7 + k) for k in range(i % 13 + 3)),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    last = start = time.monotonic()
    gap, tokens, error, done, status = 0.0, 0, None, False, 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            status = r.status_code
            if status != 200:
                error = f"status {status}: {(await r.aread())[:200]!r}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    now = time.monotonic()
                    gap, last = max(gap, now - last), now
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        done = True
                        continue
                    event = json.loads(data)
                    if "error" in event:
                        error = f"error event: {str(event['error'])[:200]}"
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    gap = max(gap, time.monotonic() - last) if not done else gap
    if error is None and not done:
        error = "stream ended without [DONE]"
    if error is None and tokens != max_tokens:
        error = f"{tokens} tokens of {max_tokens}"
    return {"error": error, "max_gap_s": gap, "latency_s": time.monotonic() - start}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def soak(url: str, requests: int, low: int, high: int, deadline: float) -> dict[str, Any]:
    rng = random.Random(0)
    limits = httpx.Limits(max_connections=requests + 8, max_keepalive_connections=requests + 8)
    timeout = httpx.Timeout(deadline * 2 + 60, connect=60)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        warm = await one(client, url, -1, 2)
        assert warm["error"] is None, warm
        start = time.monotonic()
        results = await asyncio.gather(
            *(one(client, url, i, rng.randint(low, high)) for i in range(requests))
        )
        wall = time.monotonic() - start
    gaps = [r["max_gap_s"] for r in results]
    failures = Counter(str(r["error"]).split(":")[0] for r in results if r["error"])
    return {
        "requests": requests,
        "failed": sum(failures.values()),
        "failures": dict(failures),
        "first_errors": [r["error"] for r in results if r["error"]][:5],
        "wall_s": round(wall, 2),
        "stall_timeout_s": deadline,
        "max_gap_s": round(max(gaps), 3),
        "gap_p50_s": round(_pct(gaps, 0.5), 3),
        "gap_p99_s": round(_pct(gaps, 0.99), 3),
        "gaps_at_deadline": sum(g >= deadline for g in gaps),
        "latency_p50_s": round(_pct([r["latency_s"] for r in results], 0.5), 3),
        "latency_max_s": round(max(r["latency_s"] for r in results), 3),
    }


def left_running(servers: dict[str, str], wait_s: float = 15.0) -> dict[str, float]:
    """Each server's running requests plus its KV pool's use, once both are 0 (the last
    acknowledgements reach the prefill after the answers) or `wait_s` has passed."""
    deadline = time.monotonic() + wait_s
    while True:
        left = {
            name: metric(url, "stallfree:num_requests_running")
            + metric(url, "stallfree:kv_cache_usage_perc")
            for name, url in servers.items()
        }
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--stall-timeout", type=float, default=60.0)
    p.add_argument("--max-tokens", type=int, nargs=2, default=[4, 24], metavar=("MIN", "MAX"))
    p.add_argument("--json", type=Path, help="write the figures here too")
    p.add_argument("--log-dir", type=Path, help="the servers' logs (default: a temporary dir)")
    args = p.parse_args()
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pd-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {
        "STALLFREE_DISAGGREGATION__STALL_TIMEOUT_S": str(args.stall_timeout),
        "STALLFREE_SCHEDULER__MAX_WAITING_REQUESTS": str(args.requests + 16),
        "TOKENIZERS_PARALLELISM": "false",
    }
    server_args = ["--served-model-name", MODEL]
    with pd_deployment(args.model, log_dir, server_args, env) as pd:
        figures = asyncio.run(soak(pd.router, args.requests, *args.max_tokens, args.stall_timeout))
        figures["left_running"] = left_running({"prefill": pd.prefill, "decode": pd.decode})
    figures["log_dir"] = str(log_dir)
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures))
    ok = not figures["failed"] and not figures["gaps_at_deadline"]
    return 0 if ok and not any(figures["left_running"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
