"""Servers as subprocesses for the benchmark scripts: one `stallfree serve`, or a disaggregated
deployment (a prefill server, a decode server and `stallfree router`), on free loopback ports,
each with its log file, all stopped on exit (imported as `pd_processes` from a script in this
folder). `python -m stallfree` runs whichever checkout `PYTHONPATH` names."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Processes:
    """The processes started, in order; `stop` ends them newest first."""

    log_dir: Path
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, name: str, args: Sequence[str], timeout: float = 180.0) -> str:
        """`python -m stallfree ARGS --port P`, healthy; its URL."""
        port = free_port()
        cmd = [sys.executable, "-m", "stallfree", *args, "--port", str(port)]
        log = self.log_dir / f"{name}.log"
        with open(log, "w") as f:
            f.write("+ " + shlex.join(cmd) + "\n")
            f.flush()
            proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        self.procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, url, log, timeout)
        return url

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: exited with {proc.returncode}; see {log}")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            if r.status == 200:
                return
        time.sleep(0.25)
    raise RuntimeError(f"{url}: not healthy after {timeout:.0f} s; see {log}")


@dataclass
class PD:
    router: str
    prefill: str
    decode: str


@contextlib.contextmanager
def pd_deployment(
    model: str, log_dir: Path, server_args: Sequence[str] = (), env: dict[str, str] | None = None
) -> Iterator[PD]:
    """A prefill server, a decode server and the router in front of them."""
    procs = Processes(log_dir, {**os.environ, **(env or {})})
    try:
        boot = free_port()
        prefill_args = ["serve", model, "--disaggregation-mode", "prefill"]
        prefill = procs.start(
            "prefill", [*prefill_args, "--disaggregation-bootstrap-port", str(boot), *server_args]
        )
        decode = procs.start(
            "decode", ["serve", model, "--disaggregation-mode", "decode", *server_args]
        )
        router = procs.start(
            "router", ["router", "--prefill", prefill, str(boot), "--decode", decode]
        )
        yield PD(router, prefill, decode)
    finally:
        procs.stop()


def metric(url: str, name: str) -> float:
    """The sum of a family's samples on `url`'s /metrics (0 when it has none)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )
