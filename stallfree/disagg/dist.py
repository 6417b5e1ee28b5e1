"""The torch.distributed transport: one two-rank process group per (prefill, decode) pair,
point-to-point `send`/`recv` over gloo (CPU) or NCCL (GPU).

The prefill server hosts a `TCPStore` (the rendezvous). Pairing gives each pair its own key
prefix in it; the prefill side is rank 0, the decode side rank 1. A peer that dies breaks the
group: the pending `recv` or `send` raises, and every room of the pair fails (`TransportError`).
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from typing import Any

import torch
import torch.distributed as dist

from stallfree.disagg.transport import TransportError

# a pair's group waits this long for a peer that stopped answering mid-message (the rooms'
# own deadlines are far shorter; an idle pair never waits on the group)
GROUP_TIMEOUT_S = 3600.0


class KVStore:
    """The prefill side's rendezvous store, on an ephemeral port of its bootstrap host."""

    def __init__(self, host: str, timeout_s: float = 60.0) -> None:
        self.host = host
        self.store = dist.TCPStore(
            host,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self._port = int(self.store.port)

    @property
    def port(self) -> int:
        return self._port

    def close(self) -> None:
        """Drop the store (its server thread goes with the last reference)."""
        self.store = None  # type: ignore[assignment]


class DistChannel:
    """One pair's process group. `send` only on rank 0 (prefill), `recv` only on rank 1."""

    def __init__(
        self,
        store: dist.Store,
        pair_id: str,
        rank: int,
        backend: str,
        device: torch.device,
    ) -> None:
        self.rank, self.device, self.backend = rank, device, backend
        prefixed = dist.PrefixStore(f"stallfree-kv/{pair_id}/", store)
        timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
        self.group: Any
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(prefixed, rank, 2, options)
        else:
            self.group = dist.ProcessGroupGloo(prefixed, rank, 2, timeout)
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def connect(
        cls, host: str, port: int, pair_id: str, backend: str, device: torch.device
    ) -> DistChannel:
        """The decode side: join the prefill's store and the pair's group as rank 1."""
        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60))
        return cls(store, pair_id, 1, backend, device)

    def _peer(self) -> int:
        return 1 - self.rank

    def send(self, tensor: torch.Tensor) -> None:
        if self.backend == "nccl":
            tensor = tensor.to(self.device)
        t = tensor.contiguous()
        group = self.group
        if group is None:
            raise TransportError("the KV channel is closed")
        try:
            group.send([t], self._peer(), 0).wait()
        except RuntimeError as exc:
            raise TransportError(f"KV send failed: {exc}") from exc

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        device = self.device if self.backend == "nccl" else torch.device("cpu")
        buf = torch.empty(shape, dtype=dtype, device=device)
        group = self.group
        if group is None:
            raise TransportError("the KV channel is closed")
        try:
            group.recv([buf], self._peer(), 0).wait()
        except RuntimeError as exc:
            raise TransportError(f"KV receive failed: {exc}") from exc
        return buf

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        group, self.group = self.group, None
        abort = getattr(group, "abort", None)
        if callable(abort):
            with contextlib.suppress(RuntimeError):
                abort()
        del group  # its transport threads go with it, before the interpreter's teardown
