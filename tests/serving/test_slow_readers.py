"""Clients that stop reading a response: `server.write_timeout_s` closes a connection that
accepts no bytes for that long, its requests are aborted and freed, and what the server holds
for such clients meanwhile stays bounded (the engine pauses a stream whose reader is behind).

The clients are raw sockets with a small receive buffer that send a request and never read.
The server's listening socket gets a small send buffer too (accepted sockets inherit it), so
the kernel's buffers fill after a few KB instead of megabytes and the server's own write buffer
stalls within a second.
"""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import time
from typing import Any

from stallfree.entrypoints.server import RunningServer
from stallfree.entrypoints.server.transport.connections import ConnectionBudget
from stallfree.runtime.telemetry.stats import EngineCounters
from tests.engine_util import settle
from tests.http_util import NO_EOS, completion, finished, read_to_end, serving

CLIENTS = 8
CHOICES = 16
MAX_TOKENS = 600
MAX_UNREAD = 128  # scheduler.max_unread_tokens
# what the server may hold per never-reading client: 16 choices x max_unread_tokens (128) and a
# chunk, each token with 21 logprobs (about 3 KB as Python objects) and its KV, plus a 64 KiB
# write buffer: about 7 MB (measured: 6.3). Unbounded, it grows with the output for as long as
# the connection stays open. RSS is the test process's: the server runs in it.
RSS_BOUND_MB_PER_CLIENT = 12


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def budget(server: RunningServer) -> ConnectionBudget:
    return server.server.config.http.budget  # type: ignore[union-attr]


def shrink_send_buffers(server: RunningServer) -> None:
    for listener in server.server.servers:
        for sock in listener.sockets:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)


def request_bytes(route: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


def never_reading(port: int, body: dict[str, Any], route: str = "/v1/completions") -> socket.socket:
    """A connection that sends `body` and then reads nothing (until the test reads it out)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(request_bytes(route, body))
    return sock


async def until(predicate: Any, timeout: float = 30, each: Any = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        if each is not None:
            each()
        await asyncio.sleep(0.02)


def _sections(write_timeout_s: float, clients: int) -> dict[str, Any]:
    requests = clients * CHOICES
    return {
        "server": {"write_timeout_s": write_timeout_s, "max_concurrent_requests": clients},
        # every choice is admitted at once: each stream starts writing
        "cache": {"max_running_requests": requests, "max_total_tokens": requests * 640},
    }


async def test_clients_that_never_read_are_closed_and_their_requests_freed():
    # long enough for every stream to fall max_unread_tokens behind first (about 2 s here)
    async with serving(**_sections(4.0, CLIENTS)) as live:
        shrink_send_buffers(live.server)
        assert (await live.http.post("/v1/completions", json=completion())).status_code == 200
        conns = budget(live.server)
        gc.collect()
        before = rss_mb()
        peak = before

        def sample() -> None:
            nonlocal peak
            peak = max(peak, rss_mb())

        def counters() -> EngineCounters:
            return live.engine.snapshot().counters

        body = completion(max_tokens=MAX_TOKENS, n=CHOICES, logprobs=20, stream=True)
        body["ignore_eos"] = True
        socks = [never_reading(live.port, body) for _ in range(CLIENTS)]
        requests = CLIENTS * CHOICES
        await until(lambda: conns.write_timeouts == CLIENTS, each=sample)
        growth = peak - before
        print(f"RSS growth with {CLIENTS} never-reading clients: {growth:.1f} MB")
        assert growth < RSS_BOUND_MB_PER_CLIENT * CLIENTS, f"RSS grew {growth:.0f} MB"
        # before they were closed, the engine paused every choice once its reader was
        # max_unread_tokens behind (the fan-out's reader holds at most a chunk per choice)
        assert counters().backpressure_pauses == requests
        assert counters().generation_tokens <= requests * (MAX_UNREAD + 32)

        for sock in socks:
            sent = await read_to_end(sock)
            assert sent.startswith(b"HTTP/1.1 200"), sent[:100]
            assert b"data: [DONE]" not in sent  # cut off mid-stream
        await settle(live.engine)
        assert finished(live.engine, "abort") == requests
        # the request slots are back: max_concurrent_requests is CLIENTS. A handler leaves the
        # count when its response task ends, which can be a loop turn after the engine settles
        lifecycle = live.server.server.sf.lifecycle
        await until(lambda: lifecycle.in_flight == 0 and not lifecycle.admitted, timeout=10)
        again = [live.http.post("/v1/completions", json=completion()) for _ in range(CLIENTS)]
        assert {r.status_code for r in await asyncio.gather(*again)} == {200}


async def test_a_slow_reader_that_keeps_reading_is_never_closed():
    async with serving(**_sections(0.5, 1)) as live:
        shrink_send_buffers(live.server)
        conns = budget(live.server)
        body = completion(max_tokens=80, n=4, logprobs=20, stream=True) | NO_EOS
        sock = never_reading(live.port, body)
        sock.setblocking(False)
        received = b""
        stalled = False
        # 8 KB every 0.1 s: slower than the server writes (its writes stall), but never
        # still for 0.5 s
        while not received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):  # the last chunk
            await asyncio.sleep(0.1)
            stalled = stalled or any(conn.flow.write_paused for conn in conns.live)
            try:
                data = sock.recv(8192)
            except BlockingIOError:
                continue
            assert data, "closed by the server"
            received += data
        sock.close()
        assert stalled and conns.write_timeouts == 0
        assert received.count(b'"finish_reason":"length"') == 4
        await settle(live.engine)


async def test_a_whole_answer_the_client_does_not_read_is_dropped_after_the_timeout():
    async with serving(**_sections(0.5, 1)) as live:
        shrink_send_buffers(live.server)
        # one JSON body of about 1 MB: written whole, it waits in the server's write buffer
        body = completion(max_tokens=150, n=CHOICES, logprobs=20) | NO_EOS
        sock = never_reading(live.port, body)
        conns = budget(live.server)
        await until(lambda: conns.write_timeouts == 1)
        sent = await read_to_end(sock)
        assert sent.startswith(b"HTTP/1.1 200")
        await settle(live.engine)
        # the answer was complete before the write stalled: nothing was aborted
        assert finished(live.engine, "length") == CHOICES
        assert live.server.server.sf.lifecycle.in_flight == 0


async def test_the_write_timeout_closes_a_native_stream_too():
    async with serving(**_sections(0.5, 1)) as live:
        shrink_send_buffers(live.server)
        params = {"max_new_tokens": 2000, "ignore_eos": True, "logprobs": 20}
        body = {"text": "hello", "sampling_params": params, "stream": True}
        sock = never_reading(live.port, body, route="/generate")
        conns = budget(live.server)
        await until(lambda: conns.write_timeouts == 1)
        assert b"[DONE]" not in await read_to_end(sock)
        await settle(live.engine)
        assert finished(live.engine, "abort") == 1
