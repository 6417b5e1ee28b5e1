"""`Front`: what the replicas' HTTP front works with, and its watch over their processes.

A replica's process exiting is seen at once (its sentinel becomes readable on the event loop):
the replica is marked down, never chosen again, its `replica_up` goes to 0 and, unless the
front is shutting down, one error line says so and `replica_exits` counts it. Its requests in
flight fail on their own, as their connections break. The front's `/health` is 200 only while
every replica's process runs and answers its own `/health` with 200; the front probes them
every `PROBE_EVERY_S` too, and places no request on one that stopped answering while another
answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from multiprocessing.process import BaseProcess

from stallfree.config import StallfreeConfig
from stallfree.entrypoints.replicas.metrics import ReplicaMetrics
from stallfree.entrypoints.replicas.placement import Placement, PrefixIndex, Replica
from stallfree.entrypoints.router.dispatch import Router
from stallfree.entrypoints.router.flags import RouterSettings, Upstream
from stallfree.entrypoints.server.base.state import Lifecycle

logger = logging.getLogger("stallfree.replicas")
PROBE_EVERY_S = 2.0


class Front:
    def __init__(
        self, config: StallfreeConfig, processes: list[BaseProcess], urls: list[str]
    ) -> None:
        self.config = config
        self.processes = processes
        rc = config.replicas
        settings = RouterSettings(
            prefill=(),
            decode=tuple(Upstream(url) for url in urls),
            request_timeout_s=rc.request_timeout_s,
            max_body_bytes=config.server.max_body_bytes,
            startup_timeout_s=rc.startup_timeout_s,
        )
        self.router = Router(settings)
        servers = self.router.pool.decode
        for server in servers:
            server.role = "replica"
        self.replicas = [
            Replica(i, server, PrefixIndex(rc.prefix_blocks)) for i, server in enumerate(servers)
        ]
        self.placement = Placement(self.replicas, rc)
        self.metrics = ReplicaMetrics(r.label for r in self.replicas)
        self.lifecycle = Lifecycle()  # the front's own door (its Guard): draining refuses
        self.exited = asyncio.Event()  # every replica's process has exited

    def watch(self) -> None:
        """Watch each replica's process from the running event loop."""
        loop = asyncio.get_running_loop()
        for replica, proc in zip(self.replicas, self.processes, strict=True):
            loop.add_reader(proc.sentinel, self._on_exit, replica, proc)

    def _on_exit(self, replica: Replica, proc: BaseProcess) -> None:
        asyncio.get_running_loop().remove_reader(proc.sentinel)
        proc.join(timeout=0)
        replica.alive = False
        replica.prefixes.clear()
        self.metrics.up.labels(engine=replica.label).set(0)
        if not self.lifecycle.draining:
            self.metrics.exits.labels(engine=replica.label).inc()
            live = sum(r.alive for r in self.replicas)
            logger.error(
                "replica %d (pid %s) exited with code %s; its requests in flight fail, "
                "%d of %d replicas go on serving; /health answers 503",
                replica.index, proc.pid, proc.exitcode, live, len(self.replicas),
            )  # fmt: skip
        if not any(r.alive for r in self.replicas):
            self.exited.set()

    async def healthy(self) -> list[int]:
        """The replicas that are down: exited, or not answering /health with 200."""
        answers = await self.router.health.up()
        down = []
        for r in self.replicas:
            r.answering = answers.get(r.server.url, False)
            up = r.alive and r.answering
            self.metrics.up.labels(engine=r.label).set(1 if up else 0)
            if not up:
                down.append(r.index)
        return down

    async def probe_forever(self) -> None:
        """Probe the replicas' /health every `PROBE_EVERY_S`, so placement passes over one
        that stopped answering and `replica_up` stays current between scrapes."""
        while True:
            await self.healthy()
            await asyncio.sleep(PROBE_EVERY_S)

    def signal_replicas(self, signum: int) -> None:
        """Send `signum` to every replica still running (SIGTERM: drain and exit)."""
        for r, proc in zip(self.replicas, self.processes, strict=True):
            if r.alive and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signum)

    @property
    def draining(self) -> bool:
        return self.lifecycle.draining

    def begin_drain(self, signum: int = signal.SIGTERM) -> None:
        self.lifecycle.begin_drain()
        self.signal_replicas(signum)
