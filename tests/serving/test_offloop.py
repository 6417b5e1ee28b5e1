"""Chat-template rendering and tokenization of heavy requests run in a worker thread, so the
event loop (and `/health`) keeps answering while they run; light requests stay inline.

Each test holds a render in progress (the template call waits on an event the event loop
sets) and checks that the loop ran meanwhile: with the render on the loop, the loop could not
run until the wait gave up.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import threading
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from stallfree.config.settings import ServerConfig
from stallfree.entrypoints.server import create_app, start_server
from stallfree.entrypoints.server.base.protocol import ChatCompletionRequest, CompletionRequest
from stallfree.entrypoints.server.intake import requests, screening
from stallfree.runtime.model.loader import load_tokenizer
from tests.engine_util import engine_config
from tests.http_util import MODEL, NO_EOS, completion, serving, stallfree_serve
from tests.process_util import descendants, running

# the longest a held render waits for the loop to release it
HOLD_S = 3.0


def chat_body(messages: int, chars: int = 60) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x" * chars} for _ in range(messages)],
        "max_tokens": 2,
    }


# weighs 130 x (64 + 1), over requests.OFF_LOOP_WEIGHT; renders to ~1300 tokens, in the context
HEAVY = chat_body(130, chars=1)
LIGHT = chat_body(2)


class HeldRender:
    """Wraps a tokenizer's `apply_chat_template`: each call waits until `release` is set (or
    HOLD_S passes) and records on which thread it ran and whether it was released."""

    def __init__(self, tokenizer: Any) -> None:
        self.render = tokenizer.apply_chat_template
        self.started = threading.Event()
        self.release = threading.Event()
        self.released: list[bool] = []
        self.threads: list[threading.Thread] = []
        tokenizer.apply_chat_template = self

    def __call__(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        self.threads.append(threading.current_thread())
        self.started.set()
        self.released.append(self.release.wait(HOLD_S))
        return self.render(messages, **kwargs)

    async def wait_started(self) -> None:
        deadline = time.monotonic() + 2 * HOLD_S
        while not self.started.is_set():
            assert time.monotonic() < deadline, "the render never started"
            await asyncio.sleep(0.005)


def _engine() -> Any:
    return SimpleNamespace(tokenizer=load_tokenizer("tiny"))


async def test_a_heavy_chat_renders_in_a_worker_while_the_loop_runs():
    engine = _engine()
    body = ChatCompletionRequest.model_validate(HEAVY)
    expected = requests.chat_prompt_ids(engine, body)
    held = HeldRender(engine.tokenizer)
    task = asyncio.create_task(requests.chat_prompt_ids_async(engine, body))
    await held.wait_started()
    held.release.set()  # the loop ran while the render was held
    assert await task == expected
    assert held.released == [True]
    assert held.threads[0] is not threading.main_thread()


async def test_a_light_chat_renders_inline():
    engine = _engine()
    body = ChatCompletionRequest.model_validate(LIGHT)
    expected = requests.chat_prompt_ids(engine, body)
    held = HeldRender(engine.tokenizer)
    held.release.set()
    assert await requests.chat_prompt_ids_async(engine, body) == expected
    assert held.threads == [threading.current_thread()]


async def test_what_a_worker_raises_is_raised_to_the_caller():
    engine = _engine()
    engine.tokenizer.chat_template = None  # no template: a 400 naming messages
    body = ChatCompletionRequest.model_validate(HEAVY)
    with pytest.raises(requests.ApiError) as caught:
        await requests.chat_prompt_ids_async(engine, body)
    assert caught.value.info.code == "no_chat_template"


@pytest.mark.parametrize(
    "prompt", ["hello", "x" * 20_000, ["a", "y" * 20_000], [[1, 2, 3]], [1, 2]], ids=repr
)
async def test_prompt_ids_are_the_same_on_the_loop_and_off_it(prompt):
    engine = _engine()
    got = await requests.prompt_ids_async(engine, prompt, 128)
    assert got == requests.prompt_ids(engine, prompt, 128)
    text = prompt if isinstance(prompt, str) else "z" * 10_000
    assert await requests.encode_async(engine, text) == engine.tokenizer.encode(text)


# ---------------------------------------------------------------- over HTTP


async def test_health_answers_while_a_heavy_chat_renders():
    async with serving() as live:
        held = HeldRender(live.engine.tokenizer)
        chat = asyncio.create_task(live.http.post("/v1/chat/completions", json=HEAVY))
        await held.wait_started()
        health = await live.http.get("/health")
        assert health.status_code == 200
        held.release.set()
        assert (await chat).status_code == 200
        assert held.released == [True], "the loop was held while the template rendered"


TOJSON_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for call in m.tool_calls or [] %}{{ call.function | tojson }}{% endfor %}"
    "{% endfor %}<|assistant|>"
)


def _tool_calls_body(messages: int, calls: int) -> dict[str, Any]:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": [1]}'}}
    history = [{"role": "assistant", "content": None, "tool_calls": [call] * calls}] * messages
    return {"model": MODEL, "messages": history, "max_tokens": 2}


@pytest.mark.slow
async def test_health_keeps_answering_while_large_chat_bodies_render():
    # 1 MB bodies (2000 messages of 10 tool calls each, rendered by tojson), four at once; each
    # is a 400 in the end (its prompt is over the context), after it has been rendered and
    # tokenized
    # 20k tool calls: past the default max_content_parts, which counts them
    # the screening deadline (10 s by default, tested on its own) is lifted: four 1 MB bodies
    # screened in turn beside the renders on a loaded 2-core machine can take longer, and a 503
    # for that is not what this test is about
    server = {
        "chat_template": TOJSON_TEMPLATE,
        "max_content_parts": 20_000,
        "screening_timeout_s": 300.0,
    }
    async with serving(server=server) as live:
        tokenizer = live.engine.tokenizer
        render = tokenizer.apply_chat_template
        rendering = 0
        answered_while_rendering = 0

        def counted(messages: list[dict[str, Any]], **kwargs: Any) -> str:
            nonlocal rendering
            rendering += 1
            try:
                return render(messages, **kwargs)
            finally:
                rendering -= 1

        tokenizer.apply_chat_template = counted
        bodies = [_tool_calls_body(2000, 10) for _ in range(4)]
        chats = [
            # the four renders share two cores: a loaded machine takes longer than the client's
            # default 10 s for the last answer; /health is the one held to that
            asyncio.create_task(live.http.post("/v1/chat/completions", json=b, timeout=120))
            for b in bodies
        ]
        while not all(c.done() for c in chats):
            assert (await live.http.get("/health")).status_code == 200
            answered_while_rendering += rendering > 0
        for chat in chats:
            r = chat.result()
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "context_length_exceeded"
        assert answered_while_rendering >= 3


def _validations(monkeypatch: pytest.MonkeyPatch) -> list[threading.Thread]:
    """The threads on which this process validated a body (the screening process's own are not
    seen here)."""
    threads: list[threading.Thread] = []
    real = screening.validate_body

    def counted(model: Any, raw: bytes) -> Any:
        threads.append(threading.current_thread())
        return real(model, raw)

    monkeypatch.setattr(requests, "validate_body", counted)
    return threads


def test_what_is_dense():
    assert not screening.is_dense(json.dumps({"prompt": "x" * 1_000_000}).encode())
    assert screening.is_dense(json.dumps([{}] * screening.DENSE_SEPARATORS).encode())
    assert screening.is_dense(b"[" + b"1," * screening.DENSE_SEPARATORS + b"1]")


async def test_dense_bodies_are_parsed_and_screened_in_another_process(monkeypatch):
    """A 4 MB chat body of 120k empty messages is parsed, validated and refused by the screening
    process: this process validates none of it. A large body that is not dense (long text) is
    validated in a worker thread, and a small one inline."""
    threads = _validations(monkeypatch)
    body = {"model": MODEL, "messages": [{"role": "user", "content": ""}] * 120_000}
    async with serving() as live:
        answers = await asyncio.gather(
            *(live.http.post("/v1/chat/completions", json=body) for _ in range(3))
        )
        for answer in answers:
            assert answer.status_code == 400
            assert answer.json()["error"]["code"] == "too_many_messages"
        assert threads == []
        pool = screening._pool
        assert pool is not None
        pids = [p.pid for p in pool._processes.values()]
        assert len(pids) == 1 and pids[0] != os.getpid()
        # long text: a worker thread; a short body: inline, on the loop's thread
        long_text = {**completion(), "prompt": "x" * (screening.OFF_LOOP_BODY_BYTES + 1)}
        answer = await live.http.post("/v1/completions", json=long_text)
        assert answer.status_code == 400  # longer than the context
        assert await live.http.post("/v1/completions", json=completion())
        assert [t is threading.main_thread() for t in threads] == [False, True]
    assert screening._pool is None  # the lifespan stopped the process


def _dense_padding() -> list[Any]:
    """An ignored field's value, enough to make a body dense."""
    return [[]] * screening.DENSE_SEPARATORS


