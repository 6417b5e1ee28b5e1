"""A BatchContext on the CPU stream with no model, for batch-level tests."""

from __future__ import annotations

import torch

from stallfree.overlap.future_map import FutureMap
from stallfree.overlap.host_read import SyncMonitor
from stallfree.overlap.stream import CpuStream
from stallfree.runtime.execution.context import BatchContext
from stallfree.runtime.memory.pool import (
    KVCache,
    KVCacheShape,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
)
from stallfree.runtime.request.req import Req
from stallfree.runtime.request.sampling_params import SamplingParams


def make_ctx(
    page_size: int = 1,
    num_tokens: int = 256,
    num_reqs: int = 16,
    max_context: int = 128,
    cpu_mirrors: bool = True,
    strict: bool = False,
    check_mirrors: bool = True,
    kv_shape: KVCacheShape | None = None,
) -> BatchContext:
    """The caller closes its stream (`ctx.stream.close()`); tests get contexts from the
    `batch_ctx` fixture (tests/conftest.py), which does."""
    stream = CpuStream()
    device = torch.device("cpu")
    num_slots = (num_tokens // page_size + 1) * page_size
    return BatchContext(
        req_to_token_pool=ReqToTokenPool(num_reqs, max_context, device),
        allocator=TokenToKVPoolAllocator(num_slots - page_size, page_size),
        kv_cache=KVCache(kv_shape or KVCacheShape(1, 1, 4), num_slots, torch.float32, device),
        stream=stream,
        monitor=SyncMonitor(stream, strict=strict),
        future_map=FutureMap(num_reqs, device),
        cpu_mirrors=cpu_mirrors,
        check_mirrors=check_mirrors,
    )


def make_req(rid: str, prompt_len: int, max_new_tokens: int = 16) -> Req:
    return Req(
        rid=rid,
        origin_input_ids=list(range(1, prompt_len + 1)),
        sampling_params=SamplingParams(max_new_tokens=max_new_tokens),
    )
