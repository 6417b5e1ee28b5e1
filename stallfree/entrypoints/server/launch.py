"""Running the app: `serve` (the `stallfree serve` command) and `start_server` (an app on the
current event loop, for tests and benchmarks).

Shutdown. The first SIGTERM or SIGINT starts a drain: the server keeps listening, `/health`
answers 503 and new API requests get 503, while the requests in progress run on. When the last
one has finished, or `server.graceful_shutdown_s` has passed, the server stops. At that deadline
every request still running is aborted: a stream ends with an SSE error event, any other
request gets a JSON 503; a connection whose client is not reading (its writes stalled) is reset
instead, since that event could not reach it (`ConnectionBudget.stop_writes`), so the server
stops at the deadline rather than waiting out the cut-off and uvicorn's own wait, and nothing
is left for uvicorn to cancel. A second signal ends the grace period at once; a third exits
without waiting. A drained shutdown exits with status 0. `serve` also stops, with status 1,
when the engine dies (its scheduler stopped, or it failed closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI
from uvicorn.logging import DefaultFormatter

from stallfree.config import StallfreeConfig
from stallfree.config.settings import ServerConfig
from stallfree.entrypoints.server.app import create_app
from stallfree.entrypoints.server.base.state import ServerState
from stallfree.entrypoints.server.transport.connections import ConnectionBudget, guarded_protocol
from stallfree.entrypoints.server.transport.guard import PROBES

logger = logging.getLogger("stallfree.server")
# every line of the server's log starts with its time, uvicorn's and the engine's alike
# (`2026-01-31 12:00:00,123 INFO:     stallfree.server: ...`)
LOG_FORMAT = "%(asctime)s %(levelprefix)s %(name)s: %(message)s"

# after the grace period, how long aborted requests get to write their last event
_CUT_OFF_S = 5.0
# uvicorn's own wait for connections once the drain is over (it only bounds the last writes)
_CLOSE_WAIT_S = 5
# file descriptors kept for everything but client connections (model files, logs, pipes)
_FD_RESERVE = 128


def _loop_name() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:  # pragma: no cover
        return "asyncio"
    return "uvloop"


def max_connections(limits: ServerConfig) -> int:
    """`server.max_connections`, capped below the process's open-file limit."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):  # pragma: no cover
        return limits.max_connections
    if soft == resource.RLIM_INFINITY:
        return limits.max_connections
    return max(1, min(limits.max_connections, soft - _FD_RESERVE))


def uvicorn_config(app: FastAPI, config: StallfreeConfig, **overrides: Any) -> uvicorn.Config:
    """uvicorn settings for `app`: uvloop, the guarded HTTP protocol, keep-alive, logging, and
    the transport: TLS, a Unix socket instead of TCP, the proxy's root path."""
    limits = config.server
    options: dict[str, Any] = {
        "host": limits.host,
        "port": limits.port,
        "loop": _loop_name(),
        "http": guarded_protocol(
            max_connections(limits), limits.header_timeout_s, limits.write_timeout_s
        ),
        "timeout_keep_alive": limits.keep_alive_s,
        "timeout_graceful_shutdown": _CLOSE_WAIT_S,
        "log_level": limits.uvicorn_log_level or limits.log_level,
        "log_config": uvicorn_log_config(),
        "access_log": limits.access_log,
        "lifespan": "on",
        "root_path": limits.root_path,
    }
    if limits.uds is not None:
        options["uds"] = limits.uds
    if limits.tls:
        options |= {
            "ssl_keyfile": limits.ssl_keyfile,
            "ssl_certfile": limits.ssl_certfile,
            "ssl_ca_certs": limits.ssl_ca_certs,
            "ssl_cert_reqs": limits.ssl_cert_reqs,
        }
    result = uvicorn.Config(app, **(options | overrides))
    # uvicorn configured its loggers just now; the filter goes on after that
    _filter_probes(not limits.access_log_probes, limits.root_path)
    return result


