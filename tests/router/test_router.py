"""`stallfree router` against fake prefill and decode servers (tests/router/conftest.py): the
two legs and their bodies, the pick of servers, failing fast both ways and on a client that
leaves, start-up checks, body limits, the API key, /health, /v1/models, /metrics, the flags."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

import pytest

from stallfree.cli import build_parser
from stallfree.entrypoints.cli import parse, subparsers
from stallfree.entrypoints.cli import run as run_command
from stallfree.entrypoints.router import pool as router_pool
from stallfree.entrypoints.router.flags import DEFAULT_BOOTSTRAP_PORT, Upstream, router_settings
from stallfree.entrypoints.router.launch import serve_router
from stallfree.entrypoints.router.startup import StartupError
from tests.router.conftest import BOOTSTRAP_PORT, decode_events

PROMPT = {"model": "m", "prompt": "hello", "max_tokens": 4}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


# a liveness bound, named as one: the tests assert order and counts, never how fast
TIMEOUT_S = 10.0
# the router's wait before it cancels a prefill leg still running after the answer: long
# enough that the answer is checked first
GRACE_S = 2.0


async def within(event: asyncio.Event, seconds: float = TIMEOUT_S) -> None:
    await asyncio.wait_for(event.wait(), seconds)


async def test_a_whole_answer_is_the_decode_servers_and_both_legs_get_the_bootstrap_fields(
    cluster,
) -> None:
    c = await cluster()
    body = {**PROMPT, "stream_options": {"include_usage": True}}
    resp = await c.http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"id": "d0", "choices": [{"text": "hi"}]}
    [pre], [dec] = c.prefill[0].bodies, c.decode[0].bodies
    room = pre["bootstrap_room"]
    assert isinstance(room, int) and 0 <= room < 2**63 and dec["bootstrap_room"] == room
    for leg in (pre, dec):
        assert leg["bootstrap_host"] == "127.0.0.1" and leg["bootstrap_port"] == BOOTSTRAP_PORT
        assert leg["prompt"] == "hello" and leg["max_tokens"] == 4
    assert pre["stream"] is False and "stream_options" not in pre
    assert "stream" not in dec and dec["stream_options"] == {"include_usage": True}
    # no id from the client: the router's own, the room in hex, on both legs and the answer
    ids = {c.prefill[0].headers[0]["x-request-id"], c.decode[0].headers[0]["x-request-id"]}
    assert ids == {f"{room:x}"} and resp.headers["x-request-id"] == f"{room:x}"


async def test_a_stream_is_relayed_event_by_event(cluster) -> None:
    c = await cluster()
    decode = c.decode[0]
    decode.hold = asyncio.Event()  # the fake sends its first event, then waits for this
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"X-Request-Id": "client-id-1"}
    async with c.http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        chunks = resp.aiter_bytes()
        # the first event comes through while the decode server still holds the rest back
        first = await asyncio.wait_for(chunks.__anext__(), TIMEOUT_S)
        decode.hold.set()
        got = first + b"".join([chunk async for chunk in chunks])
    assert got == b"".join(decode_events("d0"))
    [pre], [dec] = c.prefill[0].bodies, decode.bodies
    assert pre["stream"] is False and "stream_options" not in pre
    assert dec["stream"] is True and dec["stream_options"] == {"include_usage": True}
    assert pre["messages"] == dec["messages"] == CHAT["messages"]
    assert pre["bootstrap_room"] == dec["bootstrap_room"]
    assert c.prefill[0].headers[0]["x-request-id"] == decode.headers[0]["x-request-id"]
    assert decode.headers[0]["x-request-id"] == "client-id-1"
    assert await c.metric("stallfree:router_first_byte_seconds_count", route="chat") == 1


async def test_round_robin_takes_each_kind_in_turn(cluster) -> None:
    c = await cluster(prefill=2, decode=2)
    answers = [(await c.http.post("/v1/completions", json=PROMPT)).json()["id"] for _ in range(4)]
    assert answers == ["d0", "d1", "d0", "d1"]
    assert [len(p.bodies) for p in c.prefill] == [2, 2]
    # each decode leg names the prefill server its partner leg went to
    for p in c.prefill:
        rooms = {b["bootstrap_room"] for b in p.bodies}
        paired = [b for d in c.decode for b in d.bodies if b["bootstrap_room"] in rooms]
        assert {b["bootstrap_port"] for b in paired} == {p.bodies[0]["bootstrap_port"]}
    # start-up asked every decode server about every prefill server
    for d in c.decode:
        assert sorted(x["bootstrap_port"] for x in d.connects) == [
            BOOTSTRAP_PORT,
            BOOTSTRAP_PORT + 1,
        ]
        assert {x["bootstrap_host"] for x in d.connects} == {"127.0.0.1"}


async def test_least_load_picks_the_idle_decode_server(cluster) -> None:
    c = await cluster(decode=2, policy="least_load")
    c.decode[0].mode = "slow"
    stream = {**PROMPT, "stream": True}
    async with c.http.stream("POST", "/v1/completions", json=stream) as resp:
        # d0, the tie's first, is busy (the iterator is kept: collected, it would close the stream)
        chunks = resp.aiter_bytes()
        await asyncio.wait_for(chunks.__anext__(), TIMEOUT_S)
        inflight = "stallfree:router_inflight_requests"
        assert await c.metric(inflight, server=c.decode[0].url) == 1
        answers = [(await c.http.post("/v1/completions", json=PROMPT)).json()["id"] for _ in "ab"]
    assert answers == ["d1", "d1"]  # round robin would have sent the second to d0


async def test_a_prefill_error_passes_through_and_cancels_the_decode_leg(cluster) -> None:
    c = await cluster()
    prefill, decode = c.prefill[0], c.decode[0]
    prefill.mode, prefill.gate = "error", decode.arrived  # answers once decode is waiting
    decode.mode = "hang"
    resp = await c.http.post("/v1/completions", json=PROMPT)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "p0 says no"
    # the hanging decode leg never answers by itself: the router answered without it (the
    # client's 5 s timeout is under the router's 10 s request timeout), then hung up on it
    await within(decode.cancelled)
    assert await c.metric("stallfree:router_leg_failures_total", leg="prefill") == 1


async def test_a_prefill_that_cannot_be_reached_is_a_502_naming_it(cluster) -> None:
    c = await cluster()
    await c.prefill[0].stop()
    c.decode[0].mode = "hang"
    resp = await c.http.post("/v1/completions", json=PROMPT)
    assert resp.status_code == 502
    error = resp.json()["error"]
    assert error["type"] == "upstream_error" and error["code"] == 502
    assert error["message"].startswith(f"prefill server {c.prefill[0].url} failed: ")
    # the decode leg was cancelled, before or after its request reached the server
    await asyncio.sleep(0.2)
    assert not c.decode[0].bodies or c.decode[0].cancelled.is_set()


async def test_a_decode_error_cancels_a_hanging_prefill_leg(cluster) -> None:
    c = await cluster()
    prefill, decode = c.prefill[0], c.decode[0]
    prefill.mode = "hang"
    decode.mode, decode.error_status, decode.gate = "error", 503, prefill.arrived
    resp = await c.http.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert resp.status_code == 503 and resp.json()["error"]["message"] == "d0 says no"
    # the hanging prefill leg never answers by itself: the router answered without it (the
    # client's 5 s timeout is under the router's 10 s request timeout), then hung up on it
    await within(prefill.cancelled)
    assert await c.metric("stallfree:router_leg_failures_total", leg="decode") == 1


async def test_a_decode_stream_that_breaks_ends_with_an_error_event(cluster) -> None:
    c = await cluster()
    c.prefill[0].mode, c.decode[0].mode = "hang", "break"
    async with c.http.stream("POST", "/v1/completions", json={**PROMPT, "stream": True}) as resp:
        assert resp.status_code == 200
        got = b"".join([chunk async for chunk in resp.aiter_bytes()])
    events = [e for e in got.decode().split("\n\n") if e]
    assert [json.loads(e.removeprefix("data: ")) for e in events[:2]] == [
        {"id": "d0", "i": 0},
        {"id": "d0", "i": 1},
    ]
    assert len(events) == 3
    error = json.loads(events[2].removeprefix("data: "))["error"]
    assert error["message"].startswith(f"decode server {c.decode[0].url} failed: its stream broke")
    await within(c.prefill[0].cancelled)


async def test_a_prefill_error_after_the_stream_started_is_an_error_event(cluster) -> None:
    c = await cluster()
    prefill, decode = c.prefill[0], c.decode[0]
    decode.mode = "slow"
    prefill.mode, prefill.gate = "error", decode.first_sent
    async with c.http.stream("POST", "/v1/completions", json={**PROMPT, "stream": True}) as resp:
        assert resp.status_code == 200
        got = b"".join([chunk async for chunk in resp.aiter_bytes()])
    last = got.decode().strip().split("\n\n")[-1]
    assert json.loads(last.removeprefix("data: "))["error"]["message"] == "p0 says no"
    await within(decode.cancelled)


async def test_a_client_that_leaves_mid_stream_cancels_both_legs(cluster) -> None:
    c = await cluster()
    prefill, decode = c.prefill[0], c.decode[0]
    prefill.mode, decode.mode = "hang", "slow"
    async with c.http.stream("POST", "/v1/completions", json={**PROMPT, "stream": True}) as resp:
        await asyncio.wait_for(resp.aiter_bytes().__anext__(), TIMEOUT_S)
    # leaving the block without reading on closes the connection
    await within(decode.cancelled)
    await within(prefill.cancelled)
    leg = "stallfree:router_leg_failures_total"
    deadline = time.monotonic() + TIMEOUT_S
    while await c.metric(leg, leg="client") != 1:
        assert time.monotonic() < deadline, "the client's leaving was never counted"
        await asyncio.sleep(0.02)
    assert await c.metric("stallfree:router_requests_total", route="completions", status="499") == 1


async def test_a_prefill_still_running_after_the_answer_is_cancelled_after_the_grace(
    cluster,
) -> None:
    c = await cluster(grace_s=GRACE_S)
    c.prefill[0].mode = "hang"
    resp = await c.http.post("/v1/completions", json=PROMPT)
    assert resp.status_code == 200 and resp.json()["id"] == "d0"
    # order: the answer came first, with the prefill leg still open; the grace ends it after
    assert not c.prefill[0].cancelled.is_set()
    await within(c.prefill[0].cancelled)
    assert c.running is not None
    deadline = time.monotonic() + TIMEOUT_S
    while c.running.router.lingering:
        assert time.monotonic() < deadline, "the cancelled prefill leg is still lingering"
        await asyncio.sleep(0.01)


async def test_a_refused_handshake_stops_start_up_naming_the_pair(cluster, capsys) -> None:
    c = await cluster(decode=2, start=False)
    c.decode[1].connect_status = 409
    c.decode[1].connect_message = "page size 16 here, 32 on the prefill"
    line = (
        f"router: decode {c.decode[1].url} cannot work with prefill {c.prefill[0].url}: "
        "page size 16 here, 32 on the prefill"
    )
    with pytest.raises(StartupError) as exc:
        await c.start()
    assert exc.value.exit_code == 2 and str(exc.value) == line
    assert await serve_router(c.settings(), configure_logs=False) == 2
    assert capsys.readouterr().err.strip().splitlines() == [line]


async def test_a_server_that_never_comes_up_is_named(cluster, capsys) -> None:
    c = await cluster(start=False)
    c.decode[0].healthy = False
    assert await serve_router(c.settings(startup_timeout_s=0.3), configure_logs=False) == 1
    err = capsys.readouterr().err
    assert f"decode {c.decode[0].url} (HTTP 503)" in err and c.prefill[0].url not in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b'["a", "list"]', "must be a JSON object, not list"),
        (b'{"prompt": "\\ud800"}', "lone surrogate"),
        (b'{"prompt": "\xff"}', "not valid JSON"),
        (b'{"prompt": "a", "temperature": NaN}', "NaN"),
        (b"[" * 100_000, "not valid JSON"),
    ],
    ids=["not-json", "a-list", "lone-surrogate", "not-utf8", "nan", "deep"],
)
async def test_a_bad_body_is_a_400_and_reaches_no_server(cluster, content, message) -> None:
    c = await cluster()
    resp = await c.http.post("/v1/completions", content=content)
    assert resp.status_code == 400
    assert message in resp.json()["error"]["message"]
    assert not c.prefill[0].bodies and not c.decode[0].bodies


async def test_a_body_over_the_limit_is_a_413(cluster) -> None:
    c = await cluster(max_body_bytes=1000)
    big = {**PROMPT, "prompt": "x" * 2000}
    resp = await c.http.post("/v1/completions", json=big)
    assert resp.status_code == 413

    async def chunked():  # no Content-Length: counted as it is read
        for _ in range(4):
            yield b" " * 400

    resp = await c.http.post("/v1/completions", content=chunked())
    assert resp.status_code == 413
    assert (await c.http.post("/v1/completions", json=PROMPT)).status_code == 200
    assert not c.prefill[0].bodies[1:]


async def test_the_api_key_is_required_and_passed_on(cluster) -> None:
    c = await cluster(api_key="sekrit")
    assert (await c.http.post("/v1/completions", json=PROMPT)).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert (await c.http.post("/v1/completions", json=PROMPT, headers=wrong)).status_code == 401
    assert (await c.http.get("/v1/models")).status_code == 401
    assert not c.prefill[0].bodies
    right = {"Authorization": "Bearer sekrit"}
    assert (await c.http.post("/v1/completions", json=PROMPT, headers=right)).status_code == 200
    assert c.prefill[0].headers[0]["authorization"] == "Bearer sekrit"
    assert c.decode[0].headers[0]["authorization"] == "Bearer sekrit"
    assert (await c.http.get("/health")).status_code == 200  # probes stay open


async def test_health_and_models_follow_the_servers(cluster, monkeypatch) -> None:
    monkeypatch.setattr(router_pool, "HEALTH_TTL_S", 0.0)
    c = await cluster(decode=2)
    resp = await c.http.get("/health")
    assert resp.status_code == 200 and resp.json() == {"status": "ok"}
    assert (await c.http.get("/v1/models")).json()["data"][0]["id"] == "d0"
    c.decode[0].healthy = False
    assert (await c.http.get("/v1/models")).json()["data"][0]["id"] == "d1"
    assert (await c.http.get("/health")).status_code == 200
    c.decode[1].healthy = False
    resp = await c.http.get("/health")
    assert resp.status_code == 503 and set(resp.json()["down"]) == {d.url for d in c.decode}
    assert (await c.http.get("/v1/models")).status_code == 503


async def test_metrics_count_requests_and_leg_failures(cluster) -> None:
    c = await cluster()
    for _ in range(2):
        assert (await c.http.post("/v1/completions", json=PROMPT)).status_code == 200
    c.prefill[0].mode, c.decode[0].mode = "error", "hang"  # a decode server waits for its KV
    assert (await c.http.post("/v1/chat/completions", json=CHAT)).status_code == 400
    m = c.metric
    assert await m("stallfree:router_requests_total", route="completions", status="200") == 2
    assert await m("stallfree:router_requests_total", route="chat", status="400") == 1
    assert await m("stallfree:router_request_seconds_count", route="completions") == 2
    assert await m("stallfree:router_first_byte_seconds_count", route="completions") == 2
    assert await m("stallfree:router_leg_failures_total", leg="prefill") == 1
    assert await m("stallfree:router_leg_failures_total", leg="decode") == 0
    for server in (c.prefill[0].url, c.decode[0].url):
        assert await m("stallfree:router_inflight_requests", server=server) == 0


def test_the_flags_take_sglangs_spellings(capsys) -> None:
    argv = ["router", "--pd-disaggregation", "--prefill", "http://10.0.0.1:30000", "9000"]
    argv += ["--prefill", "http://10.0.0.2:30000/", "9001", "--prefill", "http://10.0.0.3:1"]
    argv += ["--decode", "http://10.0.0.4:30001", "--decode", "http://10.0.0.5:30001"]
    argv += ["--policy", "least_load", "--port", "0", "--api-key", "k"]
    settings = router_settings(parse(build_parser(), argv))
    assert settings.prefill == (
        Upstream("http://10.0.0.1:30000", 9000),
        Upstream("http://10.0.0.2:30000", 9001),
        Upstream("http://10.0.0.3:1", DEFAULT_BOOTSTRAP_PORT),
    )
    assert settings.prefill[0].host == "10.0.0.1"
    assert [u.url for u in settings.decode] == ["http://10.0.0.4:30001", "http://10.0.0.5:30001"]
    assert (settings.policy, settings.port, settings.api_key) == ("least_load", 0, "k")
    # a missing kind is one line and status 2
    args = parse(build_parser(), ["router", "--prefill", "http://10.0.0.1:30000"])
    assert run_command(args) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "router: at least one --decode URL is required"
    ]
    router = subparsers(build_parser()).choices["router"]
    formatter = router._get_formatter()
    for action in router._actions:
        if action.option_strings and action.dest != "help":
            assert "default" in (formatter._get_help_string(action) or ""), action.dest
    assert "--prefill URL [BOOTSTRAP_PORT]" in router.format_usage()
    for bad in (["--prefill", "http://a:1", "99999"], ["--decode", "ftp://a"], ["--port", "65536"]):
        with pytest.raises(SystemExit) as exc:
            parse(build_parser(), ["router", *bad])
        assert exc.value.code == 2


async def test_the_command_announces_its_url_and_stops_on_sigterm(cluster) -> None:
    c = await cluster(start=False)
    argv = ["-m", "stallfree", "router", "--port", "0", "--prefill", c.prefill[0].url, "9000"]
    argv += ["--decode", c.decode[0].url]
    env = {**os.environ, "NO_PROXY": "*"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().strip()
        assert line.startswith("router: listening on http://127.0.0.1:"), line
        url = line.rsplit(" ", 1)[1]
        resp = await c.http.post(f"{url}/v1/completions", json=PROMPT)
        assert resp.status_code == 200 and resp.json()["id"] == "d0"
        assert c.prefill[0].bodies[0]["bootstrap_port"] == 9000
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(proc.wait(), 10)
        await c.http.aclose()
    assert rc == 0
