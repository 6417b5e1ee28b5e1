"""The tool-call and reasoning parsers, whole and streamed: what a stream sends concatenates to
what a whole reply holds, whatever the pieces the text arrives in."""

from __future__ import annotations

import json
import random

import pytest

from stallfree.entrypoints.server.chat.chat_output import ChatOutput
from stallfree.entrypoints.server.chat.reasoning import REASONING_PARSERS
from stallfree.entrypoints.server.chat.tool_parsers import (
    MAX_DEPTH,
    PARSERS,
    CallDraft,
    json_array_schema,
    streamed_arguments,
    too_deep,
)

ARGS = {"city": 'Par"is}', "days": [1, 22, -3.5], "deep": {"a": {"b": []}}, "ok": True, "x": None}
WANT = json.dumps(ARGS, ensure_ascii=False)

# each parser, a reply holding content and two calls in its format, and the content
REPLIES = {
    "hermes": (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
        + WANT
        + '}\n</tool_call>\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>',
        "Let me look.",
    ),
    "llama3_json": (
        '{"name": "get_weather", "parameters": ' + WANT + '}; {"name": "noop", "parameters": {}}',
        None,
    ),
    "mistral": (
        'Let me look.[TOOL_CALLS][{"name": "get_weather", "arguments": '
        + WANT
        + '}, {"name": "noop", "arguments": {}}]',
        "Let me look.",
    ),
    "mistral-v11": (
        "Let me look.[TOOL_CALLS]get_weather[ARGS]" + WANT + "[TOOL_CALLS]noop[ARGS]{}",
        "Let me look.",
    ),
    "pythonic": (
        '[get_weather(city="Par\\"is}", days=[1, 22, -3.5], deep={"a": {"b": []}}, ok=True, '
        "x=None), noop()]",
        None,
    ),
    "json_array": (
        '[{"name": "get_weather", "parameters": ' + WANT + '}, {"name": "noop", "parameters": {}}]',
        None,
    ),
}


def _pieces(text: str, rng: random.Random) -> list[str]:
    out, at = [], 0
    while at < len(text):
        step = rng.randint(1, 4)
        out.append(text[at : at + step])
        at += step
    return out


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_a_whole_reply_gives_its_content_and_calls(name):
    text, content = REPLIES[name]
    choice = ChatOutput(tools=PARSERS[name.split("-")[0]]()).choice()
    choice.feed(text, final=True)
    message = choice.message()
    assert message["content"] == content
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message["tool_calls"]
    ]
    assert calls == [("get_weather", ARGS), ("noop", {})]
    assert all(
        c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"]
    )
    assert choice.finish_reason("stop") == "tool_calls"
    assert choice.finish_reason("length") == "length"


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("name", sorted(REPLIES))
def test_streamed_deltas_concatenate_to_the_whole_reply(name, seed):
    text, content = REPLIES[name]
    parser = PARSERS[name.split("-")[0]]
    whole = ChatOutput(tools=parser()).choice()
    whole.feed(text, final=True)
    want = whole.message()
    stream = ChatOutput(tools=parser()).choice()
    pieces = _pieces(text, random.Random(seed))
    got_content, calls = "", {}
    for i, piece in enumerate(pieces):
        out = stream.feed(piece, final=i == len(pieces) - 1)
        got_content += out.content
        for delta in out.calls:
            entry = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
            if "id" in delta:
                assert delta["type"] == "function" and not entry["name"]  # the name comes once
                entry["name"] = delta["function"]["name"]
            entry["arguments"] += delta["function"]["arguments"]
    assert got_content == (content or "")
    assert [calls[i] for i in sorted(calls)] == [c["function"] for c in want["tool_calls"]]
    if name != "pythonic":  # a pythonic call appears whole, once its list closes
        first_args = next(iter(calls.values()))["arguments"]
        assert first_args == WANT


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "mistral-v11", "json_array"])
def test_arguments_stream_before_the_call_is_whole(name):
    text, _ = REPLIES[name]
    cut = text.index('"days"') + 12  # inside the days list
    parsed = PARSERS[name.split("-")[0]]().parse(text[:cut], final=False)
    assert parsed.calls and parsed.calls[0].name == "get_weather"
    sent = streamed_arguments(parsed.calls[0])
    assert sent and WANT.startswith(sent)


