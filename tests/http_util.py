"""A server on the `tiny` preset in the test's loop, for the HTTP limit and shutdown tests, and
what they share: request bodies, the slow-step fault, counting finishes, catching warnings, and
`stallfree serve` in a subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from stallfree import Engine
from stallfree.entrypoints.server import RunningServer, create_app, start_server
from tests.engine_util import engine_config

ROOT = Path(__file__).resolve().parents[1]
MODEL = "m"
NO_EOS = {"ignore_eos": True, "temperature": 0}
# every step sleeps this long: requests last a predictable while
SLOW = {"enabled": True, "slow_step_rate": 1.0, "slow_step_seconds": 0.02}


@dataclass
class Live:
    engine: Engine
    server: RunningServer
    http: httpx.AsyncClient

    @property
    def port(self) -> int:
        return self.server.port


@contextlib.asynccontextmanager
async def serving(**sections: Any) -> AsyncIterator[Live]:
    sections.setdefault("server", {}).setdefault("served_model_name", MODEL)
    # NOTE: these tests time the server; the suite's mirror checks wait for the stream on the
    # event loop (conftest), which would stall it for every slow step
    sections.setdefault("runtime", {}).setdefault("check_mirrors", False)
    engine = Engine(engine_config("tiny", **sections))
    server = await start_server(create_app(engine))
    http = httpx.AsyncClient(
        base_url=server.url, timeout=10, limits=httpx.Limits(max_connections=200)
    )
    try:
        yield Live(engine, server, http)
    finally:
        await http.aclose()
        await server.stop()
        await engine.shutdown()


def finished(engine: Engine, reason: str) -> int:
    return engine.snapshot().counters.finished.get(reason, 0)


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 4, **fields}


@contextlib.contextmanager
def warnings_logged() -> Iterator[list[logging.LogRecord]]:
    """Every record of WARNING or above, from every logger (uvicorn's do not propagate)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if not any(r is record for r in records):  # seen once per logger it passes
                records.append(record)

    handler = Keep(logging.WARNING)
    names = ["", "uvicorn", "uvicorn.error", "uvicorn.access", "asyncio", "stallfree"]
    for name in names:
        logging.getLogger(name).addHandler(handler)
    try:
        yield records
    finally:
        for name in names:
            logging.getLogger(name).removeHandler(handler)


async def read_to_end(sock: socket.socket, timeout: float = 5) -> bytes:
    """What `sock` still holds until the server's reset (or close); fails (timeout) if the
    server never ends the connection. Read on a worker thread: the server runs on this event
    loop, and an aborted connection's socket is closed by a callback the loop runs after the
    abort (and after the write timeout it counts), so a blocking read here held the loop and
    timed out whenever the test looked between the two."""
    return await asyncio.to_thread(_read_to_end, sock, timeout)


def _read_to_end(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    parts = []
    try:
        while data := sock.recv(1 << 16):
            parts.append(data)
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    return b"".join(parts)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def stallfree_serve(*flags: str, **env: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    port = _free_port()
    environ = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false", **env)
    cmd = [sys.executable, "-m", "stallfree.entrypoints.cli", "serve", "--model", "tiny"]
    cmd += ["--device", "cpu", "--port", str(port), "--served-model-name", MODEL, *flags]
    proc = subprocess.Popen(
        cmd, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.1)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


async def get_on(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str, timeout: float
) -> int | str:
    """GET `path` on an open (kept-alive) connection: the answer's status, or the name of how
    the connection ended without one (a reset, an incomplete read)."""
    writer.write(f"GET {path} HTTP/1.1\r\nhost: test\r\n\r\n".encode())
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        length = next(
            int(line.split(b":")[1]) for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )  # fmt: skip
        await asyncio.wait_for(reader.readexactly(length), timeout)
    except (ConnectionError, asyncio.IncompleteReadError) as exc:
        return type(exc).__name__
    return int(head.split(b" ", 2)[1])
