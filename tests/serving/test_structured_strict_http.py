"""What an everyday client gets from structured outputs over HTTP, with the official `openai`
client and LangChain: schemas are strict unless they say otherwise (or the server was started
with --no-structured-outputs-strict), `\\d \\w \\s` mean ASCII in regexes and schema patterns,
LangChain's `with_structured_output(method="function_calling")` returns the object, and a
server with its model in a worker process constrains replies as one in process does."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from pydantic import BaseModel, Field

from stallfree.cli import build_parser
from stallfree.entrypoints.cli import config_from_args
from tests.server_util import Live, module_loop, serving

USER = [{"role": "user", "content": "Describe a city."}]
LOOSE = {  # what pydantic and LangChain send: no additionalProperties
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "size": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["name", "size"],
}
HERMES_TEMPLATE = (
    "{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def hermes(llama: str) -> AsyncIterator[Live]:
    async with serving(llama, server={"tool_call_parser": "hermes"}) as live:
        live.engine.tokenizer.chat_template = HERMES_TEMPLATE
        yield live


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def lenient(llama: str) -> AsyncIterator[Live]:
    async with serving(llama, runtime={"structured_outputs_strict": False}) as live:
        yield live


async def _keys(live: Live, seeds: range) -> list[list[str] | None]:
    """Each seeded reply's keys, in order; None for a reply cut by max_tokens."""
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": LOOSE}}
    out: list[list[str] | None] = []
    for seed in seeds:
        r = await live.client.chat.completions.create(
            model="test-model", messages=USER, max_tokens=60, temperature=1.0, seed=seed,
            response_format=fmt,
        )  # fmt: skip
        choice = r.choices[0]
        done = choice.finish_reason == "stop"
        out.append(list(json.loads(choice.message.content or "")) if done else None)
    return out


@module_loop
async def test_a_schema_without_additional_properties_allows_only_its_own(hermes):
    assert await _keys(hermes, range(10)) == [["name", "size"]] * 10


@module_loop
async def test_no_structured_outputs_strict_keeps_json_schemas_own_default(lenient):
    keys = await _keys(lenient, range(10))
    assert any(k != ["name", "size"] for k in keys), keys  # extra keys, or cut while adding


@module_loop
async def test_regex_classes_are_ascii_in_every_spelling(hermes):
    year = r"\d{4}-\d{2}-\d{2}"
    for body in (
        {"guided_regex": year},
        {"structured_outputs": {"regex": year}},
        {"structured_outputs": {"regex": r"\w{3}\s\S"}},
    ):
        for seed in range(4):
            c = await hermes.client.completions.create(
                model="test-model", prompt="date:", max_tokens=20, temperature=1.0, seed=seed,
                extra_body=body,
            )  # fmt: skip
            regex = next(iter(body.values()))
            regex = regex if isinstance(regex, str) else regex["regex"]
            assert re.fullmatch(regex, c.choices[0].text, re.ASCII), (regex, c.choices[0].text)
    pattern = {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": r"^\d{3}$"}},
        "required": ["code"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "code", "schema": pattern}}
    for seed in range(4):
        r = await hermes.client.chat.completions.create(
            model="test-model", messages=USER, max_tokens=30, temperature=1.0, seed=seed,
            response_format=fmt,
        )  # fmt: skip
        assert re.fullmatch(r"[0-9]{3}", json.loads(r.choices[0].message.content)["code"])


@module_loop
async def test_a_forced_tool_call_has_only_the_arguments_its_schema_names(hermes):
    tool = {"type": "function", "function": {"name": "find_city", "parameters": LOOSE}}
    for seed in range(4):
        r = await hermes.client.chat.completions.create(
            model="test-model", messages=USER, max_tokens=120, temperature=1.0, seed=seed,
            tools=[tool], tool_choice={"type": "function", "function": {"name": "find_city"}},
        )  # fmt: skip
        (call,) = r.choices[0].message.tool_calls or []
        assert list(json.loads(call.function.arguments)) == ["name", "size"]


class City(BaseModel):
    """A city and its size class."""

    name: str = Field(pattern="^[a-z]{1,6}$")
    size: int = Field(ge=0, le=9)


@module_loop
async def test_langchain_with_structured_output_function_calling_returns_the_object(hermes):
    from langchain_openai import ChatOpenAI

    got = []
    for seed in range(8):  # lenient, about half of these add keys until max_tokens: None
        model = ChatOpenAI(
            model="test-model",
            base_url=str(hermes.client.base_url),
            api_key="unused",
            temperature=1.0,
            max_tokens=120,
            seed=seed,
            max_retries=0,
        ).with_structured_output(City, method="function_calling")
        got.append(await model.ainvoke("Name a city."))
    assert all(isinstance(city, City) for city in got), got


@pytest.mark.slow
async def test_a_server_with_a_worker_process_constrains_replies(llama):
    async with serving(llama, runtime={"worker": "process", "strict": True}) as live:
        assert await _keys(live, range(4)) == [["name", "size"]] * 4
        monitor = live.engine.core.monitor
        assert monitor.schedule_path_reads == 0


def test_the_strictness_flag() -> None:
    def strict(*argv: str) -> bool:
        args = build_parser().parse_args(["serve", "tiny", *argv])
        return config_from_args(args).runtime.structured_outputs_strict

    assert strict() is True
    assert strict("--no-structured-outputs-strict") is False
    assert strict("--structured-outputs-strict") is True
