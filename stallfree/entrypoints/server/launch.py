"""Running the app: `serve` (the `stallfree serve` command) and `start_server` (an app on the
current event loop, for tests and benchmarks)."""

from __future__ import annotations

import asyncio
import signal
import socket
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI

from stallfree.config import StallfreeConfig
from stallfree.entrypoints.server.app import create_app


def _loop_name() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:  # pragma: no cover
        return "asyncio"
    return "uvloop"


def uvicorn_config(app: FastAPI, config: StallfreeConfig, **overrides: Any) -> uvicorn.Config:
    """uvicorn settings for `app`: uvloop, and SIGTERM drains in-flight requests first."""
    options: dict[str, Any] = {
        "host": config.server.host,
        "port": config.server.port,
        "loop": _loop_name(),
        "timeout_graceful_shutdown": config.server.graceful_shutdown_s,
        "log_level": "info",
        "lifespan": "on",
    }
    return uvicorn.Config(app, **(options | overrides))


def serve(config: StallfreeConfig) -> None:
    """Serve until SIGINT/SIGTERM; in-flight requests finish, then the engine drains."""
    app = create_app(config)
    # NOTE: uvicorn re-raises SIGTERM once it has drained; a drained shutdown exits 0 instead
    previous = signal.signal(signal.SIGTERM, _ignore_signal)
    try:
        uvicorn.Server(uvicorn_config(app, config)).run()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _ignore_signal(signum: int, frame: object) -> None:
    return None


@dataclass(slots=True)
class RunningServer:
    """A server running as a task on the current event loop (tests, benchmarks)."""

    server: uvicorn.Server
    task: asyncio.Task[None]
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def start_server(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> RunningServer:
    """Start `app` on `host:port` (0: a free port) in this event loop; returns once it listens."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("server exited during startup")
        await asyncio.sleep(0.01)
    return RunningServer(server, task, host, sock.getsockname()[1])
