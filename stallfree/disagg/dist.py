"""The torch.distributed transport: one two-rank process group per (prefill, decode) pair,
point-to-point `send`/`recv` over gloo (CPU) or NCCL (GPU).

Each pair meets through its own store (`disagg/pair_store.py`): the prefill side, rank 0, keeps
it in memory; the decode side, rank 1, reaches it through the authenticated bootstrap endpoint.
Every tensor travels as messages of at most `CHUNK_BYTES`, so the decode side's gloo receiver
(a child process, `disagg/kv_receiver.py`) needs only a few fixed slots. A peer that dies breaks
the group: the pending `recv` or `send` raises, and every room of the pair fails
(`TransportError`).
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from typing import Any

import torch
import torch.distributed as dist

from stallfree.disagg.kv_receiver import chunks
from stallfree.disagg.transport import TransportError

# a pair's group waits this long for a peer that stopped answering mid-message (the rooms'
# own deadlines are far shorter); forming the group waits only `pair_timeout_s`
GROUP_TIMEOUT_S = 3600.0
MAGIC_WARM_UP = 0x5354_5755  # "STWU"


class DistChannel:
    """One pair's process group, in this process. `send` on rank 0 (prefill), `recv` on rank 1
    (a decode server on NCCL; on gloo the decode side receives in a child process)."""

    def __init__(self, store: dist.Store, rank: int, backend: str, device: torch.device) -> None:
        self.rank, self.device, self.backend = rank, device, backend
        # NOTE: NCCL reads the store again when its first send or receive sets up the
        # communicator, so the store lives as long as the channel
        self.store = store
        timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
        self.group: Any
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(store, rank, 2, options)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, 2, timeout)
        self._lock = threading.Lock()
        self._closed = False
        if backend == "nccl":
            self._warm_up()

    def _warm_up(self) -> None:
        """One small message at pairing, so NCCL sets its communicator up now, within the pair's
        join deadline, rather than at the first room (an idle pair's peer would wait for it)."""
        if self.rank == 0:
            self.send(torch.tensor([MAGIC_WARM_UP], dtype=torch.int64))
        elif self.recv((1,), torch.int64).item() != MAGIC_WARM_UP:
            raise TransportError("the pair's first message is not the warm-up")

    def _peer(self) -> int:
        return 1 - self.rank

    def _group(self) -> Any:
        group = self.group
        if group is None:
            raise TransportError("the KV channel is closed")
        return group

    def send(self, tensor: torch.Tensor) -> None:
        if self.backend == "nccl":
            tensor = tensor.to(self.device)
        flat = tensor.contiguous().reshape(-1).view(torch.uint8)
        group = self._group()
        try:
            for off, n in chunks(flat.numel()):
                group.send([flat[off : off + n]], self._peer(), 0).wait()
        except RuntimeError as exc:
            raise TransportError(f"KV send failed: {exc}") from exc

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        device = self.device if self.backend == "nccl" else torch.device("cpu")
        buf = torch.empty(shape, dtype=dtype, device=device)
        flat = buf.reshape(-1).view(torch.uint8)
        group = self._group()
        try:
            for off, n in chunks(flat.numel()):
                group.recv([flat[off : off + n]], self._peer(), 0).wait()
        except RuntimeError as exc:
            raise TransportError(f"KV receive failed: {exc}") from exc
        return buf

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        group, self.group = self.group, None
        close_store = getattr(self.store, "close", None)
        if callable(close_store):
            close_store()
        abort = getattr(group, "abort", None)
        if callable(abort):
            with contextlib.suppress(RuntimeError):
                abort()
        del group  # its transport threads go with it, before the interpreter's teardown
