"""`--compact-decode-weights only`: each dense bfloat16 linear kept in its compact form alone
(csrc/compact_bf16.cpp: 12 bits a value, losslessly), the dense weight given back.

A decode step at one stream reads every weight once, so its time is the weights' bytes; the
compact form is 0.75 of them, and kept alone it is also 0.75 of the memory rather than the
1.75x of a second copy (`beside`). Decode steps multiply the form as `beside` does
(`NativeLinear.compact_rows`; on the AVX2 variant every row count its dense kernel takes),
and prompts past that decode it a block of rows at a time into a buffer the dense products
read (`native_layers.decompacted_product`), so the outputs stay the dense weight's bits.

The rows that do not fit the form (more than 16 distinct high bytes: a few in trained weights,
2.1% of a random Gaussian 1B Llama's) are still read dense. They stay in a tensor of the
weight's shape whose other rows are never written: an anonymous mapping advised against huge
pages, so only the pages those rows touch take memory, and the kernels read them where they
read a dense weight's rows (`sparse_rows`). That tensor stays out of the huge pages' arena
(`huge_pages.stay_in_place`), which would copy it whole.

The output matrix keeps its dense weight (a tied one is the embedding too; `lm_head_weight`
reads it) with the compact form beside it. Nothing that reads a dense weight may run on such a
model: tensor parallelism's partial products and LoRA's base products are refused by the
settings, the native loops leave such a layer to its own `forward` past `linear_compact`'s rows,
and it takes neither the AMX tiles' prompt products nor a prepacked copy.
"""

from __future__ import annotations

import logging
import mmap

import torch
from torch import nn

from stallfree.runtime.memory.heap import release_free_heap
from stallfree.runtime.memory.huge_pages import stay_in_place
from stallfree.runtime.model.native_layers import NativeLinear, compact_applies

logger = logging.getLogger(__name__)

# a compact table's code 0 where the row does not fit (compact_bf16.cpp's kUnfit)
UNFIT = 0xFF
# dense bytes given back between returns of the C heap's free pages to the system
_TRIM_BYTES = 128 << 20


def sparse_rows(weight: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """A contiguous [n, k] copy of bfloat16 `weight` holding only the rows `tables` marks as not
    fitting the compact form; the other rows are the mapping's untouched zero pages."""
    n, k = weight.shape
    size = max(n * k * weight.element_size(), 1)
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    out = torch.frombuffer(buf, dtype=weight.dtype, count=n * k).view(n, k)
    unfit = (tables[:, 0] == UNFIT).nonzero().flatten()
    if unfit.numel():
        out[unfit] = weight.detach()[unfit]
    return out


def keep_compact_only(model: nn.Module) -> int:
    """Every bfloat16 `NativeLinear` of `model` that has a compact form (`compact_applies`)
    switched to that form alone, one layer at a time, in place: its codes and tables built, its
    weight replaced by `sparse_rows` and the dense storage given back before the next layer
    (the load's peak is the dense weights and one layer's form, not both in full), any
    prepacked copy dropped. The output matrix (`lm_head`) gets its form beside its dense
    weight, as `beside` keeps it. Returns the dense bytes given back."""
    dropped = kept = freed = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, NativeLinear) or not compact_applies(module.weight):
                continue
            codes, tables = torch.ops.stallfree.compact_bf16(module.weight.detach())
            module.compact_codes, module.compact_tables = codes, tables
            if name.rsplit(".", 1)[-1] == "lm_head":
                continue
            weight = module.weight
            sparse = nn.Parameter(sparse_rows(weight, tables), requires_grad=False)
            stay_in_place(sparse)
            module.weight = sparse
            module.weight_prepacked = None
            module.compact_only = True
            size = weight.numel() * weight.element_size()
            dropped += size
            freed += size
            kept += int((tables[:, 0] == UNFIT).sum()) * weight.shape[1] * weight.element_size()
            del weight
            if freed >= _TRIM_BYTES:
                release_free_heap()  # the C heap keeps blocks under its mmap threshold
                freed = 0
    if dropped:
        logger.info(
            "weights: %.0f MB of dense bfloat16 kept only in the compact form (%.1f MB of rows "
            "that do not fit it kept dense)",
            dropped / 2**20,
            kept / 2**20,
        )
    return dropped
