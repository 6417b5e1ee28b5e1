"""The model's thinking split from its answer (`--reasoning-parser`), as vLLM names the parsers.

- `deepseek_r1`: everything up to `</think>` is reasoning, whether or not the reply starts
  with `<think>` (newer R1 templates write it into the prompt); a reply cut off before
  `</think>` is all reasoning.
- `qwen3`: a reply that starts with `<think>` reasons until `</think>`; one that does not
  (thinking disabled, `chat_template_kwargs: {"enable_thinking": false}`) is all content. A
  reply cut off inside its thinking is reasoning, as its stream already said.

`split` reads the whole text so far and returns the reasoning that is sure to stay reasoning
and the answer so far, so a stream can send what each call adds.
"""

from __future__ import annotations

from typing import ClassVar

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