async def test_a_dense_body_that_passes_is_answered_as_its_plain_twin(monkeypatch):
    threads = _validations(monkeypatch)
    plain = {**completion(max_tokens=6), **NO_EOS}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **NO_EOS}
    async with serving() as live:
        for route, body in (("/v1/completions", plain), ("/v1/chat/completions", chat)):
            twin = await live.http.post(route, json=body)
            dense = await live.http.post(route, json={**body, "metadata": _dense_padding()})
            assert twin.status_code == dense.status_code == 200
            assert twin.json()["choices"] == dense.json()["choices"]
        assert len(threads) == 2  # the plain twins only


async def test_bodies_validated_off_the_loop_answer_as_fastapi_did():
    """Malformed JSON, a wrong type, a lone surrogate and an unknown model get the same
    answers inline, in the worker thread (past the size threshold) and in the screening process
    (dense past it)."""
    pad = " " * screening.OFF_LOOP_BODY_BYTES
    dense = ', "metadata": ' + json.dumps(_dense_padding())
    seen: list[list[tuple[int, Any]]] = []
    async with serving() as live:
        for extra, tail in (("", ""), ("", pad), (dense, ""), (dense, pad)):
            bodies = [
                '{"model": "x", "prompt": ' + extra,
                f'{{"model": "{MODEL}", "prompt": "hi", "n": "many"{extra}}}' + tail,
                f'{{"model": "{MODEL}", "prompt": "\\ud800"{extra}}}' + tail,
                f'{{"model": "other", "prompt": "hi"{extra}}}' + tail,
                f'{{"model": "{MODEL}", "prompt": "hi", "suffix": "s"{extra}}}' + tail,
            ]
            answers = [
                await live.http.post(
                    "/v1/completions",
                    content=b.encode(),
                    headers={"content-type": "application/json"},
                )
                for b in bodies
            ]
            seen.append([(a.status_code, a.json()["error"]["param"]) for a in answers])
            assert "malformed JSON body" in answers[0].json()["error"]["message"]
    assert seen[0] == [(400, None), (400, "n"), (400, "prompt"), (404, "model"), (400, "suffix")]
    assert seen[1] == seen[2] == seen[3] == seen[0]