@pytest.mark.parametrize(
    "partial",
    [{"a": "x"}, {"a": 1, "b": [1, 2]}, {"a": {"b": {}}}, {"s": 'en"d]}'}, {"e": ""}],
)
def test_a_streamed_prefix_is_a_prefix_of_any_longer_object(partial):
    sent = streamed_arguments(CallDraft("f", partial))
    longer = partial | {"zz": [{"more": 1}]}
    assert json.dumps(longer, ensure_ascii=False).startswith(sent)
    assert not sent.endswith(("}", "]", '"'))


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("hermes", "Hi <tool_call>\n{not json}\n</tool_call>"),
        ("hermes", 'Hi <tool_call>\n{"name": "f", "arguments": {"a": 1'),
        ("llama3_json", '{"name": "f", "parameters": {"a": 1}'),
        ("llama3_json", '{"title": "not a call"}'),
        ("mistral", "x[TOOL_CALLS][1, 2]"),
        ("mistral", "x[TOOL_CALLS]f[ARGS]{broken"),
        ("mistral", "x[TOOL_CALLS]f no args"),
        ("pythonic", "[print(1)] is code"),
        ("pythonic", "[f(*a)]"),
    ],
)
def test_calls_that_do_not_parse_are_content(name, text):
    choice = ChatOutput(tools=PARSERS[name]()).choice()
    choice.feed(text, final=True)
    assert choice.message() == {"role": "assistant", "content": text}
    assert choice.finish_reason("stop") == "stop"


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_plain_text_is_content_whole_and_streamed(name):
    text = "The answer is 42.\n  "
    stream = ChatOutput(tools=PARSERS[name.split("-")[0]]()).choice()
    sent = "".join(stream.feed(p, final=i == len(text) - 1).content for i, p in enumerate(text))
    assert sent == text and stream.message() == {"role": "assistant", "content": text}


def test_a_possible_marker_waits_then_goes_out_as_content():
    choice = ChatOutput(tools=PARSERS["hermes"]()).choice()
    assert choice.feed("a <tool_").content == "a"
    assert choice.feed("ca").content == ""
    assert choice.feed("t", final=True).content == " <tool_cat"


def test_a_named_call_keeps_the_name_and_ends_as_stop():
    choice = ChatOutput(tools=PARSERS["json_array"](), named="get_weather").choice()
    choice.feed('[{"name": "get_weather", "parameters": {}}]', final=True)
    assert choice.message()["tool_calls"][0]["function"]["name"] == "get_weather"
    assert choice.finish_reason("stop") == "stop"


CUT = sorted(set(REPLIES) - {"pythonic"})  # a pythonic call appears once its list closes


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", CUT)
def test_a_reply_cut_inside_its_second_call_keeps_the_first_whole_and_streamed(name, seed):
    text, content = REPLIES[name]
    cut = text[: text.rindex("{") + 1]  # the second call's arguments just opened
    parser = PARSERS[name.split("-")[0]]
    whole = ChatOutput(tools=parser()).choice()
    whole.feed(cut, final=True, cut=True)
    message = whole.message()
    assert message["content"] == content
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert calls == [("get_weather", WANT)]  # the cut call is not one
    assert whole.finish_reason("length") == "length"
    stream = ChatOutput(tools=parser()).choice()
    pieces = _pieces(cut, random.Random(seed))
    sent, streamed = "", {}
    for i, piece in enumerate(pieces):
        out = stream.feed(piece, final=i == len(pieces) - 1, cut=True)
        sent += out.content
        for delta in out.calls:
            entry = streamed.setdefault(delta["index"], ["", ""])
            entry[0] += delta.get("function", {}).get("name", "")
            entry[1] += delta["function"]["arguments"]
    assert sent == (content or "")
    # a stream has sent the cut call as far as it went, and nothing after
    assert [tuple(streamed[i]) for i in sorted(streamed)] == [*calls, ("noop", "{")]
    assert stream.message() == message | {"tool_calls": stream.message()["tool_calls"]}
    assert [c["function"] for c in stream.message()["tool_calls"]] == [
        c["function"] for c in message["tool_calls"]
    ]


@pytest.mark.parametrize("name", CUT)
def test_a_reply_that_ended_inside_a_call_without_a_cut_is_content(name):
    """The model stopped (finish reason stop) with a call unfinished: not calls after all."""
    text, _ = REPLIES[name]
    broken = text[: text.rindex("{") + 1]
    choice = ChatOutput(tools=PARSERS[name.split("-")[0]]()).choice()
    choice.feed(broken, final=True)
    assert choice.message() == {"role": "assistant", "content": broken}


@pytest.mark.parametrize("name", CUT)
def test_a_forced_reply_has_no_content_even_cut_before_a_name(name):
    text, _ = REPLIES[name]
    for end in (1, text.index("get_weather") + 3, len(text)):
        choice = ChatOutput(tools=PARSERS[name.split("-")[0]](), forced=True).choice()
        choice.feed(text[:end], final=True, cut=end < len(text))
        message = choice.message()
        assert message["content"] is None
        names = [c["function"]["name"] for c in message.get("tool_calls", [])]
        assert names == (["get_weather", "noop"] if end == len(text) else [])


