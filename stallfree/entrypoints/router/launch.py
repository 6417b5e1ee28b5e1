"""Running the router: `serve_router` (the `stallfree router` command) and `start_router` (a
router on the current event loop, for tests).

Start-up binds the listening address first (so a taken port fails at once), then checks the
servers (`startup`), and only then listens; stdout gets one line, `router: listening on URL`,
once it does (with `--port 0`, the port picked). The first SIGTERM or SIGINT stops listening
and gives the requests in progress `SHUTDOWN_GRACE_S` to finish, then cuts them (which closes
both of their legs); a second signal exits at once. A stop on a signal exits with status 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType

import uvicorn
from uvicorn.logging import DefaultFormatter

from stallfree.entrypoints.router.app import create_app
from stallfree.entrypoints.router.dispatch import PREFILL_GRACE_S, Router
from stallfree.entrypoints.router.flags import RouterSettings
from stallfree.entrypoints.router.startup import StartupError, check_servers

logger = logging.getLogger("stallfree.router")

SHUTDOWN_GRACE_S = 30


class RouterServer(uvicorn.Server):
    """uvicorn's server with the signal handling of the module docstring (uvicorn's own
    re-raises the signal once it has stopped, so the process would die of it)."""

    def __init__(self, config: uvicorn.Config, handle_signals: bool) -> None:
        super().__init__(config)
        self.handle_signals = handle_signals
        self._signals = 0

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {
            sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._signals += 1
        self.should_exit = True
        if self._signals > 1:
            self.force_exit = True


@dataclass(slots=True)
class RunningRouter:
    """A router serving as a task on the current event loop."""

    router: Router
    server: RouterServer
    task: asyncio.Task[None]
    url: str

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to `host:port` (0: a free port), not yet listening."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def start_router(
    settings: RouterSettings,
    sock: socket.socket | None = None,
    prefill_grace_s: float = PREFILL_GRACE_S,
    handle_signals: bool = False,
    log_level: str = "warning",
) -> RunningRouter:
    """Check the servers, then serve on `sock` (default: `settings.host:port` bound here);
    returns once it listens. StartupError when the checks fail (the socket is closed)."""
    sock = sock if sock is not None else bind(settings.host, settings.port)
    router = Router(settings, prefill_grace_s)
    try:
        await check_servers(router)
    except BaseException:
        await router.aclose()
        sock.close()
        raise
    config = uvicorn.Config(
        create_app(router),
        lifespan="on",
        log_level=log_level,
        access_log=False,
        timeout_keep_alive=settings.keep_alive_s,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    server = RouterServer(config, handle_signals)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("the router exited during startup")
        await asyncio.sleep(0.01)
    return RunningRouter(router, server, task, url_of(sock))


def _configure_logging() -> None:
    """The router's log lines look like uvicorn's, on stderr."""
    log = logging.getLogger("stallfree.router")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(DefaultFormatter("%(levelprefix)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


async def serve_router(settings: RouterSettings, configure_logs: bool = True) -> int:
    """`stallfree router`: serve until a signal; the exit status (module docstring; 1 or 2
    when start-up fails, with the reason on stderr). `configure_logs`: give the router's
    logger a stderr handler of its own (the command does; a test keeps pytest's)."""
    if configure_logs:
        _configure_logging()
    try:
        sock = bind(settings.host, settings.port)
    except OSError as exc:
        print(f"router: cannot listen on {settings.host}:{settings.port}: {exc}", file=sys.stderr)
        return 2
    try:
        running = await start_router(settings, sock, handle_signals=True, log_level="info")
    except StartupError as exc:
        print(exc, file=sys.stderr)
        return exc.exit_code
    print(f"router: listening on {running.url}", flush=True)
    await running.task
    return 0
