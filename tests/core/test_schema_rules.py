"""How a client's regex and JSON schema reach llguidance: `\\d \\w \\s` (and their negations,
inside and outside brackets) in ASCII, checked against Python's `re.ASCII` through the real
matcher, and strict schemas (unnamed properties and tuple items refused unless the schema says
otherwise)."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from llguidance import LLMatcher

from stallfree.runtime.text.ascii_regex import ascii_classes
from stallfree.runtime.text.grammar_compiler import build_lltokenizer
from stallfree.runtime.text.strict_schema import prepare_lark, prepare_schema
from stallfree.runtime.text.tokenizer import ByteTokenizer

_LLTOK = build_lltokenizer(ByteTokenizer(), 300)


def _backend_matches(regex: str, text: str) -> bool:
    """Whether llguidance's matcher for `regex` accepts `text` whole (byte by byte)."""
    matcher = LLMatcher(_LLTOK, LLMatcher.grammar_from_regex(regex), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    data = list(text.encode())
    if matcher.validate_tokens(data) != len(data):
        return False
    matcher.consume_tokens(data)
    return bool(matcher.is_accepting())


@pytest.mark.parametrize(
    ("written", "sent"),
    [
        (r"\d{4}-\d{2}", "[0-9]{4}-[0-9]{2}"),
        (r"\w+\s\W\S\D", r"[0-9A-Za-z_]+[\t\n\x0B\x0C\r ][^0-9A-Za-z_][^\t\n\x0B\x0C\r ][^0-9]"),
        (r"[\d.]+", "[0-9.]+"),
        (r"[^\d\s]", r"[^0-9\t\n\x0B\x0C\r ]"),
        (r"[\D_]", "[[^0-9]_]"),
        (r"\\d", r"\\d"),  # an escaped backslash, then a literal d
        (r"\\\d", r"\\[0-9]"),
        (r"[\]\d]", r"[\]0-9]"),
        (r"[]\d]", "[]0-9]"),  # `]` first in a class is a literal
        (r"[^]\w]", "[^]0-9A-Za-z_]"),
        (r"[[:alpha:]\d]", "[[:alpha:]0-9]"),
        (r"\p{Nd}\x41\u00e9", r"\p{Nd}\x41\u00e9"),
        (r"a\.b\[\d", r"a\.b\[[0-9]"),
        ("abc\\", "abc\\"),  # a trailing backslash is the backend's to refuse
    ],
)
def test_the_translation_of_each_form(written, sent):
    assert ascii_classes(written) == sent
    assert ascii_classes(sent) == sent  # idempotent


def test_a_year_is_ascii_digits_only():
    regex = ascii_classes(r"\d{4}-\d{2}-\d{2}")
    assert _backend_matches(regex, "1988-01-01")
    assert not _backend_matches(regex, "\U0001fbf8" * 4 + "-01-01")  # Unicode Nd
    assert _backend_matches(r"\d{4}", "\U0001fbf8" * 4)  # what llguidance reads unchanged


_PIECES = [
    r"\d", r"\D", r"\w", r"\W", r"\s", r"\S", "[\\d.]", "[^\\d]", "[\\D_]", "[\\w-]",
    "[^\\s\\d]", "[a-c\\s]", "[]a]", "\\.", "\\\\", "a", "-", "_", ".", "[\\W]", "[^\\S]",
]  # fmt: skip
_CHARS = "09aZ_-. \t\n\x0b\x0c\r\\]é\u00a0\u2003\u0663\U0001fbf8ß"


@st.composite
def _regexes(draw: st.DrawFn) -> str:
    parts = draw(st.lists(st.sampled_from(_PIECES), min_size=1, max_size=4))
    quant = draw(st.sampled_from(["", "+", "*", "?", "{1,2}"]))
    body = "".join(parts)
    if draw(st.booleans()):
        other = draw(st.sampled_from(_PIECES))
        body = f"(?:{body}|{other})"
    return body + quant


@settings(max_examples=150, deadline=None)
@given(_regexes(), st.text(alphabet=_CHARS, max_size=4))
@example(r"[\D.]", "\U0001fbf8")
@example(r"\s", "\u00a0")
@example(r"\w", "é")
@example(r"[^\d\s]", "\u0663")
def test_the_backend_reads_a_translated_regex_as_python_reads_it_in_ascii(regex, text):
    expected = re.fullmatch(regex, text, re.ASCII) is not None
    assert _backend_matches(ascii_classes(regex), text) == expected, (regex, text)


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": r"^\w+$"},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {}}}},
        "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
        "open": {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
        "any": {"type": "object"},
    },
    "patternProperties": {r"^x\d$": {"type": "integer"}},
    "$defs": {"Node": {"type": "object", "properties": {"v": {"const": {"properties": 1}}}}},
    "x-guidance": {"whitespace_flexible": True},
}


