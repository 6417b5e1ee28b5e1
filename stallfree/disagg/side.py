"""What the prefill and the decode side share: the engine's fingerprint, a room table whose
deadlines a ticker checks, the figures, and posting a thread's results to the loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from stallfree.disagg.fingerprint import Fingerprint, fingerprint_of
from stallfree.disagg.rooms import RoomTable
from stallfree.disagg.stats import DisaggStats
from stallfree.runtime.engine import Engine

TICK_S = 0.05  # how often deadlines are checked


class RoomSide:
    def __init__(self, engine: Engine, role: str) -> None:
        self.engine = engine
        self.rooms = RoomTable()
        self.stats = DisaggStats(role)
        self._fingerprint: Fingerprint | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ticker: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._fingerprint = fingerprint_of(self.engine.core)
        self._ticker = asyncio.create_task(self._tick())

    async def _stop(self, why: str) -> None:
        """Stop the ticker and fail every open room."""
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        for room in self.rooms:
            room.fail(why)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            for room in self.rooms.expire():
                self.stats.failed(room.error.stage if room.error else "transfer")
            self.stats.queues = self.rooms.counts()

    @property
    def fingerprint(self) -> Fingerprint:
        assert self._fingerprint is not None, f"{type(self).__name__}.start() first"
        return self._fingerprint

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        """From a sender or receiver thread: run `fn(*args)` on the loop, in order."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(fn, *args)
