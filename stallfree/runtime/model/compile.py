"""Start-up compilation of the decoder layers (`runtime.torch_compile`).

`warm_up` compiles `LlamaForCausalLM.compile_layers`' graphs before the first request: it runs
the model on throwaway batches (its own small KV cache, no scheduler) of one token, of two
(torch specialises size 1; from 2 the dynamic graph serves every size) and a 3-token prefill,
and logs what was compiled and how long it took. torch guards the graphs on its thread count,
so the warm-up runs at the stream's.
"""

from __future__ import annotations

import logging
import time

import torch

from stallfree.runtime.memory.pool import KVCache
from stallfree.runtime.model.forward_batch import ForwardBatch, ForwardMode
from stallfree.runtime.model.loader import LoadedModel

logger = logging.getLogger(__name__)


def throwaway_batch(
    loaded: LoadedModel, mode: ForwardMode, lens: list[int], new: int
) -> ForwardBatch:
    """`len(lens)` requests whose lengths after the step are `lens`, `new` tokens each (token
    id 1), over a KV cache of their own (zeros) with each row's slots contiguous: a batch to
    run the model on with no scheduler (the warm-up here, benchmarks/bench_decode_step.py)."""
    device = next(loaded.model.parameters()).device
    width = max(lens)
    kv = KVCache(loaded.kv_cache_shape(), len(lens) * width + 1, loaded.dtype, device)
    req_to_token = torch.zeros((len(lens), width), dtype=torch.int64, device=device)
    for row in range(len(lens)):
        req_to_token[row] = torch.arange(1 + row * width, 1 + (row + 1) * width)
    ids: list[int] = []
    positions: list[int] = []
    locs: list[int] = []
    for row, n in enumerate(lens):
        ids += [1] * new
        positions += range(n - new, n)
        locs += req_to_token[row, n - new : n].tolist()
    rows = torch.arange(len(lens), device=device)
    seq_lens = torch.tensor(lens, device=device)
    return ForwardBatch(
        mode=mode,
        batch_size=len(lens),
        input_ids=torch.tensor(ids, device=device),
        positions=torch.tensor(positions, device=device),
        out_cache_loc=torch.tensor(locs, device=device),
        req_pool_indices=rows,
        seq_lens=seq_lens,
        req_pool_indices_cpu=rows.cpu(),
        seq_lens_cpu=seq_lens.cpu(),
        extend_lens_cpu=[new] * len(lens),
        prefix_lens_cpu=[n - new for n in lens],
        req_to_token=req_to_token,
        kv_cache=kv,
    )


def warm_up(loaded: LoadedModel, threads: int) -> float:
    """Compile the model's layers (`compile_layers`) and run the warm-up batches at `threads`
    torch threads (the graphs are guarded on the count: it must be the stream's); seconds."""
    start = time.perf_counter()
    model = loaded.model
    model.compile_layers()
    batches = [
        throwaway_batch(loaded, ForwardMode.DECODE, [4], 1),
        throwaway_batch(loaded, ForwardMode.DECODE, [4, 5], 1),
        throwaway_batch(loaded, ForwardMode.EXTEND, [3], 3),
    ]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for fb in batches:
            model(fb)
    finally:
        torch.set_num_threads(previous)
    seconds = time.perf_counter() - start
    logger.info(
        "torch.compile: %d decoder layers in 2 graphs (before and after attention), dynamic "
        "token count, warmed up on %d batches in %.1f s",
        loaded.arch.num_layers,
        len(batches),
        seconds,
    )
    return seconds
