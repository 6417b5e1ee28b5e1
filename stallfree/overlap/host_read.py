"""`host_read`: the only sanctioned device-to-host read, and the monitor that counts stalls."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch

from stallfree.overlap.stream import DeviceStream
from stallfree.overlap.strict import ScheduleSyncError, StrictGuard, StrictReadError

__all__ = ["ScheduleSyncError", "StallSink", "StrictReadError", "SyncMonitor"]


StallSink = Callable[[str, float], None]


class SyncMonitor:
    """Counts and times every `host_read`, per site, and enforces strict mode.

    Its counts are the engine's stall counters; sinks receive each stall's duration.

    In strict mode on the CPU stream it also runs the read guard (`overlap/strict.py`): any
    other read of a stream-owned tensor on the schedule path raises. `enable_read_guard()` turns
    the guard on without strict (tests of the legacy modes, where `host_read` is allowed).
    """

    def __init__(self, stream: DeviceStream, strict: bool = False) -> None:
        self.stream = stream
        self.strict = strict
        self.guard: StrictGuard | None = None
        if strict:
            self.enable_read_guard()
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
            with self.stream.schedule_guard(self.strict), self._guarded():
                yield
        finally:
            self._in_schedule_path = outer

    def enable_read_guard(self) -> StrictGuard | None:
        """Guard reads of stream-owned tensors on the schedule path (CPU stream only).

        Only tensors the stream produces after this call are known to the guard, so call it
        before any batch is built. Returns the guard, or None on a CUDA stream (there
        `torch.cuda.set_sync_debug_mode` plays this part in strict mode).
        """
        if self.guard is None and self.stream.device.type == "cpu":
            self.guard = self.stream.guard or StrictGuard()
            self.stream.attach_guard(self.guard)
        return self.guard

    def _guarded(self) -> contextlib.AbstractContextManager[None]:
        return self.guard.schedule_path() if self.guard is not None else contextlib.nullcontext()

    def debug_read(self) -> contextlib.AbstractContextManager[None]:
        """A sanctioned debug read (the mirror parity checker): the guard lets it through."""
        return self.guard.suspended() if self.guard is not None else contextlib.nullcontext()

    def host_read(self, tensor: torch.Tensor, site: str) -> torch.Tensor:
        """Synchronise the stream and copy `tensor` to the host, recording the stall at `site`."""
        if self._in_schedule_path:
            self.schedule_path_reads += 1
            if self.strict:
                raise ScheduleSyncError(f"host_read at {site!r} on the schedule path (strict mode)")
        start = time.perf_counter()
        with self.debug_read():
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
