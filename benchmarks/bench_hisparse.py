"""Dense attention against HiSparse at long context on `bench-cpu`.

    python benchmarks/bench_hisparse.py [--context 4096] [--batch 4] [--steps 16]
                                        [--top-k 256] [--buffer 512] [--budget-gib 1]

Prints, for each: device KV bytes per request, the largest batch that fits the device budget,
decode throughput, bytes moved per decode step, and the buffer hit rate.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from stallfree import Engine, SamplingParams, load_config
from stallfree.runtime.telemetry.observer import EngineObserver


class DecodeWindow(EngineObserver):
    """Marks decode step `start` (past the prefill still in flight) with the HiSparse counters."""

    def __init__(self, engine: Engine, start: int = 3) -> None:
        self.engine = engine
        self.start = start
        self.steps = 0
        self.mark: tuple[float, Any] | None = None

    def on_step(self, num_reqs: int, decode: bool, overlapped: bool) -> None:
        if decode:
            self.steps += 1
            if self.steps == self.start:
                hisparse = self.engine.core.ctx.sparse
                # NOTE: one sync, outside the measured window's steady state
                stats = hisparse.stats(sync=True) if hisparse else None
                self.mark = (time.perf_counter(), stats)


def dense_bytes_per_request(engine: Engine, context: int) -> int:
    return engine.core.ctx.kv_cache.bytes_per_token() * context


def hisparse_bytes_per_request(engine: Engine, context: int) -> int:
    hs = engine.core.ctx.sparse
    arch = engine.core.loaded.arch
    per_layer_token = engine.core.ctx.kv_cache.bytes_per_token() // arch.num_layers
    dense_layers = arch.num_layers - len(hs.sparse_layers)
    index_keys = context * arch.head_dim * 4 * len(hs.sparse_layers)
    return dense_layers * per_layer_token * context + hs.device_bytes_per_request() + index_keys


async def run(args: argparse.Namespace, hisparse: bool) -> dict:
    prompt_len = args.context - args.steps - 2
    cfg = load_config(
        model={"path": "bench-cpu"},
        runtime={"device": "cpu"},
        cache={
            "max_total_tokens": args.batch * (args.context + 8),
            "max_running_requests": args.batch,
        },
        scheduler={"chunked_prefill_size": 1024, "max_prefill_tokens": 1024},
        hisparse={"enabled": hisparse, "top_k": args.top_k, "device_buffer_size": args.buffer},
    )
    engine = Engine(cfg)
    window = DecodeWindow(engine)
    engine.add_observer(window)
    async with engine:
        prompts = [[(i * 13 + j * 7) % 256 for j in range(prompt_len)] for i in range(args.batch)]
        params = SamplingParams(max_new_tokens=args.steps, ignore_eos=True)
        await asyncio.gather(*(engine.complete(p, params) for p in prompts))
        t1 = time.perf_counter()
        s1 = engine.core.ctx.sparse.stats(sync=True) if hisparse else None
        per_req = (hisparse_bytes_per_request if hisparse else dense_bytes_per_request)(
            engine, args.context
        )
    assert window.mark is not None
    t0, s0 = window.mark
    n = window.steps - window.start + 1
    out = {
        "bytes_per_req": per_req,
        "max_batch": int(args.budget_gib * 2**30 // per_req),
        "tok_s": n * args.batch / (t1 - t0),
    }
    if hisparse:
        hits, misses = s1.hits - s0.hits, s1.misses - s0.misses
        out["h2d_per_step"] = (s1.bytes_h2d - s0.bytes_h2d) / n
        out["d2h_per_step"] = (s1.bytes_d2h - s0.bytes_d2h) / n
        out["hit_rate"] = hits / max(hits + misses, 1)
    return out


async def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--top-k", type=int, default=256)
    p.add_argument("--buffer", type=int, default=512)
    p.add_argument("--budget-gib", type=float, default=1.0)
    args = p.parse_args()
    dense = await run(args, hisparse=False)
    sparse = await run(args, hisparse=True)
    mib = 2**20
    print(
        f"bench-cpu, context {args.context}, batch {args.batch}, {args.steps} decode steps; "
        f"HiSparse top_k {args.top_k}, buffer {args.buffer}; device budget {args.budget_gib} GiB"
    )
    print(f"{'':<32}{'dense':>12}{'hisparse':>12}{'ratio':>8}")
    rows = [
        ("device KV MiB per request", dense["bytes_per_req"] / mib, sparse["bytes_per_req"] / mib),
        ("largest batch in budget", dense["max_batch"], sparse["max_batch"]),
        ("decode tokens/s", dense["tok_s"], sparse["tok_s"]),
    ]
    for name, d, s in rows:
        print(f"{name:<32}{d:>12.2f}{s:>12.2f}{s / d:>8.2f}")
    print(f"{'H2D MiB per decode step':<32}{'-':>12}{sparse['h2d_per_step'] / mib:>12.3f}")
    print(f"{'D2H MiB per decode step':<32}{'-':>12}{sparse['d2h_per_step'] / mib:>12.3f}")
    print(f"{'buffer hit rate':<32}{'-':>12}{sparse['hit_rate']:>12.3f}")


if __name__ == "__main__":
    import uvloop

    uvloop.run(main())
