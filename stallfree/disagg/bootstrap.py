"""The control plane between the two sides: the prefill server's bootstrap endpoint (HTTP, on
`disaggregation.bootstrap_port`), and the decode side's clients of it.

    GET  /health                       the decode side's heartbeat
    GET  /bootstrap/info               the prefill's fingerprint, backend and KV store port
    POST /bootstrap/pair               a decode server pairs up (409 names a mismatch)
    POST /bootstrap/rooms/{room}       the decode side's destination pages for a room
    POST /bootstrap/rooms/{room}/ack   the decode side has the room's KV (or refused it)
    POST /bootstrap/rooms/{room}/abort the decode side gave the room up

`HttpControl` speaks it over httpx; `LocalControl` calls a `PrefillSide` in the same process
(the loopback backend).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any, Protocol

from pydantic import BaseModel, Field

from stallfree.disagg.fingerprint import Fingerprint, HandshakeError
from stallfree.disagg.prefill import PrefillSide, Registration
from stallfree.disagg.rooms import MAX_ROOM
from stallfree.disagg.transport import KVChannel

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 10.0


class ControlError(RuntimeError):
    """The prefill's bootstrap endpoint refused or could not be reached."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class PrefillControl(Protocol):
    label: str

    async def info(self) -> dict[str, Any]: ...

    async def pair(self, fingerprint: Fingerprint, shards: list[list[int]]) -> dict[str, Any]: ...

    async def register(
        self, room: int, pair_id: str, pages: list[int], num_tokens: int
    ) -> None: ...

    async def ack(self, room: int, ok: bool, message: str = "") -> None: ...

    async def abort(self, room: int, message: str) -> None: ...

    async def health(self) -> bool: ...

    async def channel(self, pair: dict[str, Any], info: dict[str, Any]) -> KVChannel: ...

    async def close(self) -> None: ...


class LocalControl:
    """A prefill side in this process (tests and embedding; the loopback backend)."""

    def __init__(self, prefill: PrefillSide) -> None:
        self.prefill = prefill
        self.label = "local prefill"
        self.alive = True  # tests turn it off to play a dead prefill

    def _up(self) -> PrefillSide:
        if not self.alive:
            raise ControlError("prefill server is unreachable")
        return self.prefill

    async def info(self) -> dict[str, Any]:
        return self._up().info()

    async def pair(self, fingerprint: Fingerprint, shards: list[list[int]]) -> dict[str, Any]:
        try:
            return self._up().pair(fingerprint, shards)
        except HandshakeError as exc:
            raise ControlError(str(exc), 409) from exc

    async def register(self, room: int, pair_id: str, pages: list[int], num_tokens: int) -> None:
        try:
            self._up().register(room, Registration(pair_id, pages, num_tokens))
        except (KeyError, ValueError) as exc:
            raise ControlError(str(exc), 409) from exc

    async def ack(self, room: int, ok: bool, message: str = "") -> None:
        self._up().ack(room, ok, message)

    async def abort(self, room: int, message: str) -> None:
        self._up().abort(room, message)

    async def health(self) -> bool:
        return self.alive

    async def channel(self, pair: dict[str, Any], info: dict[str, Any]) -> KVChannel:
        return self._up().loopback_channel(pair["pair_id"])

    async def close(self) -> None:
        return None


class HttpControl:
    """A prefill server's bootstrap endpoint at `host:port`."""

    def __init__(self, host: str, port: int, device: Any) -> None:
        import httpx

        self.host, self.port, self.device = host, port, device
        self.label = f"prefill bootstrap {host}:{port}"
        self._http = httpx.AsyncClient(
            base_url=f"http://{_url_host(host)}:{port}", timeout=CONTROL_TIMEOUT_S
        )

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        import httpx

        try:
            r = await self._http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise ControlError(f"{self.label} unreachable: {exc!r}") from exc
        if r.status_code != 200:
            # NOTE: the peer's body never reaches a client (it would make this server a probe of
            # whatever answers there); the operator finds it in the log
            logger.warning(
                "%s answered %d to %s %s: %r", self.label, r.status_code, method, path, r.text[:200]
            )
            raise ControlError(f"{self.label} answered HTTP {r.status_code}", r.status_code)
        return r.json()

    async def info(self) -> dict[str, Any]:
        return dict(await self._call("GET", "/bootstrap/info"))

    async def pair(self, fingerprint: Fingerprint, shards: list[list[int]]) -> dict[str, Any]:
        body = {"fingerprint": fingerprint.model_dump(), "shards": shards}
        return dict(await self._call("POST", "/bootstrap/pair", body))

    async def register(self, room: int, pair_id: str, pages: list[int], num_tokens: int) -> None:
        body = {"pair_id": pair_id, "pages": pages, "num_tokens": num_tokens}
        await self._call("POST", f"/bootstrap/rooms/{room}", body)

    async def ack(self, room: int, ok: bool, message: str = "") -> None:
        await self._call("POST", f"/bootstrap/rooms/{room}/ack", {"ok": ok, "message": message})

    async def abort(self, room: int, message: str) -> None:
        await self._call("POST", f"/bootstrap/rooms/{room}/abort", {"message": message})

    async def health(self) -> bool:
        try:
            await self._call("GET", "/health")
        except ControlError:
            return False
        return True

    async def channel(self, pair: dict[str, Any], info: dict[str, Any]) -> KVChannel:
        from stallfree.disagg.dist import DistChannel

        port = info.get("store_port")
        if not isinstance(port, int):
            raise ControlError(f"{self.label} offers no KV store for backend {pair['backend']}")
        return await asyncio.to_thread(
            DistChannel.connect, self.host, port, pair["pair_id"], pair["backend"], self.device
        )

    async def close(self) -> None:
        await self._http.aclose()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


# ---------------------------------------------------------------------- the endpoint


class PairBody(BaseModel):
    fingerprint: Fingerprint
    shards: list[list[int]] = Field(max_length=1024)


class RegisterBody(BaseModel):
    pair_id: str = Field(max_length=64)
    pages: list[int] = Field(max_length=1 << 22)
    num_tokens: int = Field(ge=1)


class AckBody(BaseModel):
    ok: bool
    message: str = Field("", max_length=4096)


class AbortBody(BaseModel):
    message: str = Field("", max_length=4096)


def bootstrap_app(prefill: PrefillSide) -> Any:
    from fastapi import FastAPI, Path
    from fastapi.responses import JSONResponse

    app = FastAPI(title="stallfree bootstrap", docs_url=None, redoc_url=None, openapi_url=None)
    Room = Path(ge=0, le=MAX_ROOM)

    def refuse(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/bootstrap/info")
    async def info() -> dict[str, Any]:
        return prefill.info()

    @app.post("/bootstrap/pair", response_model=None)
    async def pair(body: PairBody) -> Any:
        try:
            return prefill.pair(body.fingerprint, body.shards)
        except HandshakeError as exc:
            return refuse(409, str(exc))

    @app.post("/bootstrap/rooms/{room}", response_model=None)
    async def register(body: RegisterBody, room: int = Room) -> Any:
        try:
            prefill.register(room, Registration(body.pair_id, body.pages, body.num_tokens))
        except KeyError as exc:
            return refuse(404, str(exc.args[0]))
        except ValueError as exc:
            return refuse(409, str(exc))
        return {"room": room}

    @app.post("/bootstrap/rooms/{room}/ack")
    async def ack(body: AckBody, room: int = Room) -> dict[str, Any]:
        return {"room": room, "known": prefill.ack(room, body.ok, body.message)}

    @app.post("/bootstrap/rooms/{room}/abort")
    async def abort(body: AbortBody, room: int = Room) -> dict[str, Any]:
        return {"room": room, "known": prefill.abort(room, body.message)}

    return app


class BootstrapServer:
    """The bootstrap endpoint, served by uvicorn as a task on the current loop."""

    def __init__(self, prefill: PrefillSide, host: str, port: int) -> None:
        self.prefill, self.host, self.port = prefill, host, port
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        import uvicorn

        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            bootstrap_app(self.prefill), log_level="warning", access_log=False, lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # the main server owns them
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("bootstrap server exited during startup")
            await asyncio.sleep(0.01)

    @property
    def url(self) -> str:
        return f"http://{_url_host(self.host)}:{self.port}"

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
