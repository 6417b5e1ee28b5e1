"""Code the benchmark scripts share (imported as `common`: run a script as
`python benchmarks/<script>.py`, which puts this folder on the import path)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import httpx

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


@contextlib.contextmanager
def serve_process(
    model: str = "tiny",
    *flags: str,
    prefix: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """`stallfree serve --model MODEL` on the CPU in a subprocess on a free loopback port
    (`prefix` runs it under another command, such as `taskset`); its URL once `/health`
    answers 200."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [*prefix, sys.executable, "-m", "stallfree.entrypoints.cli", "serve", "--model", model]
    cmd += ["--device", "cpu", "--port", str(port), *flags]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=None if env is None else dict(env),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("stallfree serve did not start")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
