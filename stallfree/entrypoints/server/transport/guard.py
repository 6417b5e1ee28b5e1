"""`Guard`: the ASGI middleware every HTTP request passes before the app sees it.

In order, for each request it:

1. gives the request an id (`x-request-id` on the answer, and in every log line about it): the
   client's own `X-Request-Id` when it sends one (1 to 128 of `A-Za-z0-9-_.:~`; another is a
   400), else a fresh one;
2. refuses a request that carries both `Content-Length` and `Transfer-Encoding` (400), and a
   `Host` outside `server.allowed_hosts` when that is set (400);
3. for API routes (everything but `/health` and `/metrics`): with `server.api_key` set (one key
   or several), refuses a request without one of the keys (401, `Connection: close`) on its head
   alone, before it is counted or a byte of its body is read; refuses new requests while the
   server drains (503) and past `server.max_concurrent_requests` in progress (503 with
   `Retry-After`);
4. refuses a body over `server.max_body_bytes` (413): at once from `Content-Length`, or while
   counting a chunked body; and a body that does not arrive within `server.body_timeout_s`
   (408). The body is read here and handed on whole, so the app never reads an unbounded one;
5. counts each refusal by reason (`http_refusals_total`) when metrics are on;
6. turns any exception that escapes the app into a JSON 500 naming the request id, and logs it.

A refusal is a JSON body in the OpenAI error shape; refusals that leave unread bytes on the
connection (or come while draining) also close it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stallfree.config.settings import ServerConfig
from stallfree.entrypoints.server.base.errors import (
    ApiError,
    count_refusal,
    error_body,
    internal_error,
    overloaded,
    shutting_down,
)
from stallfree.entrypoints.server.base.protocol import ErrorInfo
from stallfree.entrypoints.server.base.state import Lifecycle
from stallfree.entrypoints.server.output.streaming import CLIENT_CLOSED_REQUEST
from stallfree.metrics.operator import ServerMetrics

logger = logging.getLogger("stallfree.server")

PROBES = frozenset({"/health", "/metrics"})
# a client's own request id (`X-Request-Id`), used as the request's id when it is this
_REQUEST_ID = re.compile(rb"[A-Za-z0-9_.:~-]{1,128}")
_CLOSE = (b"connection", b"close")


class _Refused(Exception):
    def __init__(self, status: int, info: ErrorInfo, close: bool = True) -> None:
        self.status = status
        self.info = info
        self.close = close


class Guard:
    def __init__(
        self,
        app: ASGIApp,
        limits: ServerConfig,
        lifecycle: Lifecycle,
        metrics: ServerMetrics | None = None,
    ) -> None:
        self.app = app
        self.limits = limits
        self.lifecycle = lifecycle
        self.metrics = metrics
        self.api_keys = tuple(k.encode() for k in limits.api_keys)
        hosts = limits.allowed_hosts
        self.allowed_hosts = (
            None
            if hosts is None or "*" in hosts
            else frozenset(h.lower().removesuffix(".") for h in hosts)
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid, bad_id = _request_id(scope)
        scope.setdefault("state", {})["request_id"] = rid
        lifecycle = self.lifecycle
        reply = _ReplyWithId(send, rid, lifecycle)
        probe = _route_path(scope) in PROBES
        counted = False
        try:
            length = self._check_head(scope, probe)  # the API key first, as for any request
            if bad_id:
                raise _Refused(
                    400,
                    _info(
                        "x-request-id must be 1 to 128 characters of letters, digits and "
                        "-_.:~ (it names the request in logs, answers and aborts)",
                        param="x-request-id",
                    ),
                )
            if not probe:
                lifecycle.in_flight += 1
                counted = True
            await self._pass_on(scope, receive, reply, length)
        except Exception as exc:
            await self._refuse(exc, rid, reply)
        finally:
            if counted:
                lifecycle.in_flight -= 1

    async def _pass_on(
        self, scope: Scope, receive: Receive, reply: _ReplyWithId, length: int | None
    ) -> None:
        """Read the body (when there is one) whole, then hand the request to the app."""
        if length is None or length > 0:
            body = await self._read_body(receive, length)
            if body is None:
                # the client left while sending it: nobody reads this answer, but it ends
                # the request as what it was (499, nginx's "client closed request") for
                # the HTTP metrics and logs, not as a 500 the server never gave
                info = _info("the client closed the connection before its body arrived")
                await _answer(reply, CLIENT_CLOSED_REQUEST, info, close=True)
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, reply)

    async def _refuse(self, exc: Exception, rid: str, reply: _ReplyWithId) -> None:
        """Answer what escaped (a refusal, an `ApiError`, or a 500 for anything else), unless
        the answer's head has gone out already; count the refusals. Called in the `except`
        block, so the log line carries the traceback."""
        if isinstance(exc, _Refused):
            count_refusal(self.metrics, exc.status, exc.info.code)
            if not reply.started:
                await _answer(reply, exc.status, exc.info, exc.close)
        elif isinstance(exc, ApiError):
            count_refusal(self.metrics, exc.status, exc.info.code)
            if not reply.started:
                close = "connection" in {k.lower() for k in exc.headers}
                extra = [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
                await _answer(reply, exc.status, exc.info, close, extra)
        else:
            logger.exception("request %s: unhandled error", rid)
            if not reply.started:
                failure = internal_error(rid)
                await _answer(reply, failure.status, failure.info, close=False)

    def _check_head(self, scope: Scope, probe: bool) -> int | None:
        """Check the request line and headers; the body's declared length (None: chunked)."""
        length: int | None = 0
        chunked = False
        host = b""
        authorization = b""
        has_length = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                # the HTTP parser has checked it is digits, and that repeats agree
                length = int(value)
                has_length = True
            elif name == b"transfer-encoding":
                chunked = True
            elif name == b"host":
                host = value
            elif name == b"authorization":
                authorization = value
        if has_length and chunked:
            raise _Refused(
                400,
                _info("a request must not carry both Content-Length and Transfer-Encoding"),
            )
        if self.allowed_hosts is not None and _hostname(host) not in self.allowed_hosts:
            raise _Refused(400, _info("unknown Host header", param="host", code="invalid_host"))
        if not probe and self.api_keys:
            self._check_key(authorization)
        if not probe:
            lifecycle = self.lifecycle
            if lifecycle.draining:
                raise shutting_down()
            if lifecycle.in_flight >= self.limits.max_concurrent_requests:
                raise overloaded(
                    self.limits.retry_after_s,
                    f"the server is overloaded: {self.limits.max_concurrent_requests} requests "
                    "are in progress; retry later",
                )
        if chunked:
            return None
        if length is not None and length > self.limits.max_body_bytes:
            raise self._too_large()
        return length

    def _check_key(self, authorization: bytes) -> None:
        """The API key, from the request head: nothing of a keyless request is counted or read."""
        scheme, _, token = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            raise _Refused(
                401,
                _info(
                    "missing API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                ),
            )
        token = token.strip()
        # every key is compared, in constant time each: which key matched (or how many came
        # before it) does not show in the answer's timing
        matched = [hmac.compare_digest(token, key) for key in self.api_keys]
        if not any(matched):
            raise _Refused(401, _info("invalid API key", code="invalid_api_key"))

    def _too_large(self) -> _Refused:
        limit = self.limits.max_body_bytes
        return _Refused(
            413,
            _info(
                f"the request body is larger than this server accepts ({limit} bytes)",
                code="request_too_large",
            ),
        )

    async def _read_body(self, receive: Receive, length: int | None) -> bytes | None:
        """The whole body, counted as it arrives; None if the client disconnected."""
        limit = self.limits.max_body_bytes

        async def read() -> bytes | None:
            parts: list[bytes] = []
            size = 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise self._too_large()
                parts.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(parts)

        try:
            return await asyncio.wait_for(read(), self.limits.body_timeout_s)
        except asyncio.TimeoutError:
            raise _Refused(
                408,
                _info(
                    f"the request body did not arrive within {self.limits.body_timeout_s:g}s",
                    code="request_timeout",
                ),
            ) from None


class _ReplyWithId:
    """The request's `send`, with its id on the answer's head (and `Connection: close` while
    the server drains); `started` once the head has gone out."""

    def __init__(self, send: Send, rid: str, lifecycle: Lifecycle) -> None:
        self.send = send
        self.rid = rid
        self.lifecycle = lifecycle
        self.started = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            headers = [*message.get("headers", ()), (b"x-request-id", self.rid.encode())]
            if self.lifecycle.draining and _CLOSE not in headers:
                headers.append(_CLOSE)
            message = {**message, "headers": headers}
        await self.send(message)


def _request_id(scope: Scope) -> tuple[str, bool]:
    """The request's id: the client's `X-Request-Id` when it is a valid one, else a fresh one;
    and whether the client sent an invalid one (a 400)."""
    given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
    bad_id = given is not None and not _REQUEST_ID.fullmatch(given)
    rid = given.decode() if given is not None and not bad_id else uuid.uuid4().hex
    return rid, bad_id


def _route_path(scope: Scope) -> str:
    """The request's path, without the proxy's prefix (`server.root_path`) when it has one."""
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return path


def _info(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> ErrorInfo:
    return ErrorInfo(message=message, type=type, param=param, code=code)


def _hostname(host: bytes) -> str | None:
    """The host part of a Host header: `[::1]:8000` -> `::1`, `Example.org.:80` ->
    `example.org` (one trailing dot is the same name, fully qualified); None when malformed:
    a port that is not digits, brackets around anything but an IPv6 address, bytes after
    `]` other than a port."""
    text = host.decode("latin-1").strip().lower()
    if text.startswith("["):
        inside, bracket, rest = text[1:].partition("]")
        if not bracket or ":" not in inside or (rest and not _is_port(rest)):
            return None
        return inside
    name, colon, port = text.partition(":")
    if colon and not port.isdigit():
        return None
    return name[:-1] if name.endswith(".") and not name.endswith("..") else name


def _is_port(rest: str) -> bool:
    return rest.startswith(":") and rest[1:].isdigit()


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive channel that yields `body` whole once, then the connection's own messages
    (so the app still learns of a disconnect from it)."""
    pending = True

    async def replay() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _answer(
    send: Send,
    status: int,
    info: ErrorInfo,
    close: bool,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    body = error_body(info)
    headers: list[Any] = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *(extra or []),
    ]
    if close and _CLOSE not in headers:
        headers.append(_CLOSE)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
