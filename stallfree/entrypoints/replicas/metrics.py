"""The front's `/metrics`: every replica's families, merged, then the front's own.

Each replica labels its series `engine="i"` (its index), so the replicas' expositions hold the
same families with distinct series; merged, each family is declared once (one HELP and TYPE)
and holds every replica's series, as one exposition must. The front's families are the
router's (`stallfree:router_*`: requests, latency, failed legs, requests in flight per
replica URL) and the replicas' own (`stallfree:replica_*`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from stallfree.metrics.names import PREFIX

# why the front placed a request on a replica
REASONS = ("prefix", "load", "turn")


@dataclass(slots=True)
class _Family:
    head: list[bytes] = field(default_factory=list)
    samples: list[bytes] = field(default_factory=list)


def merge_expositions(texts: Iterable[bytes]) -> bytes:
    """Prometheus text expositions with distinct series as one: a family's HELP and TYPE from
    the first text that declares it, its samples from all, in the order first seen."""
    families: dict[bytes, _Family] = {}
    for text in texts:
        current: _Family | None = None
        for line in text.splitlines():
            if line.startswith((b"# HELP ", b"# TYPE ")):
                name = line.split(b" ", 3)[2]
                current = families.setdefault(name, _Family())
                kind = line[:6]
                if not any(h.startswith(kind + b" " + name + b" ") for h in current.head):
                    current.head.append(line)
            elif line and not line.startswith(b"#") and current is not None:
                current.samples.append(line)
    out = [line for f in families.values() for line in (*f.head, *f.samples)]
    return b"\n".join(out) + b"\n" if out else b""


class ReplicaMetrics:
    """The replicas as the front sees them, on a registry of the front's own."""

    def __init__(self, labels: Iterable[str]) -> None:
        self.registry = CollectorRegistry()
        self.routed = Counter(
            f"{PREFIX}replica_routed_requests",
            "Requests the front placed on each replica, by why: prefix (it was sent the "
            "longest prefix of the prompt), load (least loaded) or turn (round robin)",
            ["engine", "reason"],
            registry=self.registry,
        )
        self.up = Gauge(
            f"{PREFIX}replica_up",
            "1 while the replica's process runs and its /health answers 200, else 0",
            ["engine"],
            registry=self.registry,
        )
        self.exits = Counter(
            f"{PREFIX}replica_exits",
            "Replica processes that exited while the front was not shutting down",
            ["engine"],
            registry=self.registry,
        )
        for label in labels:
            self.up.labels(engine=label).set(0)
            self.exits.labels(engine=label)
            for reason in REASONS:
                self.routed.labels(engine=label, reason=reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)
