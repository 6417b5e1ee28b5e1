"""Shutdown: a drain on SIGTERM or SIGINT, the grace period's deadline, exit statuses, and what
is logged. In-process servers are drained the way a signal drains them (`RunningServer.drain`);
`stallfree serve` subprocesses get the real signals."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from typing import Any

import httpx
import pytest

from tests.engine_util import settle
from tests.http_util import (
    NO_EOS,
    SLOW,
    completion,
    finished,
    serving,
    stallfree_serve,
    warnings_logged,
)

# liveness: a server that has not stopped this long after its drain or its engine's death is
# a failure (a timeout, never a speed figure)
STOP_TIMEOUT_S = 20.0


async def sse_events(http: httpx.AsyncClient, body: dict[str, Any]) -> list[str]:
    async with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        assert r.status_code == 200
        return [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]


async def until(predicate: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------- in process


async def test_a_drain_answers_503_at_once_and_lets_running_requests_finish():
    async with serving(faults=SLOW, server={"graceful_shutdown_s": 20}) as live:
        stream = asyncio.create_task(sse_events(live.http, completion(max_tokens=60) | NO_EOS))
        whole = asyncio.create_task(
            live.http.post("/v1/completions", json=completion(max_tokens=50) | NO_EOS)
        )
        await until(lambda: live.engine.snapshot().running == 2)
        live.server.drain()
        health = await live.http.get("/health")
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        # at once: before either running request has finished
        assert live.engine.snapshot().running == 2
        refused = await live.http.post("/v1/completions", json=completion())
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "shutting_down"
        assert refused.headers["connection"] == "close"
        # retryable elsewhere: the Rust routers retry a 503 that carries Retry-After
        assert refused.headers["retry-after"] == "1"
        # the running ones finish as if nothing happened
        events = await stream
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        answer = await whole
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 50
        assert await asyncio.wait_for(live.server.wait(), STOP_TIMEOUT_S) == 0
        await settle(live.engine)


async def test_at_the_deadline_streams_end_with_an_error_event_and_others_get_503():
    with warnings_logged() as log_records:
        await _cut_off_at_the_deadline()
    # one warning that the grace period ran out; no error, no traceback
    assert [r.levelname for r in log_records] == ["WARNING"], [r.getMessage() for r in log_records]
    assert not any(r.exc_info for r in log_records)


async def _cut_off_at_the_deadline() -> None:
    async with serving(faults=SLOW, server={"graceful_shutdown_s": 0.5}) as live:
        body = completion(max_tokens=400) | NO_EOS
        streams = [asyncio.create_task(sse_events(live.http, body)) for _ in range(3)]
        wholes = [
            asyncio.create_task(live.http.post("/v1/completions", json=body)) for _ in range(3)
        ]
        await until(lambda: live.server.server.sf.lifecycle.in_flight == 6)
        await until(lambda: len(live.server.server.sf.lifecycle.admitted) == 6)
        live.server.drain()
        for events in await asyncio.gather(*streams):
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["code"] == "shutting_down" and error["type"] == "service_unavailable"
            # cut at the deadline, not at the end: far fewer token events than the 400 asked
            assert len(events) < 200, len(events)
        for r in await asyncio.gather(*wholes):
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert await asyncio.wait_for(live.server.wait(), STOP_TIMEOUT_S) == 0
        await settle(live.engine)
        assert finished(live.engine, "abort") == 6


async def test_a_server_whose_engine_failed_closed_stops_with_status_1():
    engine_faults = {"enabled": True, "fail_step_rate": 1.0}
    async with serving(faults=engine_faults, runtime={"max_consecutive_step_failures": 1}) as live:
        live.server.server.exit_on_engine_death = True
        r = await live.http.post("/v1/completions", json=completion())
        assert r.status_code == 500
        assert await asyncio.wait_for(live.server.wait(), STOP_TIMEOUT_S) == 1


# ---------------------------------------------------------------- `stallfree serve` subprocesses


SLOW_ENV = {
    "STALLFREE_FAULTS__ENABLED": "true",
    "STALLFREE_FAULTS__SLOW_STEP_RATE": "1.0",
    "STALLFREE_FAULTS__SLOW_STEP_SECONDS": "0.01",
}


@pytest.mark.slow
def test_sigint_drains_then_exits_0_and_probes_stay_out_of_the_access_log():
    with stallfree_serve(**SLOW_ENV) as (proc, base):
        assert httpx.get(base + "/v1/models").status_code == 200
        assert httpx.get(base + "/metrics").status_code == 200
        body = completion(max_tokens=150, stream=True) | NO_EOS
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break
            proc.send_signal(signal.SIGINT)
            time.sleep(0.05)
            health = httpx.get(base + "/health", timeout=STOP_TIMEOUT_S)
            assert health.status_code == 503
            refused = httpx.post(
                base + "/v1/completions", json=completion(), timeout=STOP_TIMEOUT_S
            )
            assert refused.status_code == 503
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=30) == 0
        out = proc.stdout.read() if proc.stdout else ""
    assert '"GET /v1/models HTTP/1.1" 200' in out
    assert "/health" not in out and "/metrics" not in out
    assert "Traceback" not in out


@pytest.mark.slow
def test_sigterm_past_the_grace_period_ends_streams_with_an_error_and_exits_0():
    env = SLOW_ENV | {"STALLFREE_SERVER__GRACEFUL_SHUTDOWN_S": "1"}
    with stallfree_serve("--no-access-log", **env) as (proc, base):
        body = completion(max_tokens=1000) | NO_EOS
        with (
            httpx.stream(
                "POST", base + "/v1/completions", json=body | {"stream": True}, timeout=30
            ) as r,
            httpx.Client(base_url=base, timeout=30) as other,
        ):
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break
            proc.send_signal(signal.SIGTERM)
            whole = other.post("/v1/completions", json=body | {"max_tokens": 900})
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert whole.status_code == 503 and whole.json()["error"]["code"] == "shutting_down"
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["error"]["code"] == "shutting_down"
        # cut at the grace period's end, far short of the 1000 tokens asked
        assert len(rest) < 500, len(rest)
        assert proc.wait(timeout=30) == 0
        out = proc.stdout.read() if proc.stdout else ""
    assert "Traceback" not in out and "HTTP/1.1" not in out
    assert "grace period over" in out


@pytest.mark.slow
def test_a_server_whose_engine_died_exits_non_zero():
    env = {
        "STALLFREE_FAULTS__ENABLED": "true",
        "STALLFREE_FAULTS__FAIL_STEP_RATE": "1.0",
        "STALLFREE_RUNTIME__MAX_CONSECUTIVE_STEP_FAILURES": "1",
    }
    with stallfree_serve(**env) as (proc, base):
        r = httpx.post(base + "/v1/completions", json=completion(), timeout=10)
        assert r.status_code == 500
        assert proc.wait(timeout=15) == 1
        out = proc.stdout.read() if proc.stdout else ""
    assert "the engine stopped serving" in out
