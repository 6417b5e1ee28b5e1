"""HTTP resource limits against hostile clients, on loopback: body size, request heads, idle and
slow connections, the connection budget, concurrency and queue overload, disconnects, and the
request values that used to reach the engine unchecked.

Every test bounds its counts and its time; servers run the `tiny` preset in the test's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import time
from typing import Any

import pytest

from stallfree.entrypoints.cli import build_parser, config_from_args, main
from tests.engine_util import settle
from tests.http_util import MODEL, NO_EOS, SLOW, completion, finished, serving

# liveness: what the server must have done by this long is a failure past it, never a speed
# figure; the tests assert the order of events and their counts, and a deadline's lower bound
# (load only makes an answer later)
LIVENESS_S = 20.0
# uvloop's timers count from libuv's loop clock, which keeps whole milliseconds (truncated), so a
# server deadline may fire up to a millisecond before its time on time.monotonic(): CI once saw a
# 0.5 s head deadline close the connection 0.49992 s after the client's earlier start
TIMER_SLACK_S = 0.005

# ---------------------------------------------------------------- raw HTTP


class Raw:
    """One loopback connection, written and read byte-exactly."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int) -> Raw:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def response(self, timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), timeout)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        body = await asyncio.wait_for(self.reader.readexactly(length), timeout)
        return status, headers, body

    async def closed_by_peer(self, timeout: float) -> bool:
        """True once the server has closed the connection (EOF or reset) within `timeout`."""
        try:
            data = await asyncio.wait_for(self.reader.read(65536), timeout)
        except asyncio.TimeoutError:  # NOTE: before OSError, which it subclasses
            return False
        except (ConnectionError, OSError):
            return True
        return data == b""

    def still_open(self) -> bool:
        """Nothing read: the server has neither closed nor reset the connection so far."""
        return not self.reader.at_eof() and self.reader.exception() is None

    def close(self) -> None:
        self.writer.close()


def head(method: str, path: str, *headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *headers, "", ""]
    return "\r\n".join(lines).encode()


# ---------------------------------------------------------------- body size (item 3)


async def _until_idle(engine: Any) -> None:
    while engine.snapshot().running:
        await asyncio.sleep(0.005)


async def test_a_body_over_the_limit_is_413_before_it_is_read():
    async with serving(server={"max_body_bytes": 65536}) as live:
        raw = await Raw.open(live.port)
        # a 200 MB body is announced and never sent: the answer cannot wait for it
        await raw.send(
            head(
                "POST",
                "/v1/completions",
                "Content-Type: application/json",
                "Content-Length: 200000000",
            )
        )
        status, headers, body = await raw.response(timeout=3)
        assert status == 413
        assert headers["connection"] == "close"
        error = json.loads(body)["error"]
        assert error["code"] == "request_too_large" and "65536" in error["message"]
        assert await raw.closed_by_peer(3)
        raw.close()
        assert (await live.http.get("/health")).status_code == 200


async def test_a_chunked_body_is_counted_as_it_arrives():
    async with serving(server={"max_body_bytes": 65536}) as live:
        raw = await Raw.open(live.port)
        await raw.send(
            head(
                "POST",
                "/v1/completions",
                "Content-Type: application/json",
                "Transfer-Encoding: chunked",
            )
        )
        # 64 KiB (the limit) and 1 KiB more, with no terminating chunk
        for size in [8192] * 8 + [1024]:
            await raw.send(f"{size:x}\r\n".encode() + b"x" * size + b"\r\n")
        status, headers, body = await raw.response(timeout=3)
        assert status == 413 and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "request_too_large"
        raw.close()


async def test_a_body_within_the_limit_is_served():
    async with serving(server={"max_body_bytes": 65536}) as live:
        big = await live.http.post("/v1/completions", json=completion(prompt="x" * 60_000))
        assert big.status_code == 400  # read whole, then refused by the engine's checks
        assert big.json()["error"]["code"] == "context_length_exceeded"
        ok = await live.http.post("/v1/completions", json=completion())
        assert ok.status_code == 200


async def test_a_body_that_does_not_arrive_in_time_is_408():
    async with serving(server={"body_timeout_s": 0.5}) as live:
        start = time.monotonic()  # before the connection: the server's clock starts later
        raw = await Raw.open(live.port)
        await raw.send(
            head("POST", "/v1/completions", "Content-Type: application/json", "Content-Length: 50")
            + b'{"model": '
        )
        status, _, body = await raw.response(timeout=LIVENESS_S)
        assert status == 408
        waited = time.monotonic() - start
        assert waited >= 0.5 - TIMER_SLACK_S, waited  # not before the body's deadline
        assert json.loads(body)["error"]["code"] == "request_timeout"
        raw.close()


