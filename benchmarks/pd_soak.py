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

The client is one httpx pool, as a real client's: it reuses connections that went idle (up to
`CLIENT_KEEPALIVE_S`, httpx's 5 s; `reused_connections` counts the requests that went out on
one), and a request lost on a reused connection before any answer (the router closed it as the
request came) is sent once more, and counted in `resent`. With the router keeping idle
connections longer than the pool (`--timeout-keep-alive`), that never happens.

Exit status 1 when a request failed or was resent, a gap reached the deadline, or a pool is
not free.
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
# how long the client's pool keeps an idle connection (httpx's default)
CLIENT_KEEPALIVE_S = 5.0


# what a request sent on a pooled connection the server was closing at that moment ends with,
# before any answer
_STALE = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class _Trace:
    """What httpx's trace extension told of one try: whether it opened a connection of its own
    or reused a pooled one, whether an answer's head came, and the last step it reached."""

    def __init__(self) -> None:
        self.new_connection = False
        self.answered = False
        self.step = "queued"

    async def __call__(self, name: str, info: dict[str, Any]) -> None:
        self.new_connection |= name.startswith("connection.connect_tcp")
        self.answered |= name == "http11.receive_response_headers.complete"
        self.step = name

    def lost_on_a_pooled_connection(self, exc: Exception) -> bool:
        """The try went out on a reused connection and ended before any answer, as when the
        server closed that connection as the request came: a client sends it again."""
        return isinstance(exc, _STALE) and not self.new_connection and not self.answered

    def describe(self, elapsed_s: float) -> str:
        kind = "a new connection" if self.new_connection else "a reused connection"
        return f"{kind}, at {self.step}, {elapsed_s:.1f} s after sending"


class _Progress:
    """One request's events: the longest time without one, the tokens, `[DONE]`, an error."""

    def __init__(self) -> None:
        self.start = self.last = time.monotonic()
        self.gap, self.tokens, self.done = 0.0, 0, False
        self.error: str | None = None

    def line(self, line: str) -> None:
        if not line.startswith("data: "):
            return
        now = time.monotonic()
        self.gap, self.last = max(self.gap, now - self.last), now
        data = line[len("data: ") :]
        if data == "[DONE]":
            self.done = True
            return
        event = json.loads(data)
        if "error" in event:
            self.error = f"error event: {str(event['error'])[:200]}"
        if event.get("usage"):
            self.tokens = event["usage"]["completion_tokens"]


async def _send(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], trace: _Trace, p: _Progress
) -> None:
    """One try of a streaming request, its events into `p`; httpx's errors propagate."""
    async with client.stream("POST", url, json=body, extensions={"trace": trace}) as r:
        if r.status_code != 200:
            p.error = f"status {r.status_code}: {(await r.aread())[:200]!r}"
            return
        async for line in r.aiter_lines():
            p.line(line)


async def one(client: httpx.AsyncClient, url: str, i: int, max_tokens: int) -> dict[str, Any]:
    """One streaming request, sent once more (as a well-behaved client does) when its first
    try was lost on a pooled connection before any answer; `resent` says so."""
    body = {
        "model": MODEL,
        "prompt": f"request {i}: " + " ".join(str(i * 7 + k) for k in range(i % 13 + 3)),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    p, resent, reused = _Progress(), False, False
    for last_try in (False, True):
        trace = _Trace()
        try:
            await _send(client, url + "/v1/completions", body, trace, p)
        except httpx.HTTPError as exc:
            if not last_try and trace.lost_on_a_pooled_connection(exc):
                resent = True
                continue
            p.error = f"{type(exc).__name__}: {exc} [{trace.describe(time.monotonic() - p.start)}]"
        finally:
            reused |= not trace.new_connection
        break
    gap = max(p.gap, time.monotonic() - p.last) if not p.done else p.gap
    error = p.error
    if error is None and not p.done:
        error = "stream ended without [DONE]"
    if error is None and p.tokens != max_tokens:
        error = f"{p.tokens} tokens of {max_tokens}"
    latency = time.monotonic() - p.start
    return {"error": error, "max_gap_s": gap, "latency_s": latency, "resent": resent,
            "reused": reused}  # fmt: skip


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def soak(url: str, requests: int, low: int, high: int, deadline: float) -> dict[str, Any]:
    rng = random.Random(0)
    # idle connections kept well under the router's keep-alive (`--timeout-keep-alive`, 120 s)
    limits = httpx.Limits(
        max_connections=requests + 8,
        max_keepalive_connections=requests + 8,
        keepalive_expiry=CLIENT_KEEPALIVE_S,
    )
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
        "reused_connections": sum(r["reused"] for r in results),
        "resent": sum(r["resent"] for r in results),
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
    ok = not figures["failed"] and not figures["resent"] and not figures["gaps_at_deadline"]
    return 0 if ok and not any(figures["left_running"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
