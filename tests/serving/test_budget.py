"""What one request may cost (issue 21, finding 1): `server.max_request_cost` refuses a request
whose answer would hold too many token entries before anything is generated, chats are held to
`max_chat_messages` and `max_content_parts`, an echoed prompt's logprobs are computed once per
prompt, and a whole body is written off the event loop.

Servers run the `tiny` preset (a 2048-token context, a byte tokenizer) in the test's loop.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest

from stallfree.config.settings import ServerConfig
from stallfree.entrypoints.server.api import openai_api
from stallfree.entrypoints.server.intake.budget import RequestCost
from tests.http_util import MODEL, NO_EOS, serving

DEFAULT_COST = ServerConfig().max_request_cost


def _ids(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(length)] for _ in range(count)]


def _chat(messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": 2, **fields}


class Calls:
    """The engine requests a route made: their ids and sampling params."""

    def __init__(self, engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.made: list[tuple[str, Any]] = []
        generate = engine.generate

        def recorded(
            prompt: Any, params: Any, rid: Any = None, **kwargs: Any
        ) -> AsyncIterator[Any]:
            self.made.append((rid, params))
            return generate(prompt, params, rid, **kwargs)

        monkeypatch.setattr(engine, "generate", recorded)


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


def _reset_peak_rss() -> bool:
    """Start VmHWM again from the RSS now (Linux's clear_refs 5); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


# ---------------------------------------------------------------- the cost


def test_the_cost_counts_every_entry_the_answer_holds():
    # 8 prompts of 2040 ids, n 16, echo, logprobs 20, max_tokens 1: issue 21's first request
    echoed = RequestCost(8, 8 * 2040, 16, 1, 20, echo=True)
    assert echoed.total == 16 * 8 * (2040 + 1) * 21 == 5_486_208
    assert echoed.formula() == (
        "n 16 x (16320 prompt tokens echoed + 8 prompts x 1 max_tokens) x (logprobs 20 + 1)"
    )
    # not echoed, the prompt is counted once: it is computed once (the prefix cache), and it is
    # not in the answer
    plain = RequestCost(8, 32, 16, 2000, 20)
    assert plain.total == 32 + 16 * 8 * 2000 * 21
    assert RequestCost(1, 100, 4, 10, None).total == 100 + 4 * 10
    assert RequestCost(1, 100, 4, 10, None, echo=True).total == 4 * 110
    assert RequestCost(1, 100, 4, 10, 0).total == 100 + 4 * 10
    # the field named: the logprobs, else n, else max_tokens
    assert (plain.param(), RequestCost(1, 1, 4, 10, 0).param()) == ("logprobs", "n")
    assert RequestCost(1, 1, 1, 10, None, max_tokens_field="max_completion_tokens").param() == (
        "max_completion_tokens"
    )


async def test_the_amplifying_requests_of_issue_21_are_refused_before_any_generation(
    monkeypatch,
):
    async with serving() as live:
        calls = Calls(live.engine, monkeypatch)
        echo = {
            "model": MODEL,
            "prompt": _ids(8, 2040),
            "n": 16,
            "echo": True,
            "logprobs": 20,
            "max_tokens": 1,
        }
        long = {
            "model": MODEL,
            "prompt": [f"hi {i}" for i in range(8)],
            "n": 16,
            "max_tokens": 2000,
            "logprobs": 20,
            "ignore_eos": True,
        }
        for body, cost in [(echo, 5_486_208), (long, 32 + 16 * 8 * 2000 * 21)]:
            for stream in (False, True):
                r = await live.http.post("/v1/completions", json=body | {"stream": stream})
                assert r.status_code == 400, r.text[:300]
                error = r.json()["error"]
                assert error["code"] == "request_too_costly"
                assert error["param"] == "logprobs"
                assert error["type"] == "invalid_request_error"
                message = error["message"]
                assert "server.max_request_cost" in message and str(DEFAULT_COST) in message
                assert f"costs {cost} token entries" in message
        assert calls.made == []  # nothing reached the engine
        # the server serves on
        ok = await live.http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}
        )
        assert ok.status_code == 200


