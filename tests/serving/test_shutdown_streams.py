"""Shutdown with clients that do not read: at the end of the grace period their connections
are reset at once, and the server stops promptly, logging one WARNING and no traceback.

The clients are raw sockets with a small receive buffer that never read; the server's listening
socket gets a small send buffer (accepted sockets inherit it), so their writes stall within a
second. The log is watched only once the server runs: uvicorn configures its loggers as it
starts, dropping handlers added before.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import httpx

from stallfree.entrypoints.server import RunningServer
from tests.engine_util import settle
from tests.http_util import NO_EOS, completion, finished, read_to_end, serving, warnings_logged

GRACE_S = 0.5
# liveness: a server not stopped this long after its drain began is a failure; far inside the
# 60 s write timeout the stalled writers would otherwise hold it for
STOP_TIMEOUT_S = 15.0


def shrink_send_buffers(server: RunningServer) -> None:
    for listener in server.server.servers:
        for sock in listener.sockets:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)


def never_reading(port: int, body: dict[str, Any]) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


async def until(predicate: Any, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def stalled(server: RunningServer) -> int:
    budget = server.server.config.http.budget  # type: ignore[union-attr]
    return sum(conn.flow.write_paused for conn in budget.live)


async def sse_events(http: httpx.AsyncClient, body: dict[str, Any]) -> list[str]:
    async with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        assert r.status_code == 200
        return [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]


def quiet(records: list[Any]) -> None:
    """One WARNING (the grace period is over) and nothing else: no error, no traceback."""
    assert [r.levelname for r in records] == ["WARNING"], [r.getMessage() for r in records]
    assert "grace period over" in records[0].getMessage()
    assert not any(r.exc_info for r in records)


async def test_streams_that_are_not_read_are_reset_at_the_deadline_and_the_server_stops():
    server = {"graceful_shutdown_s": GRACE_S, "write_timeout_s": 60}
    # room for every request at once: none waits behind the paused ones
    async with serving(server=server, cache={"max_total_tokens": 33 * 1100}) as live:
        shrink_send_buffers(live.server)
        body = completion(max_tokens=1000, n=4, logprobs=20, stream=True) | NO_EOS
        socks = [never_reading(live.port, body) for _ in range(8)]
        # one client that reads: it gets its error event and [DONE]
        reading = asyncio.create_task(sse_events(live.http, completion(max_tokens=1000) | NO_EOS))
        await until(lambda: stalled(live.server) == 8)
        with warnings_logged() as records:
            live.server.drain()
            assert await asyncio.wait_for(live.server.wait(), STOP_TIMEOUT_S) == 0
        quiet(records)
        assert "(8 connections not reading closed)" in records[0].getMessage()
        events = await reading
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "shutting_down"
        for sock in socks:
            assert b"data: [DONE]" not in await read_to_end(sock)
        await settle(live.engine)
        assert finished(live.engine, "abort") == 8 * 4 + 1


async def test_an_answer_left_unread_does_not_hold_the_stop():
    # the request finished before the drain, and all of its answer (about 40 KB, under the
    # write buffer's high-water mark) was written; what the kernel did not take waits in the
    # write buffer of a client that does not read. uvicorn would wait 5 s for it to drain,
    # then log an error
    server = {"graceful_shutdown_s": GRACE_S, "write_timeout_s": 60}
    async with serving(server=server) as live:
        shrink_send_buffers(live.server)
        sock = never_reading(live.port, completion(max_tokens=60, logprobs=20) | NO_EOS)
        lifecycle = live.server.server.sf.lifecycle
        await until(lambda: finished(live.engine, "length") == 1 and lifecycle.in_flight == 0)
        budget = live.server.server.config.http.budget  # type: ignore[union-attr]
        assert any(conn.transport.get_write_buffer_size() > 0 for conn in budget.live)
        with warnings_logged() as records:
            live.server.drain()
            assert await asyncio.wait_for(live.server.wait(), STOP_TIMEOUT_S) == 0
        # nothing ran past the grace period (uvicorn's own 5 s wait for the unread buffer
        # would end in an error line): nothing is logged
        assert records == [], [r.getMessage() for r in records]
        assert (await read_to_end(sock)).startswith(b"HTTP/1.1 200")
        await settle(live.engine)
