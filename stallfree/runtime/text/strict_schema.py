"""A client's JSON schema as vLLM's and SGLang's default backend reads it.

Three rules, applied to a copy of the schema before llguidance compiles it:

- **Strict** (on unless `runtime.structured_outputs_strict` is off): an object schema that
  names properties (`properties` or `patternProperties`) and says nothing of the others
  (`additionalProperties`, `unevaluatedProperties`) allows no others, and a tuple
  (`prefixItems` without `items`) allows no items past the ones it names. A model that may add
  keys (pydantic and LangChain schemas do not say `additionalProperties: false`) adds them
  until `max_tokens`. A schema that says `additionalProperties: true` or gives `items` keeps
  what it says. The branches of an `allOf` are left open: each closed on its own names would
  make their intersection refuse every key another branch names.
- **Integer bounds** beyond ±2^53, always: refused where no integer within them satisfies the
  schema, else taken as ±2^53 (`text/integer_bounds.py`).
- **ASCII classes**, always: every `pattern` and `patternProperties` key reads `\\d`, `\\w`,
  `\\s` as ASCII (`text/ascii_regex.py`).

`prepare_lark` applies both to every `%json` schema of a Lark grammar (forced tool calls, a
reasoning model's constrained answer). Only keywords that hold schemas are walked, so
`const`, `enum`, `default` and `examples` values are never touched, nor is llguidance's own
`x-guidance` object.
"""

from __future__ import annotations

import json
from typing import Any

from stallfree.runtime.text.ascii_regex import ascii_classes
from stallfree.runtime.text.integer_bounds import exact_integer_bounds

# keywords whose value is one schema, a list of schemas, or a name -> schema map
_ONE = (
    "additionalProperties",
    "unevaluatedProperties",
    "items",
    "additionalItems",
    "unevaluatedItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
)
_MANY = ("anyOf", "oneOf", "prefixItems")
_NAMED = ("properties", "$defs", "definitions", "dependentSchemas")


def prepare_schema(schema: Any, strict: bool) -> Any:
    """A copy of `schema` with the module's rules applied (a non-schema value as it is)."""
    return _walk(schema, strict, closable=True)


def _walk(schema: Any, strict: bool, closable: bool) -> Any:
    if isinstance(schema, list):  # draft-4 tuple `items`
        return [_walk(s, strict, True) for s in schema]
    if not isinstance(schema, dict):
        return schema  # `true`, `false`, or not a schema
    out = exact_integer_bounds(dict(schema))
    if isinstance(out.get("pattern"), str):
        out["pattern"] = ascii_classes(out["pattern"])
    for key in _ONE:
        if key in out:  # a negation or a condition keeps its own meaning: never closed
            out[key] = _walk(out[key], strict, key not in ("not", "if"))
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [_walk(s, strict, True) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_walk(s, strict, False) for s in out["allOf"]]
    for key in _NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: _walk(s, strict, True) for name, s in out[key].items()}
    patterns = out.get("patternProperties")
    if isinstance(patterns, dict):
        out["patternProperties"] = {
            ascii_classes(p): _walk(s, strict, True) for p, s in patterns.items()
        }
    if strict and closable:
        _close(out)
    return out


def _close(schema: dict[str, Any]) -> None:
    names = "properties" in schema or "patternProperties" in schema
    if names and "additionalProperties" not in schema and "unevaluatedProperties" not in schema:
        schema["additionalProperties"] = False
    if isinstance(schema.get("prefixItems"), list) and "items" not in schema:
        schema["items"] = False


_DECODER = json.JSONDecoder()


def prepare_lark(grammar: str, strict: bool) -> str:
    """`grammar` (llguidance's Lark) with the module's rules applied to each `%json { ... }`
    schema in it: the forced tool calls and a reasoning model's constrained answer are such
    grammars. String and regex literals and comments are copied as written, so `%json` inside
    one is left alone; a GBNF grammar has no `%json` and comes back unchanged."""
    out: list[str] = []
    i, n = 0, len(grammar)
    while i < n:
        ch = grammar[i]
        if ch in "\"'" or (ch == "/" and not grammar.startswith("//", i)):
            end = _literal_end(grammar, i)
            out.append(grammar[i:end])
            i = end
        elif grammar.startswith("//", i):
            end = grammar.find("\n", i)
            end = n if end == -1 else end
            out.append(grammar[i:end])
            i = end
        elif grammar.startswith("%json", i):
            start = i + len("%json")
            while start < n and grammar[start] in " \t\r\n":
                start += 1
            try:
                schema, end = _DECODER.raw_decode(grammar, start)
            except ValueError:
                schema, end = None, start  # not a schema: the backend reports it
            out.append(grammar[i:start])
            if isinstance(schema, dict):
                out.append(json.dumps(prepare_schema(schema, strict), ensure_ascii=False))
            else:
                out.append(grammar[start:end])
            i = end
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _literal_end(text: str, start: int) -> int:
    """The index after the string or regex literal opened at `start` (its closing quote or
    slash, unescaped; the end of the line if it has none)."""
    close = text[start]
    i = start + 1
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == close:
            return i + 1
        if ch == "\n":
            return i
        i += 1
    return len(text)
