"""What stays cheap while the engine is loaded: `/health` latency while large chat bodies are
parsed and validated, and with N requests queued, the host cost of one health check plus `Engine.snapshot()` at 0 and N queued, and the stop-string
search per token with many long stop strings.

These are the figures the tests used to assert as wall-clock bounds; the tests now assert
counts (calls made, scans done) and these numbers are printed here instead. `tiny` preset, an
in-process server on loopback; medians over `--repeats` rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

from stallfree import Engine, SamplingParams, load_config
from stallfree.entrypoints.server import create_app, start_server
from stallfree.runtime.request.req import Req
from stallfree.runtime.telemetry.observer import EngineObserver
from stallfree.runtime.text.output_processor import OutputProcessor
from stallfree.runtime.text.tokenizer import ByteTokenizer


def _probe(port: int, n: int) -> list[float]:
    """`n` sequential GET /health on one keep-alive connection; seconds each."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    took = []
    try:
        for _ in range(n):
            start = time.perf_counter()
            conn.request("GET", "/health")
            resp = conn.getresponse()
            resp.read()
            took.append(time.perf_counter() - start)
            time.sleep(0.002)
    finally:
        conn.close()
    return took


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _check_cost(engine: Engine, calls: int) -> float:
    """Microseconds per `healthy` + `snapshot()`, the work of one probe and one scrape."""
    start = time.perf_counter()
    seen = 0
    for _ in range(calls):
        seen += engine.healthy
        engine.snapshot()
    assert seen == calls, "the engine was not healthy throughout"
    return (time.perf_counter() - start) / calls * 1e6


async def health_round(queued: int, probes: int) -> tuple[list[float], float, float]:
    cfg = load_config(
        model={"path": "tiny"},
        runtime={"device": "cpu"},
        cache={"max_running_requests": 2},
        scheduler={"max_waiting_requests": queued + 500},
        server={"max_concurrent_requests": queued + 500},
    )
    engine = Engine(cfg)
    server = await start_server(create_app(engine))
    params = SamplingParams(max_new_tokens=1500, ignore_eos=True)
    try:
        idle_cost = _check_cost(engine, 2000)

        async def hold(i: int) -> None:
            async for _ in engine.generate([1 + i % 200, 2, 3], params):
                pass

        held = [asyncio.create_task(hold(i)) for i in range(queued)]
        while engine.snapshot().waiting < queued - 10:
            await asyncio.sleep(0.05)
        loaded_cost = _check_cost(engine, 2000)
        took = await asyncio.to_thread(_probe, server.port, probes)
        for t in held:
            t.cancel()
        await asyncio.gather(*held, return_exceptions=True)
    finally:
        await server.stop()
        await engine.shutdown(drain=False)
    return took, idle_cost, loaded_cost


def stop_string_cost(stops: int, chars: int, tokens: int) -> tuple[float, float]:
    """Microseconds of `OutputProcessor.on_token` per token, without stop strings and with
    `stops` stop strings of `chars` characters that never match (the worst case: every token
    is searched for all of them), best of 5 runs of `tokens` tokens each."""
    never = ["\x00" * (chars - 1) + chr(0x4E00 + i) for i in range(stops)]

    def run(stop: list[str]) -> float:
        best = float("inf")
        for _ in range(5):
            output = OutputProcessor(ByteTokenizer(), EngineObserver())
            params = SamplingParams(max_new_tokens=tokens, ignore_eos=True, stop=stop)
            req = Req(rid="r", origin_input_ids=[1, 2, 3], sampling_params=params)
            output.add(req)
            start = time.perf_counter()
            for i in range(tokens):
                tok = 97 + i % 26
                req.output_ids.append(tok)
                output.on_token(req, tok, 0.0)
            best = min(best, time.perf_counter() - start)
        return best / tokens * 1e6

    return run([]), run(never)


