"""OpenTelemetry tracing (`server.otlp_traces_endpoint`, vLLM's `--otlp-traces-endpoint`).

Each engine request becomes one span, `llm_request` (kind SERVER), with a child span for each
phase it went through: `queue` (arrival to first scheduling), `prefill` (to the first token)
and `decode` (first token to last). The request span carries vLLM's `gen_ai.*` attributes. A
client's W3C `traceparent` (and `tracestate`) header makes the request span a child of the
client's span, so the request shows inside the caller's trace.

The spans are made when the request finishes, from the times the engine already keeps
(`Req.arrival_time`, `first_scheduled_time`) and the token times this observer notes, and a
`BatchSpanProcessor` sends them from its own thread over OTLP/HTTP (protobuf). Nothing here
runs with tracing off: the server adds no observer and reads no header, and the
`opentelemetry` packages (the `tracing` extra) are not imported.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from stallfree.runtime.telemetry.observer import EngineObserver

if TYPE_CHECKING:
    from stallfree.runtime.request.req import Req

REQUEST_SPAN = "llm_request"
PHASE_SPANS = ("queue", "prefill", "decode")


class TracingUnavailableError(RuntimeError):
    pass


class RequestTracer(EngineObserver):
    """An engine observer that exports a span tree per finished request.

    `expect(rids, headers)` ties the engine requests an HTTP request admits to the trace its
    headers name; a request nobody announced (the embedded API) starts a trace of its own."""

    def __init__(self, endpoint: str, service_name: str = "stallfree", exporter: Any = None):
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind, set_span_in_context
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as exc:  # pragma: no cover - the extra is in every test install
            raise TracingUnavailableError(
                "server.otlp_traces_endpoint needs OpenTelemetry: pip install 'stallfree[tracing]'"
            ) from exc
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=_traces_url(endpoint))
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("stallfree")
        self._propagator = TraceContextTextMapPropagator()
        self._server_kind = SpanKind.SERVER
        self._inside = set_span_in_context
        # perf_counter -> wall clock nanoseconds, for the span times
        self._offset_ns = time.time_ns() - time.perf_counter_ns()
        self._parents: dict[str, Any] = {}
        self._tokens: dict[str, list[float]] = {}  # rid -> [first token, last token]

    # ------------------------------------------------------------------ the server's side

    def expect(self, rids: Iterable[str], headers: Mapping[str, str]) -> None:
        """The engine requests `rids` belong to the trace `headers` carry, if any."""
        carrier = {k: headers[k] for k in ("traceparent", "tracestate") if k in headers}
        parent = self._propagator.extract(carrier) if carrier else None
        for rid in rids:
            self._parents.setdefault(rid, parent)  # a live request's id is not taken over

    def forget(self, rids: Iterable[str]) -> None:
        """Requests the engine refused: they never finish, so nothing would take them back."""
        for rid in rids:
            self._parents.pop(rid, None)
            self._tokens.pop(rid, None)

    def shutdown(self) -> None:
        """Send what is queued, then stop the exporter (blocks: run it off the event loop)."""
        self.provider.shutdown()

    # ------------------------------------------------------------------ engine events

    def on_tokens(self, req: Req, count: int, now: float) -> None:
        times = self._tokens.get(req.rid)
        if times is None:
            self._tokens[req.rid] = [now, now]
        else:
            times[1] = now

    def on_request_finished(self, req: Req, now: float) -> None:
        parent = self._parents.pop(req.rid, None)
        first, last = self._tokens.pop(req.rid, None) or (None, None)
        ns = self._ns
        arrival, scheduled = req.arrival_time, req.first_scheduled_time
        params = req.sampling_params
        reason = req.finished_reason.value if req.finished_reason is not None else "none"
        attributes: dict[str, Any] = {
            "gen_ai.request.id": req.rid,
            "gen_ai.usage.prompt_tokens": len(req.origin_input_ids),
            "gen_ai.usage.completion_tokens": len(req.output_ids),
            "gen_ai.request.max_tokens": params.max_new_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.response.finish_reasons": [reason],
            "gen_ai.latency.e2e": now - arrival,
        }
        if scheduled is not None:
            attributes["gen_ai.latency.time_in_queue"] = scheduled - arrival
        if first is not None:
            attributes["gen_ai.latency.time_to_first_token"] = first - arrival
        span = self.tracer.start_span(
            REQUEST_SPAN,
            context=parent,
            kind=self._server_kind,
            attributes=attributes,
            start_time=ns(arrival),
        )
        inside = self._inside(span)
        phases: list[tuple[str, float, float]] = []
        if scheduled is not None:
            phases.append(("queue", arrival, scheduled))
            phases.append(("prefill", scheduled, first if first is not None else now))
            if first is not None and last is not None and last > first:
                phases.append(("decode", first, last))
        else:
            phases.append(("queue", arrival, now))  # left before it was scheduled
        for name, start, end in phases:
            self.tracer.start_span(name, context=inside, start_time=ns(start)).end(ns(end))
        span.end(ns(now))

    def _ns(self, perf: float) -> int:
        return int(perf * 1e9) + self._offset_ns


def _traces_url(endpoint: str) -> str:
    """vLLM's flag takes the collector's address; OTLP/HTTP posts traces to `/v1/traces`."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"
