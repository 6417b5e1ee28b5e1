"""Chat-template rendering and tokenization of heavy requests run in a worker thread, so the
event loop (and `/health`) keeps answering while they run; light requests stay inline.

Each test holds a render in progress (the template call waits on an event the event loop
sets) and checks that the loop ran meanwhile: with the render on the loop, the loop could not
run until the wait gave up.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from stallfree.entrypoints.server import requests
from stallfree.entrypoints.server.protocol import ChatCompletionRequest
from stallfree.runtime.model.loader import load_tokenizer
from tests.http_util import MODEL, serving

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

    def __call__(self, messages: list[dict[str, Any]]) -> str:
        self.threads.append(threading.current_thread())
        self.started.set()
        self.released.append(self.release.wait(HOLD_S))
        return self.render(messages)

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


async def test_health_keeps_answering_while_large_chat_bodies_render():
    # 1 MB bodies (2000 messages of 10 tool calls each, rendered by tojson), four at once; each
    # is a 400 in the end (its prompt is over the context), after it has been rendered and
    # tokenized
    async with serving(server={"chat_template": TOJSON_TEMPLATE}) as live:
        tokenizer = live.engine.tokenizer
        render = tokenizer.apply_chat_template
        rendering = 0
        answered_while_rendering = 0

        def counted(messages: list[dict[str, Any]]) -> str:
            nonlocal rendering
            rendering += 1
            try:
                return render(messages)
            finally:
                rendering -= 1

        tokenizer.apply_chat_template = counted
        bodies = [_tool_calls_body(2000, 10) for _ in range(4)]
        chats = [
            asyncio.create_task(live.http.post("/v1/chat/completions", json=b)) for b in bodies
        ]
        while not all(c.done() for c in chats):
            assert (await live.http.get("/health")).status_code == 200
            answered_while_rendering += rendering > 0
        for chat in chats:
            r = chat.result()
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert answered_while_rendering >= 3


async def test_health_answers_while_large_bodies_are_validated(monkeypatch):
    """A 4 MB chat body (120k empty messages) is parsed and validated in the worker pool: the
    event loop answers /health meanwhile (on the loop, it answered none until all were done)."""
    validating = 0
    real = requests._validate_body

    def counted(model: Any, raw: bytes) -> Any:
        nonlocal validating
        validating += 1
        try:
            return real(model, raw)
        finally:
            validating -= 1

    monkeypatch.setattr(requests, "_validate_body", counted)
    body = {"model": MODEL, "messages": [{"role": "user", "content": ""}] * 120_000}
    async with serving() as live:
        posts = [
            asyncio.create_task(live.http.post("/v1/chat/completions", json=body)) for _ in range(4)
        ]
        answered_while_validating = 0
        while not all(p.done() for p in posts):
            assert (await live.http.get("/health")).status_code == 200
            answered_while_validating += validating > 0
        for post in posts:
            answer = post.result()
            assert answer.status_code == 400
            assert answer.json()["error"]["code"] == "too_many_messages"
        assert answered_while_validating >= 3


async def test_bodies_validated_off_the_loop_answer_as_fastapi_did():
    """Malformed JSON, a wrong type and a lone surrogate get the same 400s either side of the
    size threshold."""
    pad = " " * requests.OFF_LOOP_BODY_BYTES
    async with serving() as live:
        for tail in ("", pad):
            bad_json = await live.http.post(
                "/v1/completions",
                content=b'{"model": "x", "prompt": ' + tail.encode(),
                headers={"content-type": "application/json"},
            )
            wrong = await live.http.post(
                "/v1/completions",
                content=(f'{{"model": "{MODEL}", "prompt": "hi", "n": "many"}}' + tail).encode(),
                headers={"content-type": "application/json"},
            )
            lone = await live.http.post(
                "/v1/completions",
                content=(f'{{"model": "{MODEL}", "prompt": "\\ud800"}}' + tail).encode(),
                headers={"content-type": "application/json"},
            )
            assert bad_json.status_code == wrong.status_code == lone.status_code == 400
            assert "malformed JSON body" in bad_json.json()["error"]["message"]
            assert wrong.json()["error"]["param"] == "n"
            assert lone.json()["error"]["param"] == "prompt"
