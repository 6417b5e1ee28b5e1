"""`KVTransfer`: the copies of HiSparse KV between the host pool and the device buffers.

Every method runs on the stream (enqueued by the coordinator's schedule path, or called by the
attention backend inside the forward), so it may index with device tensors freely.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from stallfree.hisparse.indexer import index_keys

if TYPE_CHECKING:
    from stallfree.hisparse.memory import DeviceBuffers, HostKVPool
    from stallfree.runtime.memory.kv_format import KVFormat
    from stallfree.runtime.memory.pool import ReqToTokenPool


class KVTransfer:
    """Host pool <-> device buffers, by sparse layer index `li` (not the model's layer id)."""

    def __init__(
        self,
        host: HostKVPool,
        buffers: DeviceBuffers,
        req_to_token_pool: ReqToTokenPool,
        kv_format: KVFormat,
    ) -> None:
        self.host = host
        self.buffers = buffers
        self.req_to_token_pool = req_to_token_pool
        self.kv_format = kv_format

    def backup(
        self,
        rows: torch.Tensor,
        pos: torch.Tensor,
        grow: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        step: int,
    ) -> None:
        """Reserved slot -> host slot of position `pos` of request slots `rows`, every sparse
        layer; `grow` (rows, positions, buffer slots) also keeps those tokens in the buffer."""
        buf, host = self.buffers, self.host
        locs = self.req_to_token_pool.req_to_token[rows, pos]
        src = buf.reserved(rows)
        for li in range(len(host.k)):
            # NOTE: on CUDA a D2H scatter indexed by device `locs` needs a UVA kernel to stay async.
            host.k[li][locs] = buf.k[li][src].to(host.k[li].device)
            host.v[li][locs] = buf.v[li][src].to(host.v[li].device)
            if grow is not None:
                self._grow(li, *grow, step)

    def _grow(
        self, li: int, rows: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, step: int
    ) -> None:
        buf = self.buffers
        dst, src = buf.phys(rows, slots), buf.reserved(rows)
        buf.k[li][dst] = buf.k[li][src]
        buf.v[li][dst] = buf.v[li][src]
        buf.pos_to_buf[li][rows, pos] = slots
        buf.buf_pos[li][rows, slots] = pos
        buf.last_use[li][rows, slots] = step

    def write_extend(self, li: int, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """A prefill chunk's KV goes to the host pool; its indexer keys stay on the device."""
        k_cpu, v_cpu = self.host.k[li], self.host.v[li]
        locs_cpu = locs.to(k_cpu.device)
        fmt = self.kv_format
        k_cpu[locs_cpu] = fmt.encode(k).to(k_cpu.device)
        v_cpu[locs_cpu] = fmt.encode(v).to(v_cpu.device)
        self.buffers.index_keys[li][locs] = index_keys(k, fmt)

    def host_rows(self, li: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored K and V rows of logical `slots` from the host pool, on the device."""
        device = self.buffers.k[li].device
        slots_cpu = slots.to(self.host.k[li].device)
        return self.host.k[li][slots_cpu].to(device), self.host.v[li][slots_cpu].to(device)

    def host_kv(self, li: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """KV of logical `slots` from the host pool, on the device, as float rows (chunked
        prefill's prefix)."""
        k, v = self.host_rows(li, slots)
        if not self.kv_format.quantized:
            return k, v
        return self.kv_format.decode(k), self.kv_format.decode(v)

    def load(self, li: int, rows: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor) -> None:
        """Host -> buffer copy of positions `pos` of request slots `rows` into buffer `slots`."""
        locs = self.req_to_token_pool.req_to_token[rows, pos]
        k, v = self.host_rows(li, locs)
        dst = self.buffers.phys(rows, slots)
        self.buffers.k[li][dst] = k
        self.buffers.v[li][dst] = v
