"""Dense bfloat16 weights whose rows of a multiple of 2 KB lie one 64-byte line further apart.

The AMX tiles (csrc/amx_gemm.cpp, csrc/isa_amx.cpp) load a weight 16 rows at a time at the
same column. Where a row is a multiple of 2 KB (1024 bfloat16 values or more by powers of
two: a 1B Llama's 2048 and 8192), the 16 lines of a tile fall in one or two of L1's 64 sets
of 12 ways and evict one another as they arrive; one more line per row spreads them over 16
sets. On a 1B Llama's prompt products on the tiles (256 rows, one process alternating
between the two layouts of the same values) the padded rows took 0.86-0.98 of the time, the
whole 256-token forward 0.964 (and 0.966 at 64 tokens).

The extra line costs the decode step's reading: the hardware prefetchers fetch it with the
row, so a one-row matrix-vector product takes about the padding's share more (1.6% of a
4 KB row: 1.009-1.014 of the 1B model's batch-1 step, 0.974 at four rows where the tiles
run). Rows of other lengths already spread over the sets (SmolLM2's 576 values, 18 lines a
row, over all 16; its 1536, 48 lines, over 4), gained 0.98-1.0 on its whole prompt and lost
2% at one row, so they stay as they are.

`pad_rows` re-lays each weight in place (`Tensor.set_`, so every reference to the parameter
sees it), as a view of the first `in_features` values of each row of a wider buffer, with the
extra values zero. Every native kernel that reads dense weights takes the row stride
(`rows_contiguous`), and torch's own products read a row-strided matrix without a copy and
with the same bits. Weights shared with another module (tied embeddings) stay as they are.
`STALLFREE_PAD_WEIGHT_ROWS=0` turns it off.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from stallfree.runtime.memory.huge_pages import module_tensors, stays_in_place

logger = logging.getLogger(__name__)

PAD_BYTES = 64
# rows of a multiple of this many bytes are padded (the module's docstring)
PADDED_MULTIPLE = 2048


def enabled() -> bool:
    value = os.environ.get("STALLFREE_PAD_WEIGHT_ROWS", "1").strip().lower()
    return value not in ("0", "off", "false", "no")


def rows_contiguous(w: torch.Tensor) -> bool:
    """Whether `w` is an [out, in] matrix whose rows are each contiguous (a padded weight's or
    a contiguous one's): what the native dense kernels read."""
    return w.dim() == 2 and (w.stride(1) == 1 or w.shape[1] <= 1) and w.stride(0) >= w.shape[1]


def is_padded(w: torch.Tensor) -> bool:
    return rows_contiguous(w) and w.shape[0] > 1 and w.stride(0) > w.shape[1]


def _sharing(model: nn.Module) -> tuple[dict[int, int], dict[int, int]]:
    """How many module slots hold each tensor (by id), and how many distinct tensors use each
    storage (by its data pointer)."""
    holders: dict[int, int] = {}
    users: dict[int, set[int]] = {}
    for t in module_tensors(model):  # a tensor once per slot that holds it
        holders[id(t)] = holders.get(id(t), 0) + 1
        if t.device.type == "cpu" and not t.is_mkldnn and not t.is_sparse:
            users.setdefault(t.untyped_storage().data_ptr(), set()).add(id(t))
    return holders, {ptr: len(ids) for ptr, ids in users.items()}


def pad_rows(model: nn.Module) -> int:
    """Pad the rows of every CPU bfloat16 nn.Linear weight of `model` whose rows are a multiple
    of PADDED_MULTIPLE bytes and that no other module or tensor shares by PAD_BYTES, in place;
    returns how many."""
    if not enabled():
        return 0
    holders, users = _sharing(model)
    padded = 0
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, nn.Linear):
                continue
            w = module.weight
            if (
                w.device.type != "cpu"
                or w.dtype != torch.bfloat16
                or w.dim() != 2
                or w.shape[0] < 2
                or (w.shape[1] * w.element_size()) % PADDED_MULTIPLE != 0
                or not w.is_contiguous()
                or stays_in_place(w)
                or holders.get(id(w), 0) != 1
                or users.get(w.untyped_storage().data_ptr(), 0) != 1
            ):
                continue
            n, k = w.shape
            extra = PAD_BYTES // w.element_size()
            wide = torch.zeros(n, k + extra, dtype=w.dtype)
            wide[:, :k].copy_(w)
            w.set_(wide.untyped_storage(), 0, (n, k), (k + extra, 1))
            padded += 1
    if padded:
        logger.info("weights: %d bfloat16 matrices' rows padded by %d bytes", padded, PAD_BYTES)
    return padded
