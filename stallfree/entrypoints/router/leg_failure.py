"""How a leg of a relayed request fails, and what the client is shown of it.

A leg fails when its server answers an error (its status and body are kept, and shown to the
client as they are when the body is an OpenAI-shaped error) or when its connection fails or
breaks off (a 502, or 504 on a timeout, naming the server). `leg_failure` reads a finished
leg's task; `Answer` is a whole answer held until it is complete.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import httpx

from stallfree.entrypoints.router.pool import Server, describe

# the headers of an upstream answer passed on to the client; the rest (length, framing,
# connection) are the router's own connection's business
_PASSED = frozenset({"content-type", "cache-control", "x-accel-buffering", "retry-after"})


def error_payload(message: str, type: str, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": None, "code": code}}


class LegFailure(Exception):
    """A leg that failed: the server answered an error (`status`, `body`), or its connection
    failed or broke off (`status` None; `gateway_status` is what the client gets)."""

    def __init__(
        self,
        leg: str,
        server: Server,
        reason: str,
        status: int | None = None,
        body: bytes = b"",
        headers: list[tuple[bytes, bytes]] | None = None,
        gateway_status: int = 502,
    ) -> None:
        super().__init__(f"{leg} server {server.url} failed: {reason}")
        self.leg = leg
        self.server = server
        self.status = status
        self.body = body
        self.headers = headers or []  # what the client may see of the server's answer's head
        self.gateway_status = gateway_status

    @classmethod
    def of(cls, leg: str, server: Server, exc: httpx.HTTPError) -> LegFailure:
        if isinstance(exc, httpx.TimeoutException):
            return cls(leg, server, f"no answer in time ({describe(exc)})", gateway_status=504)
        return cls(leg, server, describe(exc))

    @classmethod
    def answered(cls, leg: str, server: Server, resp: httpx.Response, body: bytes) -> LegFailure:
        head = passed_headers(resp.headers)
        return cls(leg, server, f"HTTP {resp.status_code}", resp.status_code, body, head)

    @property
    def message(self) -> str:
        return str(self)

    def error(self) -> dict[str, Any]:
        """The OpenAI-shaped error this failure shows the client: the server's own when its
        body was one, else the router's naming the server."""
        if self.status is not None:
            try:
                payload = json.loads(self.body)
            except ValueError:
                payload = None
            if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
                return payload
        return error_payload(self.message, "upstream_error", self.gateway_status)


@dataclass(slots=True)
class Answer:
    """A whole (not event-stream) answer of the decode leg, sent once it is complete."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


def leg_failure(task: asyncio.Task[Any]) -> LegFailure | None:
    """A finished leg's failure, None when it succeeded; anything else it raised (a bug)
    propagates."""
    if task.cancelled():
        return None
    exc = task.exception()
    if exc is None or isinstance(exc, LegFailure):
        return exc
    raise exc


def passed_headers(headers: httpx.Headers) -> list[tuple[bytes, bytes]]:
    """The head of an upstream answer that the client may see."""
    return [(k, v) for k, v in headers.raw if k.lower().decode("latin-1") in _PASSED]