def test_strict_closes_what_names_properties_or_items_and_keeps_what_says_otherwise():
    out = prepare_schema(PERSON, strict=True)
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["name"]["pattern"] == "^[0-9A-Za-z_]+$"
    assert props["tags"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in props["tags"]  # an array, not an object
    assert props["pair"]["items"] is False
    assert props["open"]["additionalProperties"] is True
    assert "additionalProperties" not in props["any"]  # names nothing: any object
    assert list(out["patternProperties"]) == ["^x[0-9]$"]
    node = out["$defs"]["Node"]
    assert node["additionalProperties"] is False
    assert node["properties"]["v"] == {"const": {"properties": 1}}  # a value, not a schema
    assert out["x-guidance"] == {"whitespace_flexible": True}
    assert PERSON["properties"]["name"]["pattern"] == r"^\w+$"  # the client's is untouched
    assert prepare_schema(out, strict=True) == out


def test_not_strict_only_translates_patterns():
    out = prepare_schema(PERSON, strict=False)
    assert "additionalProperties" not in out and "items" not in out["properties"]["pair"]
    assert out["properties"]["name"]["pattern"] == "^[0-9A-Za-z_]+$"


def test_all_of_branches_stay_open_negations_keep_their_meaning():
    schema = {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}},
            {"type": "object", "properties": {"b": {"type": "integer"}}},
        ],
        "not": {"properties": {"c": {}}},
        "anyOf": [{"properties": {"d": {}}}],
    }
    out = prepare_schema(schema, strict=True)
    assert all("additionalProperties" not in b for b in out["allOf"])
    assert "additionalProperties" not in out["not"]
    assert out["anyOf"][0]["additionalProperties"] is False
    assert prepare_schema(True, strict=True) is True


def test_every_json_schema_of_a_lark_grammar_is_prepared_and_literals_are_not():
    from stallfree.entrypoints.server.chat.tool_parsers import PARSERS

    args = {"type": "object", "properties": {"city": {"type": "string", "pattern": r"\w+"}}}
    grammar = PARSERS["hermes"]().forced_grammar([("weather", args)], many=True)
    prepared = prepare_lark(grammar, strict=True)
    body = json.loads(prepared.split("%json", 1)[1].strip().split("\n")[0])
    assert body["properties"]["arguments"]["additionalProperties"] is False
    assert body["properties"]["arguments"]["properties"]["city"]["pattern"] == "[0-9A-Za-z_]+"
    assert prepare_lark(prepared, strict=True) == prepared
    assert prepare_lark(grammar, strict=False).count("additionalProperties") == 1  # the call's
    kept = (
        'start: "%json {\\"properties\\": {}}" x // %json {"properties": {}}\n'
        'x: /["%json {}]+/ y\ny: %json nonsense\n'
    )
    assert prepare_lark(kept, strict=True) == kept
    assert prepare_lark('root ::= "a" [0-9]', strict=True) == 'root ::= "a" [0-9]'
    reasoning = 'start: think answer\nanswer: %json {"properties": {"a": {}}}'
    assert prepare_lark(reasoning, strict=True).endswith(
        '%json {"properties": {"a": {}}, "additionalProperties": false}'
    )
