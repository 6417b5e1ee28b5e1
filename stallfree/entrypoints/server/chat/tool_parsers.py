"""Tool calls out of a model's text, in the formats models are trained to write them.

Each parser reads the whole text generated so far and returns what of it is plain content
and the calls it holds (`Parsed`); called again as the text grows (streaming) it returns more
of each. A call's name appears once it is whole; its arguments are the object parsed so far
(`partial_json_parser`, with only containers left open: a string, number or literal that may
still grow is left out), so `streamed_arguments` can send a prefix that never changes.

- `hermes` (Hermes 2/3, Qwen2.5/3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call, after any content;
- `llama3_json` (Llama 3.1/3.2): the whole reply is `{"name": ..., "parameters": {...}}`, calls
  separated by `;`;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after any content, or the
  v11 form `[TOOL_CALLS]name[ARGS]{...}` per call (the markers are special tokens: such a
  request keeps special tokens in its text);
- `pythonic` (Llama 3.2/4 pythonic, ToolACE): `[get_weather(city="Paris"), ...]`, whose call
  appears once the list is whole;
- `json_array`: vLLM's form for a forced call (`tool_choice` required or named) with a parser
  whose own format cannot be written as a grammar: `[{"name": ..., "parameters": {...}}]`.

A reply whose calls do not parse at the end is all content, as vLLM gives it. So is one nested
deeper than `MAX_DEPTH` arrays and objects: such a text is never handed to a (recursive) parser.
"""

from __future__ import annotations

import ast
import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from partial_json_parser import Allow
from partial_json_parser import loads as partial_loads

from stallfree.entrypoints.server.chat.parse_memo import ParseMemo
from stallfree.entrypoints.server.chat.reasoning import holdback

_OPEN_CONTAINERS = Allow.ARR | Allow.OBJ
# the deepest nesting of JSON arrays and objects (or Python lists, dicts, calls) a call may have
MAX_DEPTH = 64
# a bracket, or a JSON string (closed or not) whose brackets do not count
_BRACKETS = re.compile(r'"(?:[^"\\]|\\.)*"?|[\[\]{}()]', re.DOTALL)


@dataclass(slots=True)
class CallDraft:
    """One call as far as it is known: `name` once whole, `arguments` as parsed so far."""

    name: str | None
    arguments: Any = None
    done: bool = False


@dataclass(slots=True)
class Parsed:
    """What a text holds: its plain content (the part of it that is sure to stay content) and
    its calls."""

    content: str
    calls: list[CallDraft] = field(default_factory=list)


def arguments_text(arguments: Any) -> str:
    """A call's `arguments` as the OpenAI API carries them: JSON text."""
    return json.dumps({} if arguments is None else arguments, ensure_ascii=False)


def streamed_arguments(call: CallDraft) -> str:
    """The part of the call's arguments text that is final: all of it once the call is done;
    before, the JSON of the object so far without its closing brackets and quotes (what is
    left out is still to come, so each such prefix extends the last)."""
    if call.arguments is None:
        return ""
    text = arguments_text(call.arguments)
    return text if call.done else text.rstrip('"]} ')


def too_deep(text: str, limit: int = MAX_DEPTH) -> bool:
    """Whether `text` opens more than `limit` brackets at once (those in strings aside); a
    loop, not a recursion, so any depth is safe to ask about."""
    if text.count("[") + text.count("{") + text.count("(") <= limit:
        return False
    depth = 0
    for match in _BRACKETS.finditer(text):
        char = match.group()
        if char in "[{(":
            depth += 1
            if depth > limit:
                return True
        elif char in "]})":
            depth = max(depth - 1, 0)
    return False


def _loads(text: str) -> Any:
    """`json.loads`, with a text nested too deep a ValueError like any other that is not JSON."""
    if too_deep(text):
        raise ValueError("nested too deep")
    return json.loads(text)


def _partial_loads(text: str) -> Any:
    try:
        return partial_loads(text, _OPEN_CONTAINERS)
    except Exception:  # partial_json_parser raises its own errors, and ValueError
        return None


def _partial(memo: ParseMemo, key: Any, text: str) -> Any:
    return memo.partial(key, text, _partial_loads)


def new_memo() -> ParseMemo:
    """A memo for one choice's parses (a stream's), bounded by `MAX_DEPTH`."""
    return ParseMemo(MAX_DEPTH)


