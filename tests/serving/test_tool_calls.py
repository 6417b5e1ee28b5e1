"""Tool calling and reasoning over HTTP, with the official client, LangChain and httpx.

A tiny random model makes no sensible call of its own; `tool_choice` required or a named
function constrains its reply to a valid call, which makes every test deterministic in what it
checks: the call parses, names a given tool, and its arguments validate against the tool's
schema, streamed or whole. `auto` is tried with a grammar that makes the model write a call in
the hermes format, which the parser must then find.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any, Literal

import jsonschema
import openai
import pytest
import pytest_asyncio

from stallfree.entrypoints.server.chat.tool_parsers import MAX_DEPTH
from tests.server_util import Live, module_loop, serving

HERMES_TEMPLATE = (
    "{% if tools %}<|system|>\nTools: {{ tools | tojson }}\n{% endif %}"
    "{% if documents %}Docs: {{ documents | length }}\n{% endif %}"
    "{% if greeting is defined %}{{ greeting }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n"
    '{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}\n'
    "</tool_call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def hermes(llama: str) -> AsyncIterator[Live]:
    """A server that parses hermes tool calls (auto allowed)."""
    server = {"tool_call_parser": "hermes", "enable_auto_tool_choice": True}
    async with serving(llama, server=server) as live:
        live.engine.tokenizer.chat_template = HERMES_TEMPLATE
        yield live


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def thinker(llama: str) -> AsyncIterator[Live]:
    """A server that splits deepseek_r1 thinking and parses hermes tool calls."""
    server = {"tool_call_parser": "hermes", "reasoning_parser": "deepseek_r1"}
    async with serving(llama, server=server) as live:
        live.engine.tokenizer.chat_template = HERMES_TEMPLATE
        yield live


def _check_calls(calls: list[Any], names: set[str] | None = None) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in (names or set(SCHEMAS))
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


async def _streamed(live: Live, **kwargs: Any) -> tuple[dict[int, dict[str, str]], str | None]:
    """The calls a stream sends, put together from their deltas, and its finish reason."""
    calls: dict[int, dict[str, str]] = {}
    finish = None
    stream = await live.client.chat.completions.create(**kwargs, stream=True)
    async for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                entry = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                if delta.id:
                    assert not entry["id"], "a call's id and name come once"
                    entry["id"], entry["name"] = delta.id, delta.function.name
                entry["arguments"] += delta.function.arguments or ""
    return calls, finish


def _kwargs(**extra: Any) -> dict[str, Any]:
    return dict(model="test-model", messages=USER, tools=TOOLS, max_tokens=120) | extra


async def _required(live: Live, parallel: bool) -> None:
    counts = []
    for seed in range(6 if not parallel else 4):
        kwargs = _kwargs(
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            parallel_tool_calls=parallel,
            max_tokens=400 if parallel else 120,
        )
        r = await live.client.chat.completions.create(**kwargs)
        choice = r.choices[0]
        if parallel and choice.finish_reason == "length":
            continue  # a random model may go on calling until max_tokens
        assert choice.finish_reason == "tool_calls", repr(choice.message.content)
        assert choice.message.content is None
        _check_calls(choice.message.tool_calls)
        streamed, finish = await _streamed(live, **kwargs)
        assert finish == "tool_calls"
        whole = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert [(c["name"], c["arguments"]) for _, c in sorted(streamed.items())] == whole
        counts.append(len(whole))
    if parallel:
        assert max(counts) > 1, counts  # some seed made more than one call
    else:
        assert counts == [1] * 6


@module_loop
async def test_required_calls_a_tool_with_valid_arguments_in_the_hermes_format(hermes):
    await _required(hermes, False)
    await _required(hermes, True)


@module_loop
async def test_required_calls_a_tool_with_valid_arguments_as_a_json_array(live):
    await _required(live, False)  # no parser: vLLM's JSON array
    await _required(live, True)


async def _named(live: Live) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(3):
        r = await live.client.chat.completions.create(
            **_kwargs(tool_choice=named, temperature=1.0, seed=seed)
        )
        calls = r.choices[0].message.tool_calls
        assert len(calls) == 1 and r.choices[0].finish_reason == "stop"
        _check_calls(calls, {"get_time"})


@module_loop
async def test_a_named_function_is_the_one_called_in_the_hermes_format(hermes):
    await _named(hermes)


@module_loop
async def test_a_named_function_is_the_one_called_as_a_json_array(live):
    await _named(live)


@module_loop
async def test_parallel_tool_calls_false_makes_one_call(hermes):
    for seed in range(3):
        r = await hermes.client.chat.completions.create(
            **_kwargs(tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed)
        )
        assert len(r.choices[0].message.tool_calls) == 1


HERMES_CALL = (
    'start: "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": '
    '{\\"city\\": \\"" CITY "\\", \\"days\\": " DAY "}}\\n</tool_call>"\n'
    'CITY: "Paris" | "Rome"\nDAY: /[1-7]/'
)


@module_loop
async def test_auto_finds_the_call_the_model_writes(hermes):
    # the grammar makes the model write a hermes call; the auto parser has to find it
    kwargs = _kwargs(extra_body={"structured_outputs": {"grammar": HERMES_CALL}}, temperature=1.0)
    r = await hermes.client.chat.completions.create(**kwargs, seed=3)
    assert r.choices[0].finish_reason == "tool_calls"
    _check_calls(r.choices[0].message.tool_calls, {"get_weather"})
    streamed, finish = await _streamed(hermes, **kwargs, seed=3)
    call = r.choices[0].message.tool_calls[0]
    assert streamed[0]["arguments"] == call.function.arguments and finish == "tool_calls"
    # a plain reply (no call) under auto is content, and the finish reason stays stop/length
    plain = await hermes.client.chat.completions.create(
        **_kwargs(temperature=0, extra_body={"guided_regex": "[a-z ]{4,12}"})
    )
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content and plain.choices[0].finish_reason == "stop"


# a hermes call nested past the parsers' depth limit (issue 42, finding 11): content, not a call
DEEP_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"a": '
    + "[" * (MAX_DEPTH + 16)
    + "]" * (MAX_DEPTH + 16)
    + "}}\n</tool_call>"
)


@module_loop
async def test_a_call_nested_too_deep_is_content_whole_and_streamed(hermes):
    grammar = {"grammar": "start: " + json.dumps(DEEP_CALL)}
    kwargs = _kwargs(max_tokens=len(DEEP_CALL) + 8, extra_body={"structured_outputs": grammar})
    r = await hermes.client.chat.completions.create(**kwargs)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == DEEP_CALL and r.choices[0].finish_reason == "stop"
    # a stream has sent the call's name before the nesting shows (as with any call that turns
    # out not to parse); it ends as content, with no error, and the call never completes
    content, finish, arguments = "", None, ""
    stream = await hermes.client.chat.completions.create(**kwargs, stream=True)
    async for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            arguments += "".join(d.function.arguments or "" for d in choice.delta.tool_calls or ())
            finish = choice.finish_reason or finish
    assert content == DEEP_CALL and finish == "stop"
    assert len(arguments) <= 2 * MAX_DEPTH


@module_loop
async def test_tools_documents_and_template_kwargs_reach_the_template(hermes):
    async def prompt_tokens(**extra: Any) -> int:
        r = await hermes.client.chat.completions.create(
            model="test-model", messages=USER, max_tokens=1, **extra
        )
        return r.usage.prompt_tokens

    bare = await prompt_tokens()
    greeted = await prompt_tokens(extra_body={"chat_template_kwargs": {"greeting": "hello there"}})
    assert greeted - bare == len("hello there\n")
    documented = await prompt_tokens(extra_body={"documents": [{"text": "a"}, {"text": "b"}]})
    assert documented - bare == len("Docs: 2\n")
    with_tools = await prompt_tokens(tools=TOOLS, tool_choice="none")
    rendered = "<|system|>\nTools: " + json.dumps(TOOLS, ensure_ascii=False) + "\n"
    assert with_tools - bare == len(rendered.encode())
    # /tokenize renders the same prompt from the same fields
    extra = {"tools": TOOLS, "chat_template_kwargs": {"greeting": "hello there"}}
    r = await hermes.http.post("/tokenize", json={"messages": USER} | extra)
    assert r.status_code == 200, r.text
    assert r.json()["count"] == with_tools + len("hello there\n")
    bad = await hermes.http.post(
        "/tokenize", json={"messages": USER, "chat_template_kwargs": {"tools": 1}}
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs.tools"


@module_loop
async def test_a_tool_calling_history_renders(hermes):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}  # fmt: skip
    messages = [*USER, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]  # fmt: skip
    r = await hermes.client.chat.completions.create(
        model="test-model", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=2
    )
    assert r.choices[0].message.tool_calls is None and r.usage.prompt_tokens > 0


# schemas whose forced-call grammar is over the 64 KiB a structured output may take
BIG_TOOLS = [
    {"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {f"p{j}": {"type": "string"} for j in range(100)}}}}
    for i in range(40)
]  # fmt: skip
REFUSED = [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "no tool named 'nope'"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot both"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages", "set by the"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name",
     "pattern"),
    ({"tools": [WEATHER] * 129}, "tools", "at most 128"),
    ({"tools": BIG_TOOLS, "tool_choice": "required"}, "tools", "over the 65536"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
      "tool_choice": "required"}, "tools", ""),
]  # fmt: skip


@module_loop
@pytest.mark.parametrize(("extra", "param", "words"), REFUSED, ids=[r[1] for r in REFUSED])
async def test_bad_tool_requests_are_400s_naming_the_field(hermes, extra, param, words):
    r = await hermes.http.post(
        "/v1/chat/completions",
        json={"model": "test-model", "messages": USER, "max_tokens": 4} | extra,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert (await hermes.http.get("/health")).status_code == 200


@module_loop
async def test_auto_needs_the_server_flags(live):
    with pytest.raises(openai.BadRequestError) as info:
        await live.client.chat.completions.create(model="test-model", messages=USER, tools=TOOLS)
    body: dict[str, Any] = info.value.body  # type: ignore[assignment]
    assert body["param"] == "tool_choice" and "--enable-auto-tool-choice" in body["message"]


@module_loop
async def test_langchain_bind_tools_gets_valid_calls(hermes):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"], days: int) -> str:
        """The weather in a city for some days."""
        return "sunny"

    model = ChatOpenAI(
        model="test-model",
        base_url=str(hermes.client.base_url),
        api_key="unused",
        temperature=1.0,
        max_tokens=120,
        seed=5,
        max_retries=0,
    ).bind_tools([get_weather], tool_choice="required")
    reply = await model.ainvoke("What is the weather in Paris?")
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather"
    args = reply.tool_calls[0]["args"]
    assert args["city"] in {"Paris", "Rome", "Oslo"} and isinstance(args["days"], int)
    merged = None
    async for chunk in model.astream("What is the weather in Paris?"):
        merged = chunk if merged is None else merged + chunk
    # the same seed streams the same calls, put together from their chunks
    assert merged is not None
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [
        (c["name"], c["args"]) for c in reply.tool_calls
    ]


@module_loop
async def test_thinking_goes_to_reasoning_content_whole_and_streamed(thinker):
    # a GBNF grammar is left as it is (not wrapped to think first): it writes the thinking
    grammar = {"grammar": 'root ::= "<think>" [a-z]{3,8} "</think>" [A-Z] [a-z]{2,6}'}
    kwargs = dict(model="test-model", messages=USER, max_tokens=40, temperature=1.0, seed=2,
                  extra_body={"structured_outputs": grammar})  # fmt: skip
    r = await thinker.client.chat.completions.create(**kwargs)
    message = r.choices[0].message
    thinking = message.model_extra["reasoning_content"]  # type: ignore[index]
    assert thinking.isalpha() and thinking.islower() and 3 <= len(thinking) <= 8
    assert message.content[0].isupper() and "<think>" not in message.content
    stream = await thinker.client.chat.completions.create(**kwargs, stream=True)
    reasoning, content = "", ""
    async for chunk in stream:
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            reasoning += extra.get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (thinking, message.content)


@module_loop
async def test_a_constrained_reply_thinks_freely_first(thinker):
    """With a reasoning parser, a JSON-schema reply (and a forced call) is constrained only
    after `</think>`: a random model's thinking runs free until max_tokens, never JSON."""
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
    for extra in ({"response_format": fmt}, {"tools": TOOLS, "tool_choice": "required"}):
        r = await thinker.client.chat.completions.create(
            model="test-model", messages=USER, max_tokens=24, temperature=1.0, seed=4, **extra
        )
        choice = r.choices[0]
        thinking = choice.message.model_extra["reasoning_content"]  # type: ignore[index]
        assert choice.finish_reason == "length" and choice.message.content is None
        assert thinking and not choice.message.tool_calls
        assert not thinking.startswith(("{", "<tool_call>")), thinking  # not the constraint's


