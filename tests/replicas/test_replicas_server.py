"""`stallfree serve --data-parallel-size 2` as an operator runs it: a front process and two
replica processes, against one plain `stallfree serve` of the same model.

Greedy answers through the front equal the single server's (completions and chat, streamed and
not), with overlap on (in-process engines) and off (worker processes, round robin), and with
two tensor-parallel ranks per replica; the
front's metrics count how requests were placed: a shared prefix stays on one replica, so the
prefix-cache hit rate of two replicas is within 10% of one engine's, where round robin's is
not, and concurrent new prompts spread; /metrics holds engine="0" and engine="1" series and
passes promtool; after the workload every pool is free again. A replica killed with SIGKILL
mid-stream ends that stream with an error event, /health turns 503 and names it, the other
replica goes on answering, and a SIGTERM then stops the front with status 0 and nothing left
running, once the stream in progress at the SIGTERM has finished. Bad bodies get the replicas' own answers, a body over the limit the front's 413, as one server's; a
client that leaves frees its replica; replicas whose front is killed drain and exit.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.process_util import descendants, running
from tests.router.rust_routers import (
    REQUEST_TIMEOUT_S,
    Proc,
    Procs,
    ask,
    chat,
    completion,
    wait_ready,
)

pytestmark = pytest.mark.slow  # three servers, five engine processes

PROMPTS = ["one two three four", "the quick brown fox", "a b c d e f g"]
REQUESTS = [
    ("completions", completion(PROMPTS[0])),
    ("completions", completion(PROMPTS[1], stream=True)),
    ("chat", chat(PROMPTS[2])),
    ("chat", chat(PROMPTS[0], stream=True)),
    ("completions", completion(PROMPTS, n=2)),  # a list of prompts, two choices each
]
ORIGIN = "https://app.example"
# three long prefixes taken in turn: round robin over two replicas scatters each one
GROUPS = [
    f"Group {g}: " + f"shared context number {g} for every question here. " * 4 for g in range(3)
]


class Cluster:
    def __init__(self, procs: Procs) -> None:
        self.single = procs.server("single")
        self.front = procs.server("front", "--dp-size", "2", "--allowed-origins", ORIGIN)
        # overlap off, worker processes, round robin: the other placement and engine kind
        self.rr = procs.server(
            "rr", "-dp", "2", "--no-overlap", "--worker", "process", "--replica-policy",
            "round_robin",
        )  # fmt: skip
        for proc in (self.single, self.front, self.rr):
            wait_ready(proc)
        self.direct = [ask(self.single.url, route, body) for route, body in REQUESTS]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    procs = Procs(Path(tmp_path_factory.mktemp("replicas")))
    try:
        yield Cluster(procs)
    finally:
        procs.close()


def scrape(proc: Proc) -> dict[str, list]:
    r = httpx.get(proc.url + "/metrics", timeout=REQUEST_TIMEOUT_S, trust_env=False)
    assert r.status_code == 200
    return {f.name: f.samples for f in text_string_to_metric_families(r.text)}


def value(samples: dict[str, list], family: str, name: str | None = None, **labels: str) -> float:
    """The sum of `family`'s samples (named `name`, default the family's) with `labels`."""
    name = name or family
    return sum(
        s.value
        for s in samples[family]
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def hit_rate(before: dict[str, list], after: dict[str, list]) -> float:
    def delta(kind: str) -> float:
        family = f"stallfree:prefix_cache_{kind}"
        return value(after, family, family + "_total") - value(before, family, family + "_total")

    return delta("hits") / delta("queries")


def shared_prefix_workload(proc: Proc) -> float:
    """The prefix-cache hit rate of 12 requests, 4 per group, the groups taken in turn."""
    before = scrape(proc)
    for i in range(4):
        for g, prefix in enumerate(GROUPS):
            answer = ask(proc.url, "completions", completion(prefix + f"question {i}{g}?", 4))
            assert answer.complete
    return hit_rate(before, scrape(proc))


def assert_pools_free(proc: Proc, engines: list[str]) -> None:
    samples = scrape(proc)
    for engine in engines:
        assert value(samples, "stallfree:num_requests_running", engine=engine) == 0
        assert value(samples, "stallfree:kv_cache_usage_perc", engine=engine) == 0.0


@pytest.mark.parametrize("front", ["front", "rr"])
def test_greedy_answers_equal_one_server(cluster, front):
    proc = getattr(cluster, front)
    answers = [ask(proc.url, route, body) for route, body in REQUESTS]
    assert all(a.complete for a in cluster.direct)
    assert answers == cluster.direct
    assert_pools_free(proc, ["0", "1"])


def test_replicas_of_two_tensor_parallel_ranks_each(cluster, tmp_path):
    """-dp 2 --tp-size 2: four rank processes, two per replica; the same greedy answers."""
    procs = Procs(tmp_path)
    try:
        proc = procs.server("dp-tp", "-dp", "2", "--tp-size", "2")
        wait_ready(proc)
        ranks = [d for d in descendants(proc.popen.pid) if running(d)]
        answers = [ask(proc.url, route, body) for route, body in REQUESTS]
        assert answers == cluster.direct
        assert len(ranks) == 2 * 3  # per replica: its process and its two ranks
        samples = scrape(proc)
        family = "stallfree:worker_message_bytes"
        for engine in ("0", "1"):  # each replica's scheduler sent its ranks their steps
            assert value(samples, family, family + "_total", engine=engine) > 0
    finally:
        procs.close()


def test_a_shared_prefix_stays_on_one_replica(cluster):
    single = shared_prefix_workload(cluster.single)
    before = scrape(cluster.front)
    aware = shared_prefix_workload(cluster.front)
    after = scrape(cluster.front)
    family = "stallfree:replica_routed_requests"
    name = family + "_total"
    prefix = value(after, family, name, reason="prefix") - value(
        before, family, name, reason="prefix"
    )
    assert prefix == 9  # every request but each group's first followed its prefix
    round_robin = shared_prefix_workload(cluster.rr)
    print(f"prefix-cache hit rate: one engine {single:.3f}, cache_aware {aware:.3f}, "
          f"round robin {round_robin:.3f}")  # fmt: skip
    assert single > 0.5
    assert abs(aware - single) <= 0.1 * single
    assert round_robin < 0.9 * single
    assert_pools_free(cluster.front, ["0", "1"])


def test_concurrent_new_prompts_spread(cluster):
    family = "stallfree:replica_routed_requests"
    before = scrape(cluster.front)
    bodies = [completion(f"{i} a new prompt about something else", 64) for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda b: ask(cluster.front.url, "completions", b), bodies))
    assert all(a.complete for a in answers)
    after = scrape(cluster.front)
    sent = [
        value(after, family, family + "_total", engine=e)
        - value(before, family, family + "_total", engine=e)
        for e in ("0", "1")
    ]
    assert sorted(sent) == [2, 2]


def test_metrics_have_each_engine_and_pass_promtool(cluster):
    samples = scrape(cluster.front)
    engines = {s.labels["engine"] for s in samples["stallfree:num_requests_running"]}
    assert engines == {"0", "1"}
    assert value(samples, "stallfree:replica_up", engine="0") == 1
    assert value(samples, "stallfree:replica_up", engine="1") == 1
    served = value(samples, "stallfree:request_success", "stallfree:request_success_total")
    family = "stallfree:replica_routed_requests"
    routed = value(samples, family, family + "_total")
    assert served > 0 and routed > 0
    promtool = pytest.importorskip("tests.metrics.test_promtool")
    if promtool.PROMTOOL is None:
        pytest.skip("promtool is not installed")
    text = httpx.get(cluster.front.url + "/metrics", trust_env=False).content
    findings = promtool.check_metrics(text)
    known = [f for f in findings if f.endswith(promtool.COLON_RULE)]
    assert [f for f in findings if f not in known] == [promtool.VLLM_TOTAL_HISTOGRAM]


def leftovers(pids: set[int]) -> list[str]:
    """The command lines of `pids` still running."""
    return [
        Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        for pid in pids
        if running(pid)
    ]


def _health(proc: Proc) -> tuple[int, dict]:
    r = httpx.get(proc.url + "/health", timeout=REQUEST_TIMEOUT_S, trust_env=False)
    return r.status_code, r.json()


def test_a_killed_replica_fails_its_stream_and_the_other_serves(cluster):
    proc = cluster.rr
    status, body = _health(proc)
    assert status == 200
    pids = {r["engine"]: r["pid"] for r in body["replicas"]}
    stream = completion("tell me a very long story", 2000, stream=True)
    events: list[dict] = []
    done = False
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
    http = httpx.Client(base_url=proc.url, timeout=timeout, trust_env=False)
    with http, http.stream("POST", "/v1/completions", json=stream) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                break
        samples = scrape(proc)
        busy = [e for e in pids if value(samples, "stallfree:num_requests_running", engine=e)]
        assert len(busy) == 1
        victim = busy[0]
        os.kill(pids[victim], signal.SIGKILL)
        for line in lines:
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    assert not done
    assert "error" in events[-1] and events[-1]["error"]["code"] == 502
    status, body = _health(proc)
    assert status == 503 and body["status"] == "unavailable"
    assert {r["engine"]: r["up"] for r in body["replicas"]} == {victim: False, **{
        e: True for e in pids if e != victim
    }}  # fmt: skip
    samples = scrape(proc)
    assert value(samples, "stallfree:replica_up", engine=victim) == 0
    assert value(samples, "stallfree:replica_exits", "stallfree:replica_exits_total") == 1
    assert f"replica {victim} (pid {pids[victim]}) exited" in proc.output()
    # the other replica answers every request, as before
    answers = [ask(proc.url, route, body) for route, body in REQUESTS]
    assert answers == cluster.direct
    assert_pools_free(proc, [e for e in pids if e != victim])
    left = descendants(proc.popen.pid)
    # a SIGTERM drains: the stream in progress finishes, new requests get 503 + Retry-After
    body = completion("a story to finish while draining", 1500, stream=True)
    http = httpx.Client(base_url=proc.url, timeout=timeout, trust_env=False)
    with http, http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        proc.popen.send_signal(signal.SIGTERM)
        status, _ = _health(proc)
        # the replica's drain starts once the front has passed the signal on
        deadline = time.monotonic() + REQUEST_TIMEOUT_S  # a liveness bound
        refused = http.post("/v1/completions", json=completion("late", 2))
        while refused.status_code != 503 and time.monotonic() < deadline:
            refused = http.post("/v1/completions", json=completion("late", 2))
        assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert status == 503
    try:
        assert proc.popen.wait(timeout=60) == 0
    except subprocess.TimeoutExpired:
        proc.popen.kill()
        raise
    # a replica's worker ends once its replica has gone: a liveness bound, not a timing assert
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while leftovers(left) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leftovers(left)


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b'{"prompt": "x", "max_tokens": -1}'])
def test_bad_bodies_get_the_replicas_own_answers(cluster, body):
    def post(proc: Proc) -> httpx.Response:
        headers = {"content-type": "application/json"}
        return httpx.post(
            proc.url + "/v1/completions", content=body, headers=headers, trust_env=False
        )

    direct, front = post(cluster.single), post(cluster.front)
    assert 400 <= direct.status_code < 500
    assert front.status_code == direct.status_code
    assert front.json()["error"]["type"] == direct.json()["error"]["type"]


def test_the_front_answers_cors(cluster):
    url = cluster.front.url + "/v1/completions"
    preflight = httpx.options(
        url,
        headers={"origin": ORIGIN, "access-control-request-method": "POST"},
        trust_env=False,
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.post(url, json=completion("hi", 2), headers={"origin": ORIGIN}, trust_env=False)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == ORIGIN


def test_a_body_over_the_limit_is_the_front_s_413_as_one_server_s(cluster):
    big = b'{"prompt": "' + b"a" * (4 * 1024 * 1024 + 1) + b'"}'
    direct, front = (
        httpx.post(p.url + "/v1/completions", content=big, trust_env=False)
        for p in (cluster.single, cluster.front)
    )
    assert direct.status_code == front.status_code == 413
    assert front.json()["error"] == direct.json()["error"]


def test_a_client_that_leaves_frees_its_replica(cluster):
    proc = cluster.front
    family = "stallfree:router_leg_failures"
    before = value(scrape(proc), family, family + "_total", leg="client")
    body = completion("a story that nobody reads to its end", 2000, stream=True)
    with (
        httpx.Client(base_url=proc.url, timeout=REQUEST_TIMEOUT_S, trust_env=False) as http,
        http.stream("POST", "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: {"))
    deadline = time.monotonic() + REQUEST_TIMEOUT_S  # a liveness bound, not a timing assert
    while value(scrape(proc), "stallfree:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert_pools_free(proc, ["0", "1"])
    assert value(scrape(proc), family, family + "_total", leg="client") == before + 1


def test_replicas_drain_and_exit_when_their_front_is_killed(cluster):
    proc = cluster.front
    replicas = descendants(proc.popen.pid)
    assert len([pid for pid in replicas if running(pid)]) >= 2
    proc.kill()
    deadline = time.monotonic() + REQUEST_TIMEOUT_S  # a liveness bound, not a timing assert
    while leftovers(replicas) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leftovers(replicas)
