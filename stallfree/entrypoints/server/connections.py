"""The HTTP/1.1 connection protocol: uvicorn's h11 protocol with a connection budget and a
deadline for request heads.

uvicorn closes a keep-alive connection that stays idle after a response (`timeout_keep_alive`),
but nothing else: a connection that never sends a byte, or sends its headers a byte at a time,
stays open for ever, and enough of them use up the process's file descriptors. So:

- **head deadline**: a request's line and headers must arrive whole within `header_timeout_s`,
  counted from the connection's opening, or from the first byte of a later request on it;
  otherwise the connection is closed;
- **connection budget**: at most `max_connections` are open. A new one past the budget closes
  the connection that has been idle longest (no request in progress: a fresh or slow one, or a
  keep-alive one between requests); if every connection is busy, the new one is closed.

uvicorn's own `limit_concurrency` is not used: it counts idle connections as load and answers
every request past it with a plain-text 503, even while the idle ones could just be closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from stallfree.entrypoints.server.errors import error_body
from stallfree.entrypoints.server.protocol import ErrorInfo

logger = logging.getLogger("stallfree.server")

_WARN_EVERY_S = 10.0


class ConnectionBudget:
    """The live connections of one server, and its idle ones, longest idle first."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.live: set[GuardedH11Protocol] = set()
        # a dict keeps insertion order: the first key is the longest idle
        self.idle: dict[GuardedH11Protocol, None] = {}
        self.evicted = 0
        self.refused = 0
        self._warned_at = -_WARN_EVERY_S

    def make_room(self) -> bool:
        """Close the longest-idle connection if the budget is spent; False if it is spent
        and every connection is busy."""
        if len(self.live) < self.limit:
            return True
        while self.idle:
            conn = next(iter(self.idle))
            self.forget(conn)
            if conn.close_idle():
                self.evicted += 1
                self._warn("closed the longest-idle connection to admit a new one")
                return True
        self.refused += 1
        self._warn("refused a new connection: every connection is busy")
        return False

    def forget(self, conn: GuardedH11Protocol) -> None:
        self.live.discard(conn)
        self.idle.pop(conn, None)

    def _warn(self, what: str) -> None:
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_S:
            self._warned_at = now
            logger.warning(
                "connection limit (server.max_connections = %d) reached: %s "
                "(%d closed idle, %d refused so far)",
                self.limit,
                what,
                self.evicted,
                self.refused,
            )


class GuardedH11Protocol(H11Protocol):
    """See the module docstring; `guarded_protocol` makes one class per server."""

    budget: ClassVar[ConnectionBudget]
    header_timeout_s: ClassVar[float]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        budget = self.budget
        if not budget.make_room():
            self.transport.close()
            return
        budget.live.add(self)
        budget.idle[self] = None
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.budget.forget(self)
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            self._disarm_head_timer()
        elif self.conn.their_state is h11.IDLE:
            # a request head has begun, or not even that: it must be whole in time
            if self._head_timer is None:
                self._arm_head_timer()
        else:
            # the head is whole: a request is in progress
            self._disarm_head_timer()
            self.budget.idle.pop(self, None)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        # idle until its next request (uvicorn's keep-alive timer runs now)
        self.budget.idle.pop(self, None)
        if self in self.budget.live:
            self.budget.idle[self] = None

    def send_400_response(self, msg: str) -> None:
        """A request the HTTP parser refused (malformed, or a head over h11's size limit):
        400 in the OpenAI error shape, like every other refusal, and the connection closes."""
        body = error_body(
            ErrorInfo(message=f"malformed HTTP request: {msg}", type="invalid_request_error")
        )
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        try:
            self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers)))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:
            pass  # a response had begun already: only closing is left
        self.transport.close()

    def close_idle(self) -> bool:
        """Close this connection, idle between requests; False if it was closing already."""
        self._disarm_head_timer()
        if self.transport.is_closing():
            return False
        if self.conn.our_state is not h11.ERROR:
            with contextlib.suppress(h11.LocalProtocolError):
                self.conn.send(h11.ConnectionClosed())
        self.transport.close()
        return True

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.budget.forget(self)
            self.close_idle()


def guarded_protocol(max_connections: int, header_timeout_s: float) -> type[GuardedH11Protocol]:
    """The protocol class of one server: its own budget, shared by its connections."""
    return type(
        "StallfreeH11Protocol",
        (GuardedH11Protocol,),
        {"budget": ConnectionBudget(max_connections), "header_timeout_s": header_timeout_s},
    )
