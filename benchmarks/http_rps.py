"""Requests per second for short requests: the HTTP server against the embedded API.

Both run the `tiny` preset on the CPU. The server is a `stallfree serve` subprocess; the client
is a minimal keep-alive HTTP/1.1 client on raw asyncio streams in this process (httpx's own
per-request cost would dominate the figure). On a small machine the two compete for cores.

    python benchmarks/http_rps.py [--requests 400] [--concurrency 16] [--max-tokens 4]

`--metrics-ab ROUNDS` instead measures what `/metrics` costs a request: servers with
`--metrics` and with `--no-metrics`, each in a fresh process, interleaved over ROUNDS rounds
(medians), and then the HTTP middleware alone (prometheus-fastapi-instrumentator around an
app that answers at once), timed in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Awaitable, Callable

import uvloop
from common import serve_process

from stallfree import Engine, SamplingParams, load_config


async def drive(n: int, concurrency: int, one: Callable[[int], Awaitable[None]]) -> float:
    """Requests per second for `n` calls of `one` with `concurrency` in flight."""
    queue = iter(range(n))

    async def worker() -> None:
        for i in queue:
            await one(i)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return n / (time.perf_counter() - start)


async def embedded(args: argparse.Namespace) -> float:
    params = SamplingParams(max_new_tokens=args.max_tokens, ignore_eos=True)
    async with Engine(load_config(model={"path": "tiny"}, runtime={"device": "cpu"})) as engine:

        async def one(i: int) -> None:
            await engine.complete(f"short request {i}", params)

        await drive(args.concurrency, args.concurrency, one)  # warm up
        return await drive(args.requests, args.concurrency, one)


async def over_http(args: argparse.Namespace, url: str, route: str) -> float:
    host, port = url.removeprefix("http://").split(":")
    conns = [await asyncio.open_connection(host, int(port)) for _ in range(args.concurrency)]
    free: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
    for conn in conns:
        free.put_nowait(conn)

    async def one(i: int) -> None:
        reader, writer = await free.get()
        try:
            await post(reader, writer, route, _body(route, i, args.max_tokens))
        finally:
            free.put_nowait((reader, writer))

    try:
        await drive(args.concurrency, args.concurrency, one)
        return await drive(args.requests, args.concurrency, one)
    finally:
        for _, writer in conns:
            writer.close()


async def post(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str, body: dict[str, object]
) -> bytes:
    payload = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
    writer.write(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    headers = await reader.readuntil(b"\r\n\r\n")
    status = int(headers.split(b" ", 2)[1])
    length = int(headers.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    data = await reader.readexactly(length)
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {data[:200]!r}")
    return data


def _body(route: str, i: int, max_tokens: int) -> dict[str, object]:
    if route == "/generate":
        sampling = {"max_new_tokens": max_tokens, "ignore_eos": True}
        return {"text": f"short request {i}", "sampling_params": sampling}
    return {
        "model": "tiny",
        "prompt": f"short request {i}",
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }


def metrics_ab(args: argparse.Namespace) -> None:
    """Requests per second with metrics on and off, interleaved, and the middleware's cost."""
    import os
    import statistics

    print(f"load average {os.getloadavg()[0]:.2f}")
    rps: dict[str, list[float]] = {"--metrics": [], "--no-metrics": []}
    for round_ in range(args.metrics_ab):
        for flag, runs in rps.items():
            with serve_process("tiny", flag) as url:
                runs.append(uvloop.run(over_http(args, url, "/v1/completions")))
            print(f"round {round_ + 1} {flag:<13} {runs[-1]:>8.1f} req/s")
    on, off = (statistics.median(v) for v in rps.values())
    cost_us = (1 / on - 1 / off) * 1e6
    print(f"median: metrics on {on:.1f} req/s, off {off:.1f} req/s, on/off {on / off:.3f}")
    print(f"per request, end to end: {cost_us:+.0f} us (with {args.concurrency} in flight)")
    per_call = uvloop.run(middleware_cost(20_000))
    print(f"the HTTP middleware alone: {per_call:.1f} us per request")
    print(f"load average {os.getloadavg()[0]:.2f}")


async def middleware_cost(n: int) -> float:
    """Microseconds the instrumentator adds to one request (an app that answers at once)."""
    from fastapi import FastAPI
    from fastapi.responses import Response
    from prometheus_client import CollectorRegistry

    from stallfree.metrics.operator import ServerMetrics

    async def call(app: FastAPI) -> float:
        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/completions",
            "raw_path": b"/v1/completions",
            "root_path": "",
            "query_string": b"",
            "headers": [],
            "scheme": "http",
            "server": ("bench", 80),
            "http_version": "1.1",
        }

        async def receive() -> dict[str, object]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, object]) -> None:
            return None

        await app(scope, receive, send)  # builds the middleware stack
        start = time.perf_counter()
        for _ in range(n):
            await app(scope, receive, send)
        return (time.perf_counter() - start) / n * 1e6

    def app_with(instrumented: bool) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/completions")
        async def answer() -> Response:
            return Response(b"{}", media_type="application/json")

        if instrumented:
            ServerMetrics(CollectorRegistry(), ("m", "0"), 4096).instrument(app)
        return app

    plain, instrumented = await call(app_with(False)), await call(app_with(True))
    return instrumented - plain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--metrics-ab", type=int, default=0, metavar="ROUNDS")
    args = parser.parse_args()
    if args.metrics_ab:
        metrics_ab(args)
        return
    print(f"{args.requests} requests, {args.concurrency} in flight, {args.max_tokens} tokens each")
    base = uvloop.run(embedded(args))
    print(f"{'embedded Engine.complete':<28} {base:>8.1f} req/s")
    with serve_process() as url:
        for route in ("/generate", "/v1/completions"):
            rps = uvloop.run(over_http(args, url, route))
            print(f"{'HTTP ' + route:<28} {rps:>8.1f} req/s  ({rps / base:.2f}x embedded)")


if __name__ == "__main__":
    main()
