"""The seam sparse-attention plug-ins (HiSparse) implement: the hooks the batch ops call.

The core never imports a plug-in. `ScheduleBatch` calls these hooks with host facts it already
holds, so a plug-in makes its decisions on the host, exactly as the core does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from stallfree.runtime.model.forward_batch import ForwardMode
    from stallfree.runtime.request.req import Req
    from stallfree.runtime.telemetry.stats import SparseStats


class SparseAttention(Protocol):
    """Hooks a sparse-attention plug-in gives the batch lifecycle (see `ScheduleBatch`)."""

    def map_last_loc_to_buffer(
        self,
        seq_lens: torch.Tensor,
        out_cache_loc: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens_cpu: torch.Tensor | None,
        req_pool_indices_cpu: torch.Tensor | None,
    ) -> None:
        """A decode batch was prepared. `None` mirrors mean legacy mode: read the device
        tensors through `host_read`."""

    def plan_step(
        self,
        mode: ForwardMode,
        reqs: Sequence[Req],
        prefix_lens_cpu: Sequence[int],
        extend_lens_cpu: Sequence[int],
        output_rows: Sequence[bool],
    ) -> object:
        """The plan the launched batch carries to the plug-in's attention backend
        (`ForwardBatch.sparse_plan`); the core never looks inside it."""

    def request_retracted(self, req: Req) -> None: ...

    def request_finished(self, req: Req) -> None: ...

    def stats(self, sync: bool = False) -> SparseStats:
        """Without `sync` nothing waits (device-side counts may lag a step)."""
