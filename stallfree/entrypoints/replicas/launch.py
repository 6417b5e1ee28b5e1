"""`serve_replicas`: `stallfree serve --data-parallel-size N`.

Start-up binds the front's address first (a taken port fails at once, before any model loads),
starts the N replicas, waits until each answers `/health` with 200 (a replica that exits
meanwhile stops the start: status 1, its reason in its own log lines above), then serves.

Shutdown. The first SIGTERM or SIGINT is passed to every replica, which drains as one server
does (its `/health` and new requests answer 503 with Retry-After, its requests in progress run
on up to `server.graceful_shutdown_s`); the front relays until the last replica has exited,
then stops, with status 0. A second signal is passed on too (the replicas end their grace at
once); a third kills them. Once every replica has exited without a signal, the front stops
with status 1.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from multiprocessing.process import BaseProcess
from types import FrameType

import uvicorn

from stallfree.config import StallfreeConfig
from stallfree.entrypoints.replicas.app import create_front_app
from stallfree.entrypoints.replicas.children import start_replica, stop_replicas
from stallfree.entrypoints.replicas.front import Front
from stallfree.entrypoints.router.launch import RouterServer, bind, url_of
from stallfree.entrypoints.router.startup import StartupError, wait_until_up
from stallfree.entrypoints.server.launch import configure_logging, uvicorn_config

logger = logging.getLogger("stallfree.replicas")
# how long the replicas get to exit after the front stops, beyond their own grace
_STOP_MARGIN_S = 10.0


def check_replicas(config: StallfreeConfig) -> None:
    """ValueError for what does not combine with data-parallel replicas."""
    if config.disaggregation.mode != "null":
        raise ValueError(
            "--data-parallel-size does not combine with --disaggregation-mode: run prefill and "
            "decode servers behind `stallfree router` instead"
        )
    par = config.parallel
    if par.nnodes > 1 or par.dist_init_addr is not None:
        raise ValueError(
            "--data-parallel-size runs every replica on this machine, each replica's "
            "tensor-parallel ranks meeting at a free local port of its own: leave --nnodes and "
            "--dist-init-addr unset"
        )


class FrontServer(RouterServer):
    """uvicorn's server with the shutdown of the module docstring."""

    def __init__(self, config: uvicorn.Config, front: Front) -> None:
        super().__init__(config, handle_signals=True)
        self.front = front
        self.exit_code = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._signals += 1
        if self._signals <= 2:
            self.front.begin_drain()
        else:
            self.front.begin_drain(signal.SIGKILL)
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if self.front.exited.is_set():
            self.exit_code = 0 if self.front.draining else 1
            return True
        return False


async def _first_exit(processes: list[BaseProcess]) -> BaseProcess:
    while True:
        for proc in processes:
            if not proc.is_alive():
                return proc
        await asyncio.sleep(0.25)


async def wait_ready(front: Front) -> None:
    """Until every replica answers /health with 200; StartupError if one exits first or they
    are not up within `replicas.startup_timeout_s`."""
    servers = [r.server for r in front.replicas]
    timeout = front.config.replicas.startup_timeout_s
    up = asyncio.create_task(wait_until_up(front.router.client, servers, timeout))
    died = asyncio.create_task(_first_exit(front.processes))
    try:
        await asyncio.wait({up, died}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        up.cancel()
        died.cancel()
    if died.done() and not died.cancelled():
        proc = died.result()
        raise StartupError(
            f"replicas: {proc.name} exited with code {proc.exitcode} while starting", 1
        )
    up.result()


async def _serve(config: StallfreeConfig, sock: socket.socket | None) -> int:
    processes: list[BaseProcess] = []
    try:
        urls = []
        for index in range(config.replicas.data_parallel_size):
            proc, url = start_replica(config, index)
            processes.append(proc)
            urls.append(url)
        front = Front(config, processes, urls)
        try:
            await wait_ready(front)
        except BaseException:
            await front.router.aclose()
            raise
        server = FrontServer(uvicorn_config(create_front_app(front), config), front)
        where = config.server.uds or (url_of(sock) if sock is not None else "?")
        logger.info("%d replicas up behind %s", len(processes), where)
        await server.serve(sockets=[sock] if sock is not None else None)
        return server.exit_code
    finally:
        grace = config.server.graceful_shutdown_s + _STOP_MARGIN_S
        await asyncio.to_thread(stop_replicas, processes, grace)


async def serve_replicas(config: StallfreeConfig) -> int:
    """Serve until a signal, then drain (module docstring); the exit status (1 when start-up
    fails, with the reason on stderr). ValueError for flags that do not combine."""
    check_replicas(config)
    configure_logging(config.server)
    sock = None
    if config.server.uds is None:
        try:
            sock = bind(config.server.host, config.server.port)
        except OSError as exc:
            where = f"{config.server.host}:{config.server.port}"
            print(f"stallfree: cannot listen on {where}: {exc}", file=sys.stderr)
            return 2
    try:
        return await _serve(config, sock)
    except StartupError as exc:
        print(exc, file=sys.stderr)
        return exc.exit_code
    finally:
        if sock is not None:
            sock.close()
