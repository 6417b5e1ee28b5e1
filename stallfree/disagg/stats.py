"""A disaggregated server's figures: rooms per queue, failures per stage, transfer seconds and
bytes. Kept in its own Prometheus registry, which the server's `/metrics` appends to the
engine's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

QUEUES = ("bootstrap", "prealloc", "transfer")
STAGES = ("bootstrap", "prealloc", "transfer", "wait_ack")
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BYTES_BUCKETS = tuple(float(1 << p) for p in range(10, 34, 2))  # 1 KiB .. 8 GiB


class DisaggStats:
    def __init__(self, role: str) -> None:
        self.role = role
        self.registry = CollectorRegistry()
        labels = ["role"]
        self._queue = Gauge(
            "stallfree:disagg_queue_reqs",
            "Rooms (requests in disaggregated hand-over) per queue: bootstrap (pairing up), "
            "prealloc (decode: waiting for pages), transfer (KV moving or awaiting its ack)",
            [*labels, "queue"],
            registry=self.registry,
        )
        self._failures = Counter(
            "stallfree:kv_transfer_failures",
            "Rooms that failed, by the stage they were in",
            [*labels, "stage"],
            registry=self.registry,
        )
        self._seconds = Histogram(
            "stallfree:kv_transfer_seconds",
            "Seconds from a room's first KV read (prefill) or its registration (decode) to "
            "the last layer sent or received",
            labels,
            buckets=SECONDS_BUCKETS,
            registry=self.registry,
        )
        self._bytes = Histogram(
            "stallfree:kv_transfer_bytes",
            "KV bytes moved per room (all layers and ranks)",
            labels,
            buckets=BYTES_BUCKETS,
            registry=self.registry,
        )
        self._rooms = Counter(
            "stallfree:kv_transfers",
            "Rooms whose KV moved completely",
            labels,
            registry=self.registry,
        )
        for q in QUEUES:
            self._queue.labels(role, q).set(0)
        for s in STAGES:
            self._failures.labels(role, s)
        self._queue_counts: dict[str, int] = dict.fromkeys(QUEUES, 0)
        self.failures: dict[str, int] = dict.fromkeys(STAGES, 0)
        self.transfers = 0
        self.transfer_seconds = 0.0
        self.transfer_bytes = 0

    @property
    def queues(self) -> dict[str, int]:
        return dict(self._queue_counts)

    @queues.setter
    def queues(self, counts: dict[str, int]) -> None:
        merged = {
            "bootstrap": counts.get("bootstrap", 0),
            "prealloc": counts.get("prealloc", 0),
            "transfer": counts.get("transfer", 0) + counts.get("wait_ack", 0),
        }
        self._queue_counts = merged
        for q, n in merged.items():
            self._queue.labels(self.role, q).set(n)

    def failed(self, stage: str) -> None:
        stage = stage if stage in STAGES else "transfer"
        self.failures[stage] += 1
        self._failures.labels(self.role, stage).inc()

    def transferred(self, seconds: float, nbytes: int) -> None:
        self.transfers += 1
        self.transfer_seconds += seconds
        self.transfer_bytes += nbytes
        self._rooms.labels(self.role).inc()
        self._seconds.labels(self.role).observe(seconds)
        self._bytes.labels(self.role).observe(nbytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)
