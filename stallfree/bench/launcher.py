"""Start a `stallfree serve` subprocess for one mode on a free loopback port, and stop it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from stallfree.bench.targets import TargetError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config_env(settings: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Nested settings as `STALLFREE_SECTION__KEY` variables, the way the config reads them."""
    env = {}
    for section, values in settings.items():
        for key, value in values.items():
            text = value if isinstance(value, str) else json.dumps(value)
            env[f"STALLFREE_{section.upper()}__{key.upper()}"] = text
    return env


class ServerProcess:
    """`stallfree serve` configured through its environment, so every setting reaches it."""

    def __init__(
        self,
        settings: dict[str, dict[str, Any]],
        config_path: str | None = None,
        startup_timeout_s: float = 300.0,
    ) -> None:
        self.settings = settings
        self.config_path = config_path
        self.startup_timeout_s = startup_timeout_s
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    def _command(self) -> list[str]:
        cmd = [sys.executable, "-m", "stallfree.cli", "serve"]
        if self.config_path:
            cmd += ["--config", self.config_path]
        return cmd

    async def start(self) -> str:
        env = dict(os.environ)
        env.update(config_env(self.settings))
        env.update(config_env({"server": {"host": "127.0.0.1", "port": self.port}}))
        # closed in stop(): the log outlives this call, for the error message if startup fails
        self._log = tempfile.NamedTemporaryFile(prefix="stallfree-serve-", suffix=".log")  # noqa: SIM115
        self.proc = subprocess.Popen(
            self._command(), env=env, stdout=self._log, stderr=subprocess.STDOUT
        )
        try:
            await self._wait_healthy()
        except BaseException:
            await self.stop()
            raise
        return self.base_url

    async def _wait_healthy(self) -> None:
        import httpx  # here, not at the top: the base install has no httpx

        deadline = time.monotonic() + self.startup_timeout_s
        async with httpx.AsyncClient(base_url=self.base_url, timeout=2.0) as client:
            while time.monotonic() < deadline:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise TargetError(
                        f"stallfree serve exited with code {self.proc.returncode}:\n{self.log_tail()}"
                    )
                try:
                    if (await client.get("/health")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)
        raise TargetError(
            f"stallfree serve did not become healthy in {self.startup_timeout_s:.0f}s:\n"
            f"{self.log_tail()}"
        )

    def log_tail(self, lines: int = 20) -> str:
        if self._log is None:
            return ""
        text = Path(self._log.name).read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    async def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (graceful drain), then SIGKILL if it outlives `timeout_s`."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait)
        if self._log is not None:
            self._log.close()
            self._log = None
