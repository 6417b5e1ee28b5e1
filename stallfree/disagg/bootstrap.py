"""The control plane between the two sides: the prefill server's bootstrap endpoint (HTTP, on
`disaggregation.bootstrap_port`), and the decode side's clients of it.

    GET  /health                       the decode side's heartbeat
    GET  /bootstrap/info               the prefill's fingerprint, backend and KV store port
    POST /bootstrap/pair               a decode server pairs up (409 names a mismatch)
    POST /bootstrap/rooms/{room}       the decode side's destination pages for a room
    POST /bootstrap/rooms/{room}/ack   the decode side has the room's KV (or refused it)
    POST /bootstrap/rooms/{room}/abort the decode side gave the room up
    GET|POST /bootstrap/pairs/{pair_id}/store?key=K   the pair's rendezvous (disagg/pair_store.py)

Every call but `/health` needs the shared secret when one is set, and no body may exceed the
limit (`disagg/guard.py`). A room's registration is refused (429) beyond
`disaggregation.max_rooms` rooms open, or `max_rooms_per_pair` for one decode server.

`HttpControl` speaks it over httpx; `LocalControl` calls a `PrefillSide` in the same process
(the loopback backend). An answer `HttpControl` cannot read is a `ControlError` with status 502
naming the endpoint, never a traceback.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import socket
from array import array
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, Field, ValidationError

from stallfree.config import DisaggregationConfig
from stallfree.config.server import KEEP_ALIVE_S
from stallfree.disagg.fingerprint import Fingerprint, HandshakeError
from stallfree.disagg.guard import BootstrapGuard, secret_headers
from stallfree.disagg.pair_store import MAX_KEY_LEN, MAX_VALUE_BYTES, StoreError
from stallfree.disagg.prefill import (
    PrefillSide,
    Registration,
    RegistrationError,
    RoomLimitError,
)
from stallfree.disagg.rooms import MAX_ROOM
from stallfree.disagg.transport import KVChannel

if TYPE_CHECKING:
    from fastapi import FastAPI

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 10.0


BAD_UPSTREAM = 502


class ControlError(RuntimeError):
    """The prefill's bootstrap endpoint refused or could not be reached (status: its HTTP
    answer; 502 when the answer could not be read)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class PrefillControl(Protocol):
    label: str

    async def info(self) -> dict[str, Any]: ...

    async def pair_info(self) -> PrefillInfo: ...

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

    async def pair_info(self) -> PrefillInfo:
        return PrefillInfo.read(await self.info(), self.label)

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

    def __init__(self, host: str, port: int, device: Any, config: DisaggregationConfig) -> None:
        import httpx

        self.host, self.port, self.device, self.config = host, port, device, config
        self.label = f"prefill bootstrap {host}:{port}"
        self.base_url = f"http://{_url_host(host)}:{port}"
        self.headers = secret_headers(config.secret)
        self._http = httpx.AsyncClient(
            base_url=self.base_url, timeout=CONTROL_TIMEOUT_S, headers=self.headers
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
        try:
            return r.json()
        except ValueError:
            logger.warning("%s answered %s %s with %r", self.label, method, path, r.text[:200])
            raise ControlError(
                f"{self.label} answered {method} {path} with no JSON", BAD_UPSTREAM
            ) from None

    async def info(self) -> dict[str, Any]:
        return _object(await self._call("GET", "/bootstrap/info"), self.label, "/bootstrap/info")

    async def pair_info(self) -> PrefillInfo:
        return PrefillInfo.read(await self.info(), self.label)

    async def pair(self, fingerprint: Fingerprint, shards: list[list[int]]) -> dict[str, Any]:
        body = {"fingerprint": fingerprint.model_dump(), "shards": shards}
        answer = _object(await self._call("POST", "/bootstrap/pair", body), self.label, "pair")
        pair_id, backend = answer.get("pair_id"), answer.get("backend")
        if not isinstance(pair_id, str) or not 0 < len(pair_id) <= 64 or not pair_id.isalnum():
            raise ControlError(f"{self.label} answered a pairing with no pair id", BAD_UPSTREAM)
        if backend not in ("gloo", "nccl"):
            raise ControlError(f"{self.label} pairs over unknown backend {backend!r}", BAD_UPSTREAM)
        return {"pair_id": pair_id, "backend": backend}

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
        return await asyncio.to_thread(self._join, pair["pair_id"], pair["backend"])

    def _join(self, pair_id: str, backend: str) -> KVChannel:
        """Join the pair's group as rank 1: on gloo in a receiver process of its own (a peer
        that sends what was not asked for kills that process, not this one)."""
        from stallfree.disagg.dist import DistChannel
        from stallfree.disagg.kv_receiver import ProcessChannel
        from stallfree.disagg.pair_store import HttpStore

        timeout_s = self.config.pair_timeout_s
        if backend == "gloo":
            from stallfree.disagg.dist import GROUP_TIMEOUT_S

            return ProcessChannel(
                {
                    "base_url": self.base_url,
                    "pair_id": pair_id,
                    "headers": self.headers,
                    "join_timeout_s": timeout_s,
                    "group_timeout_s": GROUP_TIMEOUT_S,
                }
            )
        store = HttpStore(self.base_url, pair_id, self.headers, timeout_s)
        try:
            return DistChannel(store, 1, backend, self.device)  # closes the store with it
        except BaseException:
            store.close()
            raise

    async def close(self) -> None:
        await self._http.aclose()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _read_registration(data: bytes) -> Registration:
    body = RegisterBody.model_validate_json(data)
    return Registration(body.pair_id, array("q", body.pages), body.num_tokens)


def _room_id(text: str) -> int | None:
    return int(text) if text.isdigit() and int(text) <= MAX_ROOM else None


def _fields(exc: ValidationError) -> str:
    return ", ".join(".".join(map(str, e["loc"])) or "a JSON object" for e in exc.errors()[:3])


def _object(answer: Any, label: str, what: str) -> dict[str, Any]:
    if not isinstance(answer, dict):
        raise ControlError(f"{label} answered {what} with something not an object", BAD_UPSTREAM)
    return answer


class PrefillInfo(BaseModel):
    """What `/bootstrap/info` must answer (anything else is a 502 naming the endpoint)."""

    role: str = Field(max_length=32)
    fingerprint: Fingerprint
    backend: str = Field(max_length=32)

    @classmethod
    def read(cls, answer: dict[str, Any], label: str) -> PrefillInfo:
        try:
            return cls.model_validate(answer)
        except ValidationError as exc:
            raise ControlError(
                f"{label} answered /bootstrap/info without a valid {_fields(exc)}", BAD_UPSTREAM
            ) from None


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


class StoreBody(BaseModel):
    value: str = Field(max_length=2 * MAX_VALUE_BYTES)  # base64


class AbortBody(BaseModel):
    message: str = Field("", max_length=4096)


def bootstrap_app(prefill: PrefillSide) -> Any:
    """The bootstrap endpoint's ASGI app for `prefill`, behind the secret and body limit."""
    from fastapi import FastAPI

    app = FastAPI(title="stallfree bootstrap", docs_url=None, redoc_url=None, openapi_url=None)
    _add_pairing_routes(app, prefill)
    _add_room_routes(app, prefill)
    _add_store_routes(app, prefill)
    cfg = prefill.config
    return BootstrapGuard(app, cfg.secret, cfg.bootstrap_max_body_bytes)


def _refuse(status: int, message: str) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


def _add_pairing_routes(app: FastAPI, prefill: PrefillSide) -> None:
    """`/health`, `/bootstrap/info` and `/bootstrap/pair`: what a decode server reads and
    sends before its first room."""

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
            return _refuse(409, str(exc))


def _add_room_routes(app: FastAPI, prefill: PrefillSide) -> None:
    """A room's registration, its ack and its abort."""
    from fastapi import Path
    from fastapi.responses import JSONResponse

    Room = Path(ge=0, le=MAX_ROOM)

    async def register(request: Any) -> Any:
        # NOTE: a plain route, so the body (up to the limit: a million pages is ~8 MiB) is
        # parsed on a thread, not on the prefill's loop
        room = _room_id(request.path_params["room"])
        if room is None:
            return _refuse(422, f"a room id is an integer in [0, {MAX_ROOM}]")
        try:
            reg = await asyncio.to_thread(_read_registration, await request.body())
        except ValidationError as exc:
            return _refuse(422, f"a registration needs {_fields(exc)}")
        except OverflowError:
            return _refuse(422, "a registration's pages are 64-bit integers")
        try:
            prefill.register(room, reg)
        except RoomLimitError as exc:
            return _refuse(429, str(exc))
        except RegistrationError as exc:
            return _refuse(422, str(exc))
        except KeyError as exc:
            return _refuse(404, str(exc.args[0]))
        except ValueError as exc:
            return _refuse(409, str(exc))
        return JSONResponse({"room": room})

    app.router.add_route("/bootstrap/rooms/{room}", register, methods=["POST"])

    @app.post("/bootstrap/rooms/{room}/ack")
    async def ack(body: AckBody, room: int = Room) -> dict[str, Any]:
        return {"room": room, "known": prefill.ack(room, body.ok, body.message)}

    @app.post("/bootstrap/rooms/{room}/abort")
    async def abort(body: AbortBody, room: int = Room) -> dict[str, Any]:
        return {"room": room, "known": prefill.abort(room, body.message)}


def _add_store_routes(app: FastAPI, prefill: PrefillSide) -> None:
    """The pair's rendezvous store: get and set one key (`disagg/pair_store.py`)."""
    from fastapi import Path, Query

    PairId = Path(min_length=1, max_length=64, pattern="^[0-9a-f]+$")
    Key = Query(min_length=1, max_length=MAX_KEY_LEN)

    @app.get("/bootstrap/pairs/{pair_id}/store", response_model=None)
    async def store_get(pair_id: str = PairId, key: str = Key) -> Any:
        store = prefill.pair_store(pair_id)
        value = store.peek(key) if store is not None else None
        if value is None:
            return _refuse(404, "no such key")
        return {"value": base64.b64encode(value).decode()}

    @app.post("/bootstrap/pairs/{pair_id}/store", response_model=None)
    async def store_set(body: StoreBody, pair_id: str = PairId, key: str = Key) -> Any:
        store = prefill.pair_store(pair_id)
        if store is None:
            return _refuse(404, f"unknown pair {pair_id}")
        try:
            store.set(key, base64.b64decode(body.value, validate=True))
        except binascii.Error:
            return _refuse(400, "a rendezvous value is base64")
        except StoreError as exc:
            return _refuse(409, str(exc))
        return {"key": key}


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
        # decode servers' httpx pools reuse connections idle up to 5 s: the endpoint keeps them
        # well past that, or a call sent as it closes one is lost (a failed room)
        config = uvicorn.Config(
            bootstrap_app(self.prefill),
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=KEEP_ALIVE_S,
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
