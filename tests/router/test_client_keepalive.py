"""Our HTTP servers keep a client's idle connection longer than clients' pools keep theirs
(issue 42): the router (`--timeout-keep-alive`, 120 s) and `stallfree serve` (the same flag,
`server.keep_alive_s`).

A 1,000-request PD soak (benchmarks/pd_soak.py) lost 2 requests in each run, ReadError on the
client's connection to the router with nothing in any log, and the decode server never saw
them. The client is one httpx pool: it reuses idle connections up to its keepalive_expiry (5 s)
and, with 1,000 requests in flight, many at just that age; the router closed idle connections
at uvicorn's default 5 s. The router runs on uvloop, whose loop runs the timers that fell due
while it was busy before it polls the sockets again, so a request that came in the meantime is
still unread when the keep-alive timer closes its connection: the kernel resets it (a close with
unread data) and no one logs anything. `test_a_connection_reused_at_a_clients_keep_alive_expiry
_is_answered` holds the router's loop in an I/O callback while such requests arrive: with the
5 s keep-alive, each connection was reset (4 of 4); now each is answered."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvloop
from fastapi import FastAPI

from stallfree.cli import build_parser
from stallfree.config.server import KEEP_ALIVE_S
from stallfree.entrypoints.cli import config_from_args
from stallfree.entrypoints.router.flags import RouterSettings, router_settings
from stallfree.entrypoints.router.launch import start_router
from stallfree.entrypoints.server.launch import uvicorn_config
from tests.http_util import get_on

# how long clients' pools keep an idle connection by default: httpx; Go's and hyper's (reqwest,
# the Rust routers), the longest of the common ones
HTTPX_KEEPALIVE_S = 5.0
GO_HYPER_KEEPALIVE_S = 90.0
CONNECTIONS = 4
LIVENESS_S = 30.0


class RouterThread:
    """The router on a uvloop loop in a thread of its own, as `stallfree router` runs it."""

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.ready = threading.Event()
        self.url = ""
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.thread = threading.Thread(target=uvloop.run, args=(self._main(),), daemon=True)

    async def _main(self) -> None:
        self.loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        running = await start_router(self.settings)
        self.url = running.url
        self.ready.set()
        await self._stop.wait()
        await running.stop()

    def stop(self) -> None:
        if self.loop is not None and self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(LIVENESS_S)

    def hold(self, until: float, sent: threading.Event) -> threading.Event:
        """Keep the router's loop busy in an I/O callback (after a poll, before the timers
        due by then run) until `sent` is set and the clock passes `until`; returns the event
        set once it is busy."""
        busy, (trigger, pulled) = threading.Event(), socket.socketpair()
        loop = self.loop
        assert loop is not None

        def busy_loop() -> None:
            loop.remove_reader(pulled.fileno())
            busy.set()
            sent.wait(LIVENESS_S)
            time.sleep(max(0.0, until - time.monotonic()))
            trigger.close()
            pulled.close()

        loop.call_soon_threadsafe(loop.add_reader, pulled.fileno(), busy_loop)
        trigger.send(b"x")
        return busy


async def test_a_connection_reused_at_a_clients_keep_alive_expiry_is_answered(cluster) -> None:
    c = await cluster(start=False)
    router = RouterThread(c.settings())
    router.thread.start()
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        assert await asyncio.to_thread(router.ready.wait, LIVENESS_S)
        port = int(router.url.rsplit(":", 1)[1])
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(CONNECTIONS)]
        assert [await get_on(*conn, "/metrics", LIVENESS_S) for conn in conns] == [
            200
        ] * CONNECTIONS
        answered = time.monotonic()  # each keep-alive timer started before this
        await asyncio.sleep(HTTPX_KEEPALIVE_S - 1.0)
        # busy past the moment httpx's pool would let the connections go
        sent = threading.Event()
        busy = router.hold(answered + HTTPX_KEEPALIVE_S + 0.5, sent)
        assert await asyncio.to_thread(busy.wait, LIVENESS_S)
        # sent as httpx's pool reuses them: just under 5 s idle
        await asyncio.sleep(max(0.0, answered + HTTPX_KEEPALIVE_S - 0.2 - time.monotonic()))
        requests = [asyncio.create_task(get_on(*conn, "/metrics", LIVENESS_S)) for conn in conns]
        await asyncio.sleep(0.05)  # written
        sent.set()
        assert await asyncio.gather(*requests) == [200] * CONNECTIONS
    finally:
        for _, writer in conns:
            writer.close()
        await asyncio.to_thread(router.stop)


async def test_the_router_keeps_idle_connections_as_its_flag_says(cluster) -> None:
    parser = build_parser()
    argv = ["router", "--prefill", "http://10.0.0.1:1", "--decode", "http://10.0.0.2:1"]
    default = router_settings(parser.parse_args(argv))
    assert default.keep_alive_s == KEEP_ALIVE_S > GO_HYPER_KEEPALIVE_S
    assert (
        router_settings(parser.parse_args([*argv, "--timeout-keep-alive", "120"])).keep_alive_s
        == 120
    )
    for bad in ("0", "-5", "1.5", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args([*argv, "--timeout-keep-alive", bad])
    c = await cluster(keep_alive_s=120)
    assert c.running is not None
    assert c.running.server.config.timeout_keep_alive == 120  # what uvicorn runs with


def test_the_server_keeps_idle_connections_as_its_flag_says() -> None:
    def keep_alive(*flags: str) -> float:
        config = config_from_args(build_parser().parse_args(["serve", "m", *flags]))
        return float(uvicorn_config(FastAPI(), config).timeout_keep_alive)

    assert keep_alive() == KEEP_ALIVE_S
    assert keep_alive("--timeout-keep-alive", "30") == 30.0
    for bad in ("0", "-1"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "m", "--timeout-keep-alive", bad])
