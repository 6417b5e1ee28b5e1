"""Memory pools. Free lists are host-owned; `req_to_token` rows and KV live on the device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from stallfree.runtime.memory.kv_format import KVFormat, kv_format
from stallfree.runtime.memory.lazy_zeros import zeros


class ReqToTokenPool:
    """Request slots. Row `i` of `req_to_token` holds the KV slot of each token of request `i`."""

    def __init__(self, size: int, max_context_len: int, device: torch.device) -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = zeros((size, max_context_len), torch.int64, device)
        self._free: list[int] = list(range(size - 1, -1, -1))
        self._free_set: set[int] = set(self._free)

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        taken = [self._free.pop() for _ in range(n)]
        self._free_set.difference_update(taken)
        return taken

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.size or slot in self._free_set:
            raise RuntimeError(f"double free of request slot {slot}")
        self._free.append(slot)
        self._free_set.add(slot)


class PageEvictor(Protocol):
    """Holds pages it can give back on demand (the prefix cache)."""

    def evictable_pages(self) -> int: ...

    def evict(self, num_pages: int) -> int: ...


class TokenToKVPoolAllocator:
    """KV slot allocator in pages of `page_size` tokens. Page 0 is reserved as padding.

    With an `evictor` (the prefix cache), pages it holds unlocked count as available: an
    allocation that finds too few free pages has it evict the difference first.
    """

    def __init__(self, num_slots: int, page_size: int) -> None:
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.size = self.num_pages * page_size  # usable slots
        # page 0 (slots 0..page_size-1) is never handed out, so padded writes are harmless.
        self._free_pages: list[int] = list(range(self.num_pages, 0, -1))
        self._free_set: set[int] = set(self._free_pages)
        self.evictor: PageEvictor | None = None

    def free_page_count(self) -> int:
        """Pages in the free list, not counting what the evictor could give back."""
        return len(self._free_pages)

    def available_pages(self) -> int:
        """Pages an allocation can get now: free ones plus those the evictor can give back."""
        if self.evictor is None:
            return len(self._free_pages)
        return len(self._free_pages) + self.evictor.evictable_pages()

    def available_size(self) -> int:
        return self.available_pages() * self.page_size

    def alloc_pages(self, n: int) -> list[int] | None:
        short = n - len(self._free_pages)
        if short > 0:
            if self.evictor is None or short > self.evictor.evictable_pages():
                return None
            self.evictor.evict(short)
            if n > len(self._free_pages):
                return None
        taken = [self._free_pages.pop() for _ in range(n)]
        self._free_set.difference_update(taken)
        return taken

    def free_pages(self, pages: list[int]) -> None:
        for p in pages:
            if p in self._free_set or not 1 <= p <= self.num_pages:
                raise RuntimeError(f"double free of KV page {p}")
        self._free_pages.extend(pages)
        self._free_set.update(pages)

    def usage(self) -> float:
        return 1.0 - len(self._free_pages) / self.num_pages


@dataclass(slots=True)
class KVCacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int


class KVCache:
    """Per-layer K and V buffers of stored rows, `[num_slots, num_kv_heads, row_width]` on the
    device, in `format` (kv_format.py): the weights' dtype (`auto`, `row_width == head_dim`) or
    quantized. `dtype` is the stored rows' dtype; `read` gives float rows back."""

    def __init__(
        self,
        shape: KVCacheShape,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.shape = shape
        self.num_slots = num_slots
        self.format = kv_format(kv_cache_dtype, dtype)
        self.dtype = self.format.storage
        self.device = device
        self.row_width = self.format.row_width(shape.head_dim)
        dims = (num_slots, shape.num_kv_heads, self.row_width)
        # pages are committed as tokens are written: the pool costs what the contexts use
        self.k_buffers = [zeros(dims, self.dtype, device) for _ in range(shape.num_layers)]
        self.v_buffers = [zeros(dims, self.dtype, device) for _ in range(shape.num_layers)]

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffers[layer][loc] = self.format.encode(k)
        self.v_buffers[layer][loc] = self.format.encode(v)

    def bytes_per_token(self) -> int:
        """K and V of one token in every layer, scales included."""
        return bytes_per_token(self.format, self.shape)


def bytes_per_token(fmt: KVFormat, shape: KVCacheShape) -> int:
    """What one token's K and V take in a pool of `shape` stored in `fmt`."""
    return 2 * shape.num_layers * shape.num_kv_heads * fmt.row_bytes(shape.head_dim)
