"""stallfree behind the routers operators run: sglang-router (cache aware, round robin, power
of two) and vllm-router in front of two `stallfree serve` processes, and sglang-router's
prefill/decode mode in front of a stallfree prefill server and decode server.

Greedy answers through each router equal direct access (completions and chat, streamed and
not); each router's worker probes are answered (sglang-router lists the served model, vllm-router
takes the token ids from /render, never /tokenize); a list of prompts through the prefill/decode
mode equals colocated (the bootstrap fields in list form); a server killed with SIGKILL mid-run
leaves every request ending, complete or with an error, and the other server serving."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.router.rust_routers import (
    REQUEST_TIMEOUT_S,
    SERVED,
    Answer,
    Proc,
    Procs,
    ask,
    calls,
    chat,
    completion,
    free_port,
    wait_ready,
)

sglang_router = pytest.importorskip("sglang_router", reason="the `routers` test extra")
vllm_router = pytest.importorskip("vllm_router", reason="the `routers` test extra")

pytestmark = pytest.mark.slow  # subprocess servers and routers (see pyproject)

PROMPTS = ["one two three four", "the quick brown fox", "a b c d e f g"]
# (route, body): each kind of request a client sends through a router
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("completions", completion(PROMPTS[0])),
    ("completions", completion(PROMPTS[1], stream=True)),
    ("chat", chat(PROMPTS[2])),
    ("chat", chat(PROMPTS[0], stream=True)),
]


class Cluster:
    def __init__(self, procs: Procs) -> None:
        self.procs = procs
        self.bootstrap_port = free_port()
        self.a = procs.server("a")
        self.b = procs.server("b")
        self.prefill = procs.server(
            "prefill",
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(self.bootstrap_port),
        )
        self.decode = procs.server("decode", "--disaggregation-mode", "decode")
        for server in (self.a, self.b, self.prefill, self.decode):
            wait_ready(server)
        self.direct = [ask(self.a.url, route, body) for route, body in REQUESTS]

    def router(self, kind: str, *flags: str) -> Proc:
        proc = self.procs.router(kind, "--worker-urls", self.a.url, self.b.url, *flags)
        wait_ready(proc, "/v1/models")
        return proc


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    procs = Procs(Path(tmp_path_factory.mktemp("rust_routers")))
    try:
        yield Cluster(procs)
    finally:
        procs.close()


def test_direct_answers_are_whole_greedy_answers(cluster: Cluster) -> None:
    assert all(a.complete for a in cluster.direct), cluster.direct
    assert all(reason == "length" for a in cluster.direct for _, reason in a.choices)
    assert len({a.choices[0][0] for a in cluster.direct}) == len(REQUESTS)


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin", "power_of_two"])
def test_sglang_router_answers_equal_direct_access(cluster: Cluster, policy: str) -> None:
    router = cluster.router("sglang", "--policy", policy)
    # twice over: round robin puts each request on both servers
    for _ in range(2):
        got = [ask(router.url, route, body) for route, body in REQUESTS]
        assert got == cluster.direct
    models = httpx.get(router.url + "/v1/models", timeout=5, trust_env=False).json()
    assert [m["id"] for m in models["data"]] == [SERVED]
    # its probes found the model and the load on both servers
    for server in (cluster.a, cluster.b):
        assert calls(server, "GET", "/model_info", 200) >= 1
        assert calls(server, "GET", "/model_info", 404) == 0
        assert calls(server, "GET", "/get_model_info") == 0
    loads = httpx.get(router.url + "/get_loads", timeout=5, trust_env=False).json()
    assert sorted(w["worker"] for w in loads["workers"]) == sorted([cluster.a.url, cluster.b.url])
    router.stop()


def test_vllm_router_answers_equal_direct_access_with_render_not_tokenize(
    cluster: Cluster,
) -> None:
    before = {s.name: calls(s, "POST", "/tokenize") for s in (cluster.a, cluster.b)}
    router = cluster.router("vllm", "--policy", "cache_aware")
    for _ in range(2):
        got = [ask(router.url, route, body) for route, body in REQUESTS]
        assert got == cluster.direct
    renders = sum(
        calls(s, "POST", path, 200)
        for s in (cluster.a, cluster.b)
        for path in ("/v1/completions/render", "/v1/chat/completions/render")
    )
    assert renders >= 2 * len(REQUESTS)
    for s in (cluster.a, cluster.b):
        assert calls(s, "POST", "/v1/completions/render", 404) == 0
        assert calls(s, "POST", "/tokenize") == before[s.name]
    router.stop()


def test_sglang_prefill_decode_mode_equals_colocated(cluster: Cluster) -> None:
    router = cluster.procs.router(
        "sglang",
        "--pd-disaggregation",
        "--prefill",
        cluster.prefill.url,
        str(cluster.bootstrap_port),
        "--decode",
        cluster.decode.url,
        "--policy",
        "round_robin",
    )
    wait_ready(router, "/v1/models")
    got = [ask(router.url, route, body) for route, body in REQUESTS]
    assert got == cluster.direct
    # a list of prompts: the router sends the bootstrap fields as lists, one entry per prompt
    batch = completion(PROMPTS, max_tokens=8)
    want = ask(cluster.a.url, "completions", batch)
    assert want.complete and len(want.choices) == len(PROMPTS)
    assert ask(router.url, "completions", batch) == want
    router.stop()


def test_a_server_killed_mid_run_ends_every_request_and_the_other_serves(
    cluster: Cluster,
) -> None:
    """Last in the module: it kills server b."""
    routers = [
        cluster.router("sglang", "--policy", "round_robin"),
        cluster.router("vllm", "--policy", "round_robin"),
    ]
    long = [
        ("completions", completion(PROMPTS[i % 3], max_tokens=400, stream=i % 2 == 0))
        for i in range(4)
    ]
    with concurrent.futures.ThreadPoolExecutor(len(long) * len(routers)) as pool:
        running = [pool.submit(ask, r.url, route, body) for r in routers for route, body in long]
        _wait_busy(cluster.b)
        cluster.b.kill()
        # every request ends: whole, or with an error; none hangs past its client's bound
        ended = [f.result(timeout=REQUEST_TIMEOUT_S + 30) for f in running]
    for answer in ended:
        assert answer.complete or answer.status != 200 or not answer.done, answer
        if answer.complete:
            assert [r for _, r in answer.choices] == ["length"]
    # the survivor serves through both routers (a router may spend a request finding b gone)
    for router in routers:
        after = [ask(router.url, route, body) for route, body in REQUESTS for _ in range(2)]
        assert all(isinstance(a, Answer) for a in after)
        served = [a for a in after if a.complete]
        assert len(served) >= len(REQUESTS), after
        assert set(served) <= set(cluster.direct)
    assert cluster.a.popen.poll() is None


def _wait_busy(server: Proc) -> None:
    """Until the server has requests running (its first generation request is in)."""
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while time.monotonic() < deadline:
        text = httpx.get(server.url + "/metrics", timeout=5, trust_env=False).text
        for line in text.splitlines():
            if line.startswith("stallfree:num_requests_running{") and float(line.split()[-1]):
                return
        time.sleep(0.05)
    raise AssertionError("server b never ran a request")