# ---------------------------------------------------------------- HTTP hygiene (item 19)


async def test_content_length_and_transfer_encoding_together_are_400():
    async with serving() as live:
        payload = json.dumps(completion()).encode()
        raw = await Raw.open(live.port)
        await raw.send(
            head(
                "POST",
                "/v1/completions",
                "Content-Type: application/json",
                f"Content-Length: {len(payload)}",
                "Transfer-Encoding: chunked",
            )
            + f"{len(payload):x}\r\n".encode()
            + payload
            + b"\r\n0\r\n\r\n"
        )
        status, headers, body = await raw.response()
        assert status == 400 and headers["connection"] == "close"
        assert "Transfer-Encoding" in json.loads(body)["error"]["message"]
        raw.close()


@pytest.mark.parametrize(
    "request_bytes",
    [b"GARBAGE\r\n\r\n", b"GET /health HTTP/1.1\r\nBad Header: x\r\n\r\n"],
    ids=["garbage", "bad-header-name"],
)
async def test_a_malformed_request_is_a_json_400(request_bytes):
    async with serving() as live:
        raw = await Raw.open(live.port)
        await raw.send(request_bytes)
        status, headers, body = await raw.response()
        assert status == 400 and headers["connection"] == "close"
        assert json.loads(body)["error"]["message"].startswith("malformed HTTP request")
        raw.close()
        assert (await live.http.get("/health")).status_code == 200


async def test_a_host_outside_allowed_hosts_is_400():
    async with serving(server={"allowed_hosts": ["api.example"]}) as live:
        evil = await live.http.get("/health", headers={"Host": "evil.example"})
        assert evil.status_code == 400 and evil.json()["error"]["code"] == "invalid_host"
        good = await live.http.get("/health", headers={"Host": "API.example:8000"})
        assert good.status_code == 200


# ---------------------------------------------------------------- connections (item 4)