def test_the_json_array_schema_bounds_parallel_calls():
    one = json_array_schema([("f", {"type": "object"})], many=False)
    assert one["minItems"] == 1 and one["maxItems"] == 1
    assert "maxItems" not in json_array_schema([("f", {})], many=True)


# ---------------------------------------------------------------- reasoning

REASONED = [
    (
        "deepseek_r1",
        "<think>Paris is in France.</think>\n\nParis.",
        "Paris is in France.",
        "\n\nParis.",
    ),
    ("deepseek_r1", "Paris is in France.</think>Paris.", "Paris is in France.", "Paris."),
    ("deepseek_r1", "still thinking <", "still thinking <", None),
    ("qwen3", "<think>\nhmm\n</think>\n\nParis.", "\nhmm\n", "\n\nParis."),
    ("qwen3", "Paris, no thinking.", None, "Paris, no thinking."),
    ("qwen3", "<think>cut off", "cut off", None),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), REASONED)
def test_reasoning_splits_whole_and_streamed(name, text, reasoning, content):
    output = ChatOutput(reasoning=REASONING_PARSERS[name]())
    whole = output.choice()
    whole.feed(text, final=True)
    assert whole.message() == {
        "role": "assistant",
        "content": content,
        "reasoning_content": reasoning,
    }
    stream = output.choice()
    got = [stream.feed(c, final=i == len(text) - 1) for i, c in enumerate(text)]
    assert "".join(p.reasoning for p in got) == (reasoning or "")
    assert "".join(p.content for p in got) == (content or "")


def test_reasoning_then_a_tool_call():
    output = ChatOutput(reasoning=REASONING_PARSERS["qwen3"](), tools=PARSERS["hermes"]())
    choice = output.choice()
    text = '<think>need weather</think>\n<tool_call>\n{"name": "w", "arguments": {"c": 1}}\n</tool_call>'
    pieces = [choice.feed(c, final=i == len(text) - 1) for i, c in enumerate(text)]
    message = choice.message()
    assert message["reasoning_content"] == "need weather" and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "w", "arguments": '{"c": 1}'}
    assert "".join(p.reasoning for p in pieces) == "need weather"
    assert "".join(p.content for p in pieces) == ""


# ---------------------------------------------------------------- constrained after thinking

