"""A listed prefill server that lies on its KV channel fails only its own requests (issue 42,
finding 1): a first K tensor twice the size announced (which made gloo abort the whole decode
process), a header announcing another dtype or head_dim. Both servers are real processes; the
decode server answers each lie with a clean 503 naming what went wrong, keeps serving, and pairs
anew for the next request."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.disagg.test_disagg_processes import MODEL, free_port, spawn, stop, wait_healthy

pytestmark = pytest.mark.slow  # subprocess servers (see pyproject)

ROOT = Path(__file__).resolve().parents[2]
SECRET = "a-shared-secret-of-the-test"


def _hostile_prefill(port: int, bootstrap_port: int) -> subprocess.Popen[str]:
    environ = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        TOKENIZERS_PARALLELISM="false",
        STALLFREE_DISAGGREGATION__SECRET=SECRET,
    )
    args = ["serve", MODEL, "--port", str(port), "--disaggregation-mode", "prefill"]
    args += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    args += ["--disaggregation-transfer-timeout", "10"]
    return subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "disagg" / "hostile_prefill.py"), *args],
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


DECODE: list[subprocess.Popen[str]] = []  # the module's decode server process


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[str, str, int]]:
    p_port, b_port, d_port = free_port(), free_port(), free_port()
    procs = []
    try:
        procs.append(_hostile_prefill(p_port, b_port))
        wait_healthy(procs[-1], f"http://127.0.0.1:{p_port}")
        procs.append(
            spawn(
                ["serve", MODEL, "--port", str(d_port), "--disaggregation-mode", "decode"],
                STALLFREE_DISAGGREGATION__SECRET=SECRET,
            )
        )
        wait_healthy(procs[-1], f"http://127.0.0.1:{d_port}")
        DECODE[:] = [procs[-1]]
        yield f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}", b_port
    finally:
        for proc in procs:
            stop(proc)


def _both_legs(servers: tuple[str, str, int], room: int) -> tuple[httpx.Response, httpx.Response]:
    """One request as the router sends it: the same body to both servers at once."""
    prefill_url, decode_url, b_port = servers
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": "one two three four five six seven",
        "max_tokens": 4,
        "temperature": 0,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": b_port,
        "bootstrap_room": room,
    }
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        legs = [
            pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=60)
            for url in (prefill_url, decode_url)
        ]
        prefill_leg, decode_leg = (leg.result() for leg in legs)
    return prefill_leg, decode_leg


@pytest.mark.parametrize(
    "room,named",
    [
        pytest.param(401, "KV receiver process died", id="oversized-tensor"),
        pytest.param(402, "dtype torch.float64", id="dtype"),
        pytest.param(403, "head dim", id="head-dim"),
    ],
)
def test_a_lying_prefill_fails_only_its_own_request(
    servers: tuple[str, str, int], room: int, named: str
) -> None:
    honest = 4 * room  # room % 4 == 0: the prefill sends as agreed
    _, ok = _both_legs(servers, honest)
    assert ok.status_code == 200, ok.text
    _, lied = _both_legs(servers, room)
    assert lied.status_code == 503, lied.text
    error = lied.json()["error"]["message"]
    assert "KV transfer failed" in error and named in error, error
    # the decode process lives on, pairs anew and serves the next request
    assert httpx.get(servers[1] + "/health", timeout=5).status_code == 200
    _, again = _both_legs(servers, honest + 4)
    assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["text"] == ok.json()["choices"][0]["text"]


def _receivers_of(pid: int) -> list[int]:
    """The KV receiver processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and b"stallfree.disagg.kv_receiver" in cmdline:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


def test_receivers_die_with_the_decode_server(servers: tuple[str, str, int]) -> None:
    _, ok = _both_legs(servers, 4 * 1000)
    assert ok.status_code == 200, ok.text
    (decode,) = DECODE
    receivers = _receivers_of(decode.pid)
    assert len(receivers) == 1  # one pair, one receiver: the lying pairs' receivers are gone
    decode.kill()  # no shutdown: SIGKILL
    decode.wait(timeout=30)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in receivers):
        assert time.monotonic() < deadline, "a KV receiver outlived its decode server"
        time.sleep(0.05)
