"""Typed events the engine emits as they happen; metrics collectors subscribe to them.

Counters are not events: they live in `EngineCounters` and are read through a snapshot. Events
carry what a counter cannot: per-request timing (TTFT, ITL, latency) and per-call durations.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stallfree.runtime.req import Req


class EngineObserver:
    """Every hook is a no-op by default. Hooks run on the event loop and must not block."""

    def on_request_added(self, req: Req) -> None: ...

    def on_request_scheduled(self, req: Req) -> None:
        """The first time the request's prefill is launched (queue time ends)."""

    def on_tokens(self, req: Req, count: int, now: float) -> None:
        """`count` new output tokens were accepted for `req` at `now` (perf_counter)."""

    def on_request_finished(self, req: Req, now: float) -> None: ...

    def on_step(self, num_reqs: int, decode: bool, overlapped: bool) -> None:
        """A batch was launched; `overlapped` when an earlier batch was still unprocessed."""

    def on_stall(self, site: str, seconds: float) -> None:
        """A `host_read` at `site` waited `seconds` for the device."""

    def on_schedule(self, seconds: float) -> None:
        """Host time to build and launch one batch."""


class MetricsExporter(EngineObserver, ABC):
    """An observer that also renders the engine's metrics for a scrape."""

    @abstractmethod
    def render(self) -> bytes: ...


class ObserverFanout(EngineObserver):
    """Calls every registered observer; the engine holds exactly one of these."""

    def __init__(self) -> None:
        self.observers: list[EngineObserver] = []

    def on_request_added(self, req: Req) -> None:
        for o in self.observers:
            o.on_request_added(req)

    def on_request_scheduled(self, req: Req) -> None:
        for o in self.observers:
            o.on_request_scheduled(req)

    def on_tokens(self, req: Req, count: int, now: float) -> None:
        for o in self.observers:
            o.on_tokens(req, count, now)

    def on_request_finished(self, req: Req, now: float) -> None:
        for o in self.observers:
            o.on_request_finished(req, now)

    def on_step(self, num_reqs: int, decode: bool, overlapped: bool) -> None:
        for o in self.observers:
            o.on_step(num_reqs, decode, overlapped)

    def on_stall(self, site: str, seconds: float) -> None:
        for o in self.observers:
            o.on_stall(site, seconds)

    def on_schedule(self, seconds: float) -> None:
        for o in self.observers:
            o.on_schedule(seconds)
