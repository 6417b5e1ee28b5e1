"""Where HiSparse keeps KV: a host pool by logical slot, and per-request device buffers.

Logical slots are what `req_to_token` holds (handed out by `TokenToKVPoolAllocator`). The host
pool is addressed by logical slot directly (identity mapping), so it has one row per slot.
Device buffers are addressed by physical slot `row * (buffer_size + 1) + j`: `j < buffer_size`
is a buffer slot, `j == buffer_size` the reserved slot for the newest token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class HostKVPool:
    """Full KV of every token for the sparse layers; pinned when the device is CUDA."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        row_width: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        pin = device.type == "cuda"
        dims = (num_slots, num_kv_heads, row_width)  # stored rows, as the KV cache's
        self.k = [torch.zeros(dims, dtype=dtype, pin_memory=pin) for _ in range(num_layers)]
        self.v = [torch.zeros(dims, dtype=dtype, pin_memory=pin) for _ in range(num_layers)]
        self.num_slots = num_slots


class DeviceBuffers:
    """Per sparse layer: buffer KV, indexer keys, the position<->slot maps and LRU stamps."""

    def __init__(
        self,
        num_layers: int,
        num_rows: int,
        buffer_size: int,
        max_context: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        row_width: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.buffer_size = buffer_size
        self.stride = buffer_size + 1
        phys = (num_rows * self.stride, num_kv_heads, row_width)  # stored rows

        def per_layer(make: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
            return [make() for _ in range(num_layers)]

        self.k = per_layer(lambda: torch.zeros(phys, dtype=dtype, device=device))
        self.v = per_layer(lambda: torch.zeros(phys, dtype=dtype, device=device))
        self.index_keys = per_layer(
            lambda: torch.zeros((num_slots, head_dim), dtype=torch.float32, device=device)
        )
        # pos_to_buf[row, pos]: buffer slot holding that position, -1 when not resident
        self.pos_to_buf = per_layer(
            lambda: torch.full((num_rows, max_context), -1, dtype=torch.int64, device=device)
        )
        # buf_pos[row, j]: position held by buffer slot j, -1 when empty
        self.buf_pos = per_layer(
            lambda: torch.full((num_rows, buffer_size), -1, dtype=torch.int64, device=device)
        )
        # last_use[row, j]: decode step that last selected slot j (LRU order, per layer)
        self.last_use = per_layer(
            lambda: torch.zeros((num_rows, buffer_size), dtype=torch.int64, device=device)
        )

    def phys(self, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return rows * self.stride + slots

    def reserved(self, rows: torch.Tensor) -> torch.Tensor:
        return rows * self.stride + self.buffer_size

    def nbytes(self) -> int:
        tensors = self.k + self.v + self.index_keys + self.pos_to_buf + self.buf_pos + self.last_use
        return sum(t.numel() * t.element_size() for t in tensors)
