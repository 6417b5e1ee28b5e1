"""`host_read`: the only sanctioned device-to-host read, and the monitor that counts stalls."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch

from stallfree.overlap.stream import DeviceStream


class ScheduleSyncError(RuntimeError):
    """A device read on the schedule path while strict mode is on."""


StallSink = Callable[[str, float], None]


class SyncMonitor:
    """Counts and times every `host_read`, per site, and enforces strict mode.

    Its counts are the engine's stall counters; sinks receive each stall's duration.
    """

    def __init__(self, stream: DeviceStream, strict: bool = False) -> None:
        self.stream = stream
        self.strict = strict
        self.stall_counts: dict[str, int] = defaultdict(int)
        self.stall_seconds: dict[str, float] = defaultdict(float)
        self.mirror_reads: dict[str, int] = defaultdict(int)
        self.schedule_path_reads = 0
        self._in_schedule_path = False
        self.stall_sinks: list[StallSink] = []

    @contextlib.contextmanager
    def schedule_path(self) -> Iterator[None]:
        """Marks batch preparation; host_read inside it is a stall, an error when strict."""
        outer = self._in_schedule_path
        self._in_schedule_path = True
        try:
            with self.stream.schedule_guard(self.strict):
                yield
        finally:
            self._in_schedule_path = outer

    def host_read(self, tensor: torch.Tensor, site: str) -> torch.Tensor:
        """Synchronise the stream and copy `tensor` to the host, recording the stall at `site`."""
        if self._in_schedule_path:
            self.schedule_path_reads += 1
            if self.strict:
                raise ScheduleSyncError(f"host_read at {site!r} on the schedule path (strict mode)")
        start = time.perf_counter()
        self.stream.synchronize()
        out = tensor.to("cpu", copy=True)
        waited = time.perf_counter() - start
        self.stall_counts[site] += 1
        self.stall_seconds[site] += waited
        for sink in self.stall_sinks:
            sink(site, waited)
        return out

    def mirror_read(self, field: str) -> None:
        self.mirror_reads[field] += 1

    def total_stalls(self) -> int:
        return sum(self.stall_counts.values())
