"""Issue 42's hostile clients, measured from outside on `tiny`; prints one figure per finding.

    python benchmarks/bench_hostile.py [--only 2 5 6 7 8 13] [--requests 300] [--log-dir D]

Each finding gets fresh `stallfree serve` processes (`pd_processes.py`), so the script runs
against another checkout with `PYTHONPATH=<checkout> python benchmarks/bench_hostile.py`:

- **2** failures under concurrency through the router: `--requests` streaming requests at once
  through a prefill server, a decode server and the router (`pd_soak.py`'s client); failed share.
- **5** resident memory per bootstrap room: a prefill server's RSS before and after 10 room
  registrations of about 8 MB each (a million pages) to its bootstrap endpoint, and what each got.
- **6** a plain stream beside dead-end grammars: the seconds a 64-token stream takes alone and
  while 4 clients loop on a schema no finite output satisfies (a node that must hold a node).
- **7** compiled grammars held: the server's RSS after 24 distinct schemas, each a 60 KB
  `const` (`--grammar-cache-bytes 128 MiB` where the server has it).
- **8** `/metrics` after made-up methods: its size before and after 300 requests with invented
  HTTP methods (answered 401: the server has an API key).
- **13** screening under a flood: one client (API key) posts 16 dense 4 MB bodies, then
  another posts one; the other's latency and how many of the flood were answered before it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from pd_processes import Processes, free_port, pd_deployment
from pd_soak import soak

MODEL = "tiny"
USER = [{"role": "user", "content": "Describe a node."}]
ENDLESS = {
    "$ref": "#/$defs/n",
    "$defs": {
        "n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}
    },
}
DENSE = {"model": MODEL, "messages": [{"role": "user", "content": ""}] * 120_000}


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def supports(flag: str) -> bool:
    out = subprocess.run(
        [sys.executable, "-m", "stallfree", "serve", "--help"], capture_output=True, text=True
    )
    return flag in out.stdout


@contextlib.contextmanager
def serving(log_dir: Path, name: str, *args: str, **env: str) -> Iterator[tuple[str, int]]:
    """One `stallfree serve tiny ARGS`: its URL and pid."""
    procs = Processes(log_dir, {**os.environ, **env})
    try:
        url = procs.start(name, ["serve", MODEL, "--served-model-name", MODEL, *args])
        yield url, procs.procs[-1].pid
    finally:
        procs.stop()


async def f2_router_failures(log_dir: Path, requests: int) -> str:
    env = {"STALLFREE_SCHEDULER__MAX_WAITING_REQUESTS": str(requests + 16)}
    with pd_deployment(MODEL, log_dir, ["--served-model-name", MODEL], env) as pd:
        figures = await soak(pd.router, requests, 4, 16, 300.0)
    share = 100 * figures["failed"] / requests
    return (
        f"{figures['failed']} of {requests} failed ({share:.1f}%) {figures['failures']}; "
        f"wall {figures['wall_s']} s"
    )


async def f5_room_rss(log_dir: Path, rooms: int = 10) -> str:
    boot = free_port()
    args = ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot)]
    with serving(log_dir, "f5-prefill", *args) as (_, pid):
        base = f"http://127.0.0.1:{boot}"
        async with httpx.AsyncClient(base_url=base, timeout=120) as http:
            info = (await http.get("/bootstrap/info")).json()
            heads = info["fingerprint"]["num_kv_heads"]
            body = {"fingerprint": info["fingerprint"], "shards": [[0, heads]]}
            pair = await http.post("/bootstrap/pair", json=body)
            if pair.status_code != 200:
                return f"no pair: {pair.status_code} {pair.text[:120]}"
            pair_id = pair.json()["pair_id"]
            before = rss_mb(pid)
            statuses: dict[int, int] = {}
            pages = list(range(1_000_000, 2_000_000))  # ~8 MB of JSON
            for room in range(rooms):
                reg = {"pair_id": pair_id, "pages": pages, "num_tokens": 1}
                r = await http.post(f"/bootstrap/rooms/{room}", json=reg)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            grown = rss_mb(pid) - before
    return f"{rooms} rooms of 8 MB: RSS +{grown:.0f} MB ({grown / rooms:.1f} per room); {statuses}"


async def _stream_seconds(http: httpx.AsyncClient) -> float:
    body = {"model": MODEL, "prompt": "one two", "max_tokens": 64, "ignore_eos": True}
    start = time.monotonic()
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        async for _ in r.aiter_lines():
            pass
    return time.monotonic() - start


async def f6_dead_end_grammars(log_dir: Path, loopers: int = 4) -> str:
    with serving(log_dir, "f6") as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            alone = min([await _stream_seconds(http) for _ in range(3)])
            stop = asyncio.Event()
            codes: dict[int, int] = {}

            async def loop() -> None:
                fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": ENDLESS}}
                body = {"model": MODEL, "messages": USER, "max_tokens": 30}
                while not stop.is_set():
                    r = await http.post(
                        "/v1/chat/completions", json={**body, "response_format": fmt}
                    )
                    codes[r.status_code] = codes.get(r.status_code, 0) + 1

            beside = await _beside(http, loop, loopers, stop)
            plain = await _beside(http, _plain_loop(http, stop), loopers, stop)
    return (
        f"64-token stream {alone:.2f} s alone, {beside:.2f} s (slowest of 3) beside {loopers} "
        f"dead-end loopers (their answers {codes}), {plain:.2f} s beside {loopers} loopers "
        "of plain 1-token requests"
    )


def _plain_loop(http: httpx.AsyncClient, stop: asyncio.Event) -> Any:
    async def loop() -> None:
        body = {"model": MODEL, "messages": USER, "max_tokens": 1}
        while not stop.is_set():
            await http.post("/v1/chat/completions", json=body)

    return loop


async def _beside(http: httpx.AsyncClient, loop: Any, loopers: int, stop: asyncio.Event) -> float:
    """The slowest of 3 streams while `loopers` run `loop`."""
    stop.clear()
    tasks = [asyncio.create_task(loop()) for _ in range(loopers)]
    await asyncio.sleep(1.0)
    slowest = max([await _stream_seconds(http) for _ in range(3)])
    stop.set()
    await asyncio.gather(*tasks)
    return slowest


async def f7_grammar_cache(log_dir: Path, schemas: int = 24) -> str:
    args = ["--grammar-cache-bytes", str(128 << 20)] if supports("--grammar-cache-bytes") else []
    with serving(log_dir, "f7", *args) as (url, pid):
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            before = rss_mb(pid)
            codes: dict[int, int] = {}
            for i in range(schemas):
                const = "".join(chr(97 + (i * 7 + k * 13) % 26) for k in range(60_000))
                body = {
                    "model": MODEL,
                    "prompt": "x",
                    "max_tokens": 1,
                    "structured_outputs": {"json": {"const": const}},
                }
                r = await http.post("/v1/completions", json=body)
                codes[r.status_code] = codes.get(r.status_code, 0) + 1
            grown = rss_mb(pid) - before
    cap = "cap 128 MiB" if args else "no byte cap"
    return f"{schemas} distinct 60 KB const schemas ({cap}): RSS +{grown:.0f} MB; {codes}"


async def f8_metrics_size(log_dir: Path, requests: int = 300) -> str:
    with serving(log_dir, "f8", "--metrics", "--api-key", "k") as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            before = len((await http.get("/metrics")).content)
            codes: dict[int, int] = {}
            for i in range(requests):
                r = await http.request(f"MADEUP{i}", f"/v1/x{i}")
                codes[r.status_code] = codes.get(r.status_code, 0) + 1
            after = len((await http.get("/metrics")).content)
    return f"/metrics {before / 1e3:.1f} kB -> {after / 1e3:.1f} kB after {requests}; {codes}"


async def f13_screening_flood(log_dir: Path, flood: int = 16) -> str:
    keys = json.dumps(["flood", "other"])
    with serving(log_dir, "f13", STALLFREE_SERVER__API_KEY=keys) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:

            async def post(key: str) -> float:
                start = time.monotonic()
                headers = {"Authorization": f"Bearer {key}"}
                await http.post("/v1/chat/completions", json=DENSE, headers=headers)
                order.append(key)
                return time.monotonic() - start

            order: list[str] = []
            await post("flood")  # the screening process is up
            order.clear()
            start = time.monotonic()
            tasks = [asyncio.create_task(post("flood")) for _ in range(flood)]
            while len(order) < 2:  # the flood is read and queued: two are answered
                await asyncio.sleep(0.05)
            other = await post("other")
            await asyncio.gather(*tasks)
            wall = time.monotonic() - start
    before = order.index("other")
    return (
        f"the other client's one body, sent once 2 of the flood were answered: {other:.2f} s, "
        f"answered after {before} of the {flood} flood bodies (the flood took {wall:.2f} s)"
    )


FINDINGS: dict[str, Any] = {
    "2": ("failures through the router", f2_router_failures),
    "5": ("RSS per bootstrap room", f5_room_rss),
    "6": ("a stream beside dead-end grammars", f6_dead_end_grammars),
    "7": ("compiled grammars held", f7_grammar_cache),
    "8": ("/metrics after made-up methods", f8_metrics_size),
    "13": ("screening under another client's flood", f13_screening_flood),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", nargs="+", choices=list(FINDINGS), default=list(FINDINGS))
    p.add_argument("--requests", type=int, default=300, help="finding 2's concurrent requests")
    p.add_argument("--log-dir", type=Path, help="the servers' logs (default: a temporary dir)")
    args = p.parse_args()
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-hostile-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"load average {os.getloadavg()}; logs in {log_dir}", flush=True)
    for key in args.only:
        title, run = FINDINGS[key]
        extra = (args.requests,) if key == "2" else ()
        try:
            line = asyncio.run(run(log_dir, *extra))
        except Exception as exc:  # a finding the older server cannot run: say so, go on
            line = f"not measured: {type(exc).__name__}: {str(exc)[:200]}"
        print(f"finding {key:>2} ({title}): {line}", flush=True)


if __name__ == "__main__":
    main()