# ---------------------------------------------------------------- a reply cut by max_tokens


def _call_end(text: str, at: int = 0) -> int:
    """Where the call that starts at or after `at` ends in a forced reply's text."""
    if "<tool_call>" in text:  # hermes
        return text.index("</tool_call>", at) + len("</tool_call>")
    start = text.index("{", at)  # vLLM's JSON array: one object per call
    return json.JSONDecoder().raw_decode(text, start)[1]


async def _two_calls(live: Live) -> tuple[dict[str, Any], list[str], list[Any]]:
    """A seed and its request whose forced reply makes two calls or more, the reply's tokens'
    texts, and its calls."""
    for seed in range(12):
        kwargs = _kwargs(tool_choice="required", temperature=1.0, seed=seed, max_tokens=400)
        r = await live.client.chat.completions.create(**kwargs, logprobs=True)
        choice = r.choices[0]
        if choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) >= 2:
            tokens = [entry.token for entry in choice.logprobs.content]
            return kwargs, tokens, choice.message.tool_calls
    raise AssertionError("no seed made two calls")


def _cut_inside_the_second_call(tokens: list[str]) -> int:
    """A max_tokens that ends the reply after its first call, inside its second."""
    text, at = "", 0
    ends: list[int] = []  # the token counts that end the first and the second call
    for i, token in enumerate(tokens, 1):
        text += token
        with contextlib.suppress(ValueError):
            at = _call_end(text, at)
            ends.append(i)
        if len(ends) == 2:
            break
    first, second = ends
    assert second - first >= 2, (first, second)
    return (first + second) // 2


