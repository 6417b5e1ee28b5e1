"""Every SSE event is one line by every reader's rules: U+0085, U+2028 and U+2029, which JSON
leaves raw but `str.splitlines` (and JavaScript) treat as line breaks, are written as their JSON
escapes, in model output, echoed prompts and token strings alike (issue 42)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel

from stallfree.entrypoints.server.output.streaming import sse
from tests.server_util import Live, module_loop

BREAKS = "\x85\u2028\u2029"
TEXT = "a\x85b\u2028c\u2029d"


class _Payload(BaseModel):
    text: str
    parts: list[str]


@pytest.mark.parametrize(
    "payload",
    [{"text": TEXT, "parts": [BREAKS, "x"]}, _Payload(text=TEXT, parts=[BREAKS, "x"])],
    ids=["dict", "model"],
)
def test_an_event_escapes_the_unicode_line_breaks(payload: Any) -> None:
    event = sse(payload)
    assert event.splitlines() == [event[:-2], ""]  # one line, then the blank that ends it
    assert not any(c in event for c in BREAKS)
    assert event.count("\\u0085") == 2 and event.count("\\u2028") == 2
    assert event.count("\\u2029") == 2
    assert json.loads(event.removeprefix("data: ")) == {"text": TEXT, "parts": [BREAKS, "x"]}


def test_other_text_is_written_as_before() -> None:
    payload = {"text": "é\u00a0漢字 🙂 \u2027\u202a"}
    assert sse(payload) == "data: " + json.dumps(payload, ensure_ascii=False) + "\n\n"


async def _events(live: Live, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream's events, read as a client that splits the body with `str.splitlines` does:
    every line is a whole event or blank."""
    async with live.http.stream("POST", route, json=body) as answer:
        assert answer.status_code == 200, await answer.aread()
        raw = (await answer.aread()).decode()
    lines = [line for line in raw.splitlines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines), lines
    assert not any(c in raw for c in BREAKS)
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


@module_loop
async def test_completion_output_with_line_breaks_streams_one_event_a_line(live: Live) -> None:
    body = {
        "model": "test-model",
        "prompt": "pick:",
        "max_tokens": 30,
        "stream": True,
        "structured_outputs": {"choice": [TEXT]},
    }
    events = await _events(live, "/v1/completions", body)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == TEXT


@module_loop
async def test_chat_output_with_line_breaks_streams_one_event_a_line(live: Live) -> None:
    body = {
        "model": "test-model",
        "messages": [{"role": "user", "content": "pick" + BREAKS}],
        "max_tokens": 30,
        "stream": True,
        "structured_outputs": {"choice": [TEXT]},
    }
    events = await _events(live, "/v1/chat/completions", body)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == TEXT


@module_loop
async def test_an_echoed_prompt_streams_one_event_a_line(live: Live) -> None:
    body = {
        "model": "test-model",
        "prompt": TEXT,
        "max_tokens": 2,
        "stream": True,
        "echo": True,
        "logprobs": 1,
    }
    events = await _events(live, "/v1/completions", body)
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert text.startswith(TEXT)
    assert any(e["choices"][0]["logprobs"]["tokens"] for e in events if e["choices"])


@module_loop
async def test_generate_output_with_line_breaks_streams_one_event_a_line(live: Live) -> None:
    body = {
        "text": "x",
        "stream": True,
        "sampling_params": {"max_new_tokens": 30, "regex": TEXT},
    }
    events = await _events(live, "/generate", body)
    assert "".join(e["text"] for e in events) == TEXT
