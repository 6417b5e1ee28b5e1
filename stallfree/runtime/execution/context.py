"""`BatchContext`: the shared state every batch operation and allocation works against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from stallfree.overlap.future_map import FutureMap
from stallfree.overlap.host_read import SyncMonitor
from stallfree.overlap.stream import DeviceStream
from stallfree.runtime.execution.sparse import SparseAttention
from stallfree.runtime.memory.pool import KVCache, ReqToTokenPool, TokenToKVPoolAllocator


@dataclass(slots=True)
class BatchContext:
    req_to_token_pool: ReqToTokenPool
    allocator: TokenToKVPoolAllocator
    kv_cache: KVCache
    stream: DeviceStream
    monitor: SyncMonitor
    future_map: FutureMap
    cpu_mirrors: bool = True
    check_mirrors: bool = False
    sparse: SparseAttention | None = None  # set once by a sparse-attention plug-in
    spec_k: int = 0  # speculative decoding: the most drafts a request carries (0: off)
    spec_draft_model: bool = False  # the drafts come from a draft model
    # worker processes: the `req_to_token` writes (rows, cols, locs) made on the host replica
    # since the last step, which the next step message carries to the workers; None in process
    table_journal: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    # worker processes: imported KV and first tokens (disaggregation, scheduling/kv_import.py)
    # and speculative decoding's history writes (scheduling/alloc.py) for the next step
    # message, in order; None in process
    import_journal: list[tuple[Any, ...]] | None = None
    # embeddings (runtime/embed_requests.py): the width of a pooled vector (the model's
    # hidden size); 0: the engine pools nothing
    pool_width: int = 0
