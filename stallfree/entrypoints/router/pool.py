"""The servers behind the router: which one a request goes to, and which ones are up.

Load is what this router itself has in flight on each server (a leg counts from the moment it
is picked until its task ends), so `least_load` sees a pick at once, before any byte is sent;
the servers' own queues are not asked for.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from stallfree.entrypoints.router.flags import RouterSettings
from stallfree.entrypoints.router.metrics import RouterMetrics

# how long a /health probe of the servers is reused by the router's own /health and /v1/models
HEALTH_TTL_S = 1.0
HEALTH_TIMEOUT_S = 2.0


@dataclass(slots=True, eq=False)
class Server:
    """One upstream and the legs this router has in flight on it."""

    url: str
    role: str  # "prefill" or "decode"
    bootstrap_port: int | None = None
    bootstrap_host: str = ""
    inflight: int = 0


class ServerPool:
    """The prefill and decode servers, and the pick of one of each per request."""

    def __init__(self, settings: RouterSettings, metrics: RouterMetrics) -> None:
        self.prefill = [
            Server(u.url, "prefill", u.bootstrap_port, u.host) for u in settings.prefill
        ]
        self.decode = [Server(u.url, "decode") for u in settings.decode]
        self.policy = settings.policy
        self.metrics = metrics
        # round robin: a counter per kind, so the prefill turn does not depend on the decode's
        self._turns = {"prefill": itertools.count(), "decode": itertools.count()}

    @property
    def servers(self) -> list[Server]:
        return [*self.prefill, *self.decode]

    def acquire(self, role: str) -> Server:
        """Pick a server of `role` and count a leg in flight on it (`release` uncounts it)."""
        servers = self.prefill if role == "prefill" else self.decode
        if self.policy == "least_load":
            # min keeps the first of equals: ties go by the order the servers were given
            server = min(servers, key=lambda s: s.inflight)
        else:
            server = servers[next(self._turns[role]) % len(servers)]
        self.hold(server)
        return server

    def hold(self, server: Server) -> None:
        """Count a leg in flight on `server`, picked by the caller (`release` uncounts it)."""
        server.inflight += 1
        self.metrics.inflight.labels(server=server.url).inc()

    def release(self, server: Server) -> None:
        server.inflight -= 1
        self.metrics.inflight.labels(server=server.url).dec()


async def probe(client: httpx.AsyncClient, url: str, timeout_s: float) -> str | None:
    """None when `GET {url}/health` answers 200; else what went wrong, in a few words."""
    try:
        resp = await client.get(f"{url}/health", timeout=timeout_s)
    except httpx.HTTPError as exc:
        return describe(exc)
    return None if resp.status_code == 200 else f"HTTP {resp.status_code}"


def describe(exc: BaseException) -> str:
    """An httpx failure in a few words: its class, and its text when it has one."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Health:
    """Which servers answer /health, probed at most once a `HEALTH_TTL_S` however many
    callers ask (a load balancer polling the router's /health must not multiply into probes
    of every server)."""

    def __init__(self, client: httpx.AsyncClient, servers: Sequence[Server]) -> None:
        self.client = client
        self.servers = list(servers)
        self._up: dict[str, bool] = {}
        self._at = float("-inf")
        self._lock = asyncio.Lock()

    async def up(self) -> dict[str, bool]:
        """Each server's URL and whether it answered its last probe with 200."""
        async with self._lock:
            if time.monotonic() - self._at >= HEALTH_TTL_S:
                urls = [s.url for s in self.servers]
                answers = await asyncio.gather(
                    *(probe(self.client, url, HEALTH_TIMEOUT_S) for url in urls)
                )
                self._up = {url: answer is None for url, answer in zip(urls, answers, strict=True)}
                self._at = time.monotonic()
            return dict(self._up)
