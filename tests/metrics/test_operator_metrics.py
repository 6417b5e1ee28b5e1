"""The operator's families on a live server's `/metrics`: HTTP requests by handler and status,
refusals by reason, the process collectors, the info metric and the request-parameter
histograms; promtool's verdict on them; none of it when metrics are off."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stallfree import Engine
from stallfree.entrypoints.server import create_app, start_server
from stallfree.metrics.names import REFUSAL_REASONS
from tests.engine_util import engine_config
from tests.metrics.test_promtool import (
    COLON_RULE,
    PROMTOOL,
    VLLM_TOTAL_HISTOGRAM,
    _case,
    _panel_exprs,
    _series,
    check_metrics,
    run_rule_test,
)

KEY = "sk-ops"
AUTH = {"Authorization": f"Bearer {KEY}"}
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed")
BODY = {"model": "m", "prompt": "hello", "max_tokens": 5, "n": 2, "ignore_eos": True}


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(found: dict, name: str, **labels: str) -> float:
    hits = [v for lab, v in found.get(name, []) if all(lab.get(k) == x for k, x in labels.items())]
    assert len(hits) == 1, (name, labels, found.get(name))
    return hits[0]


def _stalled_body(port: int) -> socket.socket:
    """A request whose body never arrives in full: it holds a request slot until the body
    timeout."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + KEY.encode()
        + b'\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"model"'
    )
    return sock