def _call_of(obj: Any, keys: tuple[str, ...], done: bool) -> CallDraft | None:
    """A call from a (partial) `{"name": ..., <keys[0]>: {...}}` object; None when it is not one."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if name is not None and not isinstance(name, str):
        return None
    arguments = next((obj[k] for k in keys if k in obj), None)
    if done and (name is None or not isinstance(arguments, dict | None)):
        return None
    if isinstance(arguments, str) and done:  # some models write the arguments as JSON text
        try:
            arguments = _loads(arguments)
        except ValueError:
            return None
    return CallDraft(name, arguments if isinstance(arguments, dict) else None, done)


class ToolParser(ABC):
    """Reads calls out of a text (`parse`); `format_call` writes one the way the model would,
    with its arguments left to a grammar (None: the format cannot be written as a grammar)."""

    name: ClassVar[str]
    # the request keeps special tokens in its text (its marker is one)
    keeps_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def parse(self, text: str, final: bool, memo: ParseMemo | None = None) -> Parsed:
        """The content and calls of `text`; `final` once the text is whole. A stream passes
        the same `memo` with each longer text, so each parse reads little more than what is
        new; without one, the text is read as a whole."""

    def forced_grammar(self, calls: list[tuple[str, dict[str, Any]]], many: bool) -> str | None:
        """A Lark grammar (llguidance's) whose every text is one call (`many`: one or more) of
        one of `calls` (name, parameters schema), written in this format; None if none."""
        return None


def _call_rule(name: str, schema: dict[str, Any], args_key: str) -> str:
    """A Lark `%json` rule for `{"name": <name>, <args_key>: <schema>}`, written compactly."""
    whole = {
        "type": "object",
        "properties": {"name": {"const": name}, args_key: schema or {"type": "object"}},
        "required": ["name", args_key],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "},
    }
    return "%json " + json.dumps(whole, ensure_ascii=False)


def _lark(calls: list[tuple[str, dict[str, Any]]], args_key: str, before: str, after: str) -> str:
    rules = [f"call_{i}: {_call_rule(n, s, args_key)}" for i, (n, s) in enumerate(calls)]
    alternatives = " | ".join(f"call_{i}" for i in range(len(calls)))
    parts = [
        json.dumps(before) if before else "",
        f"({alternatives})",
        json.dumps(after) if after else "",
    ]
    lines = ["one: " + " ".join(p for p in parts if p), *rules]
    return "\n".join(lines)


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)

    def parse(self, text: str, final: bool, memo: ParseMemo | None = None) -> Parsed:
        memo = memo or new_memo()
        start = text.find(self.START)
        if start < 0:
            if final:
                return Parsed(text)
            return Parsed(text[: len(text) - holdback(text, self.START)])
        calls: list[CallDraft] = []
        for match in self._BLOCK.finditer(text, start):
            body, closed = match.group(1), bool(match.group(2))
            if not closed:
                body = body[: len(body) - holdback(body, self.END)]  # a closing tag to come
            key = ("hermes", match.start(1) + len(body) - len(body.lstrip()))
            body = body.strip()
            if closed or final:
                try:
                    call = _call_of(memo.loads(key, body), ("arguments", "parameters"), True)
                except ValueError:
                    call = None
                if call is None:
                    if final:
                        return Parsed(text)  # not calls after all
                    break
            else:
                call = _call_of(_partial(memo, key, body), ("arguments", "parameters"), False)
                if call is None:
                    break
            calls.append(call)
        return Parsed(text[:start].rstrip(), calls)

    def forced_grammar(self, calls: list[tuple[str, dict[str, Any]]], many: bool) -> str | None:
        grammar = _lark(calls, "arguments", self.START + "\n", "\n" + self.END)
        return ('start: one ("\\n" one)*\n' if many else "start: one\n") + grammar


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool, memo: ParseMemo | None = None) -> Parsed:
        memo = memo or new_memo()
        body = text.lstrip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].lstrip()
        if not body:
            return Parsed(text if final else "")
        if not body.startswith("{"):
            return Parsed(text)
        calls: list[CallDraft] = []
        at = 0
        while at < len(body):
            try:
                obj, end = self._decode(memo, body, at)
            except ValueError:
                if final:
                    return Parsed(text)
                part = _partial(memo, ("llama3", at), body[at:])
                call = _call_of(part, ("parameters", "arguments"), False)
                if call is not None:
                    calls.append(call)
                break
            call = _call_of(obj, ("parameters", "arguments"), True)
            if call is None:
                return Parsed(text) if final else Parsed("", calls)
            calls.append(call)
            at = end
            while at < len(body) and body[at] in " \t\r\n;":
                at += 1
        return Parsed("", calls)

    @staticmethod
    def _decode(memo: ParseMemo, body: str, at: int) -> tuple[Any, int]:
        """The JSON value at `at` of `body` and where it ends; ValueError if there is none
        (yet): a value's brackets are scanned first, and only once they close is it parsed."""
        key = ("llama3", at)
        rest = body[at:]
        scan = memo.scan(key, rest)
        if scan.first_close < 0 or scan.deepest > memo.limit:
            raise ValueError("no whole value")
        head = rest[: scan.first_close]
        return memo.loads(("llama3-whole", at), head), at + len(head)

    def forced_grammar(self, calls: list[tuple[str, dict[str, Any]]], many: bool) -> str | None:
        grammar = _lark(calls, "parameters", "", "")
        return ('start: one ("; " one)*\n' if many else "start: one\n") + grammar


class _ArrayParser(ToolParser):
    """A JSON array of call objects after `marker` (none: the whole reply)."""

    marker: ClassVar[str] = ""
    keys: ClassVar[tuple[str, ...]] = ("arguments", "parameters")

    def parse(self, text: str, final: bool, memo: ParseMemo | None = None) -> Parsed:
        memo = memo or new_memo()
        if self.marker:
            start = text.find(self.marker)
            if start < 0:
                return Parsed(text if final else text[: len(text) - holdback(text, self.marker)])
            after = text[start + len(self.marker) :]
            content, body = text[:start].rstrip(), after.strip()
            key: Any = ("array", start + len(after) - len(after.lstrip()))
        else:
            content, body = "", text.strip()
            key = ("array", len(text) - len(text.lstrip()))
            if not body.startswith("["):
                return Parsed(text if final or body else "")
        try:
            items, complete = memo.loads(key, body), True
        except ValueError:
            if final:
                return Parsed(text)
            items, complete = _partial(memo, key, body), False
        if isinstance(items, dict):
            items = [items]
        if not isinstance(items, list):
            return Parsed(text) if final else Parsed(content)
        calls: list[CallDraft] = []
        for i, item in enumerate(items):
            done = complete or i < len(items) - 1
            call = _call_of(item, self.keys, done)
            if call is None:
                if final:
                    return Parsed(text)
                break
            calls.append(call)
        return Parsed(content, calls)


class MistralParser(_ArrayParser):
    """Both of Mistral's forms: `[TOOL_CALLS][{...}, ...]` (tokenizers before v11) and
    `[TOOL_CALLS]name[ARGS]{...}`, one marker per call (v11 on: Mistral Small 3.2, Magistral)."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    keeps_special_tokens = True

    def parse(self, text: str, final: bool, memo: ParseMemo | None = None) -> Parsed:
        memo = memo or new_memo()
        start = text.find(self.marker)
        if start < 0 or text[start + len(self.marker) :].lstrip().startswith("["):
            return super().parse(text, final, memo)
        parts = text[start + len(self.marker) :].split(self.marker)
        calls: list[CallDraft] = []
        offset = start + len(self.marker)
        for i, part in enumerate(parts):
            name, sep, args = part.partition(self.ARGS)
            key = ("v11", offset + len(name) + len(sep))
            offset += len(part) + len(self.marker)
            if not sep:  # the name may still grow, or the [ARGS] marker be on its way
                if final:
                    return Parsed(text)
                break
            try:
                arguments, done = memo.loads(key, args), True
            except ValueError:
                if final or i < len(parts) - 1:
                    return Parsed(text)
                arguments, done = _partial(memo, (*key, "partial"), args.strip()), False
            if not isinstance(arguments, dict | None):
                return Parsed(text) if final else Parsed(text[:start].rstrip(), calls)
            calls.append(CallDraft(name.strip(), arguments, done))
        return Parsed(text[:start].rstrip(), calls)


class JsonArrayParser(_ArrayParser):
    name = "json_array"
    keys = ("parameters", "arguments")


class PythonicParser(ToolParser):
    name = "pythonic"

    def parse(self, text: str, final: bool, memo: ParseMemo | None = None) -> Parsed:
        body = text.strip()
        if not body.startswith("["):
            return Parsed(text if final or body else "")
        if too_deep(body):
            return Parsed(text) if final else Parsed("")
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return Parsed(text) if final else Parsed("")  # a list that may still close
        calls = self._calls(tree)
        if calls is None:
            return Parsed(text) if final else Parsed("")
        return Parsed("", calls)

    @staticmethod
    def _calls(tree: ast.expr) -> list[CallDraft] | None:
        if not isinstance(tree, ast.List):
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or node.args:
                return None
            name = ast.unparse(node.func)
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
                json.dumps(args)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
            calls.append(CallDraft(name, args, True))
        return calls


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p
    for p in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser, JsonArrayParser)
}


def json_array_schema(calls: list[tuple[str, dict[str, Any]]], many: bool) -> dict[str, Any]:
    """The JSON schema of `JsonArrayParser`'s forced form: one call (`many`: one or more)."""
    items = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": schema or {"type": "object"}},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, schema in calls
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not many:
        schema["maxItems"] = 1
    return schema
