"""The future map (token relay): sampled ids handed from batch N to N+1 on the stream.

It is indexed by request slot. Batch N stashes the ids of the requests that produced a real
token; batch N+1 resolves a decode request's input id from its slot, all in stream order, so
no token makes a host round trip before it is fed back.
"""

from __future__ import annotations

import torch


class FutureMap:
    def __init__(self, num_req_slots: int, device: torch.device) -> None:
        self.tokens = torch.zeros(num_req_slots, dtype=torch.int64, device=device)

    def resolve(self, req_pool_indices: torch.Tensor) -> torch.Tensor:
        """Runs on the stream: the pending input id of each request slot."""
        return self.tokens[req_pool_indices]

    def stash(self, slots: torch.Tensor, rows: torch.Tensor, next_ids: torch.Tensor) -> None:
        """Runs on the stream: `tokens[slots] = next_ids[rows]`.

        Only rows that produced a real token are stashed; an intermediate prefill chunk is not,
        so it cannot overwrite a pending first decode token.
        """
        if slots.numel():
            self.tokens[slots] = next_ids[rows]
