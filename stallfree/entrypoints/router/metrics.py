"""The router's own Prometheus registry (`/metrics` of `stallfree router`).

The router has no engine, so none of the engine's families are here; its names share the
`stallfree:` prefix so one dashboard can show both. Every leg and every server is exported at
0 from the start, so a dashboard shows 0 rather than "No data".
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from stallfree.metrics.histogram import REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS
from stallfree.metrics.names import PREFIX

# the routes the router relays, as the `route` label names them
ROUTES = ("completions", "chat")
# where a request can fail: one of its two legs, or the client that left
LEGS = ("prefill", "decode", "client")


class RouterMetrics:
    """The router's families, on a registry of its own (never the process-wide one, so two
    routers in one process, as in the tests, do not collide)."""

    def __init__(self, servers: Iterable[str] = ()) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter(
            f"{PREFIX}router_requests",
            "Requests answered by the router, by route and the HTTP status it answered "
            "(499: the client left first)",
            ["route", "status"],
            registry=reg,
        )
        self.request_seconds = Histogram(
            f"{PREFIX}router_request_seconds",
            "Whole requests through the router, from the body read to the last byte relayed",
            ["route"],
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=reg,
        )
        self.first_byte_seconds = Histogram(
            f"{PREFIX}router_first_byte_seconds",
            "Time from the body read to the decode server's first body byte",
            ["route"],
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.leg_failures = Counter(
            f"{PREFIX}router_leg_failures",
            "Requests ended by a failed leg: the prefill or decode server answered an error or "
            "its connection failed, or the client left",
            ["leg"],
            registry=reg,
        )
        self.inflight = Gauge(
            f"{PREFIX}router_inflight_requests",
            "Legs in flight through this router, by upstream server",
            ["server"],
            registry=reg,
        )
        for leg in LEGS:
            self.leg_failures.labels(leg=leg)
        for route in ROUTES:
            self.request_seconds.labels(route=route)
            self.first_byte_seconds.labels(route=route)
        for url in servers:
            self.inflight.labels(server=url)

    def answered(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route=route, status=str(status)).inc()
        self.request_seconds.labels(route=route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
