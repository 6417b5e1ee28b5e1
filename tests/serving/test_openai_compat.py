"""What OpenAI clients send beyond the fields this server uses: harmless fields are accepted and
ignored (a debug line names them), output-changing ones it cannot honour are a 400 naming them;
and `GET /v1/models/{id}`."""

from __future__ import annotations

import logging
from typing import Any

import openai
import pytest

from stallfree.entrypoints.server.base.protocol import ChatMessage
from stallfree.entrypoints.server.intake.requests import _template_message
from tests.server_util import module_loop

NO_EOS = {"ignore_eos": True}
USER = [{"role": "user", "content": "Hi there"}]


def _ignored_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "stallfree.server" and "present in the request but ignored" in r.getMessage()
    ]


@module_loop
async def test_harmless_openai_fields_are_accepted_and_logged(live, caplog):
    caplog.set_level(logging.DEBUG, logger="stallfree.server")
    chat = await live.client.chat.completions.create(
        model="test-model",
        messages=USER,
        max_tokens=3,
        temperature=0,
        store=True,
        metadata={"team": "a", "trace": "b"},
        user="user-1",
        parallel_tool_calls=False,
        service_tier="auto",
        reasoning_effort="low",
        prediction={"type": "content", "content": "expected"},
        web_search_options={},
        stream_options=None,
        extra_body=NO_EOS,
    )
    plain = await live.client.chat.completions.create(
        model="test-model", messages=USER, max_tokens=3, temperature=0, extra_body=NO_EOS
    )
    # the ignored fields change nothing
    assert chat.choices[0].message.content == plain.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens == 3
    lines = _ignored_lines(caplog)
    assert lines, "no debug line named the ignored fields"
    for name in ("store", "metadata", "service_tier", "reasoning_effort"):
        assert any(repr(name) in line for line in lines), (name, lines)
    # `user` is a known field: it is read (and unused), not reported as ignored
    assert not any("'user'" in line for line in lines)

    completion = await live.client.completions.create(
        model="test-model",
        prompt="Hello",
        max_tokens=2,
        user="user-2",
        extra_body={"store": False, "metadata": {"k": "v"}, "service_tier": "default"},
    )
    assert completion.usage is not None and completion.usage.completion_tokens >= 1


@module_loop
async def test_unknown_nested_fields_and_stream_options_are_ignored(live):
    messages: list[Any] = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi there", "cache_control": {"x": [1, {}]}}],
            "junk": {"deep": [[[{"a": None}]]]},
        }
    ]
    stream = await live.client.chat.completions.create(
        model="test-model",
        messages=messages,
        max_tokens=3,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False, "future": [1]},
        extra_body=NO_EOS | {"metadata": {"nested": {"list": [1, 2, {"x": "y"}]}}},
    )
    chunks = [c async for c in stream]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = await live.client.chat.completions.create(
        model="test-model", messages=USER, max_tokens=3, temperature=0, extra_body=NO_EOS
    )
    assert text == plain.choices[0].message.content


@module_loop
async def test_tool_call_history_is_accepted_and_reaches_the_template(live):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
    }
    messages: list[Any] = [
        {"role": "user", "content": "Weather in Paris?", "name": "alice"},
        {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    result = await live.client.chat.completions.create(
        model="test-model", messages=messages, max_tokens=2, temperature=0, extra_body=NO_EOS
    )
    rendered = live.engine.tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": ""},
            {"role": "tool", "content": "sunny"},
        ]
    )
    assert result.usage is not None
    assert result.usage.prompt_tokens == len(
        live.engine.tokenizer.encode(rendered, add_special_tokens=False)
    )
    # what a template that renders tool calls gets: the fields transformers passes, with the
    # arguments' JSON text read into an object
    message = ChatMessage.model_validate(messages[1])
    assert _template_message(message, 1) == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
        ],
    }  # fmt: skip
    tool = _template_message(ChatMessage.model_validate(messages[2]), 2)
    assert tool == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    not_json = call | {"function": {"name": "f", "arguments": "not json"}}
    odd = ChatMessage.model_validate({"role": "assistant", "tool_calls": [not_json]})
    assert _template_message(odd, 0)["tool_calls"][0]["function"]["arguments"] == "not json"