async def test_a_request_at_the_budget_is_served_and_one_entry_over_is_not(monkeypatch):
    async with serving(server={"max_request_cost": 2 * 13 * 5}) as live:
        calls = Calls(live.engine, monkeypatch)
        body = {
            "model": MODEL,
            "prompt": [1, 2, 3],
            "n": 2,
            "max_tokens": 10,
            "logprobs": 4,
            "echo": True,
        } | NO_EOS
        # n 2 x (3 prompt tokens echoed + 10 max_tokens) x (logprobs 4 + 1) = 130
        assert (await live.http.post("/v1/completions", json=body)).status_code == 200
        over = await live.http.post("/v1/completions", json=body | {"max_tokens": 11})
        assert over.status_code == 400
        assert "costs 140 token entries" in over.json()["error"]["message"]
        assert "is 130" in over.json()["error"]["message"]
        assert len(calls.made) == 2
        # chat: no max_tokens is the rest of the context, and the field is top_logprobs
        chat = _chat([{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=3)
        del chat["max_tokens"]
        r = await live.http.post("/v1/chat/completions", json=chat)
        assert r.status_code == 400
        error = r.json()["error"]
        assert (error["param"], error["code"]) == ("top_logprobs", "request_too_costly")
        assert "(unset: the rest of the context)" in error["message"]
        short = await live.http.post(
            "/v1/chat/completions", json=chat | {"max_completion_tokens": 20} | NO_EOS
        )
        assert short.status_code == 200, short.text


async def test_the_largest_allowed_request_is_answered_within_a_memory_bound():
    """A request just under the default budget: 8 prompts echoed with 20 top logprobs, 16
    choices each. The test process is the server and the client; its peak RSS may grow by at
    most 150 MB (the body itself, 24.7 MB, is held by the client too). Before the budget's
    change (every choice computing the prompt's logprobs, the body built as models on the
    loop) the server alone grew by 335 MB for it."""
    if not _reset_peak_rss():
        pytest.skip("no /proc/self/clear_refs: the peak RSS cannot be reset")
    length = DEFAULT_COST // (16 * 8 * 21) - 1  # the longest prompts under the budget
    body = {
        "model": MODEL,
        "prompt": _ids(8, length),
        "n": 16,
        "echo": True,
        "logprobs": 20,
        "max_tokens": 1,
    }
    cost = RequestCost(8, 8 * length, 16, 1, 20, echo=True).total
    assert DEFAULT_COST - 16 * 8 * 21 < cost <= DEFAULT_COST
    async with serving() as live:
        # warm up what a first request allocates once (kernels, the token pieces)
        warm = body | {"prompt": _ids(2, 20), "n": 2}
        assert (await live.http.post("/v1/completions", json=warm)).status_code == 200
        gc.collect()
        before = _rss_kb("VmRSS")
        _reset_peak_rss()
        r = await live.http.post("/v1/completions", json=body, timeout=120)
        peak = _rss_kb("VmHWM")
        assert r.status_code == 200, r.text[:300]
        size = len(r.content)
        grown_mb = (peak - before) / 1024
        assert grown_mb < 150, f"peak RSS grew {grown_mb:.0f} MB for a {size / 1e6:.1f} MB body"
        choices = r.json()["choices"]
        assert len(choices) == 128
        assert all(len(c["logprobs"]["tokens"]) == length + 1 for c in choices)


# ---------------------------------------------------------------- chat size


async def test_chats_past_the_message_and_content_part_limits_are_refused(monkeypatch):
    async with serving(server={"max_chat_messages": 8, "max_content_parts": 10}) as live:
        calls = Calls(live.engine, monkeypatch)
        message = {"role": "user", "content": "hi"}
        assert (await live.http.post("/v1/chat/completions", json=_chat([message] * 8))).is_success
        r = await live.http.post("/v1/chat/completions", json=_chat([message] * 9))
        assert r.status_code == 400
        error = r.json()["error"]
        assert (error["param"], error["code"]) == ("messages", "too_many_messages")
        assert "at most 8 messages (server.max_chat_messages)" in error["message"]
        assert "holds 9" in error["message"]

        def parted(count: int) -> dict[str, Any]:
            return {"role": "user", "content": [{"type": "text", "text": "x"}] * count}

        at_limit = _chat([message, parted(4), parted(6)])
        assert (await live.http.post("/v1/chat/completions", json=at_limit)).is_success
        # the third message's parts go past the limit
        r = await live.http.post(
            "/v1/chat/completions", json=_chat([parted(4), message, parted(7), parted(1)])
        )
        assert r.status_code == 400
        error = r.json()["error"]
        assert (error["param"], error["code"]) == ("messages.2.content", "too_many_content_parts")
        assert "at most 10 content parts" in error["message"]
        assert "(server.max_content_parts)" in error["message"] and "holds 12" in error["message"]
        # tool calls count with the parts: 4 parts and 6 calls fit, a seventh call does not
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}

        def calling(count: int) -> dict[str, Any]:
            return {"role": "assistant", "content": None, "tool_calls": [call] * count}

        assert (
            await live.http.post(
                "/v1/chat/completions", json=_chat([parted(4), calling(6), message])
            )
        ).is_success
        r = await live.http.post(
            "/v1/chat/completions", json=_chat([parted(4), calling(7), message])
        )
        assert r.status_code == 400
        error = r.json()["error"]
        assert (error["param"], error["code"]) == (
            "messages.1.tool_calls",
            "too_many_content_parts",
        )
        assert "content parts and tool calls" in error["message"] and "holds 11" in error["message"]
        assert len(calls.made) == 3


async def test_the_default_message_limit_refuses_a_chat_of_4097_messages():
    assert ServerConfig().max_chat_messages == 4096
    async with serving() as live:
        body = _chat([{"role": "user", "content": ""}] * 4097)
        r = await live.http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


# ---------------------------------------------------------------- echo: computed once


def _merged(raw: str) -> dict[int, dict[str, list[Any]]]:
    """A completions stream's logprobs, merged per choice."""
    out: dict[int, dict[str, list[Any]]] = {}
    for event in raw.split("\n\n"):
        if not event.startswith("data: {"):
            continue
        for c in json.loads(event[6:])["choices"]:
            lists = out.setdefault(c["index"], {"text": []})
            lists["text"].append(c["text"])
            for key, values in (c["logprobs"] or {}).items():
                lists.setdefault(key, []).extend(values)
    return out


async def test_an_echoed_prompt_has_its_logprobs_computed_once_and_shared(monkeypatch):
    prompts = _ids(2, 30, seed=3)
    body = {
        "model": MODEL,
        "prompt": prompts,
        "n": 4,
        "echo": True,
        "logprobs": 3,
        "max_tokens": 5,
        "temperature": 0.8,
        "seed": 11,
    } | NO_EOS
    async with serving() as live:
        calls = Calls(live.engine, monkeypatch)
        whole = await live.http.post("/v1/completions", json=body)
        assert whole.status_code == 200
        asked = [rid.rsplit("-", 1)[1] for rid, p in calls.made if p.prompt_logprobs is not None]
        assert len(calls.made) == 8 and asked == ["0", "4"]  # each prompt's first choice
        assert all(p.logprobs == 3 for _, p in calls.made)
        choices = whole.json()["choices"]
        calls.made.clear()
        streamed = await live.http.post("/v1/completions", json=body | {"stream": True})
        asked = [rid.rsplit("-", 1)[1] for rid, p in calls.made if p.prompt_logprobs is not None]
        assert asked == ["0", "4"]
        events = _merged(streamed.text)
        # the prompt's logprobs as a single choice computes them
        single = await live.http.post("/v1/completions", json=body | {"n": 1, "prompt": prompts[0]})
        alone = single.json()["choices"][0]["logprobs"]
    keys = ["tokens", "token_logprobs", "top_logprobs", "text_offset"]
    for choice in choices:
        p = choice["index"] // 4
        lp = choice["logprobs"]
        echoed = {k: lp[k][: len(prompts[p])] for k in keys}
        first = choices[p * 4]["logprobs"]
        assert echoed == {k: first[k][: len(prompts[p])] for k in keys}
        assert echoed == {k: events[choice["index"]][k][: len(prompts[p])] for k in keys}
        assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == len(prompts[p]) + 5
        # the choice's own tokens, after the prompt, as the stream gave them (their logprobs
        # may differ in the last bits: the two runs batch the choices differently)
        streamed_lp = events[choice["index"]]
        assert (streamed_lp["tokens"], streamed_lp["text_offset"]) == (
            lp["tokens"],
            lp["text_offset"],
        )
        assert "".join(streamed_lp["text"]) == choice["text"]
    assert {k: alone[k][: len(prompts[0])] for k in keys} == {
        k: choices[0]["logprobs"][k][: len(prompts[0])] for k in keys
    }


async def test_a_stream_holds_a_choice_back_until_its_prompt_s_logprobs_arrive(monkeypatch):
    """The first choice of a prompt brings the prompt's logprobs; when the others' chunks come
    first (here: the first choice's stream is made to wait), they are sent after it."""
    prompt = _ids(1, 25, seed=5)[0]
    body = {
        "model": MODEL,
        "prompt": prompt,
        "n": 3,
        "echo": True,
        "logprobs": 2,
        "max_tokens": 4,
        "stream": True,
        "temperature": 0,
    } | NO_EOS
    async with serving() as live:
        generate = live.engine.generate
        release = asyncio.Event()
        finished: set[str] = set()

        async def delayed(
            prompt: Any, params: Any, rid: Any = None, **kwargs: Any
        ) -> AsyncIterator[Any]:
            first = True
            async for chunk in generate(prompt, params, rid, **kwargs):
                if first and rid.endswith("-0"):
                    await release.wait()  # held until every other choice has finished
                first = False
                if chunk.finished:
                    finished.add(rid.rsplit("-", 1)[1])
                yield chunk

        async def release_when_others_done() -> None:
            while not {"1", "2"} <= finished:
                await asyncio.sleep(0.01)
            release.set()

        monkeypatch.setattr(live.engine, "generate", delayed)
        helper = asyncio.create_task(release_when_others_done())
        r = await live.http.post("/v1/completions", json=body)
        await helper
    assert r.status_code == 200
    indexes = [
        c["index"]
        for event in r.text.split("\n\n")
        if event.startswith("data: {")
        for c in json.loads(event[6:])["choices"]
    ]
    assert indexes[0] == 0  # the prompt's first choice goes first, though it came last
    events = _merged(r.text)
    assert set(events) == {0, 1, 2}
    for index in (1, 2):
        lp = events[index]
        assert lp["tokens"][: len(prompt)] == events[0]["tokens"][: len(prompt)]
        assert lp["token_logprobs"][: len(prompt)] == events[0]["token_logprobs"][: len(prompt)]
        assert len(lp["tokens"]) == len(prompt) + 4


# ---------------------------------------------------------------- a whole body, off the loop


async def test_health_answers_while_a_large_body_is_written(monkeypatch):
    """The body of a large allowed completion is written in a worker thread: here it waits,
    once started, until /health has answered five times; written on the event loop, that wait
    would stall the loop and no /health could answer."""
    started, proceed = threading.Event(), threading.Event()
    body_of = openai_api._CompletionAnswer.body

    def waiting_body(self: Any, results: Any) -> list[bytes]:
        started.set()
        proceed.wait(30)
        return body_of(self, results)

    monkeypatch.setattr(openai_api._CompletionAnswer, "body", waiting_body)
    request = {
        "model": MODEL,
        "prompt": _ids(8, 300),
        "n": 16,
        "echo": True,
        "logprobs": 20,
        "max_tokens": 1,
    }
    async with serving() as live:
        big = asyncio.create_task(live.http.post("/v1/completions", json=request, timeout=60))
        answered = 0
        try:
            assert await asyncio.to_thread(started.wait, 30)
            for _ in range(5):
                r = await live.http.get("/health", timeout=5)
                answered += r.status_code == 200
                assert not big.done()
        finally:
            proceed.set()  # a failure above must not leave the body waiting
        response = await big
    assert answered == 5
    assert response.status_code == 200
    choices = response.json()["choices"]
    assert len(choices) == 128 and all(len(c["logprobs"]["tokens"]) == 301 for c in choices)