async def _cut_reply_keeps_completed_calls(live: Live) -> None:
    kwargs, tokens, calls = await _two_calls(live)
    cut = _cut_inside_the_second_call(tokens)
    kwargs = kwargs | {"max_tokens": cut}
    r = await live.client.chat.completions.create(**kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is None  # no markup, no grammar text
    got = choice.message.tool_calls
    first = (calls[0].function.name, calls[0].function.arguments)
    assert [(c.function.name, c.function.arguments) for c in got] == [first]
    _check_calls(got)
    streamed, finish = await _streamed(live, **kwargs)
    assert finish == "length"
    sent = [(c["name"], c["arguments"]) for _, c in sorted(streamed.items())]
    assert sent[0] == first and len(sent) <= 2
    if len(sent) == 2:  # the cut call, once its name was whole: as far as it went
        name, arguments = sent[1]
        assert name == calls[1].function.name
        assert calls[1].function.arguments.startswith(arguments)
        assert arguments != calls[1].function.arguments
    stream = await live.client.chat.completions.create(**kwargs, stream=True)
    content = [c.choices[0].delta.content async for c in stream if c.choices]
    assert not any(content), content


@module_loop
async def test_a_reply_cut_by_max_tokens_keeps_its_completed_calls_in_the_hermes_format(hermes):
    await _cut_reply_keeps_completed_calls(hermes)


@module_loop
async def test_a_reply_cut_by_max_tokens_keeps_its_completed_calls_as_a_json_array(live):
    await _cut_reply_keeps_completed_calls(live)


@module_loop
async def test_a_named_call_cut_short_is_no_content(hermes, live):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for server in (hermes, live):
        r = await server.client.chat.completions.create(
            **_kwargs(tool_choice=named, temperature=1.0, seed=1, max_tokens=6)
        )
        choice = r.choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None
        for call in choice.message.tool_calls or ():
            assert call.function.name == "get_weather"


@module_loop
async def test_langchain_bind_tools_any_returns_the_call_a_cut_reply_completed(hermes):
    from langchain_openai import ChatOpenAI

    kwargs, tokens, calls = await _two_calls(hermes)
    model = ChatOpenAI(
        model="test-model",
        base_url=str(hermes.client.base_url),
        api_key="unused",
        temperature=kwargs["temperature"],
        seed=kwargs["seed"],
        max_tokens=_cut_inside_the_second_call(tokens),
        max_retries=0,
    ).bind_tools(TOOLS, tool_choice="any")
    reply = await model.ainvoke(USER[0]["content"])
    assert reply.response_metadata["finish_reason"] == "length"
    first = calls[0].function
    assert [(c["name"], c["args"]) for c in reply.tool_calls] == [
        (first.name, json.loads(first.arguments))
    ]
    assert not reply.content and not reply.invalid_tool_calls
