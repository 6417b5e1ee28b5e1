"""How a batch's host code reads its slots and lengths: the CPU mirrors, or (legacy,
`cpu_mirrors=false`) the device tensors through `host_read`, which stalls until the stream
drains. `HostReads` is a part of each `ScheduleBatch`: it is handed the tensors to read, and
keeps what legacy mode last read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stallfree.runtime.execution.context import BatchContext

_I64 = torch.int64


@dataclass(slots=True, eq=False)
class HostReads:
    ctx: BatchContext
    # legacy mode: (device slots, their values as read through host_read or allocated on the
    # host); valid while the device tensor is the same object
    rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def known(self, req_pool_indices: torch.Tensor, req_pool_indices_cpu: torch.Tensor) -> None:
        """The device slots' values are known on the host (the host allocated them)."""
        self.rows = (req_pool_indices, req_pool_indices_cpu)

    def seq_lens(
        self,
        seq_lens_cpu: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        site: str,
    ) -> torch.Tensor:
        """Sequence lengths on the host: the mirror, or (legacy) a device read at `site`."""
        if self.ctx.cpu_mirrors:
            self.ctx.monitor.mirror_read("seq_lens_cpu")
            return seq_lens_cpu
        return self._read_device_rows(req_pool_indices, seq_lens, site)

    def req_pool_indices(
        self, req_pool_indices_cpu: torch.Tensor, req_pool_indices: torch.Tensor, site: str
    ) -> torch.Tensor:
        """Request slots on the host: the mirror, or (legacy) the device's values.

        Legacy reads the device at `site` unless the values were read (or allocated on the
        host, for an extend batch) since the device tensor last changed.
        """
        if self.ctx.cpu_mirrors:
            self.ctx.monitor.mirror_read("req_pool_indices_cpu")
            return req_pool_indices_cpu
        cached = self.rows
        if cached is not None and cached[0] is req_pool_indices:
            return cached[1]
        self.rows = (req_pool_indices, self.ctx.monitor.host_read(req_pool_indices, site))
        return self.rows[1]

    def _read_device_rows(
        self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, site: str
    ) -> torch.Tensor:
        """Legacy: one `host_read` of slots and lengths; returns the lengths, keeps the slots."""
        n = req_pool_indices.shape[0]
        both = self.ctx.stream.compute(
            lambda a, b: torch.stack([a, b]),
            req_pool_indices,
            seq_lens,
            shape=(2, n),
            dtype=_I64,
        )
        host = self.ctx.monitor.host_read(both, site)
        self.rows = (req_pool_indices, host[0])
        return host[1]