AFTER = [
    ("deepseek_r1", {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
     ['<think>x {"q" </think>\n\n{"a":1}', 'free text</think>{"a":22}'],
     ['{"a":1}', '<think>x</think>not json', '<think>x</think>{"a": 1}']),
    ("qwen3", {"choice": ['y"es', "no"]},
     ["<think>hm</think> no", 'y"es', "no"],
     ["maybe", "<think>hm</think>maybe"]),
    ("qwen3", {"regex": "[a-c]{2}/[0-9]"}, ["ab/3", "<think>?</think>\ncc/0"], ["ab3", "ab/"]),
    ("deepseek_r1", {"grammar": 'start: "x" "}"+'}, ["t</think>x}}"], ["t</think>y"]),
    ("deepseek_r1", {"json_object": True}, ["</think>{}"], ["</think>[]"]),
]  # fmt: skip


@pytest.mark.parametrize(("name", "spec", "good", "bad"), AFTER, ids=lambda v: str(v)[:20])
def test_a_wrapped_grammar_constrains_only_what_follows_the_thinking(name, spec, good, bad):
    from llguidance import LLMatcher, grammar_from

    from stallfree.entrypoints.server.chat.reasoning import after_thinking
    from stallfree.runtime.text.grammar_compiler import build_lltokenizer
    from stallfree.runtime.text.tokenizer import ByteTokenizer

    wrapped = after_thinking({**spec, "source": "response_format"}, REASONING_PARSERS[name]())
    assert wrapped["source"] == "response_format" and "grammar" in wrapped
    tok = build_lltokenizer(ByteTokenizer(), 260)

    def accepts(text: str) -> bool:
        matcher = LLMatcher(tok, grammar_from("lark", wrapped["grammar"]), log_level=0)
        return all(matcher.consume_token(b) for b in text.encode()) and matcher.is_accepting()

    assert all(accepts(t) for t in good), [t for t in good if not accepts(t)]
    assert not any(accepts(t) for t in bad), [t for t in bad if accepts(t)]


def test_what_cannot_be_wrapped_is_left_as_it_is():
    from stallfree.entrypoints.server.chat.reasoning import after_thinking

    parser = REASONING_PARSERS["deepseek_r1"]()
    for spec in ({"grammar": 'root ::= "a"'}, {"json": "{not json"}):
        assert after_thinking(spec, parser) is spec


DEEP = 10_000
# each parser, a call in its format whose arguments nest DEEP arrays (issue 42, finding 11)
NESTED = "[" * DEEP + "]" * DEEP
DEEP_REPLIES = {
    "hermes": '<tool_call>\n{"name": "f", "arguments": {"a": ' + NESTED + "}}\n</tool_call>",
    "llama3_json": '{"name": "f", "parameters": {"a": ' + NESTED + "}}",
    "mistral": '[TOOL_CALLS][{"name": "f", "arguments": {"a": ' + NESTED + "}}]",
    "mistral-v11": '[TOOL_CALLS]f[ARGS]{"a": ' + NESTED + "}",
    "pythonic": "[f(a=" + NESTED + ")]",
    "json_array": '[{"name": "f", "parameters": {"a": ' + NESTED + "}}]",
}


@pytest.mark.parametrize("name", sorted(DEEP_REPLIES))
def test_a_reply_nested_too_deep_is_content_whole_and_streamed(name):
    text = DEEP_REPLIES[name]
    whole = ChatOutput(tools=PARSERS[name.split("-")[0]]()).choice()
    whole.feed(text, final=True)
    assert whole.message()["content"] == text and "tool_calls" not in whole.message()
    streamed = ChatOutput(tools=PARSERS[name.split("-")[0]]()).choice()
    pieces = [text[at : at + 997] for at in range(0, len(text), 997)]
    deltas = [streamed.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    assert "".join(d.content for d in deltas) == text
    assert not streamed.completed()


@pytest.mark.parametrize("depth", [MAX_DEPTH - 2, MAX_DEPTH - 1])
def test_a_call_nested_to_the_limit_still_parses(depth):
    # the arguments object is one level, the call object around it another
    value = "[" * depth + "]" * depth
    text = '<tool_call>\n{"name": "f", "arguments": {"a": ' + value + "}}\n</tool_call>"
    choice = ChatOutput(tools=PARSERS["hermes"]()).choice()
    choice.feed(text, final=True)
    calls = choice.message().get("tool_calls", [])
    assert (len(calls) == 1) == (depth + 2 <= MAX_DEPTH)


def test_brackets_in_strings_do_not_count_toward_the_depth():
    assert not too_deep('["' + "[" * 500 + '\\"' + "{" * 500 + '"]')
    assert too_deep("[" * (MAX_DEPTH + 1))
    assert not too_deep("[]" * 10_000)


# a call with 12 kB of arguments in each JSON format (issue 42, finding 12)
BIG = json.dumps({"rows": [{"i": i, "v": [i, [i, {"w": "x" * (i % 7)}]]} for i in range(300)]})
BIG_REPLIES = {
    "hermes": 'Sure.\n<tool_call>\n{"name": "f", "arguments": ' + BIG + "}\n</tool_call>",
    "llama3_json": '{"name": "f", "parameters": ' + BIG + "}",
    "mistral": '[TOOL_CALLS][{"name": "f", "arguments": ' + BIG + "}]",
    "mistral-v11": "[TOOL_CALLS]f[ARGS]" + BIG,
    "json_array": '[{"name": "f", "parameters": ' + BIG + "}]",
}


@pytest.mark.parametrize("name", sorted(BIG_REPLIES))
def test_a_streamed_call_is_parsed_in_time_linear_in_its_length(name, monkeypatch):
    import stallfree.entrypoints.server.chat.tool_parsers as tool_parsers

    read: list[int] = []  # the length of each text handed to a JSON parser, whole or partial
    raw_decode, partial_loads = json.JSONDecoder.raw_decode, tool_parsers.partial_loads

    def counted_raw(decoder, text, *args, **kwargs):  # what json.loads calls too
        read.append(len(text))
        return raw_decode(decoder, text, *args, **kwargs)

    def counted_partial(text, *args, **kwargs):
        read.append(len(text))
        return partial_loads(text, *args, **kwargs)

    monkeypatch.setattr(json.JSONDecoder, "raw_decode", counted_raw)
    monkeypatch.setattr(tool_parsers, "partial_loads", counted_partial)
    text = BIG_REPLIES[name]
    assert len(BIG) > 12_000
    choice = ChatOutput(tools=PARSERS[name.split("-")[0]]()).choice()
    pieces = [text[at : at + 4] for at in range(0, len(text), 4)]  # about a token each
    deltas = [choice.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    parses, total = len(read), sum(read)
    streamed = "".join(
        c["function"]["arguments"] for d in deltas for c in d.calls if c["index"] == 0
    )
    assert json.loads(streamed) == json.loads(BIG)
    # the arguments still stream: more than a handful of deltas before the call is whole
    assert sum(1 for d in deltas for c in d.calls if c["function"].get("arguments")) >= 8
    assert total <= 4 * len(text), (parses, total, len(text))
