"""Code the benchmark scripts share (imported as `common`: run a script as
`python benchmarks/<script>.py`, which puts this folder on the import path)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from stallfree import Engine
from stallfree.runtime.telemetry.observer import EngineObserver


@dataclass
class Mark:
    """The engine's counters at one decode step, and the wall clock then."""

    wall: float
    busy: float  # device busy seconds
    schedule: float  # host seconds spent building and launching batches
    stalls: int  # host_read calls, all sites
    stall_seconds: float
    tokens: int  # generation tokens accepted
    steps: int  # decode batches launched


class Window(EngineObserver):
    """Snapshots the engine at decode step `start` and `start + steps` (two `marks`)."""

    def __init__(self, engine: Engine, start: int, steps: int) -> None:
        self.engine = engine
        self.start, self.steps = start, steps
        self.decode_steps = 0
        self.marks: list[Mark] = []

    def on_step(self, num_reqs: int, decode: bool, overlapped: bool) -> None:
        if not decode:
            return
        self.decode_steps += 1
        if self.decode_steps in (self.start, self.start + self.steps):
            snap = self.engine.snapshot()
            self.marks.append(
                Mark(
                    wall=time.perf_counter(),
                    busy=snap.device_busy_seconds,
                    schedule=snap.counters.schedule_seconds,
                    stalls=sum(snap.stalls.values()),
                    stall_seconds=sum(snap.stall_seconds.values()),
                    tokens=snap.counters.generation_tokens,
                    steps=snap.counters.decode_batches,
                )
            )
