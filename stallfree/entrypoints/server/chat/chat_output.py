"""One chat choice's text, split into reasoning, content and tool calls as it grows.

`ChoiceText.feed` takes each new piece of text and returns what it adds to each part (a
stream's delta); a whole reply is the same text fed once, final, so a streamed choice and a
whole one always agree: the deltas of each part concatenate to the whole reply's part, and a
call's argument deltas to its `arguments`. The reasoning parser (if any) reads the text first;
what follows the thinking goes to the tool parser (if any), and what that leaves is content.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from stallfree.entrypoints.server.chat.reasoning import ReasoningParser
from stallfree.entrypoints.server.chat.tool_parsers import (
    CallDraft,
    Parsed,
    ToolParser,
    streamed_arguments,
)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ChatOutput:
    """How a request's choices are read: its parsers, and whether its calls were forced
    (`tool_choice` required or a named function) and by name."""

    reasoning: ReasoningParser | None = None
    tools: ToolParser | None = None
    named: str | None = None

    @property
    def plain(self) -> bool:
        return self.reasoning is None and self.tools is None

    def choice(self) -> ChoiceText:
        return ChoiceText(self)


@dataclass(slots=True)
class Piece:
    """What one `feed` adds: reasoning text, content text, and tool-call deltas (OpenAI's
    `delta.tool_calls` entries)."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


@dataclass(slots=True)
class _SentCall:
    id: str
    name: str
    arguments: str = ""


class ChoiceText:
    def __init__(self, output: ChatOutput) -> None:
        self.output = output
        self.text = ""
        self.reasoning = ""
        self.content = ""
        self.calls: list[_SentCall] = []

    def feed(self, piece: str, final: bool = False) -> Piece:
        """What `piece` (the text's next part) adds; `final` with the text's last part."""
        self.text += piece
        if self.output.plain:
            self.content += piece
            return Piece(content=piece)
        out = Piece()
        answer = self.text
        if self.output.reasoning is not None:
            reasoning, answer, _ = self.output.reasoning.split(self.text, final)
            out.reasoning = self._grow("reasoning", reasoning)
        parser = self.output.tools
        parsed = Parsed(answer) if parser is None else parser.parse(answer, final)
        content = parsed.content
        if parser is not None and (not final or parsed.calls):
            # whitespace may be what comes before a call, which the call's content drops
            content = content.rstrip()
        out.content = self._grow("content", content)
        out.calls = self._call_deltas(parsed.calls)
        return out

    def _grow(self, part: str, now: str) -> str:
        sent: str = getattr(self, part)
        if len(now) <= len(sent) or not now.startswith(sent):
            return ""  # nothing new (or a parse that took back text: never sent twice)
        setattr(self, part, now)
        return now[len(sent) :]

    def _call_deltas(self, calls: list[CallDraft]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(calls):
            if index == len(self.calls):
                if call.name is None:
                    break
                sent = _SentCall(call_id(), self.output.named or call.name)
                self.calls.append(sent)
                deltas.append(
                    {
                        "index": index,
                        "id": sent.id,
                        "type": "function",
                        "function": {"name": sent.name, "arguments": ""},
                    }
                )
            sent = self.calls[index]
            now = streamed_arguments(call)
            if len(now) > len(sent.arguments) and now.startswith(sent.arguments):
                deltas.append(
                    {"index": index, "function": {"arguments": now[len(sent.arguments) :]}}
                )
                sent.arguments = now
        return deltas

    # ---------------------------------------------------------------- a whole reply

    def message(self) -> dict[str, Any]:
        """The choice's `message`, once the whole text has been fed (`final`)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.output.reasoning is not None:
            out["reasoning_content"] = self.reasoning or None
            out["content"] = self.content or None  # a reply that only thought has no answer
        if self.calls:
            out["content"] = self.content or None
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in self.calls
            ]
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's reason for a reply that called tools (a named call ends as `stop`)."""
        if reason == "stop" and self.calls and self.output.named is None:
            return "tool_calls"
        return reason
