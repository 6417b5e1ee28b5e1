"""OpenTelemetry tracing: spans reach a real OTLP/HTTP receiver started here, a client's
`traceparent` continues its trace, and with tracing off nothing is added."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from stallfree import Engine
from stallfree.entrypoints.server import create_app, start_server
from stallfree.entrypoints.server.output.tracing import RequestTracer
from tests.engine_util import engine_config

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
BODY = {"model": "m", "prompt": "hello there", "max_tokens": 4, "ignore_eos": True}


class Receiver:
    """An OTLP/HTTP collector on loopback: every span posted to /v1/traces."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.spans: list[Any] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.paths.append(self.path)
                export = ExportTraceServiceRequest()
                export.ParseFromString(body)
                for resource in export.resource_spans:
                    for scope in resource.scope_spans:
                        receiver.spans.extend(scope.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _attributes(span: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = (
            [x.string_value for x in v.array_value.values]
            if kind == "array_value"
            else getattr(v, kind)
        )
    return out


async def test_spans_reach_the_collector_with_the_clients_parent():
    receiver = Receiver()
    try:
        config = engine_config(
            "tiny",
            server={"served_model_name": "m", "otlp_traces_endpoint": receiver.url},
            runtime={"check_mirrors": False},
        )
        engine = Engine(config)
        app = create_app(engine)
        assert isinstance(app.state.sf.tracer, RequestTracer)
        server = await start_server(app)
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                traced = await http.post(
                    "/v1/completions",
                    json=BODY,
                    headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
                )
                assert traced.status_code == 200, traced.text
                usage = traced.json()["usage"]
                untraced = await http.post("/v1/completions", json={**BODY, "max_tokens": 1})
                assert untraced.status_code == 200
        finally:
            await server.stop()  # the lifespan's end sends what is queued
            await engine.shutdown()
    finally:
        receiver.close()

    assert set(receiver.paths) == {"/v1/traces"}
    roots = [s for s in receiver.spans if s.name == "llm_request"]
    assert len(roots) == 2
    traced_root = next(s for s in roots if s.trace_id.hex() == TRACE_ID)
    other = next(s for s in roots if s is not traced_root)
    assert traced_root.parent_span_id.hex() == PARENT_ID
    assert other.trace_id.hex() != TRACE_ID and not other.parent_span_id  # a trace of its own

    attrs = _attributes(traced_root)
    assert attrs["gen_ai.request.id"].startswith("cmpl-")
    assert attrs["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 4
    assert attrs["gen_ai.request.max_tokens"] == 4
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert 0 < attrs["gen_ai.latency.time_to_first_token"] <= attrs["gen_ai.latency.e2e"]
    assert 0 <= attrs["gen_ai.latency.time_in_queue"] <= attrs["gen_ai.latency.time_to_first_token"]

    children = {
        s.name: s
        for s in receiver.spans
        if s.parent_span_id == traced_root.span_id and s.trace_id == traced_root.trace_id
    }
    assert set(children) == {"queue", "prefill", "decode"}
    queue, prefill, decode = children["queue"], children["prefill"], children["decode"]
    assert traced_root.start_time_unix_nano == queue.start_time_unix_nano
    assert queue.end_time_unix_nano == prefill.start_time_unix_nano
    assert prefill.end_time_unix_nano == decode.start_time_unix_nano
    assert decode.end_time_unix_nano <= traced_root.end_time_unix_nano
    # one token: no decode phase
    other_children = {s.name for s in receiver.spans if s.parent_span_id == other.span_id}
    assert other_children == {"queue", "prefill"}


async def test_tracing_off_adds_no_observer_and_reads_no_header():
    config = engine_config("tiny", server={"served_model_name": "m"})
    engine = Engine(config)
    try:
        app = create_app(engine)
        assert app.state.sf.tracer is None
        assert not any(isinstance(o, RequestTracer) for o in engine.core.observers.observers)
    finally:
        await engine.shutdown()


def test_the_endpoint_gets_the_otlp_traces_path():
    from stallfree.entrypoints.server.output.tracing import _traces_url

    assert _traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert _traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert _traces_url("http://c:4318/v1/traces") == "http://c:4318/v1/traces"
