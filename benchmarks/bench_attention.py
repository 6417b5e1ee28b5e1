"""One attention layer, old formulation against `PagedAttention`, on `bench-cpu` dims.

    python benchmarks/bench_attention.py [--repeats 5] [--threads 1] [--seed 0]
    python benchmarks/bench_attention.py --native [--threads 2]
    python benchmarks/bench_attention.py --prompt [--threads 2]

`--native`: one decode layer on the torch path (`apply_rope` on q and k, `KVCache.write`,
bucketed `PagedAttention._decode` with the plan already built) against the native op
(`torch.ops.stallfree.decode_attention` through `PagedAttention.forward(..., rope=)`), in
microseconds per layer at batch 1, 4 and 16 and contexts 256 and 2048, float32 and bfloat16.

`--prompt`: one request's prompt attention (causal, no mask tensor) on SDPA against the native
prompt kernel (`torch.ops.stallfree.prefill_attention`), q, k and v views of one joint
projection row as the model has them, in microseconds per layer: SmolLM2-135M's heads (9 over
3, dim 64) and a 1B Llama's (32 over 8, dim 64), 64 to 1024 tokens, float32 and bfloat16 (the
model runs float32 prompts on the kernel, bfloat16 ones on SDPA), and the causal work's rate.

Old (reimplemented here as the baseline): decode gathers every row's K/V padded to the longest
row and repeats K/V once per query head; prefill repeats K/V too and runs 3-D SDPA with a mask.
New: `PagedAttention` (length-bucketed decode, `enable_gqa`, no K/V repeat). Decode is timed at
the first layer of a step (which also builds the bucket plan) and at a later layer (plan
reused). Prints medians (ms), old/new ratios, the K/V rows each formulation gathers, and the
largest difference between the two outputs. Figures only, no asserts.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from stallfree.runtime.memory.pool import KVCache, KVCacheShape
from stallfree.runtime.model import cpu_kernels
from stallfree.runtime.model.attention import (
    BUCKET_MERGE_ELEMS,
    BUCKET_PAD_RATIO,
    PagedAttention,
    attend,
    causal_mask,
    plan_buckets,
)
from stallfree.runtime.model.forward_batch import ForwardBatch, ForwardMode
from stallfree.runtime.model.rope import apply_rope

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 16, 4, 64, 2
MAX_LEN = 320


# ---------------------------------------------------------------------------- old formulation


def _old_expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    kv = kv.transpose(-3, -2)
    groups = heads // kv.shape[-3]
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=-3)


def _old_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    heads = q.shape[-3] if q.dim() == 4 else q.shape[1]
    k, v = _old_expand(k.to(q.dtype), heads), _old_expand(v.to(q.dtype), heads)
    if q.dim() == 4:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1)


def old_decode(q: torch.Tensor, layer: int, fb: ForwardBatch) -> torch.Tensor:
    k_buf, v_buf = fb.kv_cache.k_buffers[layer], fb.kv_cache.v_buffers[layer]
    slots = fb.req_to_token[fb.req_pool_indices, : fb.max_seq_len]
    mask = torch.arange(slots.shape[1])[None, :] < fb.seq_lens[:, None]
    out = _old_attend(q[:, :, None, :], k_buf[slots], v_buf[slots], mask[:, None, None, :])
    return out[:, :, 0, :]


def old_extend(q: torch.Tensor, layer: int, fb: ForwardBatch) -> torch.Tensor:
    k_buf, v_buf = fb.kv_cache.k_buffers[layer], fb.kv_cache.v_buffers[layer]
    outs, start = [], 0
    for i in range(fb.batch_size):
        n, prefix = fb.extend_lens_cpu[i], fb.prefix_lens_cpu[i]
        seq = prefix + n
        slots = fb.req_to_token[int(fb.req_pool_indices_cpu[i]), :seq]
        mask = causal_mask(prefix, seq, q.device)
        outs.append(_old_attend(q[start : start + n], k_buf[slots], v_buf[slots], mask))
        start += n
    return torch.cat(outs)


# ---------------------------------------------------------------------------- batches


def make_batch(
    mode: ForwardMode,
    seq_lens: list[int],
    extend_lens: list[int],
    gen: torch.Generator,
    dtype: torch.dtype = torch.float32,
) -> ForwardBatch:
    """Rows with K/V already in scattered cache slots (a random slot per token)."""
    total, width = sum(seq_lens), max(seq_lens)
    cache = KVCache(KVCacheShape(LAYERS, KV_HEADS, HEAD_DIM), total, dtype, torch.device("cpu"))
    for buf in cache.k_buffers + cache.v_buffers:
        buf.normal_(generator=gen)
    perm = torch.randperm(total, generator=gen)
    req_to_token = torch.zeros((len(seq_lens), width), dtype=torch.int64)
    new_slots, at = [], 0
    for row, n in enumerate(seq_lens):
        req_to_token[row, :n] = perm[at : at + n]
        new_slots.append(perm[at + n - extend_lens[row] : at + n])
        at += n
    rows = torch.arange(len(seq_lens))
    lens = torch.tensor(seq_lens)
    num_tokens = sum(extend_lens)
    return ForwardBatch(
        mode=mode,
        batch_size=len(seq_lens),
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        positions=torch.zeros(num_tokens, dtype=torch.int64),
        out_cache_loc=torch.cat(new_slots),
        req_pool_indices=rows.clone(),
        seq_lens=lens.clone(),
        req_pool_indices_cpu=rows,
        seq_lens_cpu=lens,
        extend_lens_cpu=list(extend_lens),
        prefix_lens_cpu=[s - e for s, e in zip(seq_lens, extend_lens, strict=True)],
        req_to_token=req_to_token,
        kv_cache=cache,
        prompt_lens_cpu=list(seq_lens),
    )


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


# ---------------------------------------------------------------------------- runs


def bench_decode(batch: int, mixed: bool, repeats: int, gen: torch.Generator) -> None:
    if mixed:
        lens = torch.randint(16, MAX_LEN + 1, (batch,), generator=gen).tolist()
    else:
        lens = [MAX_LEN] * batch
    fb = make_batch(ForwardMode.DECODE, lens, [1] * batch, gen)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    backend = PagedAttention()

    def first_layer() -> torch.Tensor:
        backend._plan_fb = None  # a new step: the plan is built again
        return backend._decode(q, 0, fb)

    def later_layer() -> torch.Tensor:
        return backend._decode(q, 1, fb)

    old = median_ms(lambda: old_decode(q, 0, fb), repeats)
    new_first = median_ms(first_layer, repeats)
    backend._decode(q, 0, fb)
    new_later = median_ms(later_layer, repeats)
    diff = (old_decode(q, 0, fb) - first_layer()).abs().max().item()
    groups = plan_buckets(lens, BUCKET_PAD_RATIO, BUCKET_MERGE_ELEMS // (KV_HEADS * HEAD_DIM))
    exact, padded = sum(lens), sum(len(g) * lens[g[0]] for g in groups)
    label = f"decode B={batch:<3d} {'mixed  ' if mixed else 'uniform'}"
    print(
        f"{label:28s} {old:9.2f} {new_first:9.2f} {new_later:9.2f} "
        f"{old / new_first:6.2f}x {old / new_later:6.2f}x  "
        f"{batch * max(lens) / exact:5.2f} {padded / exact:5.2f} {len(groups):3d}  {diff:.1e}"
    )


def bench_prefill(prompt: int, prefix: int, repeats: int, gen: torch.Generator) -> None:
    fb = make_batch(ForwardMode.EXTEND, [prefix + prompt], [prompt], gen)
    q = torch.randn(prompt, HEADS, HEAD_DIM, generator=gen)
    backend = PagedAttention()
    old = median_ms(lambda: old_extend(q, 0, fb), repeats)
    new = median_ms(lambda: backend._extend(q, 0, fb), repeats)
    diff = (old_extend(q, 0, fb) - backend._extend(q, 0, fb)).abs().max().item()
    label = f"prefill n={prompt:<4d} prefix={prefix}"
    print(
        f"{label:28s} {old:9.2f} {new:9.2f} {'':9s} {old / new:6.2f}x {'':7s}  {'':17s}  {diff:.1e}"
    )


def interleaved_us(
    a: Callable[[], object], b: Callable[[], object], repeats: int
) -> tuple[float, float]:
    """Medians (us) of `a` and `b` timed in turn, so that load from other processes falls on
    both alike."""
    a(), b()  # warm-up
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((a, times[0]), (b, times[1])):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]) * 1e6, statistics.median(times[1]) * 1e6


def bench_native(
    batch: int, context: int, dtype: torch.dtype, repeats: int, gen: torch.Generator
) -> None:
    fb = make_batch(ForwardMode.DECODE, [context] * batch, [1] * batch, gen, dtype)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(batch, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(batch, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    freqs = torch.randn(batch, HEAD_DIM // 2, generator=gen)
    sin = freqs.sin().to(dtype)
    rope = (
        torch.cat((freqs, freqs), -1).cos().to(dtype)[:, None],
        torch.cat((-sin, sin), -1)[:, None],
    )
    torch_backend, native_backend = PagedAttention(), PagedAttention()
    torch_backend._decode(q, 0, fb)  # the plan, built once per step, reused by later layers

    def torch_layer() -> torch.Tensor:
        qr, kr = apply_rope(q, *rope), apply_rope(k, *rope)
        fb.kv_cache.write(1, fb.out_cache_loc, kr, v)
        return torch_backend._decode(qr, 1, fb)

    def native_layer() -> torch.Tensor:
        return native_backend.forward(q, k, v, 1, fb, rope=rope)

    t_torch, t_native = interleaved_us(torch_layer, native_layer, repeats)
    diff = (torch_layer().float() - native_layer().float()).abs().max().item()
    label = f"B={batch:<3d} ctx={context:<5d} {str(dtype).removeprefix('torch.'):8s}"
    print(f"{label:28s} {t_torch:10.1f} {t_native:10.1f} {t_torch / t_native:7.2f}x  {diff:.1e}")


def main_native(repeats: int) -> None:
    isa = cpu_kernels.isa()
    if isa is None:
        print("native CPU kernels unavailable here: nothing to compare")
        return
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), native {isa}, "
        f"H={HEADS} KVH={KV_HEADS} D={HEAD_DIM}, one decode layer, median of {repeats} (us)"
    )
    print(f"{'case':28s} {'torch':>10s} {'native':>10s} {'ratio':>8s}  maxdiff")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            for context in (256, 2048):
                for batch in (1, 4, 16):
                    bench_native(batch, context, dtype, repeats, gen)
    print("torch: apply_rope on q and k, KVCache.write, bucketed decode (plan reused)")


def bench_prompt(
    tokens: int, heads: int, kv_heads: int, dtype: torch.dtype, repeats: int, gen: torch.Generator
) -> None:
    qkv = torch.randn(tokens, heads + 2 * kv_heads, HEAD_DIM, generator=gen).to(dtype)
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]

    def sdpa() -> torch.Tensor:
        return attend(q, k, v, None)

    def native() -> torch.Tensor:
        out: torch.Tensor = torch.ops.stallfree.prefill_attention(q, k, v, 0, 0)
        return out

    t_sdpa, t_native = interleaved_us(sdpa, native, repeats)
    diff = (sdpa().float() - native().float()).abs().max().item()
    # the causal work: each query's keys up to its own position, q.k and p.v
    flop = 4 * heads * HEAD_DIM * tokens * (tokens + 1) / 2
    label = f"{tokens:5d} tok {heads:2d}/{kv_heads} {str(dtype).removeprefix('torch.'):8s}"
    print(
        f"{label:28s} {t_sdpa:10.1f} {t_native:10.1f} {t_sdpa / t_native:7.2f}x "
        f"{flop / t_native / 1e3:8.1f}  {diff:.1e}"
    )


def main_prompt(repeats: int) -> None:
    isa = cpu_kernels.isa()
    if isa is None:
        print("native CPU kernels unavailable here: nothing to compare")
        return
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), native {isa}, D={HEAD_DIM}, "
        f"one prompt's attention, median of {repeats} (us)"
    )
    print(f"{'case':28s} {'SDPA':>10s} {'native':>10s} {'ratio':>8s} {'GFLOP/s':>8s}  maxdiff")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            for heads, kv_heads in ((9, 3), (32, 8)):
                for tokens in (64, 256, 1024):
                    bench_prompt(tokens, heads, kv_heads, dtype, repeats, gen)
    print("GFLOP/s: the native kernel's rate on the causal half (4 * H * D * n(n+1)/2)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--native", action="store_true", help="native decode op against torch")
    p.add_argument("--prompt", action="store_true", help="native prompt attention against SDPA")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.native:
        main_native(max(args.repeats, 50))
        return
    if args.prompt:
        main_prompt(max(args.repeats, 20))
        return
    gen = torch.Generator().manual_seed(args.seed)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), H={HEADS} KVH={KV_HEADS} "
        f"D={HEAD_DIM} fp32, median of {args.repeats} (ms)"
    )
    print(
        f"{'case':28s} {'old':>9s} {'new L0':>9s} {'new L1+':>9s} {'ratio0':>7s} {'ratio1+':>7s}  "
        f"{'padOld':>5s} {'padNew':>5s} {'bkt':>3s}  maxdiff"
    )
    with torch.inference_mode():
        for batch in (32, 128):
            for mixed in (False, True):
                bench_decode(batch, mixed, args.repeats, gen)
        for prompt, prefix in ((64, 0), (256, 0), (1024, 0), (256, 768)):
            bench_prefill(prompt, prefix, args.repeats, gen)
    print("padOld/padNew: K/V rows gathered over the exact sum of lengths; bkt: SDPA calls")


if __name__ == "__main__":
    main()
