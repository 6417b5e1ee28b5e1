"""The HTTP/1.1 connection protocol: uvicorn's h11 protocol with a connection budget, a
deadline for request heads, and one for writes a client does not read.

uvicorn closes a keep-alive connection that stays idle after a response (`timeout_keep_alive`),
but nothing else: a connection that never sends a byte, or sends its headers a byte at a time,
stays open for ever, and enough of them use up the process's file descriptors. So:

- **head deadline**: a request's line and headers must arrive whole within `header_timeout_s`,
  counted from the connection's opening, or from the first byte of a later request on it;
  otherwise the connection is closed;
- **head size**: a request's line and headers, up to the blank line that ends them, may take
  `MAX_HEAD_BYTES`; a longer head is answered 431 and the connection closed, before the HTTP
  parser reads it. (h11's own limit, the same number, holds only for a head still incomplete
  after a read: a whole head of any size that arrived in one read was parsed);
- **connection budget**: at most `max_connections` are open. A new one past the budget closes
  the connection that has been idle longest (no request in progress: a fresh or slow one, or a
  keep-alive one between requests); if every connection is busy, the new one is closed;
- **write deadline**: uvicorn stops an app's `send` while the connection's write buffer is over
  its high-water mark (the client does not read). A connection whose buffer then drains by not
  one byte for `write_timeout_s` is aborted (its unsent bytes dropped): the app sees a
  disconnect, so a stream's requests are aborted and their KV and request slots freed;
- **shutdown**: past the grace period (`stop_writes`) a connection that stalls a write is
  aborted at once, and when uvicorn closes the connections, one whose unsent bytes do not move
  for `_SHUTDOWN_WRITE_S` is aborted instead of holding the process.

uvicorn's own `limit_concurrency` is not used: it counts idle connections as load and answers
every request past it with a plain-text 503, even while the idle ones could just be closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import struct
import time
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from stallfree.entrypoints.server.base.errors import error_body
from stallfree.entrypoints.server.base.protocol import ErrorInfo

logger = logging.getLogger("stallfree.server")

_WARN_EVERY_S = 10.0
# once the server stops, how long a connection's unsent bytes may stand still before it is
# aborted (uvicorn would otherwise wait for them, then cancel whatever runs)
_SHUTDOWN_WRITE_S = 1.0
# SO_LINGER on with a zero timeout: close() resets the connection
_RESET = struct.pack("ii", 1, 0)
# the most bytes a request's line and headers may take, the blank line that ends them included
# (h11's default limit, which uvicorn keeps)
MAX_HEAD_BYTES = 16 * 1024
# where a head ends, as h11 finds it (a line ending may be a bare LF)
_HEAD_END = re.compile(rb"\n\r?\n")


class ConnectionBudget:
    """The live connections of one server, and its idle ones, longest idle first."""

    def __init__(self, limit: int, write_timeout_s: float = float("inf")) -> None:
        self.limit = limit
        self.write_timeout_s = write_timeout_s
        self.live: set[GuardedH11Protocol] = set()
        # a dict keeps insertion order: the first key is the longest idle
        self.idle: dict[GuardedH11Protocol, None] = {}
        self.evicted = 0
        self.refused = 0
        self.write_timeouts = 0
        # past the grace period: a stalled write aborts its connection at once
        self.stopping = False
        self._warned_at = -_WARN_EVERY_S
        self._write_warned_at = -_WARN_EVERY_S

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

    def stop_writes(self) -> int:
        """The grace period is over: abort every connection whose writes are stalled now, and
        from now on each one that stalls. Returns how many were aborted now."""
        self.stopping = True
        stalled = [conn for conn in self.live if conn.write_stalled]
        for conn in stalled:
            conn.abort()
        return len(stalled)

    def write_timed_out(self) -> None:
        self.write_timeouts += 1
        now = time.monotonic()
        if now - self._write_warned_at >= _WARN_EVERY_S:
            self._write_warned_at = now
            logger.warning(
                "closed a connection that accepted no bytes for %gs (server.write_timeout_s); "
                "%d so far",
                self.write_timeout_s,
                self.write_timeouts,
            )

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
        # the write watchdog: armed while writes are stalled (or, at shutdown, while bytes
        # are unsent); the buffer's size at its last look and when it last went down
        self._write_timer: asyncio.TimerHandle | None = None
        self._write_limit_s = 0.0
        self._watch_to_close = False
        self._unsent = 0
        self._moved_at = 0.0
        # the head being received: its bytes so far, and the last two of them (its end, a
        # blank line, may straddle two reads)
        self._head_bytes = 0
        self._head_tail = b""

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
        self._disarm_write_timer()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.budget.stopping:
            # past the grace period: a client that does not read gets nothing more
            self.loop.call_soon(self.abort)
        elif self._write_timer is None:
            self._watch_writes(self.budget.write_timeout_s)

    def resume_writing(self) -> None:
        super().resume_writing()
        if not self._watch_to_close:
            self._disarm_write_timer()

    def shutdown(self) -> None:
        """uvicorn's server is stopping (it closes idle connections, and busy ones after their
        response): unsent bytes that stand still are not waited for."""
        super().shutdown()
        self._disarm_write_timer()
        self._watch_writes(_SHUTDOWN_WRITE_S, stopping=True)

    @property
    def write_stalled(self) -> bool:
        """The client is not reading: the app's writes wait for the buffer to drain."""
        return self.flow is not None and self.flow.write_paused

    def abort(self) -> None:
        """Close the connection now with a TCP reset, dropping its unsent bytes (the kernel's
        too: closed normally, it would keep them, and probe a client that reads nothing, for
        minutes); a response in progress sees a disconnect."""
        self._disarm_write_timer()
        self.budget.forget(self)
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and not self._head_fits(data):
            self._refuse_head()
            return
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

    def _head_fits(self, data: bytes) -> bool:
        """Whether the head that `data` begins or continues stays within `MAX_HEAD_BYTES`."""
        seen = self._head_tail + data
        end = _HEAD_END.search(seen)
        upto = self._head_bytes - len(self._head_tail) + (end.end() if end else len(seen))
        if upto > MAX_HEAD_BYTES:
            return False
        if end is None:
            self._head_bytes, self._head_tail = upto, seen[-2:]
        else:  # the head is whole: the next one counts from 0
            self._head_bytes, self._head_tail = 0, b""
        return True

    def _refuse_head(self) -> None:
        """431 in the OpenAI error shape, written as is (the parser has seen no request), and
        the connection closes."""
        self._disarm_head_timer()
        body = error_body(
            ErrorInfo(
                message=f"the request's line and headers are over {MAX_HEAD_BYTES} bytes",
                type="invalid_request_error",
                code="headers_too_large",
            )
        )
        head = (
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n"
            b"connection: close\r\n\r\n"
        )
        self.transport.write(head + body)
        self.transport.close()

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

    def _buffered(self) -> int:
        try:
            return self.transport.get_write_buffer_size()
        except (AttributeError, NotImplementedError, RuntimeError):  # pragma: no cover
            return 0

    def _watch_writes(self, limit_s: float, stopping: bool = False) -> None:
        """Abort the connection once it has had unsent bytes that did not go down for
        `limit_s`: while its writes are stalled, or (`stopping`) until it is closed."""
        if limit_s == float("inf"):
            return
        self._write_limit_s = limit_s
        self._watch_to_close = stopping
        self._unsent = self._buffered()
        self._moved_at = self.loop.time()
        self._arm_write_timer(limit_s)

    def _arm_write_timer(self, remaining_s: float) -> None:
        # a look every quarter of the limit: the abort comes within 1.25 times the limit
        delay = max(0.01, min(remaining_s, self._write_limit_s / 4))
        self._write_timer = self.loop.call_later(delay, self._write_check)

    def _disarm_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_check(self) -> None:
        self._write_timer = None
        if not (self._watch_to_close or self.write_stalled):
            return
        unsent = self._buffered()
        now = self.loop.time()
        if unsent == 0 or unsent < self._unsent:
            self._moved_at = now  # bytes went out (or none wait)
        self._unsent = unsent
        remaining = self._moved_at + self._write_limit_s - now
        if remaining > 0:
            self._arm_write_timer(remaining)
            return
        if not self._watch_to_close:
            self.budget.write_timed_out()
        self.abort()

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.budget.forget(self)
            self.close_idle()


def guarded_protocol(
    max_connections: int, header_timeout_s: float, write_timeout_s: float = float("inf")
) -> type[GuardedH11Protocol]:
    """The protocol class of one server: its own budget, shared by its connections."""
    return type(
        "StallfreeH11Protocol",
        (GuardedH11Protocol,),
        {
            "budget": ConnectionBudget(max_connections, write_timeout_s),
            "header_timeout_s": header_timeout_s,
        },
    )
