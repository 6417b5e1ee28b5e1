"""The Rust routers operators run (sglang-router, vllm-router; the `routers` test extra) in front
of `stallfree serve` processes: each started as its package's own launcher starts it, on
loopback ports, with its output in a file of the test's."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
SERVED = "test-model"
# liveness bounds, named as such: the tests assert answers and counts, never how fast
START_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 60.0
LAUNCHERS = {"sglang": "sglang_router.launch_router", "vllm": "vllm_router.launch_router"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


@dataclass
class Proc:
    name: str
    port: int
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return url(self.port)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=30)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=15)


@dataclass
class Procs:
    """Every process a test module started, stopped (servers killed if need be) at its end."""

    logs: Path
    started: list[Proc] = field(default_factory=list)

    def spawn(self, name: str, argv: list[str], port: int) -> Proc:
        log = self.logs / f"{name}.log"
        env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
        with log.open("wb") as out:
            popen = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        proc = Proc(name, port, popen, log)
        self.started.append(proc)
        return proc

    def server(self, name: str, *flags: str) -> Proc:
        """`stallfree serve tiny` with its access log on (the tests read what routers call)."""
        port = free_port()
        argv = [sys.executable, "-m", "stallfree", "serve", MODEL, "--port", str(port)]
        argv += ["--served-model-name", SERVED, "--access-log", *flags]
        return self.spawn(name, argv, port)

    def router(self, kind: str, *flags: str) -> Proc:
        port = free_port()
        argv = [sys.executable, "-m", LAUNCHERS[kind], "--host", "127.0.0.1"]
        # each router's Prometheus exporter binds a port of its own (default 29000)
        argv += ["--port", str(port), "--prometheus-port", str(free_port()), *flags]
        return self.spawn(f"{kind}-router-{port}", argv, port)

    def close(self) -> None:
        for proc in reversed(self.started):
            proc.stop()


def wait_ready(proc: Proc, path: str = "/health", timeout: float = START_TIMEOUT_S) -> None:
    """Until `path` answers 200 (a router: until its /v1/models lists the served model)."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            r = httpx.get(proc.url + path, timeout=2, trust_env=False)
            if r.status_code == 200 and (path != "/v1/models" or SERVED in r.text):
                return
        if proc.popen.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{proc.name} did not come up: {proc.output()[-3000:]}")
        time.sleep(0.1)


def calls(server: Proc, method: str, path: str, status: int | None = None) -> int:
    """How many `method path` requests the server's access log shows (with `status`)."""
    needle = f'"{method} {path} HTTP/1.1" {"" if status is None else status}'
    return sum(needle in line for line in server.output().splitlines())


def completion(prompt: str | list[str], max_tokens: int = 12, **extra: Any) -> dict[str, Any]:
    body = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return {**body, "ignore_eos": True, **extra}


def chat(content: str, max_tokens: int = 12, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": content}]
    body = {"model": SERVED, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return {**body, "ignore_eos": True, **extra}


@dataclass(frozen=True)
class Answer:
    """What a client keeps of an answer: each choice's text and finish reason, by index."""

    status: int
    choices: tuple[tuple[str, str | None], ...] = ()
    done: bool = False  # a stream's [DONE], or a whole body

    @property
    def complete(self) -> bool:
        return self.status == 200 and self.done and all(r is not None for _, r in self.choices)


def ask(base: str, route: str, body: dict[str, Any]) -> Answer:
    """One request, streamed or not; text gathered per choice index."""
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
    with httpx.Client(base_url=base, timeout=timeout, trust_env=False) as http:
        if not body.get("stream"):
            r = http.post(path, json=body)
            if r.status_code != 200:
                return Answer(r.status_code)
            for c in r.json()["choices"]:
                texts[c["index"]] = c["message"]["content"] if route == "chat" else c["text"]
                reasons[c["index"]] = c["finish_reason"]
            return Answer(200, _ordered(texts, reasons), done=True)
        done = False
        with http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                return Answer(r.status_code)
            with contextlib.suppress(httpx.RemoteProtocolError, httpx.ReadError):
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    event = json.loads(line[len("data: ") :])
                    if "error" in event:
                        break
                    for c in event.get("choices", []):
                        piece = c["delta"].get("content") if route == "chat" else c["text"]
                        texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
                        if c.get("finish_reason") is not None:
                            reasons[c["index"]] = c["finish_reason"]
                        else:
                            reasons.setdefault(c["index"], None)
        return Answer(200, _ordered(texts, reasons), done)


def _ordered(
    texts: dict[int, str], reasons: dict[int, str | None]
) -> tuple[tuple[str, str | None], ...]:
    return tuple((texts.get(i, ""), reasons.get(i)) for i in sorted(texts.keys() | reasons.keys()))
