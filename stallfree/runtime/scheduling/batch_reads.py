"""How a batch's host code reads its slots and lengths: the CPU mirrors, or (legacy,
`cpu_mirrors=false`) the device tensors through `host_read`, which stalls until the stream
drains. A mix-in of `ScheduleBatch`, which owns the fields."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from stallfree.runtime.execution.context import BatchContext
    from stallfree.runtime.request.req import Req

_I64 = torch.int64


class HostReads:
    # the fields it reads (`ScheduleBatch` declares them)
    ctx: BatchContext
    reqs: list[Req]
    req_pool_indices: torch.Tensor
    req_pool_indices_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    _legacy_rows: tuple[torch.Tensor, torch.Tensor] | None

    def host_seq_lens(self, site: str) -> torch.Tensor:
        """Sequence lengths on the host: the mirror, or (legacy) a device read at `site`."""
        if self.ctx.cpu_mirrors:
            self.ctx.monitor.mirror_read("seq_lens_cpu")
            return self.seq_lens_cpu
        return self._read_device_rows(site)

    def host_req_pool_indices(self, site: str) -> torch.Tensor:
        """Request slots on the host: the mirror, or (legacy) the device's values.

        Legacy reads the device at `site` unless the values were read (or allocated on the
        host, for an extend batch) since the device tensor last changed.
        """
        if self.ctx.cpu_mirrors:
            self.ctx.monitor.mirror_read("req_pool_indices_cpu")
            return self.req_pool_indices_cpu
        cached = self._legacy_rows
        if cached is not None and cached[0] is self.req_pool_indices:
            return cached[1]
        self._legacy_rows = (
            self.req_pool_indices,
            self.ctx.monitor.host_read(self.req_pool_indices, site),
        )
        return self._legacy_rows[1]

    def _read_device_rows(self, site: str) -> torch.Tensor:
        """Legacy: one `host_read` of slots and lengths; returns the lengths, keeps the slots."""
        n = len(self.reqs)
        both = self.ctx.stream.compute(
            lambda a, b: torch.stack([a, b]),
            self.req_pool_indices,
            self.seq_lens,
            shape=(2, n),
            dtype=_I64,
        )
        host = self.ctx.monitor.host_read(both, site)
        self._legacy_rows = (self.req_pool_indices, host[0])
        return host[1]