def _serve_subprocess() -> tuple[subprocess.Popen[bytes], str]:
    """`stallfree serve tiny` in its own process, so the client's own work (8 uploads of 4 MB)
    is not counted against the server's event loop."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "stallfree", "serve", "tiny", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not start")


_CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
# the dense chat bodies of about 4 MB each: 120k empty messages, 45k tool calls in one
# message, 125k text parts in one message
LARGE_BODIES = {
    "messages": [{"role": "user", "content": ""}] * 120_000,
    "tool-calls": [{"role": "assistant", "content": None, "tool_calls": [_CALL] * 45_000}],
    "parts": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 125_000}],
}


async def large_bodies_round(bodies: int, kind: str) -> tuple[float, int, float]:
    """The longest /health answer (seconds) while `bodies` chat bodies of `kind` are posted at
    once to a server in another process, how many probes were answered meanwhile, and the
    seconds until the last body was answered."""
    proc, url = _serve_subprocess()
    body = json.dumps({"model": "tiny", "messages": LARGE_BODIES[kind]})
    worst, probes, dropped = 0.0, 0, 0
    try:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            headers = {"content-type": "application/json"}
            posts = [
                asyncio.create_task(
                    http.post("/v1/chat/completions", content=body, headers=headers)
                )
                for _ in range(bodies)
            ]
            began = time.perf_counter()
            await asyncio.sleep(0.2)  # the uploads are under way
            while not all(p.done() for p in posts):
                start = time.perf_counter()
                try:
                    await http.get("/health")
                    probes += 1
                except httpx.TransportError:
                    dropped += 1  # the server closed the probe's connection
                worst = max(worst, time.perf_counter() - start)
            answers = await asyncio.gather(*posts, return_exceptions=True)
            took = time.perf_counter() - began
            statuses = {
                a.status_code if isinstance(a, httpx.Response) else repr(a) for a in answers
            }
            if statuses != {400}:
                print(f"  answers: {statuses}")
    finally:
        proc.kill()
        proc.wait()
    if dropped:
        print(f"  {dropped} probe connections dropped by the server")
    return worst, probes, took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--queued", type=int, default=5000)
    p.add_argument("--probes", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bodies", type=int, default=8, help="large chat bodies posted at once")
    p.add_argument("--only-bodies", action="store_true", help="only the large-bodies figure")
    p.add_argument("--kind", choices=[*LARGE_BODIES, "all"], default="all")
    args = p.parse_args()
    print(f"load average: {os.getloadavg()}")
    kinds = list(LARGE_BODIES) if args.kind == "all" else [args.kind]
    rounds: dict[str, list[tuple[float, int, float]]] = {k: [] for k in kinds}
    for _ in range(args.repeats):  # the kinds interleaved, each against a fresh server
        for kind in kinds:
            rounds[kind].append(asyncio.run(large_bodies_round(args.bodies, kind)))
    for kind, runs in rounds.items():
        gaps, answered, took = zip(*runs, strict=True)
        print(
            f"{args.bodies} chat bodies of 4 MB ({kind}) at once: longest /health "
            f"{statistics.median(gaps) * 1e3:.0f} ms, {statistics.median(answered):.0f} probes "
            f"answered meanwhile, all answered in {statistics.median(took):.2f} s "
            f"(median of {args.repeats})"
        )
    if args.only_bodies:
        return
    p50s, p99s, worst, idle, loaded, stop_us = [], [], [], [], [], []
    for _ in range(args.repeats):
        took, idle_cost, loaded_cost = asyncio.run(health_round(args.queued, args.probes))
        p50s.append(_pct(took, 0.5))
        p99s.append(_pct(took, 0.99))
        worst.append(max(took))
        idle.append(idle_cost)
        loaded.append(loaded_cost)
        stop_us.append(stop_string_cost(64, 512, 2000))
    ms = 1e3
    print(f"/health with {args.queued} queued, {args.probes} probes, median of {args.repeats}:")
    print(f"  p50 {statistics.median(p50s) * ms:.2f} ms  p99 {statistics.median(p99s) * ms:.2f} ms")
    print(f"  max {statistics.median(worst) * ms:.2f} ms")
    print(
        f"health check + snapshot: {statistics.median(idle):.1f} us idle, "
        f"{statistics.median(loaded):.1f} us with {args.queued} queued"
    )
    plain = statistics.median(u[0] for u in stop_us)
    stopped = statistics.median(u[1] for u in stop_us)
    print(
        f"output processing per token: {plain:.1f} us, {stopped:.1f} us with 64 stop strings "
        "of 512 chars"
    )


if __name__ == "__main__":
    main()