def uvicorn_log_config() -> dict[str, Any]:
    """uvicorn's own logging configuration, each line led by its time."""
    config: dict[str, Any] = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    for formatter in config["formatters"].values():
        formatter["fmt"] = "%(asctime)s " + formatter["fmt"]
    return config


class _SkipProbes(logging.Filter):
    """Drops access-log lines of /health and /metrics (probes and scrapes), behind the proxy's
    `root_path` too (uvicorn logs the path with it)."""

    def __init__(self, root_path: str = "") -> None:
        super().__init__()
        self.root_path = root_path

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3:
            path = str(args[2]).partition("?")[0]
            if self.root_path and path.startswith(self.root_path):
                path = path[len(self.root_path) :]
            return path not in PROBES
        return True


def _filter_probes(on: bool, root_path: str = "") -> None:
    access = logging.getLogger("uvicorn.access")
    for f in [f for f in access.filters if isinstance(f, _SkipProbes)]:
        access.removeFilter(f)
    if on:
        access.addFilter(_SkipProbes(root_path))


def configure_logging(limits: ServerConfig) -> None:
    """The `stallfree` loggers print like uvicorn's, at `server.log_level`."""
    level = logging.getLevelName(limits.log_level.upper())
    if not isinstance(level, int):  # "trace" is uvicorn's own level, below DEBUG
        level = 5
    root = logging.getLogger("stallfree")
    root.setLevel(level)
    if not any(getattr(h, "_stallfree", False) for h in root.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(DefaultFormatter(LOG_FORMAT))
        handler._stallfree = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.propagate = False


class Server(uvicorn.Server):
    """uvicorn's server with stallfree's shutdown (see the module docstring)."""

    def __init__(
        self, config: uvicorn.Config, state: ServerState, exit_on_engine_death: bool = False
    ) -> None:
        super().__init__(config)
        self.sf = state
        self.exit_on_engine_death = exit_on_engine_death
        self.exit_code = 0
        self._signals = 0
        self._deadline: float | None = None
        self._cut_off: float | None = None
        self._announced = False

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises the captured signal once it has stopped, so SIGINT exits -2
        # and SIGTERM -15; a drained shutdown here exits normally instead
        if threading.current_thread() is not threading.main_thread():
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
        # a signal handler: it only sets flags; on_tick acts on them
        self._signals += 1
        if self._signals == 1:
            self.begin_drain()
        elif self._signals == 2:
            self._deadline = time.monotonic()
        else:
            self.should_exit = True
            self.force_exit = True

    def begin_drain(self) -> None:
        """Start the drain (what the first SIGTERM or SIGINT does)."""
        if self._deadline is None:
            self.sf.lifecycle.begin_drain()
            self._deadline = time.monotonic() + self.sf.limits.graceful_shutdown_s

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        return self._should_stop()

    def _stop_writes(self) -> int:
        protocol = self.config.http
        budget = getattr(protocol, "budget", None)
        return budget.stop_writes() if isinstance(budget, ConnectionBudget) else 0

    def _should_stop(self) -> bool:
        lifecycle = self.sf.lifecycle
        engine = self.sf.engine
        if self._deadline is None:
            if self.exit_on_engine_death and engine.accepting and not engine.healthy:
                logger.error("the engine stopped serving; the server exits with status 1")
                self.exit_code = 1
                return True
            return False
        if lifecycle.in_flight == 0:
            return True
        now = time.monotonic()
        if not self._announced:
            self._announced = True
            logger.info(
                "shutting down: waiting up to %.0fs for %d requests in progress",
                max(0.0, self._deadline - now),
                lifecycle.in_flight,
            )
        if self._cut_off is None and now >= self._deadline:
            cut = lifecycle.expire()
            # a client that does not read would never get its error event: closed now
            stalled = self._stop_writes()
            logger.warning(
                "grace period over: %d requests still running end with an error%s",
                cut,
                f" ({stalled} connections not reading closed)" if stalled else "",
            )
            self._cut_off = now + _CUT_OFF_S
        if self._cut_off is not None and now >= self._cut_off:
            logger.warning("%d requests did not end in time; stopping anyway", lifecycle.in_flight)
            return True
        return False


def load_chat_template(value: str | None) -> str | None:
    """The text of `server.chat_template`: the value itself when it is a Jinja template (it
    has `{{` or `{%`), else the file it names. A missing file or a template that does not
    parse is a ValueError naming it."""
    if value is None:
        return None
    if "{{" in value or "{%" in value:
        text = value
    else:
        try:
            text = Path(value).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ValueError(f"chat template file not found: {value}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the chat template {value}: {exc}") from None
    import jinja2

    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template {value[:80]!r} does not parse: {exc}") from None
    return text


def _use_chat_template(app: FastAPI, text: str | None) -> None:
    """`server.chat_template` replaces the tokenizer's own template for this app's engine."""
    if text is not None:
        state: ServerState = app.state.sf
        state.engine.tokenizer.chat_template = text


def serve(config: StallfreeConfig, sockets: list[socket.socket] | None = None) -> int:
    """Serve until SIGINT or SIGTERM, then drain (module docstring); the exit status.
    `sockets`: listen on these, already bound (a replica's, bound by its front), instead."""
    configure_logging(config.server)
    template = load_chat_template(config.server.chat_template)  # before the model loads
    app = create_app(config, freeze_heap=True)
    _use_chat_template(app, template)
    uv_config = uvicorn_config(app, config)
    _log_limits(config.server)
    server = Server(uv_config, app.state.sf, exit_on_engine_death=True)
    server.run(sockets=sockets)
    return server.exit_code


def _log_limits(limits: ServerConfig) -> None:
    logger.info(
        "limits: %d connections, %d concurrent requests, %d-byte bodies, head %gs, "
        "body %gs, unread writes %gs, keep-alive %gs, grace %gs",
        max_connections(limits),
        limits.max_concurrent_requests,
        limits.max_body_bytes,
        limits.header_timeout_s,
        limits.body_timeout_s,
        limits.write_timeout_s,
        limits.keep_alive_s,
        limits.graceful_shutdown_s,
    )
    if limits.host not in ("127.0.0.1", "::1", "localhost") and limits.allowed_hosts is None:
        logger.warning(
            "listening on %s with any Host header accepted; set server.allowed_hosts to the "
            "names clients use",
            limits.host,
        )


@dataclass(slots=True)
class RunningServer:
    """A server running as a task on the current event loop (tests, benchmarks)."""

    server: Server
    task: asyncio.Task[None]
    host: str
    port: int  # 0 on a Unix socket
    scheme: str = "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def drain(self) -> None:
        """What SIGTERM does: drain, then stop (`wait` for it)."""
        self.server.begin_drain()

    async def wait(self) -> int:
        """Wait until the server has stopped; its exit status."""
        await self.task
        return self.server.exit_code

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def start_server(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 0,
    exit_on_engine_death: bool = False,
    **overrides: Any,
) -> RunningServer:
    """Start `app` on `host:port` (0: a free port) in this event loop, or on `server.uds` when
    that is set; returns once it listens. `overrides` are uvicorn settings."""
    state: ServerState = app.state.sf
    uds = state.engine.config.server.uds
    sock = socket.socket(socket.AF_UNIX if uds else socket.AF_INET, socket.SOCK_STREAM)
    if uds:
        with contextlib.suppress(FileNotFoundError):
            Path(uds).unlink()
        sock.bind(uds)
    else:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    _use_chat_template(app, load_chat_template(state.engine.config.server.chat_template))
    options = {"log_level": "warning"} | overrides
    server = Server(
        uvicorn_config(app, state.engine.config, **options), state, exit_on_engine_death
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("server exited during startup")
        await asyncio.sleep(0.01)
    scheme = "https" if state.engine.config.server.tls else "http"
    return RunningServer(server, task, host, 0 if uds else sock.getsockname()[1], scheme)
