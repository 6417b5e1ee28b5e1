"""What the app keeps for its routes: the engine, the served model name, the API key, the server
limits, and where the server is in its life (serving, draining, past its grace period)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import Request

from stallfree.config.settings import ServerConfig
from stallfree.entrypoints.server.base.generation_defaults import GenerationDefaults
from stallfree.metrics.operator import ServerMetrics
from stallfree.runtime.engine import Engine


class Abortable(Protocol):
    def abort(self) -> None:
        """Abort the engine requests this stands for."""

    def names(self) -> tuple[str, ...]:
        """The ids a client may abort it by: the HTTP request's id, and its engine requests'."""


@dataclass(slots=True, eq=False)
class Lifecycle:
    """Serving, then draining (after SIGTERM or SIGINT), then expired (the grace period ran out).

    Draining: `/health` answers 503 and new API requests get 503; admitted ones run on.
    Expired: every engine request still admitted is aborted, and its HTTP request ends with an
    error (an SSE error event, or a JSON 503) instead of its normal end.
    """

    draining: bool = False
    expired: bool = False
    # API requests between the server's door and their last byte (see `Guard`)
    in_flight: int = 0
    # what the routes admitted and have not closed yet
    admitted: set[Abortable] = field(default_factory=set)

    def begin_drain(self) -> None:
        self.draining = True

    def abort_matching(self, ids: set[str] | None) -> int:
        """Abort the admitted HTTP requests named by any of `ids` (None: all of them); how
        many were aborted."""
        matched = [a for a in self.admitted if ids is None or not ids.isdisjoint(a.names())]
        for item in matched:
            item.abort()
        return len(matched)

    def expire(self) -> int:
        """End the grace period: abort what is still admitted; returns how many HTTP requests
        that cut short."""
        self.draining = True
        self.expired = True
        admitted = list(self.admitted)
        for item in admitted:
            item.abort()
        return len(admitted)


@dataclass(slots=True)
class ServerState:
    engine: Engine
    model_name: str
    limits: ServerConfig
    lifecycle: Lifecycle
    # a disaggregated role (entrypoints/server/api/disagg.py `Disaggregated`), or None
    disagg: Any = None
    # the server's Prometheus families (refusals, request parameters); None with metrics off
    metrics: ServerMetrics | None = None
    # `tracing.RequestTracer` with `server.otlp_traces_endpoint` set, else None
    tracer: Any = None
    # the model's sampling defaults (`generation_defaults.GenerationDefaults`), or none
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)

    def observe_params(self, n: int, max_tokens: int) -> None:
        """A request's `n` and `max_tokens`, for vLLM's `request_params_*` histograms."""
        if self.metrics is not None:
            self.metrics.observe_params(n, max_tokens)


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.sf
    return state


def request_id(request: Request) -> str:
    """The id `Guard` gave this request (the `x-request-id` header of its answer)."""
    return str(request.scope.get("state", {}).get("request_id", "-"))
