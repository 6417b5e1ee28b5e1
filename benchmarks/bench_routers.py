"""What a router in front of stallfree costs per request, against asking a server directly.

    python benchmarks/bench_routers.py [--requests 60] [--max-tokens 4]

Two `stallfree serve tiny` servers, and a prefill/decode pair of the same model, each its own
process on loopback. In front of the two servers: sglang-router (`--policy cache_aware`) and
vllm-router (`--policy round_robin`), the Rust routers operators run (the `routers` extra). In
front of the pair: `stallfree router` and sglang-router's prefill/decode mode. One request at a
time (a short completion, `--max-tokens` new tokens, greedy, not streamed), the systems taken in
turn for every request so machine noise hits them alike; each system's median and p90 latency
and its median over one server asked directly. The two colocated routers' difference from the
direct path is their own cost; a prefill/decode request also pays for the KV transfer between
the two servers, so the two prefill/decode routers are compared with each other. The load
average is printed before and after. The machine's two cores run every process here, so the figures are upper bounds of what
a router adds on a machine of its own.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.router.rust_routers import Proc, Procs, completion, free_port, wait_ready


def start(procs: Procs) -> dict[str, Proc]:
    """Every system, ready: the name it is reported under -> its process."""
    bootstrap = free_port()
    a, b = procs.server("a"), procs.server("b")
    prefill = procs.server(
        "prefill", "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
        str(bootstrap),
    )  # fmt: skip
    decode = procs.server("decode", "--disaggregation-mode", "decode")
    for server in (a, b, prefill, decode):
        wait_ready(server)
    systems = {"direct (one server)": a}
    workers = ("--worker-urls", a.url, b.url)
    systems["sglang-router cache_aware"] = procs.router(
        "sglang", *workers, "--policy", "cache_aware"
    )
    systems["vllm-router round_robin"] = procs.router("vllm", *workers, "--policy", "round_robin")
    pd = ("--prefill", prefill.url, str(bootstrap), "--decode", decode.url)
    systems["sglang-router prefill/decode"] = procs.router(
        "sglang", "--pd-disaggregation", *pd, "--policy", "round_robin"
    )
    port = free_port()
    argv = [sys.executable, "-m", "stallfree", "router", *pd, "--port", str(port)]
    systems["stallfree router prefill/decode"] = procs.spawn("stallfree-router", argv, port)
    for name, proc in systems.items():
        if proc is not a:
            wait_ready(proc, "/v1/models" if "stallfree router" not in name else "/health")
    return systems


def measure(systems: dict[str, Proc], requests: int, max_tokens: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in systems}
    with httpx.Client(timeout=120, trust_env=False) as http:
        for i in range(requests + 3):  # the first 3 rounds warm every path up, untimed
            body = completion(f"request {i} of the router benchmark", max_tokens=max_tokens)
            for name, proc in systems.items():
                t0 = time.perf_counter()
                r = http.post(proc.url + "/v1/completions", json=body)
                took = time.perf_counter() - t0
                r.raise_for_status()
                if i >= 3:
                    times[name].append(took)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=4)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    procs = Procs(Path(tempfile.mkdtemp(prefix="bench_routers")))
    try:
        times = measure(start(procs), args.requests, args.max_tokens)
    finally:
        procs.close()
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    direct = statistics.median(times["direct (one server)"]) * 1e3
    print(
        f"\n{args.requests} requests per system, {args.max_tokens} new tokens each, one at a time"
    )
    print("| system | median ms | p90 ms | median over direct |")
    print("| --- | --- | --- | --- |")
    for name, values in times.items():
        med = statistics.median(values) * 1e3
        p90 = sorted(values)[int(0.9 * (len(values) - 1))] * 1e3
        print(f"| {name} | {med:.1f} | {p90:.1f} | {med - direct:+.1f} ms |")


if __name__ == "__main__":
    main()