async def _workload_with_every_refusal() -> tuple[str, Engine]:
    config = engine_config(
        "tiny",
        server={
            "served_model_name": "m",
            "api_key": KEY,
            "max_concurrent_requests": 1,
            "max_body_bytes": 4096,
            "body_timeout_s": 0.5,
        },
        runtime={"check_mirrors": False},
    )
    engine = Engine(config)
    app = create_app(engine)
    server = await start_server(app)
    try:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=30) as http:
            ok = await http.post("/v1/completions", json=BODY)
            assert ok.status_code == 200, ok.text
            gen = {"text": "hi", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
            assert (await http.post("/generate", json=gen)).status_code == 200
            answers = {
                "unauthorized": await http.post(
                    "/v1/completions", json=BODY, headers={"Authorization": "Bearer no"}
                ),
                "invalid_request": await http.post(
                    "/v1/completions", json={**BODY, "temperature": "hot"}
                ),
                "body_too_large": await http.post(
                    "/v1/completions", json={**BODY, "prompt": "x" * 8000}
                ),
            }
            stalled = await asyncio.to_thread(_stalled_body, server.port)
            try:
                await asyncio.sleep(0.1)  # the stalled request holds the one slot
                answers["overloaded"] = await http.post("/v1/completions", json=BODY)
                reply = await asyncio.to_thread(stalled.recv, 4096)  # the body timeout's 408
                assert reply.startswith(b"HTTP/1.1 408"), reply
            finally:
                stalled.close()
            app.state.sf.lifecycle.begin_drain()
            answers["shutting_down"] = await http.post("/v1/completions", json=BODY)
            status = {reason: r.status_code for reason, r in answers.items()}
            assert status == {
                "unauthorized": 401,
                "invalid_request": 400,
                "body_too_large": 413,
                "overloaded": 503,
                "shutting_down": 503,
            }
            text = (await http.get("/metrics")).text
    finally:
        await server.stop()
        await engine.shutdown()
    return text, engine


@pytest.fixture(scope="module")
def scrape() -> tuple[str, Engine]:
    return asyncio.run(_workload_with_every_refusal())


def test_each_refusal_is_counted_by_reason(scrape):
    found = samples(scrape[0])
    counts = {
        reason: value(found, "stallfree:http_refusals_total", reason=reason)
        for reason in REFUSAL_REASONS
    }
    assert counts == {reason: 1.0 for reason in REFUSAL_REASONS}  # timeout: the stalled body


def test_http_requests_by_handler_method_and_status(scrape):
    found = samples(scrape[0])
    name = "stallfree:http_requests_total"

    def count(handler: str, status: str) -> float:
        return value(found, name, handler=handler, method="POST", status=status)

    assert count("/v1/completions", "2xx") == 1
    assert count("/generate", "2xx") == 1
    # 401, 400 and 413, and the stalled body's 408; then the two 503s
    assert count("/v1/completions", "4xx") == 4
    assert count("/v1/completions", "5xx") == 2
    handlers = {labels["handler"] for labels, _ in found[name]}
    assert "/metrics" not in handlers and "/health" not in handlers
    durations = "stallfree:http_request_duration_seconds_count"
    assert value(found, durations, handler="/v1/completions", method="POST", status="2xx") == 1


def test_process_platform_and_gc_collectors(scrape):
    found = samples(scrape[0])
    assert value(found, "process_resident_memory_bytes") > 10 << 20
    assert value(found, "process_open_fds") > 0
    assert value(found, "process_cpu_seconds_total") > 0
    assert {labels["generation"] for labels, _ in found["python_gc_collections_total"]} == {
        "0",
        "1",
        "2",
    }
    assert value(found, "python_info") == 1


def test_the_info_metric_names_the_configuration(scrape):
    text, engine = scrape
    found = samples(text)
    [(labels, one)] = found["stallfree:config_info"]
    assert one == 1
    assert labels == {
        "model_name": "m",
        "engine": labels["engine"],
        "version": __import__("stallfree").__version__,
        "overlap": "true",
        "cpu_mirrors": "true",
        "page_size": "1",
        "kv_slots": str(engine.core.ctx.allocator.size),
        "dtype": "float32",
        "tp_size": "1",
        "hisparse": "false",
        "speculative": "none",
    }


def test_request_parameter_histograms(scrape):
    found = samples(scrape[0])
    # the completion (n=2, max_tokens=5) and the /generate (one choice, 3 tokens) that ran
    assert value(found, "stallfree:request_params_n_count") == 2
    assert value(found, "stallfree:request_params_n_sum") == 3
    assert value(found, "stallfree:request_params_max_tokens_sum") == 8
    assert value(found, "stallfree:request_params_n_bucket", le="1.0") == 1


@needs_promtool
def test_promtool_accepts_the_server_families(scrape):
    findings = check_metrics(scrape[0].encode())
    others = [f for f in findings if not f.endswith(COLON_RULE)]
    assert others == [VLLM_TOTAL_HISTOGRAM]
    flagged = {f.split()[0] for f in findings if f.endswith(COLON_RULE)}
    assert {
        "stallfree:http_requests_total",
        "stallfree:http_refusals_total",
        "stallfree:config_info",
        "stallfree:request_params_n",
    } <= flagged
    assert not any(name.startswith(("process_", "python_")) for name in flagged)


HTTP_BY_STATUS, REFUSALS_BY_REASON, REFUSED_SHARE = 38, 40, 41


@needs_promtool
def test_http_panels_show_zero_on_an_idle_server(scrape, tmp_path):
    """Every series of the real scrape held still: rates of 0 everywhere, a share of 0 (not
    NaN), and every reason and status class that the workload produced."""
    (by_status,) = _panel_exprs(HTTP_BY_STATUS)
    (by_reason,) = _panel_exprs(REFUSALS_BY_REASON)
    (share,) = _panel_exprs(REFUSED_SHARE)
    statuses = [(f'{{status="{s}"}}', 0) for s in ("2xx", "4xx", "5xx")]
    reasons = [(f'{{reason="{r}"}}', 0) for r in sorted(REFUSAL_REASONS)]
    cases = [_case(by_status, *statuses), _case(by_reason, *reasons), _case(share, ("{}", 0))]
    run_rule_test(tmp_path, _series(scrape[0].encode()), cases)


@needs_promtool
def test_http_panels_follow_the_counters(tmp_path):
    """Per minute: 45 answered requests and 15 refused as overloaded (a 5xx): a quarter of
    the requests refused, a quarter of a refusal per second."""
    labels = 'model_name="m",engine="0"'
    http = 'handler="/v1/completions",method="POST"'
    series = [
        {"series": f'stallfree:http_requests_total{{{http},status="2xx"}}', "values": "0+45x10"},
        {"series": f'stallfree:http_requests_total{{{http},status="5xx"}}', "values": "0+15x10"},
        {
            "series": f'stallfree:http_refusals_total{{{labels},reason="overloaded"}}',
            "values": "0+15x10",
        },
    ]
    (by_status,) = _panel_exprs(HTTP_BY_STATUS)
    (by_reason,) = _panel_exprs(REFUSALS_BY_REASON)
    (share,) = _panel_exprs(REFUSED_SHARE)
    cases = [
        _case(by_status, ('{status="2xx"}', 0.75), ('{status="5xx"}', 0.25)),
        _case(by_reason, ('{reason="overloaded"}', 0.25)),
        _case(share, ("{}", 0.25)),
    ]
    run_rule_test(tmp_path, series, cases)


async def test_metrics_off_adds_no_http_families_and_no_middleware():
    config = engine_config("tiny", metrics={"enabled": False}, server={"served_model_name": "m"})
    engine = Engine(config)
    app = create_app(engine)
    assert app.state.sf.metrics is None
    assert [m.cls.__name__ for m in app.user_middleware] == ["Guard"]
    server = await start_server(app)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            assert (await http.post("/v1/completions", json={**BODY, "n": 1})).status_code == 200
            assert (await http.get("/metrics")).status_code == 404
    finally:
        await server.stop()
        await engine.shutdown()


def test_refusal_reasons_follow_status_and_code():
    from stallfree.entrypoints.server.base.errors import overloaded, refusal_reason, shutting_down

    engine_full = overloaded(1, "too many requests are waiting")
    assert refusal_reason(engine_full.status, engine_full.info.code) == "overloaded"
    draining = shutting_down()
    assert refusal_reason(draining.status, draining.info.code) == "shutting_down"
    # /flush_cache while requests run is a 400 the client retries later, not overload
    assert refusal_reason(400, "engine_busy") == "invalid_request"
    assert refusal_reason(404, "model_not_found") == "invalid_request"
    # the server's own failures are not refusals
    assert refusal_reason(503, "engine_unhealthy") is None
    assert refusal_reason(500, None) is None


async def test_a_client_that_leaves_mid_body_is_a_4xx_not_a_5xx():
    """The instrumentator counts a request that got no answer as a 500; the Guard ends one
    whose client left while sending its body as 499, so no 5xx alert fires on it."""
    config = engine_config("tiny", server={"served_model_name": "m"})
    engine = Engine(config)
    server = await start_server(create_app(engine))
    try:
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model"'
        )
        await asyncio.sleep(0.2)
        sock.close()
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
            for _ in range(100):
                found = samples((await http.get("/metrics")).text)
                statuses = {
                    lab["status"]: v
                    for lab, v in found.get("stallfree:http_requests_total", [])
                    if lab["handler"] == "/v1/completions"
                }
                if statuses:
                    break
                await asyncio.sleep(0.05)
        assert statuses == {"4xx": 1.0}
        assert value(found, "stallfree:http_refusals_total", reason="invalid_request") == 0
    finally:
        await server.stop()
        await engine.shutdown()
