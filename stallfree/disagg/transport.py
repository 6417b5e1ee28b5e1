"""How KV moves from a prefill server to a decode server: a `KVChannel` per pair of servers
(one direction, tensors in order), and the framing of one room's transfer on it.

A room's transfer is, in order: a header (the room id, the sizes, the page runs), then per layer
K and V for each destination rank (the runs' pages back to back, whole pages, only that rank's
KV heads), then a tail (the room id again, the first token, the prompt tokens the prefill found
cached). The header names the room, so the receiver can refuse KV for a room it does not expect
(and drain it, keeping the channel in step); nothing is ever sent token by token.

Backends: `LoopbackChannel` (two engines in one process), and torch.distributed point-to-point
(`disagg/dist.py`: gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

MAGIC_HEADER = 0x5354_4B56  # "STKV"
MAGIC_TAIL = 0x5354_454E  # "STEN"
HEADER_LEN = 12
TAIL_LEN = 4

DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class TransportError(RuntimeError):
    """The channel broke (the peer died or the connection failed): every room on it fails."""


class KVChannel(Protocol):
    """One direction of a pair of servers: `send` on the prefill side, `recv` on the decode
    side, tensors in the order they were sent. Both block; each side calls from one thread."""

    def send(self, tensor: torch.Tensor) -> None: ...

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...

    def close(self) -> None: ...


class LoopbackChannel:
    """Both ends in one process: a queue of copies (the sender may reuse its buffers)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[torch.Tensor | None] = queue.SimpleQueue()
        self._closed = threading.Event()

    def send(self, tensor: torch.Tensor) -> None:
        if self._closed.is_set():
            raise TransportError("loopback channel is closed")
        self._queue.put(tensor.detach().to("cpu", copy=True))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = self._queue.get()
        if t is None:
            raise TransportError("loopback channel is closed")
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise TransportError(f"expected {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
        return t

    def close(self) -> None:
        self._closed.set()
        self._queue.put(None)


# ---------------------------------------------------------------------- page runs


def contiguous_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Pair source and destination pages into runs contiguous on both sides:
    (first source page, first destination page, pages)."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            first_s, first_d, n = runs[-1]
            runs[-1] = (first_s, first_d, n + 1)
        else:
            runs.append((s, d, 1))
    return runs


# ---------------------------------------------------------------------- one room's framing


@dataclass(slots=True)
class RoomHeader:
    room: int
    num_tokens: int  # prompt tokens
    num_layers: int
    head_dim: int
    dtype: torch.dtype
    page_size: int
    dst_runs: list[tuple[int, int]]  # (first destination page, pages)
    shard_heads: list[int]  # KV heads of each destination rank

    @property
    def slots(self) -> int:
        return sum(n for _, n in self.dst_runs) * self.page_size

    def layer_bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.slots * sum(self.shard_heads) * self.head_dim * elem


@dataclass(slots=True)
class RoomTail:
    room: int
    first_token: int
    cached_tokens: int


def send_header(channel: KVChannel, h: RoomHeader) -> None:
    head = torch.tensor(
        [
            MAGIC_HEADER,
            h.room,
            h.num_tokens,
            h.num_layers,
            h.head_dim,
            DTYPES.index(h.dtype),
            h.page_size,
            len(h.dst_runs),
            len(h.shard_heads),
            0,
            0,
            0,
        ],
        dtype=torch.int64,
    )
    channel.send(head)
    channel.send(torch.tensor(h.dst_runs, dtype=torch.int64).reshape(-1, 2))
    channel.send(torch.tensor(h.shard_heads, dtype=torch.int64))


def recv_header(channel: KVChannel) -> RoomHeader:
    head = channel.recv((HEADER_LEN,), torch.int64).tolist()
    if head[0] != MAGIC_HEADER or not 0 <= head[5] < len(DTYPES):
        raise TransportError("malformed transfer header: the channel is out of step")
    runs = channel.recv((head[7], 2), torch.int64).tolist()
    shard_heads = channel.recv((head[8],), torch.int64).tolist()
    return RoomHeader(
        room=head[1],
        num_tokens=head[2],
        num_layers=head[3],
        head_dim=head[4],
        dtype=DTYPES[head[5]],
        page_size=head[6],
        dst_runs=[(a, b) for a, b in runs],
        shard_heads=shard_heads,
    )


def send_layer(channel: KVChannel, per_rank: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for k, v in per_rank:
        channel.send(k)
        channel.send(v)


def recv_layer(channel: KVChannel, h: RoomHeader) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    ks, vs = [], []
    for heads in h.shard_heads:
        shape = (h.slots, heads, h.head_dim)
        ks.append(channel.recv(shape, h.dtype))
        vs.append(channel.recv(shape, h.dtype))
    return ks, vs


def send_tail(channel: KVChannel, t: RoomTail) -> None:
    channel.send(torch.tensor([MAGIC_TAIL, t.room, t.first_token, t.cached_tokens]))


def recv_tail(channel: KVChannel) -> RoomTail:
    tail = channel.recv((TAIL_LEN,), torch.int64).tolist()
    if tail[0] != MAGIC_TAIL:
        raise TransportError("malformed transfer tail: the channel is out of step")
    return RoomTail(room=tail[1], first_token=tail[2], cached_tokens=tail[3])
