"""The model's thinking split from its answer (`--reasoning-parser`), as vLLM names the parsers.

- `deepseek_r1`: everything up to `</think>` is reasoning, whether or not the reply starts
  with `<think>` (newer R1 templates write it into the prompt); a reply cut off before
  `</think>` is all reasoning.
- `qwen3`: a reply that starts with `<think>` reasons until `</think>`; one that does not
  (thinking disabled, `chat_template_kwargs: {"enable_thinking": false}`) is all content. A
  reply cut off inside its thinking is reasoning, as its stream already said.

`split` reads the whole text so far and returns the reasoning that is sure to stay reasoning
and the answer so far, so a stream can send what each call adds.

A constrained reply (a structured output, or a forced tool call) thinks first: `after_thinking`
wraps its spec in a grammar that lets the model write its thinking freely up to `</think>`
(whitespace after it too) and constrains only the answer, so a reasoning model keeps reasoning.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

START, END = "<think>", "</think>"


def holdback(text: str, marker: str) -> int:
    """How many of `text`'s last characters could begin `marker` (they wait to be sure)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """`deepseek_r1`: reasoning until `</think>`, with or without the opening tag."""

    name: ClassVar[str] = "deepseek_r1"
    needs_start: ClassVar[bool] = False

    def split(self, text: str, final: bool) -> tuple[str, str, bool]:
        """(reasoning, answer, thinking): the reasoning sure so far, the answer so far, and
        whether the text is still inside its thinking."""
        if not final and START.startswith(text):
            return "", "", True  # may be the opening tag
        if text.startswith(START):
            text = text[len(START) :]
        elif self.needs_start:
            return "", text, False
        end = text.find(END)
        if end >= 0:
            return text[:end], text[end + len(END) :], False
        if final:
            return text, "", True
        return text[: len(text) - holdback(text, END)], "", True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    needs_start = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (ReasoningParser, Qwen3ReasoningParser)
}


# the thinking: anything up to and including `</think>` (llguidance's lazy stop), then blanks
_THINK = f'think[stop="{END}"]: /(.|\\n)*/\nBLANK: /[ \\t\\r\\n]*/\n'
_NO_FREE_WHITESPACE = {"whitespace_flexible": False}


def _answer(spec: dict[str, Any]) -> str | None:
    """The Lark rule body for a structured-output spec, or None when it cannot be embedded
    (a GBNF grammar, a schema that is not JSON: left as they are, to fail or pass alone)."""
    if spec.get("json_object"):
        return "%json " + json.dumps({"type": "object", "x-guidance": _NO_FREE_WHITESPACE})
    if spec.get("json") is not None:
        schema = spec["json"]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                return None
        if not isinstance(schema, dict):
            return None
        schema = {"x-guidance": _NO_FREE_WHITESPACE} | schema
        return "%json " + json.dumps(schema, ensure_ascii=False)
    if spec.get("choice"):
        return " | ".join(json.dumps(c, ensure_ascii=False) for c in spec["choice"])
    if spec.get("regex") is not None:
        return "/" + str(spec["regex"]).replace("/", "\\/") + "/"
    grammar = spec.get("grammar")
    if isinstance(grammar, str) and "::=" not in grammar:
        return "%lark {\n" + grammar + "\n}"
    return None


def after_thinking(spec: dict[str, Any], parser: ReasoningParser) -> dict[str, Any]:
    """`spec` (a `structured_outputs` value) as a Lark grammar whose reply thinks freely first
    and is constrained after `</think>`; `spec` itself when it cannot be wrapped."""
    answer = _answer(spec)
    if answer is None:
        return spec
    if parser.needs_start:  # qwen3: thinking is optional, and opens with its tag
        start = f"start: ({json.dumps(START)} think BLANK)? answer\n"
    else:  # deepseek_r1: the reply thinks first, its opening tag perhaps in the prompt
        start = f"start: {json.dumps(START)}? think BLANK answer\n"
    grammar = start + _THINK + "answer: " + answer
    return {"grammar": grammar, "source": spec.get("source", "structured_outputs")}