def test_serve_freezes_the_heap_once_the_engine_runs():
    """`serve` makes its app with `freeze_heap`: after the engine starts, the collector no
    longer walks what the process held then."""

    async def run() -> int:
        app = create_app(engine_config("tiny"), freeze_heap=True)
        server = await start_server(app)
        try:
            return gc.get_freeze_count()
        finally:
            await server.stop()

    gc.unfreeze()
    try:
        assert asyncio.run(run()) > 0
    finally:
        gc.unfreeze()


def test_serve_runs_its_start_up_with_the_collector_off_and_turns_it_on_with_the_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`stallfree serve` turns the cyclic collector off before its imports and the load (three
    full passes over what they make were 0.2-0.3 s of start-up); the app collects once and
    turns it back on when the engine has started."""
    import stallfree.entrypoints.server as server_pkg
    from stallfree.entrypoints import cli

    seen: list[bool] = []
    monkeypatch.setattr(server_pkg, "serve", lambda config: seen.append(gc.isenabled()) or 0)
    try:
        assert cli._serve(engine_config("tiny")) == 0
        assert seen == [False]
    finally:
        gc.enable()

    async def run() -> tuple[bool, bool]:
        app = create_app(engine_config("tiny"), freeze_heap=True)
        before = gc.isenabled()
        server = await start_server(app)
        try:
            return before, gc.isenabled()
        finally:
            await server.stop()

    gc.disable()
    try:
        assert asyncio.run(run()) == (False, True)
    finally:
        gc.enable()
        gc.unfreeze()


# liveness: /health left unanswered this long while bodies are screened is a failure
HEALTH_TIMEOUT_S = 5.0


@pytest.mark.slow
def test_health_answers_while_dense_chat_bodies_are_screened():
    """Four 4 MB chat bodies of each dense kind at once, against `stallfree serve`: /health
    keeps answering while all four are being screened, each answer within a liveness timeout,
    and every body gets its 400. (The latency itself, 0.2 to 1.2 s on the worker thread before
    from the GIL it held, is printed, not asserted: a figure, not a test.)"""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    kinds = [
        [{"role": "user", "content": ""}] * 120_000,
        [{"role": "assistant", "content": None, "tool_calls": [call] * 45_000}],
        [{"role": "user", "content": [{"type": "text", "text": "x"}] * 125_000}],
    ]

    async def round_(base: str, messages: list[Any]) -> tuple[int, float]:
        body = json.dumps({"model": MODEL, "messages": messages}).encode()
        headers = {"content-type": "application/json"}
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            posts = [
                asyncio.create_task(
                    http.post("/v1/chat/completions", content=body, headers=headers)
                )
                for _ in range(4)
            ]
            during, worst = 0, 0.0
            while not all(p.done() for p in posts):
                start = time.perf_counter()
                health = await http.get("/health", timeout=HEALTH_TIMEOUT_S)
                assert health.status_code == 200
                worst = max(worst, time.perf_counter() - start)
                during += not any(p.done() for p in posts)  # answered while all four pend
            for post in posts:
                assert post.result().status_code == 400
        return during, worst

    with stallfree_serve() as (_, base):
        for messages in kinds:
            during, worst = asyncio.run(round_(base, messages))
            print(f"/health while screening: {during} answers, the slowest {worst * 1e3:.0f} ms")
            assert during >= 2, "/health was not answered while the bodies were screened"


async def test_a_screening_process_that_dies_costs_only_its_body_a_400():
    body = {"model": MODEL, "messages": [{"role": "user", "content": ""}] * 120_000}
    async with serving() as live:
        post = asyncio.create_task(live.http.post("/v1/chat/completions", json=body))
        deadline = time.monotonic() + 10
        while not (screening._pool and screening._pool._processes):
            assert time.monotonic() < deadline, "the screening process never started"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # it is starting, or parsing the body
        for pid in list(screening._pool._processes):
            os.kill(pid, signal.SIGKILL)
        answer = await post
        assert answer.status_code == 400
        assert answer.json()["error"]["code"] == "body_unchecked"
        # the next dense body gets a new process, and the server goes on
        again = await live.http.post("/v1/chat/completions", json=body)
        assert again.status_code == 400 and again.json()["error"]["code"] == "too_many_messages"
        assert (await live.http.get("/health")).status_code == 200


async def test_a_body_submitted_as_another_app_stops_the_pool_goes_to_a_new_one(monkeypatch):
    stopped = screening._screening_pool()
    screening.close_screening()  # as another app's lifespan does, after we took the pool
    pools = iter([stopped])
    real = screening._screening_pool
    monkeypatch.setattr(screening, "_screening_pool", lambda: next(pools, None) or real())
    raw = json.dumps({"model": "other", "prompt": [[1]] * screening.DENSE_SEPARATORS}).encode()
    against = screening.Screen("m", ServerConfig())
    with pytest.raises(requests.ApiError) as caught:
        await screening.screen_elsewhere(CompletionRequest, raw, against, "peer:test")
    assert caught.value.status == 404  # screened, by the new pool's process
    screening.close_screening()


@pytest.mark.slow
def test_the_screening_process_exits_when_its_server_is_killed():
    body = {"model": MODEL, "messages": [{"role": "user", "content": ""}] * 120_000}
    with stallfree_serve() as (proc, base):
        answer = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
        assert answer.json()["error"]["code"] == "too_many_messages"
        screeners = []
        for pid in descendants(proc.pid):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"multiprocessing.spawn" in f.read():
                    screeners.append(pid)
        assert len(screeners) == 1
        proc.kill()  # no lifespan, no pool shutdown
        proc.wait()
        deadline = time.monotonic() + 10
        while running(screeners[0]):
            assert time.monotonic() < deadline, "the screening process outlived its server"
            time.sleep(0.1)
