"""Disaggregated serving as a user runs it: three `stallfree` commands on loopback ports (a
prefill server, a decode server, the router), `stallfree bench --base-url` against the router,
and the servers killed mid-request: the client gets an error at once, the survivor keeps
serving with an all-free pool, and a restarted server is paired anew."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow  # subprocess servers (see pyproject)

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args: list[str], **env: str) -> subprocess.Popen[str]:
    environ = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false", **env)
    return subprocess.Popen(
        [sys.executable, "-m", "stallfree", *args],
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_healthy(proc: subprocess.Popen[str], url: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            out = proc.stdout.read() if proc.stdout and proc.poll() is not None else ""
            raise AssertionError(f"{url} did not come up: {out[-2000:]}")
        time.sleep(0.1)


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


class Deployment:
    def __init__(self) -> None:
        self.p_port, self.b_port, self.d_port, self.r_port = (free_port() for _ in range(4))
        self.procs: dict[str, subprocess.Popen[str]] = {}

    def url(self, port: int) -> str:
        return f"http://127.0.0.1:{port}"

    def start_prefill(self, **env: str) -> None:
        self.procs["prefill"] = spawn(
            [
                "serve",
                MODEL,
                "--port",
                str(self.p_port),
                "--disaggregation-mode",
                "prefill",
                "--disaggregation-bootstrap-port",
                str(self.b_port),
                "--disaggregation-transfer-timeout",
                "10",
            ],
            **env,
        )
        wait_healthy(self.procs["prefill"], self.url(self.p_port))

    def start_decode(self) -> None:
        self.procs["decode"] = spawn(
            [
                "serve",
                MODEL,
                "--port",
                str(self.d_port),
                "--kv-transfer-config",
                json.dumps({"kv_connector": "GlooConnector", "kv_role": "kv_consumer"}),
                "--disaggregation-transfer-timeout",
                "10",
            ]
        )
        wait_healthy(self.procs["decode"], self.url(self.d_port))

    def start_router(self) -> None:
        self.procs["router"] = spawn(
            [
                "router",
                "--pd-disaggregation",
                "--prefill",
                self.url(self.p_port),
                str(self.b_port),
                "--decode",
                self.url(self.d_port),
                "--port",
                str(self.r_port),
            ]
        )
        wait_healthy(self.procs["router"], self.url(self.r_port))

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(timeout=30)

    def close(self) -> None:
        for proc in self.procs.values():
            stop(proc)


@contextlib.contextmanager
def deployment(**prefill_env: str) -> Iterator[Deployment]:
    dep = Deployment()
    try:
        dep.start_prefill(**prefill_env)
        dep.start_decode()
        dep.start_router()
        yield dep
    finally:
        dep.close()


def completion(max_tokens: int = 8, **extra: object) -> dict[str, object]:
    return {
        "model": MODEL,
        "prompt": "one two three four five six seven",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


def assert_pool_free(url: str) -> None:
    deadline = time.monotonic() + 10
    while metric(url, "stallfree:num_requests_running") or metric(
        url, "stallfree:kv_cache_usage_perc"
    ):
        assert time.monotonic() < deadline, f"{url}'s pool never drained"
        time.sleep(0.1)


def test_three_commands_serve_and_bench(tmp_path: Path) -> None:
    with deployment() as dep:
        router = dep.url(dep.r_port)
        r = httpx.post(router + "/v1/completions", json=completion(n=2), timeout=60)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 2 and r.json()["usage"]["completion_tokens"] == 16
        out = tmp_path / "bench.json"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "stallfree",
                "bench",
                "--base-url",
                router,
                "--backend",
                "openai",
                "--model",
                MODEL,
                "--dataset-name",
                "random",
                "--random-input-len",
                "24",
                "--random-output-len",
                "6",
                "--num-prompts",
                "8",
                "--max-concurrency",
                "4",
                "--output-json",
                str(out),
            ],
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        result = json.loads(out.read_text())
        assert result["completed"] == 8, result
        assert metric(dep.url(dep.d_port), "stallfree:kv_transfers_total") >= 10
        assert_pool_free(dep.url(dep.p_port))
        assert_pool_free(dep.url(dep.d_port))


def test_prefill_killed_mid_transfer_then_restarted() -> None:
    with deployment(STALLFREE_FAULTS__ENABLED="true", STALLFREE_FAULTS__KV_KILL_RATE="1.0") as dep:
        router, decode = dep.url(dep.r_port), dep.url(dep.d_port)
        r = httpx.post(router + "/v1/completions", json=completion(), timeout=60)
        assert r.status_code in (502, 503), r.text
        # the prefill's loss ends the request, not the 10 s transfer deadline ("... deadline
        # passed"): the answer names the prefill server that failed
        assert "prefill server" in r.text and "deadline" not in r.text, r.text
        assert dep.procs["prefill"].wait(timeout=10) == 17  # the injected death
        assert httpx.get(decode + "/health", timeout=5).status_code == 200
        assert_pool_free(decode)
        dep.start_prefill()  # same ports, no faults: the decode server pairs anew
        r = httpx.post(router + "/v1/completions", json=completion(), timeout=60)
        assert r.status_code == 200, r.text
        assert_pool_free(decode)


def test_decode_killed_mid_stream_then_restarted() -> None:
    with deployment() as dep:
        router, prefill = dep.url(dep.r_port), dep.url(dep.p_port)
        with httpx.stream(
            "POST",
            router + "/v1/completions",
            json=completion(max_tokens=400, stream=True),
            timeout=60,
        ) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            seen = 0
            for line in lines:
                if line.startswith("data: {"):
                    seen += 1
                    if seen == 3:
                        dep.kill("decode")
                        break
            rest = list(lines)
        # the stream ends on the decode server's loss, not a deadline: its error names the
        # decode server whose stream broke off
        errors = [line for line in rest if '"error"' in line]
        assert errors, rest[-3:]
        assert "decode server" in errors[-1] and "deadline" not in errors[-1], errors[-1]
        assert httpx.get(prefill + "/health", timeout=5).status_code == 200
        assert_pool_free(prefill)
        dep.start_decode()
        r = httpx.post(router + "/v1/completions", json=completion(), timeout=60)
        assert r.status_code == 200, r.text


def test_prefill_exits_cleanly_on_sigterm_while_its_decode_peer_runs() -> None:
    """Its KV store and pair group go before the interpreter's teardown (else: SIGABRT)."""
    with deployment() as dep:
        r = httpx.post(dep.url(dep.r_port) + "/v1/completions", json=completion(), timeout=60)
        assert r.status_code == 200, r.text
        dep.procs["prefill"].send_signal(signal.SIGTERM)
        assert dep.procs["prefill"].wait(timeout=30) == 0
        assert httpx.get(dep.url(dep.d_port) + "/health", timeout=5).status_code == 200
