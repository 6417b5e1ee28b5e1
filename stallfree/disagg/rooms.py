"""One state machine per room, on each side, with deadlines.

A room is one request's transfer, named by the id the router picked (a random 63-bit number),
so a transfer can never land in the wrong request.

    prefill: BOOTSTRAPPING -> TRANSFERRING -> WAITING_ACK -> DONE
    decode:  BOOTSTRAPPING -> PREALLOC -> TRANSFERRING -> DONE
    either may go to FAILED from any state but DONE; DONE and FAILED are final.

Every state but the final ones has a deadline (`bootstrap_timeout_s` while pairing up and
reserving, `transfer_timeout_s` once paired); `RoomTable.expire` fails the rooms past theirs.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

MAX_ROOM = (1 << 63) - 1


class RoomState(enum.Enum):
    BOOTSTRAPPING = "bootstrap"
    PREALLOC = "prealloc"
    TRANSFERRING = "transfer"
    WAITING_ACK = "wait_ack"
    DONE = "done"
    FAILED = "failed"


FINAL = (RoomState.DONE, RoomState.FAILED)

_NEXT: dict[RoomState, tuple[RoomState, ...]] = {
    RoomState.BOOTSTRAPPING: (RoomState.PREALLOC, RoomState.TRANSFERRING),
    RoomState.PREALLOC: (RoomState.TRANSFERRING,),
    RoomState.TRANSFERRING: (RoomState.WAITING_ACK, RoomState.DONE),
    RoomState.WAITING_ACK: (RoomState.DONE,),
}


class RoomError(RuntimeError):
    """A room failed; `stage` is where (bootstrap, prealloc, transfer, wait_ack)."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage


class RequestStalledError(RuntimeError):
    """A disaggregated request made no progress for `disaggregation.stall_timeout_s`."""

    def __init__(self, role: str, seconds: float) -> None:
        super().__init__(
            f"the {role} request made no progress for {seconds:g} s "
            "(disaggregation.stall_timeout_s)"
        )


def check_room(room: object) -> int:
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room <= MAX_ROOM:
        raise ValueError(f"bootstrap_room must be an integer in [0, 2**63), not {room!r}")
    return room


@dataclass(eq=False)
class Room:
    room: int
    state: RoomState
    deadline: float
    # what the side keeps about it (its export or import, the peer, the destination pages)
    data: dict[str, Any] = field(default_factory=dict)
    error: RoomError | None = None
    created: float = field(default_factory=time.monotonic)
    on_final: list[Callable[[Room], None]] = field(default_factory=list)

    @property
    def final(self) -> bool:
        return self.state in FINAL

    def advance(self, state: RoomState, deadline: float | None = None) -> None:
        if state not in _NEXT.get(self.state, ()):
            raise RuntimeError(f"room {self.room}: {self.state.value} -> {state.value}")
        self.state = state
        if deadline is not None:
            self.deadline = deadline
        if state is RoomState.DONE:
            self._finish()

    def fail(self, message: str, stage: str | None = None) -> bool:
        """Fail it (False if it is final already)."""
        if self.final:
            return False
        self.error = RoomError(stage or self.state.value, message)
        self.state = RoomState.FAILED
        self._finish()
        return True

    def _finish(self) -> None:
        hooks, self.on_final = self.on_final, []
        for hook in hooks:
            hook(self)


class RoomTable:
    """A side's rooms by id. Final rooms leave the table."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._rooms: dict[int, Room] = {}

    def __len__(self) -> int:
        return len(self._rooms)

    def __iter__(self) -> Iterator[Room]:
        return iter(list(self._rooms.values()))

    def get(self, room: int) -> Room | None:
        return self._rooms.get(room)

    def open(self, room: int, state: RoomState, timeout_s: float) -> Room:
        if room in self._rooms:
            raise KeyError(f"room {room} is already open")
        r = Room(room, state, self.clock() + timeout_s)
        r.on_final.append(self._close)
        self._rooms[room] = r
        return r

    def _close(self, room: Room) -> None:
        if self._rooms.get(room.room) is room:
            del self._rooms[room.room]

    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in RoomState if s not in FINAL}
        for r in self._rooms.values():
            out[r.state.value] += 1
        return out

    def expire(self) -> list[Room]:
        """Fail every room past its deadline; returns them."""
        now = self.clock()
        late = [r for r in self._rooms.values() if r.deadline <= now]
        for r in late:
            r.fail(f"{r.state.value} deadline passed")
        return late
