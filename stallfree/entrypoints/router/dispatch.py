"""Two-leg dispatch: each client request goes to a prefill server and a decode server at once.

The prefill leg gets the client's body with `stream: false` and the bootstrap fields (where the
prefill's KV can be fetched, and a random room that pairs the two legs); the decode leg gets
the same bootstrap fields and streams as the client asked. The client's answer is the decode
leg's, relayed as it arrives.

Either leg failing ends the request at once, both ways: the other leg is cancelled (its
connection closed, which is how a server learns to abort) rather than left waiting for a
partner that will never come. A client that leaves cancels both. The answer is then the
failed leg's own status and body when it had one, a 502 (504 on a timeout) naming the server
when its connection failed, or, once the decode stream has started, one SSE error event that
ends it. A prefill leg still running when the decode leg has finished well is given
`prefill_grace_s` to end, then cancelled: the answer never waits for it, and no task is left
behind.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from stallfree.entrypoints.router.flags import RouterSettings
from stallfree.entrypoints.router.leg_failure import Answer, LegFailure, leg_failure, passed_headers
from stallfree.entrypoints.router.metrics import RouterMetrics
from stallfree.entrypoints.router.pool import Health, Server, ServerPool, describe
from stallfree.entrypoints.router.stale_connections import send_fresh_on_stale

logger = logging.getLogger("stallfree.router")

# how long a prefill leg may still run once its decode leg has answered in full
PREFILL_GRACE_S = 5.0
# nginx's status for a request whose client left before the answer
CLIENT_CLOSED_REQUEST = 499
CONNECT_TIMEOUT_S = 10.0
# NOTE: a server closes a connection idle for its keep-alive (ours 120 s, but uvicorn's and
# vLLM's default is 5 s, as long as httpx keeps them), so the router lets them go well before
# any of them would (and sends a leg that met a closed one again: stale_connections.py)
KEEPALIVE_S = 2.0
# the fields each leg gets from the router, whatever the client sent in them
LEG_FIELDS = frozenset(
    {"bootstrap_host", "bootstrap_port", "bootstrap_room", "stream", "stream_options"}
)
_JSON = (b"content-type", b"application/json")


def encode_json(value: Any) -> bytes:
    """JSON as UTF-8. A lone surrogate (which `json` decodes from `"\\ud800"`) has no UTF-8
    form, so it raises UnicodeEncodeError, as NaN raises ValueError: both are the client's
    error (400), found before any server is asked."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def split_body(body: dict[str, Any]) -> tuple[bytes, bytes]:
    """The client's body encoded once for both legs: everything but `LEG_FIELDS`, and the
    client's own `stream` and `stream_options` (which only the decode leg keeps)."""
    core = {k: v for k, v in body.items() if k not in LEG_FIELDS}
    stream = {k: body[k] for k in ("stream", "stream_options") if k in body}
    return encode_json(core), encode_json(stream)


def join_objects(*objects: bytes) -> bytes:
    """Encoded JSON objects with distinct keys merged into one, without decoding them."""
    members = [obj[1:-1] for obj in objects if len(obj) > 2]
    return b"{" + b",".join(members) + b"}"


async def stop_task(task: asyncio.Task[Any]) -> None:
    """Cancel `task` unless it is done, and wait until it is; its outcome is read, so nothing
    is logged as never retrieved."""
    if not task.done():
        task.cancel()
        await asyncio.wait({task})
    if not task.cancelled():
        task.exception()


async def until_disconnect(receive: Receive) -> None:
    # the body has been read whole: the next message is the client leaving
    while (await receive())["type"] != "http.disconnect":
        pass


@dataclass(slots=True)
class Plan:
    """One client request, ready to relay: its route, the body's parts and the headers both
    legs get."""

    route: str  # "completions" or "chat", the metrics' label
    path: str
    core: bytes
    stream: bytes
    authorization: str | None
    request_id: str | None
    started_at: float


