"""A prefill server that lies on its KV channel: `stallfree serve` with its sender patched, run
as a process of its own by `test_disagg_hostile.py`. What it sends depends on the room:

    room % 4 == 1  the header as agreed, then a first K tensor twice the size announced
    room % 4 == 2  a header that announces another dtype
    room % 4 == 3  a header that announces another head_dim
    room % 4 == 0  everything as agreed
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from stallfree.cli import main
from stallfree.disagg import prefill, transport
from stallfree.disagg.transport import KVChannel, RoomHeader

_room = {"id": 0}


def send_header(channel: KVChannel, h: RoomHeader) -> None:
    _room["id"] = h.room
    if h.room % 4 == 2:
        h.dtype = torch.float64 if h.dtype != torch.float64 else torch.float32
    elif h.room % 4 == 3:
        h.head_dim += 8
    transport.send_header(channel, h)


def send_layer(channel: KVChannel, per_rank: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    if _room["id"] % 4 == 1:
        k, v = per_rank[0]
        channel.send(torch.cat([k, k]))  # twice what the receiver posted for
        channel.send(v)
        return
    transport.send_layer(channel, per_rank)


prefill.send_header = send_header  # type: ignore[assignment]
prefill.send_layer = send_layer  # type: ignore[assignment]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
