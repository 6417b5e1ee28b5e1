"""Requests per second for short requests: the HTTP server against the embedded API.

Both run the `tiny` preset on the CPU. The server is a `stallfree serve` subprocess; the client
is a minimal keep-alive HTTP/1.1 client on raw asyncio streams in this process (httpx's own
per-request cost would dominate the figure). On a small machine the two compete for cores.

    python benchmarks/http_rps.py [--requests 400] [--concurrency 16] [--max-tokens 4]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator

import httpx
import uvloop

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


@contextlib.contextmanager
def server_process() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "stallfree.entrypoints.cli", "serve", "--model", "tiny"]
    cmd += ["--device", "cpu", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("stallfree serve did not start")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=4)
    args = parser.parse_args()
    print(f"{args.requests} requests, {args.concurrency} in flight, {args.max_tokens} tokens each")
    base = uvloop.run(embedded(args))
    print(f"{'embedded Engine.complete':<28} {base:>8.1f} req/s")
    with server_process() as url:
        for route in ("/generate", "/v1/completions"):
            rps = uvloop.run(over_http(args, url, route))
            print(f"{'HTTP ' + route:<28} {rps:>8.1f} req/s  ({rps / base:.2f}x embedded)")


if __name__ == "__main__":
    main()
