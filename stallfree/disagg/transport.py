"""How KV moves from a prefill server to a decode server: a `KVChannel` per pair of servers
(one direction, tensors in order), and the framing of one room's transfer on it.

A room's transfer is, in order: a header (the room id, the sizes, the page runs), then per layer
K and V for each destination rank (the runs' pages back to back, whole pages, only that rank's
KV heads), then a tail (the room id again, the first token, the prompt tokens the prefill found
cached). The header names the room, so the receiver can refuse KV for a room it does not expect
(and drain it, keeping the channel in step); nothing is ever sent token by token.

Every receive is posted with a size the receiver chose: the header's first message has a fixed
size, and each size the header then announces is checked against the receiver's own
`KVLayout` (the handshake's layers, head dim, dtype, page size and KV-head shards, and at most
its pool's pages) before anything of that size is received. A header that disagrees breaks the
pair (`TransportError`): its rooms fail, the server goes on.

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

# the KV cache's stored dtypes (new ones only ever appended: the header sends the index)
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
# float8 crosses the wire as its bytes: not every backend (gloo) sends float8 tensors
_WIRE = {torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


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
    head_dim: int  # elements per stored row: an int8 row's codes and its scale's 4 bytes
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


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What the receiver takes: its own KV cache's facts, fixed at the handshake."""

    num_layers: int
    head_dim: int
    dtype: torch.dtype
    page_size: int
    shard_heads: list[int]  # KV heads of each of its ranks
    num_pages: int  # usable pages, numbered 1..num_pages

    def check(self, head: list[int]) -> str | None:
        """What in a header's first message disagrees with this layout (None: nothing)."""
        dtype = DTYPES[head[5]] if 0 <= head[5] < len(DTYPES) else None
        for label, theirs, mine in (
            ("layers", head[3], self.num_layers),
            ("head dim", head[4], self.head_dim),
            ("dtype", dtype, self.dtype),
            ("page size", head[6], self.page_size),
            ("KV-head shards", head[8], len(self.shard_heads)),
        ):
            if theirs != mine:
                return f"{label} {theirs}, not {mine}"
        if not 1 <= head[7] <= self.num_pages:
            return f"{head[7]} page runs (this server holds {self.num_pages} pages)"
        if head[2] < 1:
            return f"{head[2]} prompt tokens"
        return None

    def check_runs(self, runs: list[tuple[int, int]]) -> str | None:
        if any(n < 1 or first < 1 or first + n - 1 > self.num_pages for first, n in runs):
            return f"page runs outside pages 1..{self.num_pages}"
        if sum(n for _, n in runs) > self.num_pages:
            return f"more pages than this server's {self.num_pages}"
        return None


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


def recv_header(channel: KVChannel, layout: KVLayout) -> RoomHeader:
    """A room's header, each size it announces checked against `layout` before anything of
    that size is received (`TransportError` names the first that disagrees)."""
    head = channel.recv((HEADER_LEN,), torch.int64).tolist()
    if head[0] != MAGIC_HEADER:
        raise TransportError("malformed transfer header: the channel is out of step")
    problem = layout.check(head)
    if problem is not None:
        raise TransportError(f"transfer header disagrees with this server's KV: {problem}")
    runs = [(a, b) for a, b in channel.recv((head[7], 2), torch.int64).tolist()]
    problem = layout.check_runs(runs)
    if problem is not None:
        raise TransportError(f"transfer header disagrees with this server's KV: {problem}")
    shard_heads = channel.recv((head[8],), torch.int64).tolist()
    if shard_heads != layout.shard_heads:
        raise TransportError(
            f"transfer header disagrees with this server's KV: KV-head shards {shard_heads}, "
            f"not {layout.shard_heads}"
        )
    return RoomHeader(
        room=head[1],
        num_tokens=head[2],
        num_layers=head[3],
        head_dim=head[4],
        dtype=DTYPES[head[5]],
        page_size=head[6],
        dst_runs=runs,
        shard_heads=shard_heads,
    )


def send_layer(channel: KVChannel, per_rank: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for k, v in per_rank:
        wire = _WIRE.get(k.dtype)
        channel.send(k if wire is None else k.view(wire))
        channel.send(v if wire is None else v.view(wire))


def recv_layer(channel: KVChannel, h: RoomHeader) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    ks, vs = [], []
    wire = _WIRE.get(h.dtype, h.dtype)
    for heads in h.shard_heads:
        shape = (h.slots, heads, h.head_dim)
        ks.append(channel.recv(shape, wire).view(h.dtype))
        vs.append(channel.recv(shape, wire).view(h.dtype))
    return ks, vs


def send_tail(channel: KVChannel, t: RoomTail) -> None:
    channel.send(torch.tensor([MAGIC_TAIL, t.room, t.first_token, t.cached_tokens]))


def recv_tail(channel: KVChannel) -> RoomTail:
    tail = channel.recv((TAIL_LEN,), torch.int64).tolist()
    if tail[0] != MAGIC_TAIL:
        raise TransportError("malformed transfer tail: the channel is out of step")
    return RoomTail(room=tail[1], first_token=tail[2], cached_tokens=tail[3])
