"""Typed events the engine emits as they happen; metrics collectors subscribe to them.

Counters are not events: they live in `EngineCounters` and are read through a snapshot. Events
carry what a counter cannot: per-request timing (TTFT, ITL, latency) and per-call durations.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stallfree.runtime.request.req import Req

logger = logging.getLogger(__name__)


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

    def on_step_tokens(self, num_tokens: int) -> None:
        """The batch just launched computes `num_tokens` tokens (prompt tokens in an extend
        batch, one per request in decode); called right after `on_step`."""

    def on_stall(self, site: str, seconds: float) -> None:
        """A `host_read` at `site` waited `seconds` for the device."""

    def on_schedule(self, seconds: float) -> None:
        """Host time to build and launch one batch."""


class MetricsExporter(EngineObserver, ABC):
    """An observer that also renders the engine's metrics for a scrape."""

    @abstractmethod
    def render(self) -> bytes: ...


class ObserverFanout(EngineObserver):
    """Calls every registered observer; the engine holds exactly one of these.

    An observer that raises is logged (the first time for each hook at ERROR, with its
    traceback) and skipped: a plug-in's bug must not fail requests or stop the scheduler.
    """

    def __init__(self) -> None:
        self.observers: list[EngineObserver] = []
        self._reported: set[tuple[int, str]] = set()

    def _failed(self, observer: EngineObserver, hook: str, exc: Exception) -> None:
        key = (id(observer), hook)
        if key in self._reported:
            logger.debug("observer %r failed in %s again: %r", observer, hook, exc)
            return
        self._reported.add(key)
        logger.error(
            "observer %r failed in %s; it is skipped for this event", observer, hook, exc_info=exc
        )

    def on_request_added(self, req: Req) -> None:
        for o in self.observers:
            try:
                o.on_request_added(req)
            except Exception as exc:
                self._failed(o, "on_request_added", exc)

    def on_request_scheduled(self, req: Req) -> None:
        for o in self.observers:
            try:
                o.on_request_scheduled(req)
            except Exception as exc:
                self._failed(o, "on_request_scheduled", exc)

    def on_tokens(self, req: Req, count: int, now: float) -> None:
        for o in self.observers:
            try:
                o.on_tokens(req, count, now)
            except Exception as exc:
                self._failed(o, "on_tokens", exc)

    def on_request_finished(self, req: Req, now: float) -> None:
        for o in self.observers:
            try:
                o.on_request_finished(req, now)
            except Exception as exc:
                self._failed(o, "on_request_finished", exc)

    def on_step(self, num_reqs: int, decode: bool, overlapped: bool) -> None:
        for o in self.observers:
            try:
                o.on_step(num_reqs, decode, overlapped)
            except Exception as exc:
                self._failed(o, "on_step", exc)

    def on_step_tokens(self, num_tokens: int) -> None:
        for o in self.observers:
            try:
                o.on_step_tokens(num_tokens)
            except Exception as exc:
                self._failed(o, "on_step_tokens", exc)

    def on_stall(self, site: str, seconds: float) -> None:
        for o in self.observers:
            try:
                o.on_stall(site, seconds)
            except Exception as exc:
                self._failed(o, "on_stall", exc)

    def on_schedule(self, seconds: float) -> None:
        for o in self.observers:
            try:
                o.on_schedule(seconds)
            except Exception as exc:
                self._failed(o, "on_schedule", exc)