async def test_a_header_sent_byte_by_byte_is_dropped_within_the_timeout():
    async with serving(server={"header_timeout_s": 0.5}) as live:
        start = time.monotonic()  # before the connection: the server's clock starts later
        raw = await Raw.open(live.port)
        await raw.send(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        # a slowloris client: one byte every 50 ms, a header line that would take the liveness
        # bound to finish; the server must cut it before the head is whole
        trickle = b"X-Slow: " + b"a" * int(LIVENESS_S / 0.05)
        sent = 0
        for byte in trickle:
            try:
                await raw.send(bytes([byte]))
            except (ConnectionError, OSError):
                break
            sent += 1
            if await raw.closed_by_peer(0.05):
                break
        else:
            raise AssertionError("the server kept a slowloris connection open")
        elapsed = time.monotonic() - start
        raw.close()
        assert sent < len(trickle)
        assert elapsed >= 0.5 - TIMER_SLACK_S, elapsed  # the head's deadline closed it, not a rate


async def test_idle_connections_are_closed():
    async with serving(server={"header_timeout_s": 0.5, "keep_alive_s": 0.3}) as live:
        # a connection that never sends a byte
        silent = await Raw.open(live.port)
        # a keep-alive connection after its response
        kept = await Raw.open(live.port)
        await kept.send(head("GET", "/health"))
        status, _, _ = await kept.response()
        assert status == 200
        assert await kept.closed_by_peer(2)
        assert await silent.closed_by_peer(2)
        silent.close()
        kept.close()


def _raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"the open-file limit ({hard}) is below {needed}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


IDLE_SOCKETS = 2000


async def test_2000_idle_sockets_neither_keep_a_new_client_out_nor_stay_open():
    _raise_fd_limit(2 * IDLE_SOCKETS + 512)
    async with serving(server={"header_timeout_s": 2.0}) as live:
        idle: list[Raw] = []
        for _ in range(IDLE_SOCKETS // 200):
            idle += await asyncio.gather(*(Raw.open(live.port) for _ in range(200)))
        assert (await live.http.get("/health")).status_code == 200
        ok = await live.http.post("/v1/completions", json=completion())
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None
        # the new client was answered before the idle sockets' deadline freed their places:
        # the last one opened is still open
        assert idle[-1].still_open()
        # every idle socket is closed by the server once its head deadline passes
        closed = await asyncio.gather(*(r.closed_by_peer(LIVENESS_S) for r in idle))
        assert all(closed), closed.count(False)
        for r in idle:
            r.close()


async def test_the_connection_budget_closes_the_longest_idle_never_a_busy_one():
    async with serving(server={"max_connections": 16, "header_timeout_s": 30}, faults=SLOW) as live:
        first = [await Raw.open(live.port) for _ in range(16)]
        await asyncio.sleep(0.05)
        body = completion(max_tokens=40, stream=True) | NO_EOS
        async with live.http.stream("POST", "/v1/completions", json=body) as stream:
            assert stream.status_code == 200
            # the stream's connection took the place of the longest-idle one
            assert await first[0].closed_by_peer(1)
            # 40 more idle connections: each pushes out an idle one, never the stream
            later = [await Raw.open(live.port) for _ in range(40)]
            events = [line async for line in stream.aiter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert (await live.http.get("/health")).status_code == 200
        still_open = [r for r in first + later if not await r.closed_by_peer(0.01)]
        assert len(still_open) <= 16
        for r in first + later:
            r.close()


# ---------------------------------------------------------------- overload (item 5)


async def test_past_the_concurrency_limit_requests_get_503_with_retry_after():
    async with serving(
        server={"max_concurrent_requests": 2, "retry_after_s": 3}, faults=SLOW
    ) as live:
        body = completion(max_tokens=100, stream=True) | NO_EOS
        async with (
            live.http.stream("POST", "/v1/completions", json=body) as a,
            live.http.stream("POST", "/v1/completions", json=body) as b,
        ):
            assert a.status_code == b.status_code == 200
            third = await live.http.post("/v1/completions", json=completion())
            assert third.status_code == 503
            assert third.headers["retry-after"] == "3"
            assert third.json()["error"]["code"] == "overloaded"
            assert (await live.http.get("/health")).status_code == 200
            assert (await live.http.get("/metrics")).status_code == 200
        await settle(live.engine)


async def test_past_the_waiting_bound_the_engine_is_503_and_streams_start_at_once():
    async with serving(
        cache={"max_running_requests": 1},
        scheduler={"max_waiting_requests": 2},
        faults=SLOW,
    ) as live:
        body = completion(max_tokens=150, stream=True) | NO_EOS
        async with contextlib.AsyncExitStack() as stack:
            running = await stack.enter_async_context(
                live.http.stream("POST", "/v1/completions", json=body)
            )
            lines = running.aiter_lines()
            while not (await anext(lines)).startswith("data: "):
                pass
            # two more wait; their headers come at once, before their first token: both are
            # still waiting when the headers are in
            waiting = [
                await stack.enter_async_context(
                    live.http.stream("POST", "/v1/completions", json=body)
                )
                for _ in range(2)
            ]
            assert [w.status_code for w in waiting] == [200, 200]
            snap = live.engine.snapshot()
            assert (snap.running, snap.waiting) == (1, 2)
            refused = await live.http.post("/v1/completions", json=completion())
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert error["code"] == "overloaded" and error["type"] == "service_unavailable"
            assert (await live.http.get("/health")).status_code == 200
        await settle(live.engine)


QUEUED = 5000
PROBES = 300


def _probe_health(port: int, n: int) -> int:
    """`n` sequential GET /health on one keep-alive connection; how many were 200."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    ok = 0
    try:
        for _ in range(n):
            conn.request("GET", "/health")
            resp = conn.getresponse()
            resp.read()
            ok += resp.status == 200
            time.sleep(0.002)
    finally:
        conn.close()
    return ok


async def test_health_answers_while_5000_requests_are_queued():
    """Every probe is answered while the queue stays full (its latency under this load is a
    benchmark figure, not an assert)."""
    async with serving(
        cache={"max_running_requests": 2},
        scheduler={"max_waiting_requests": QUEUED + 500},
        server={"max_concurrent_requests": QUEUED + 500},
    ) as live:
        params = {"max_new_tokens": 1500, "ignore_eos": True}

        async def hold(i: int) -> None:
            async for _ in live.engine.generate([1 + i % 200, 2, 3], params):
                pass

        held = [asyncio.create_task(hold(i)) for i in range(QUEUED - 100)]
        try:
            async with contextlib.AsyncExitStack() as stack:
                # and 100 more over HTTP: each stream has its headers while it waits
                body = completion(max_tokens=1500, stream=True) | NO_EOS
                streams = await asyncio.gather(
                    *(
                        stack.enter_async_context(
                            live.http.stream("POST", "/v1/completions", json=body)
                        )
                        for _ in range(100)
                    )
                )
                assert {s.status_code for s in streams} == {200}
                assert live.engine.snapshot().waiting >= QUEUED - 10
                answered = await asyncio.to_thread(_probe_health, live.port, PROBES)
                assert live.engine.snapshot().waiting >= QUEUED - 50
        finally:
            for t in held:
                t.cancel()
            await asyncio.gather(*held, return_exceptions=True)
        assert answered == PROBES
        await settle(live.engine, timeout=30)


# ---------------------------------------------------------------- disconnects (items 5, 13)


async def test_a_client_that_leaves_a_whole_answer_is_seen_at_once_without_polling(monkeypatch):
    from starlette.requests import Request

    polled: list[bool] = []

    async def is_disconnected(self: Request) -> bool:
        polled.append(True)
        return False

    monkeypatch.setattr(Request, "is_disconnected", is_disconnected)
    async with serving(faults=SLOW) as live:
        payload = json.dumps(completion(max_tokens=500) | NO_EOS).encode()
        raw = await Raw.open(live.port)
        await raw.send(
            head(
                "POST",
                "/v1/completions",
                "Content-Type: application/json",
                f"Content-Length: {len(payload)}",
            )
            + payload
        )
        while live.engine.snapshot().running == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        raw.close()
        left = live.engine.snapshot().counters.generation_tokens
        await asyncio.wait_for(_until_idle(live.engine), LIVENESS_S)
        await settle(live.engine)
        assert finished(live.engine, "abort") == 1
        # cut off on the disconnect, far short of its 500 tokens
        assert live.engine.snapshot().counters.generation_tokens - left < 100
    assert not polled


async def test_leaving_a_multi_prompt_stream_aborts_all_and_logs_nothing(log_records):
    async with serving(faults=SLOW) as live:
        for round_ in range(4):
            body = completion(prompt=["one", "two", "three"], max_tokens=200, stream=True)
            async with live.http.stream("POST", "/v1/completions", json=body | NO_EOS) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: {")
                    if seen == 3 + round_:
                        break
            await settle(live.engine)
        assert finished(live.engine, "abort") == 12
    problems = [r.getMessage() for r in log_records]
    assert not problems, problems


# ---------------------------------------------------------------- request values (items 1, 2, 7, 15, 17, 18)


SURROGATE_CASES = [
    ("/v1/completions", completion(prompt="a\ud800b"), "prompt"),
    ("/v1/completions", completion(prompt=["fine", "\udfff"]), "prompt.1"),
    ("/v1/completions", completion(stop="\ud800"), "stop"),
    ("/v1/completions", completion(stop=["ok", "x\udbff"]), "stop.1"),
    ("/v1/completions", completion(user="\ud800"), "user"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]},
        "messages.0.content",
    ),
    (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}],
        },
        "messages.0.content.0.text",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": "\ud800"},
        "stop",
    ),
    ("/generate", {"text": "\ud800"}, "text"),
    (
        "/generate",
        {"text": "ok", "sampling_params": {"stop": ["\ud800"]}},
        "sampling_params.stop.0",
    ),
    ("/generate", {"text": "ok", "rid": "\ud800"}, "rid"),
    # a key: named escaped
    ("/v1/completions", completion() | {"\ud800": 1}, "\\ud800"),
]


@pytest.mark.parametrize(("route", "body", "param"), SURROGATE_CASES)
async def test_a_lone_surrogate_anywhere_is_a_400_naming_the_field(route, body, param):
    async with serving() as live:
        for stream in (False, True):
            # NOTE: escaped as \ud800 in the JSON text (httpx's json= cannot encode it)
            r = await live.http.post(
                route,
                content=json.dumps(body | {"stream": stream}),
                headers={"content-type": "application/json"},
            )
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == param and "surrogate" in error["message"]
        ok = await live.http.post("/v1/completions", json=completion())
        assert ok.status_code == 200


HUGE = {
    "max_new_tokens=10**400": ({"max_new_tokens": 10**400}, "sampling_params.max_new_tokens"),
    "max_new_tokens=1e309": ({"max_new_tokens": "1e309"}, "sampling_params.max_new_tokens"),
    "max_new_tokens=-1": ({"max_new_tokens": -1}, "sampling_params.max_new_tokens"),
    "top_k=2**63": ({"top_k": 2**63}, "sampling_params.top_k"),
    "top_k=10**6": ({"top_k": 10**6}, "sampling_params.top_k"),
    "temperature=1e309": ({"temperature": "1e309"}, "sampling_params.temperature"),
    "temperature=NaN": ({"temperature": "NaN"}, "sampling_params.temperature"),
    "seed=2**64": ({"seed": 2**64}, "sampling_params.seed"),
    "stop_token_ids=[2**63]": ({"stop_token_ids": [2**63]}, "sampling_params.stop_token_ids"),
    "stop_token_ids=[10**6]": ({"stop_token_ids": [10**6]}, "sampling_params.stop_token_ids"),
}


@pytest.mark.parametrize(("params", "param"), list(HUGE.values()), ids=list(HUGE))
async def test_huge_and_non_finite_numbers_on_generate_are_400(params, param):
    async with serving() as live:
        # raw JSON: 1e309 and NaN are numbers to a JSON parser, not strings
        text = json.dumps({"text": "hi", "sampling_params": params})
        for literal in ("1e309", "NaN"):
            text = text.replace(f'"{literal}"', literal)
        r = await live.http.post(
            "/generate", content=text, headers={"content-type": "application/json"}
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
        assert (await live.http.get("/health")).status_code == 200
        ok = await live.http.post(
            "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}}
        )
        assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 3
        await settle(live.engine)


async def test_an_overflow_while_converting_a_request_is_a_400(monkeypatch):
    # arithmetic on a client's huge number (an int too large for a float) is the client's fault
    def overflow(*args: Any, **kwargs: Any) -> None:
        raise OverflowError("int too large to convert to float")

    async with serving() as live:
        monkeypatch.setattr(live.engine.validator, "check_prompt", overflow)
        for route, body in [
            ("/v1/completions", completion()),
            (
                "/v1/chat/completions",
                {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
            ),
            ("/generate", {"text": "hi"}),
        ]:
            r = await live.http.post(route, json=body)
            assert r.status_code == 400, r.text
            assert "out of range" in r.json()["error"]["message"]


async def test_a_request_with_20000_prompts_is_a_400_naming_the_limit():
    async with serving(server={"max_prompts_per_request": 128}) as live:
        many = await live.http.post("/v1/completions", json=completion(prompt=["a"] * 20_000))
        assert many.status_code == 400
        error = many.json()["error"]
        assert error["code"] == "too_many_prompts" and "at most 128" in error["message"]
        ids = await live.http.post("/v1/completions", json=completion(prompt=[[1, 2]] * 129))
        assert ids.status_code == 400
        batch = await live.http.post("/v1/completions", json=completion(prompt=["a"] * 128))
        assert batch.status_code == 200 and len(batch.json()["choices"]) == 128
        assert sum(live.engine.snapshot().counters.finished.values()) == 128


async def test_the_model_path_is_not_a_model_name_when_a_served_name_is_set():
    async with serving() as live:
        by_path = await live.http.post("/v1/completions", json=completion(model="tiny"))
        assert by_path.status_code == 404
        assert by_path.json()["error"]["code"] == "model_not_found"
        models = (await live.http.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        assert "tiny" not in json.dumps(models)
    async with serving(server={"served_model_name": None}) as live:
        assert (
            await live.http.post("/v1/completions", json=completion(model="tiny"))
        ).status_code == 200


async def test_a_deadline_abort_is_length_to_openai_clients_and_abort_on_generate():
    # a deadline the first tokens meet on a loaded machine (at 0.3 s the test failed once in
    # a full run here), far below what 400 slowed steps take (8 s)
    async with serving(runtime={"request_timeout_s": 0.8}, faults=SLOW) as live:
        body = completion(max_tokens=400) | NO_EOS
        whole = (await live.http.post("/v1/completions", json=body)).json()
        assert whole["choices"][0]["finish_reason"] == "length"
        assert 0 < whole["usage"]["completion_tokens"] < 400
        async with live.http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
            events = [
                json.loads(line[6:])
                for line in [line async for line in r.aiter_lines()]
                if line.startswith("data: {")
            ]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        chat = await live.http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]} | NO_EOS,
        )
        assert chat.json()["choices"][0]["finish_reason"] == "length"
        native = (
            await live.http.post(
                "/generate",
                json={"text": "hi", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}},
            )
        ).json()
        assert native["meta_info"]["finish_reason"] == "abort"
        assert "deadline" in native["meta_info"]["error"]
        await settle(live.engine)


# ---------------------------------------------------------------- start-up and flags (items 11, 12)


@pytest.mark.parametrize("how", ["flag", "env"])
def test_an_empty_api_key_is_refused_at_start_up(how, monkeypatch, capsys):
    argv = ["serve", "--model", "tiny"]
    if how == "flag":
        argv += ["--api-key", ""]
    else:
        monkeypatch.setenv("STALLFREE_SERVER__API_KEY", "")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "API key is empty" in err


def test_log_flags_map_to_the_config():
    parse = build_parser().parse_args
    quiet = config_from_args(parse(["serve", "--log-level", "warning", "--no-access-log"]))
    assert (quiet.server.log_level, quiet.server.access_log) == ("warning", False)
    default = config_from_args(parse(["serve"]))
    assert (default.server.log_level, default.server.access_log) == ("info", True)
    assert default.server.access_log_probes is False