@module_loop
async def test_malformed_tool_call_history_is_a_400_naming_it(live):
    messages = [*USER, {"role": "assistant", "tool_calls": [{"type": "function"}]}]
    with pytest.raises(openai.BadRequestError) as info:
        await live.client.chat.completions.create(model="test-model", messages=messages)
    assert info.value.body["param"] == "messages.1.tool_calls.0.function"  # type: ignore[index]


CHAT_UNSUPPORTED = [
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("use_beam_search", True),
]
COMPLETION_UNSUPPORTED = [
    ("suffix", "the end"),
]


@module_loop
@pytest.mark.parametrize(("field", "value"), CHAT_UNSUPPORTED, ids=lambda v: str(v)[:24])
async def test_output_changing_chat_fields_are_a_400_naming_them(live, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        await live.client.chat.completions.create(
            model="test-model", messages=USER, max_tokens=2, extra_body={field: value}
        )
    body: dict[str, Any] = info.value.body  # type: ignore[assignment]
    assert body["param"] == field and body["code"] == "unsupported_parameter"
    assert field in body["message"] and "not supported" in body["message"]


@module_loop
@pytest.mark.parametrize(("field", "value"), COMPLETION_UNSUPPORTED, ids=lambda v: str(v)[:24])
async def test_output_changing_completion_fields_are_a_400_naming_them(live, field, value):
    r = await live.http.post(
        "/v1/completions",
        json={"model": "test-model", "prompt": "x", "max_tokens": 2, field: value},
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and "not supported" in error["message"]


@module_loop
async def test_the_defaults_of_unsupported_fields_are_accepted(live):
    defaults = {
        "tools": [],
        "tool_choice": "none",
        "functions": None,
        "function_call": "none",
        "response_format": {"type": "text"},
        "modalities": ["text"],
        "add_generation_prompt": True,
        "continue_final_message": False,
        "min_p": 0.0,
        "use_beam_search": False,
    }
    chat = await live.client.chat.completions.create(
        model="test-model", messages=USER, max_tokens=2, extra_body=defaults
    )
    assert chat.choices[0].finish_reason in {"stop", "length"}
    completion = await live.client.completions.create(
        model="test-model", prompt="x", max_tokens=2, suffix="", extra_body={"min_p": 0}
    )
    assert completion.choices[0].finish_reason in {"stop", "length"}


@module_loop
async def test_the_native_route_still_names_unknown_fields(live):
    r = await live.http.post("/generate", json={"text": "x", "bogus": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bogus"


# ---------------------------------------------------------------- GET /v1/models/{id}


@module_loop
async def test_retrieve_a_model_by_id(live):
    listed = (await live.client.models.list()).data
    retrieved = await live.client.models.retrieve("test-model")
    assert [retrieved] == listed
    assert retrieved.id == "test-model" and retrieved.object == "model"
    assert retrieved.owned_by == "stallfree"
    assert retrieved.model_extra == {"max_model_len": live.engine.max_context_len}


@module_loop
@pytest.mark.parametrize("name", ["other-model", "org/test-model", "test-model/x", "%00"])
async def test_retrieving_an_unknown_model_is_a_404_in_the_openai_shape(live, name):
    with pytest.raises(openai.NotFoundError) as info:
        await live.client.models.retrieve(name)
    body: dict[str, Any] = info.value.body  # type: ignore[assignment]
    assert body["code"] == "model_not_found" and body["type"] == "invalid_request_error"
    assert "does not exist" in body["message"]
    r = await live.http.get("/v1/models/" + name)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
