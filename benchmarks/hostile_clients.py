"""Hostile clients against a `stallfree serve` subprocess on `tiny`; prints what each costs.

Two findings of the hardening round, each measured from outside, as a client sees them:

- **hung worker**: `--worker process`; a long streaming request runs, then the worker is
  stopped (SIGSTOP). Prints how long until the request ends with an error, what `/health`
  answers meanwhile, and how long SIGTERM then takes to end the server (the worker is
  resumed and the server killed past `--give-up` seconds, so a hang is a figure, not a hang).
- **keyless slow bodies**: `--api-key`; connections without the key promise a body and send it
  slowly while a keyed client sends requests. Prints what the keyless ones got and when, and
  the keyed requests' statuses and latencies.

Run it against another checkout's package with `PYTHONPATH=<checkout> python
benchmarks/hostile_clients.py` to compare (flags the older server lacks are left out).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _supports(flag: str) -> bool:
    out = subprocess.run(
        [sys.executable, "-m", "stallfree", "serve", "--help"], capture_output=True, text=True
    )
    return flag in out.stdout


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _workers(pid: int) -> list[int]:
    """The server's worker processes (spawned children; not multiprocessing's tracker)."""
    found = []
    for child in _children(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                cmdline = f.read()
            if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                found.append(child)
        except OSError:
            pass
    return found


class Server:
    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.port = _free_port()
        cmd = [sys.executable, "-m", "stallfree", "serve", "tiny", "--port", str(self.port)]
        self.proc = subprocess.Popen(
            cmd + args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
        self.url = f"http://127.0.0.1:{self.port}"

    async def ready(self) -> None:
        async with httpx.AsyncClient(base_url=self.url) as http:
            for _ in range(600):
                try:
                    if (await http.get("/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)
        raise SystemExit("the server did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


async def hung_worker(give_up: float, step_timeout: float) -> None:
    args = ["--worker", "process"]
    if _supports("--step-timeout"):
        args += ["--step-timeout", str(step_timeout)]
    server = Server(args)
    stopped: list[int] = []
    try:
        await server.ready()
        workers = _workers(server.proc.pid)
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2000, "stream": True}
        body["ignore_eos"] = True
        async with httpx.AsyncClient(base_url=server.url, timeout=None) as http:
            ended: dict[str, float | str] = {}

            async def stream() -> None:
                async with http.stream("POST", "/v1/completions", json=body) as answer:
                    async for line in answer.aiter_lines():
                        if "error" in line:
                            ended["error_at"] = time.monotonic()
                            ended["line"] = line[:160]
                ended.setdefault("closed_at", time.monotonic())

            task = asyncio.create_task(stream())
            await asyncio.sleep(1.0)
            for pid in workers:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            start = time.monotonic()
            health = []
            while time.monotonic() - start < give_up and not task.done():
                try:
                    h = await http.get("/health", timeout=2)
                    health.append(h.status_code)
                except httpx.TransportError as exc:
                    health.append(type(exc).__name__)
                await asyncio.sleep(0.5)
            done = task.done()
            task.cancel()
            seen = ended.get("error_at", ended.get("closed_at"))
            when = f"{seen - start:.1f}s" if isinstance(seen, float) else "never"
            after = (await http.get("/health", timeout=2)).status_code if done else health[-1]
        print(f"hung worker: stopped pid(s) {workers}")
        print(f"  request ended after the stop: {when} (gave up at {give_up:.0f}s)")
        print(f"  /health while stopped: {sorted(set(map(str, health)))}; then {after}")
        print(f"  error line: {ended.get('line', '-')}")
        term = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout=give_up)
            print(f"  SIGTERM to exit: {time.monotonic() - term:.1f}s")
        except subprocess.TimeoutExpired:
            print(f"  SIGTERM to exit: not within {give_up:.0f}s (killed)")
        alive = [p for p in stopped if os.path.exists(f"/proc/{p}")]
        print(f"  worker processes left after exit: {len(alive)}")
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        server.stop()


async def _keyless(url: str, hold_s: float) -> str:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    start = time.monotonic()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json"
        b"\r\nContent-Length: 4000\r\n\r\n{"
    )
    await writer.drain()
    try:
        line = await asyncio.wait_for(reader.readline(), timeout=hold_s)
        return f"{line.decode().strip()} after {time.monotonic() - start:.2f}s"
    except asyncio.TimeoutError:
        return f"no answer within {hold_s:.0f}s (holding a slot)"
    finally:
        writer.close()


async def keyless_slow_bodies(connections: int, hold_s: float) -> None:
    server = Server(["--api-key", "k"], {"STALLFREE_SERVER__MAX_CONCURRENT_REQUESTS": "8"})
    try:
        await server.ready()
        keyless = [asyncio.create_task(_keyless(server.url, hold_s)) for _ in range(connections)]
        await asyncio.sleep(0.5)
        headers = {"Authorization": "Bearer k"}
        statuses, latencies = [], []
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=30) as http:
            for _ in range(5):
                t = time.monotonic()
                answer = await http.post(
                    "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}
                )
                statuses.append(answer.status_code)
                latencies.append(time.monotonic() - t)
                await asyncio.sleep(0.2)
        got = await asyncio.gather(*keyless)
        print(f"keyless slow bodies: {connections} connections, max concurrent requests 8")
        kinds: dict[str, int] = {}
        for g in got:
            key = g.split(" after ")[0]
            kinds[key] = kinds.get(key, 0) + 1
        print(f"  keyless answers: {json.dumps(kinds)}; first: {got[0]}")
        print(f"  keyed statuses: {statuses}; latency max {max(latencies) * 1000:.0f} ms")
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--give-up", type=float, default=30.0, help="seconds to wait for an effect")
    p.add_argument("--step-timeout", type=float, default=5.0, help="the server's watchdog")
    p.add_argument("--connections", type=int, default=16, help="keyless slow-body connections")
    p.add_argument("--only", choices=["hung", "keyless"], help="run one finding")
    args = p.parse_args()
    print(f"load average: {os.getloadavg()}")
    if args.only in (None, "hung"):
        asyncio.run(hung_worker(args.give_up, args.step_timeout))
    if args.only in (None, "keyless"):
        asyncio.run(keyless_slow_bodies(args.connections, hold_s=10.0))


if __name__ == "__main__":
    main()
