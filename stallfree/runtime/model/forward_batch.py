"""What one launched step hands the model: device tensors plus immutable host metadata.

Device tensors are only touched by work enqueued on the stream. The `_cpu` fields are host
copies taken at schedule time; the model uses them for shapes and loops, never the device.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from stallfree.runtime.memory.pool import KVCache


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"
    IDLE = "idle"


@dataclass(slots=True)
class ForwardBatch:
    mode: ForwardMode
    batch_size: int
    # device tensors
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    out_cache_loc: torch.Tensor  # [num_tokens] int64: KV slot each new token writes
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64: length after this step
    # host metadata
    req_pool_indices_cpu: torch.Tensor  # [B] int64
    seq_lens_cpu: torch.Tensor  # [B] int64
    extend_lens_cpu: list[int]  # new tokens per request (1 in decode)
    prefix_lens_cpu: list[int]  # tokens already in the cache per request
    # shared state
    req_to_token: torch.Tensor  # [num_req_slots, max_context] int64, device
    kv_cache: KVCache
    # original prompt length per request: a re-prefill after retraction also carries outputs
    prompt_lens_cpu: list[int] = field(default_factory=list)
    # a sparse-attention plug-in's plan for this step, opaque to the core (see runtime/execution/sparse.py)
    sparse_plan: object = None
    # device [N] int64: flat token offsets whose logits the model also returns, after the last
    # tokens' rows (prompt logprobs); None: only the last tokens'
    logit_positions: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens_cpu.max()) if self.batch_size else 0
