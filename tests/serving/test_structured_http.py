"""Structured outputs over HTTP with the official client and httpx: OpenAI's response_format,
vLLM's structured_outputs and guided_* fields, SGLang's /generate fields, and the 400s."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.server_util import module_loop

USER = [{"role": "user", "content": "Describe a person."}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}


@module_loop
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_response_format_json_schema_replies_validate(live, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    texts = []
    for seed in range(5):
        kwargs = dict(model="test-model", messages=USER, max_tokens=60, temperature=1.0, seed=seed)
        if stream:
            chunks = await live.client.chat.completions.create(
                **kwargs, response_format=fmt, stream=True
            )
            texts.append(
                "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
            )
        else:
            r = await live.client.chat.completions.create(**kwargs, response_format=fmt)
            assert r.choices[0].finish_reason == "stop"
            texts.append(r.choices[0].message.content)
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


@module_loop
async def test_json_object_guided_fields_and_n(live):
    r = await live.client.chat.completions.create(
        model="test-model", messages=USER, max_tokens=40, temperature=1.0, seed=1, n=3,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert len(r.choices) == 3
    for choice in r.choices:  # an object, complete unless max_tokens cut it
        assert choice.message.content.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
    c = await live.client.completions.create(
        model="test-model", prompt="code:", max_tokens=20, temperature=1.0,
        extra_body={"guided_regex": "[a-c]{3}[0-9]"},
    )  # fmt: skip
    assert re.fullmatch("[a-c]{3}[0-9]", c.choices[0].text)
    c = await live.client.completions.create(
        model="test-model", prompt="pick:", max_tokens=20, temperature=1.0,
        extra_body={"structured_outputs": {"choice": ["red", "blue"]}},
    )  # fmt: skip
    assert c.choices[0].text in ("red", "blue")
    g = await live.http.post(
        "/generate",
        json={
            "text": "x",
            "sampling_params": {"max_new_tokens": 30, "json_schema": json.dumps(SCHEMA)},
        },
    )
    assert g.status_code == 200, g.text
    jsonschema.validate(json.loads(g.json()["text"]), SCHEMA)
    g = await live.http.post(
        "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 9, "regex": "ab+c"}}
    )
    assert re.fullmatch("ab+c", g.json()["text"])


@module_loop
@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format.json_schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"guided_regex": "a(b"}, "guided_regex"),
        ({"guided_json": {"type": "nonsense"}}, "guided_json"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ],
    ids=["no-schema", "bad-type", "bad-regex", "bad-schema", "two-fields"],
)
async def test_bad_structured_requests_are_400s_naming_the_field(live, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        await live.client.chat.completions.create(
            model="test-model", messages=USER, max_tokens=4, extra_body=extra
        )
    assert info.value.body["param"] == param, info.value.body  # type: ignore[index]
    ok = await live.client.chat.completions.create(model="test-model", messages=USER, max_tokens=2)
    assert ok.choices[0].message is not None


# a node that must contain a node: the grammar compiles, but no finite output satisfies it
ENDLESS = {
    "$ref": "#/$defs/n",
    "$defs": {
        "n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}
    },
}


@module_loop
async def test_a_schema_nothing_satisfies_is_refused_before_it_runs(live):
    """The grammar dead-ends on the request's own schema: a 400 naming the field, found while
    it compiles (its forced first tokens are followed there), so it never reaches the shared
    stream; a client that sends it again gets the same answer without a second compilation,
    streamed or not (issue 42, finding 6: it was a 500 costing every stream a step, then a
    422 that still cost the step)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "node", "schema": ENDLESS}}
    kwargs = dict(model="test-model", messages=USER, max_tokens=30, response_format=fmt)
    grammars = live.engine.core.grammars
    compiled, hits = grammars.compiled, grammars.hits
    finished = dict(live.engine.snapshot().counters.finished)
    for stream in (False, True, False):
        with pytest.raises(openai.BadRequestError) as err:
            await live.client.chat.completions.create(**kwargs, stream=stream)
        assert "dead end" in err.value.message and err.value.code == "grammar_dead_end"
        assert err.value.body["param"] == "response_format"  # type: ignore[index]
    assert grammars.compiled == compiled  # refused before it counted as compiled
    assert grammars.hits == hits + 2  # the second and third: the refusal remembered
    assert dict(live.engine.snapshot().counters.finished) == finished  # never scheduled
    ok = await live.client.chat.completions.create(model="test-model", messages=USER, max_tokens=5)
    assert ok.choices[0].message.content is not None