class Relay(Response):
    """The client's answer to one request: an ASGI response that runs both legs, so it sends
    its status only once a leg decides it, and sees the client leave at any moment."""

    # the leg whose answer the client gets, as failures and the metrics name it
    answer_leg = "decode"

    def __init__(self, router: Router, plan: Plan) -> None:
        super().__init__()
        self.router = router
        self.plan = plan
        self.room = secrets.randbits(63)
        self.request_id = plan.request_id or f"{self.room:x}"
        self.answer_status = CLIENT_CLOSED_REQUEST
        self.started = False  # the answer's head has gone out
        self.finished_well = False
        self._first_byte = False

    def _leg_headers(self) -> dict[bytes, bytes]:
        """What both legs are sent with: the request id, and the client's key unchanged."""
        headers = {
            b"content-type": b"application/json",
            b"x-request-id": self._latin1(self.request_id),
        }
        if self.plan.authorization is not None:
            headers[b"authorization"] = self._latin1(self.plan.authorization)
        return headers

    def _request_id_header(self) -> tuple[bytes, bytes]:
        return (b"x-request-id", self._latin1(self.request_id))

    @staticmethod
    def _latin1(text: str) -> bytes:
        # headers arrive as latin-1 text; bytes go out unchanged (httpx would encode str as ASCII)
        return text.encode("latin-1")

    def _bodies(self, prefill: Server) -> tuple[bytes, bytes]:
        bootstrap = encode_json(
            {
                "bootstrap_host": prefill.bootstrap_host,
                "bootstrap_port": prefill.bootstrap_port,
                "bootstrap_room": self.room,
            }
        )
        plan = self.plan
        return (
            join_objects(bootstrap, b'{"stream":false}', plan.core),
            join_objects(bootstrap, plan.stream, plan.core),
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pool = self.router.pool
        prefill_server, decode_server = pool.acquire("prefill"), pool.acquire("decode")
        prefill_body, decode_body = self._bodies(prefill_server)
        headers = self._leg_headers()
        prefill = asyncio.create_task(self._prefill_leg(prefill_server, prefill_body, headers))
        # released when the task ends, however: a task cancelled before it ran has no finally
        prefill.add_done_callback(lambda _: pool.release(prefill_server))
        decode = asyncio.create_task(self._decode_leg(decode_server, decode_body, headers, send))
        decode.add_done_callback(lambda _: pool.release(decode_server))
        gone = asyncio.create_task(until_disconnect(receive))
        try:
            await self._supervise(prefill, decode, gone, send)
        finally:
            gone.cancel()
            await stop_task(decode)
            if self.finished_well and (not prefill.done() or leg_failure(prefill) is not None):
                # the answer is out: the prefill is only waited for (or its failure noted) now
                self.router.linger(prefill)
            else:
                await stop_task(prefill)
            elapsed = time.monotonic() - self.plan.started_at
            self.router.metrics.answered(self.plan.route, self.answer_status, elapsed)

    async def _supervise(
        self,
        prefill: asyncio.Task[None],
        decode: asyncio.Task[Answer | None],
        gone: asyncio.Task[None],
        send: Send,
    ) -> None:
        waiting: set[asyncio.Task[Any]] = {prefill, decode, gone}
        while True:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if decode in done:
                failure = leg_failure(decode)
                if failure is None:
                    await self._finish(decode.result(), send)
                    return
                await stop_task(prefill)
                await self._fail(failure, send)
                return
            if prefill in done:
                failure = leg_failure(prefill)
                if failure is not None:
                    await stop_task(decode)
                    await self._fail(failure, send)
                    return
                waiting.discard(prefill)  # its body is dropped: the answer is the decode's
            if gone in done:
                self.answer_status = CLIENT_CLOSED_REQUEST
                self.router.metrics.leg_failures.labels(leg="client").inc()
                logger.info("request %s: the client left; both legs cancelled", self.request_id)
                await asyncio.gather(stop_task(decode), stop_task(prefill))
                return

    async def _prefill_leg(self, server: Server, body: bytes, headers: dict[bytes, bytes]) -> None:
        client = self.router.client
        request = client.build_request(
            "POST", server.url + self.plan.path, content=body, headers=headers
        )
        try:
            resp = await send_fresh_on_stale(client, request)
        except httpx.HTTPError as exc:
            raise LegFailure.of("prefill", server, exc) from None
        if not resp.is_success:
            raise LegFailure.answered("prefill", server, resp, resp.content)

    async def _decode_leg(
        self, server: Server, body: bytes, headers: dict[bytes, bytes], send: Send
    ) -> Answer | None:
        """The decode server's answer: relayed to the client here as it arrives when it is
        an event stream (None), else read whole for the caller to send."""
        client = self.router.client
        request = client.build_request(
            "POST", server.url + self.plan.path, content=body, headers=headers
        )
        try:
            resp = await send_fresh_on_stale(client, request, stream=True)
        except httpx.HTTPError as exc:
            raise LegFailure.of(self.answer_leg, server, exc) from None
        try:
            if not resp.is_success:
                raise LegFailure.answered(
                    self.answer_leg, server, resp, await self._read(server, resp)
                )
            if resp.headers.get("content-type", "").startswith("text/event-stream"):
                await self._relay_stream(server, resp, send)
                return None
            body_read = await self._read(server, resp, timed=True)
            return Answer(resp.status_code, passed_headers(resp.headers), body_read)
        finally:
            await resp.aclose()

    def _first_byte_seen(self) -> None:
        if not self._first_byte:
            self._first_byte = True
            elapsed = time.monotonic() - self.plan.started_at
            self.router.metrics.first_byte_seconds.labels(route=self.plan.route).observe(elapsed)

    async def _read(self, server: Server, resp: httpx.Response, timed: bool = False) -> bytes:
        chunks = []
        try:
            async for chunk in resp.aiter_bytes():
                if timed:
                    self._first_byte_seen()
                chunks.append(chunk)
        except httpx.HTTPError as exc:
            raise LegFailure(
                self.answer_leg, server, f"its answer broke off: {describe(exc)}"
            ) from None
        return b"".join(chunks)

    async def _relay_stream(self, server: Server, resp: httpx.Response, send: Send) -> None:
        self.started = True  # before the send: a cancelled send may still have gone out
        self.answer_status = resp.status_code
        head = [*passed_headers(resp.headers), self._request_id_header()]
        await send({"type": "http.response.start", "status": resp.status_code, "headers": head})
        try:
            async for chunk in resp.aiter_bytes():
                if chunk:
                    self._first_byte_seen()
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as exc:
            raise LegFailure(
                self.answer_leg, server, f"its stream broke off: {describe(exc)}"
            ) from None

    async def _finish(self, answer: Answer | None, send: Send) -> None:
        if answer is None:  # the stream has been relayed: only its end is left
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            await self._send_whole(answer.status, answer.headers, answer.body, send)
        self.finished_well = True

    async def _fail(self, failure: LegFailure, send: Send) -> None:
        self.router.metrics.leg_failures.labels(leg=failure.leg).inc()
        logger.warning("request %s: %s", self.request_id, failure.message)
        if self.started:
            # ASCII: an upstream's text may hold U+2028 and the like, which clients that split
            # the stream by lines would break the event at (the servers escape them too)
            event = b"data: " + json.dumps(failure.error()).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        elif failure.status is not None:
            await self._send_whole(failure.status, failure.headers, failure.body, send)
        else:
            body = encode_json(failure.error())
            await self._send_whole(failure.gateway_status, [_JSON], body, send)

    async def _send_whole(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes, send: Send
    ) -> None:
        self.started = True
        self.answer_status = status
        head = [*headers, self._request_id_header(), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": head})
        message: Message = {"type": "http.response.body", "body": body, "more_body": False}
        await send(message)


class Router:
    """What the router app works with: the server pool, the shared HTTP client, the health
    cache, the metrics, and the prefill legs left to finish after their answers."""

    def __init__(self, settings: RouterSettings, prefill_grace_s: float = PREFILL_GRACE_S) -> None:
        self.settings = settings
        self.metrics = RouterMetrics(u.url for u in (*settings.prefill, *settings.decode))
        self.pool = ServerPool(settings, self.metrics)
        timeout = httpx.Timeout(
            settings.request_timeout_s,
            connect=min(CONNECT_TIMEOUT_S, settings.request_timeout_s),
            pool=None,
        )
        # no pool cap: each stream holds a connection for its whole length, and a cap would
        # queue requests inside the router, unseen by either server; no proxies from the
        # environment: the servers are reached directly
        limits = httpx.Limits(
            max_connections=None, max_keepalive_connections=256, keepalive_expiry=KEEPALIVE_S
        )
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)
        self.health = Health(self.client, self.pool.servers)
        self.prefill_grace_s = prefill_grace_s
        self.lingering: set[asyncio.Task[None]] = set()

    def relay(
        self, route: str, path: str, body: dict[str, Any], authorization: str | None,
        request_id: str | None, started_at: float,
    ) -> Relay:  # fmt: skip
        """The answer to a client's body (a JSON object). A body that cannot be passed on as
        JSON (a lone surrogate, NaN) is a ValueError, before any server is picked."""
        core, stream = split_body(body)
        return Relay(self, Plan(route, path, core, stream, authorization, request_id, started_at))

    def linger(self, prefill: asyncio.Task[None]) -> None:
        settle = asyncio.create_task(self._settle(prefill))
        self.lingering.add(settle)
        settle.add_done_callback(self.lingering.discard)

    async def _settle(self, prefill: asyncio.Task[None]) -> None:
        try:
            await asyncio.wait({prefill}, timeout=self.prefill_grace_s)
        finally:
            await stop_task(prefill)
        failure = leg_failure(prefill)
        if failure is not None:
            # the client has its answer; the failure is only counted and logged
            self.metrics.leg_failures.labels(leg="prefill").inc()
            logger.warning("after its answer: %s", failure.message)

    async def aclose(self) -> None:
        """Cancel the prefill legs still settling, then close the client's connections."""
        for task in list(self.lingering):
            task.cancel()
        if self.lingering:
            await asyncio.wait(set(self.lingering))
        await self.client.aclose()
