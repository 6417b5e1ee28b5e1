"""One chat choice's text, split into reasoning, content and tool calls as it grows.

`ChoiceText.feed` takes each new piece of text and returns what it adds to each part (a
stream's delta); a whole reply is the same text fed once, final, so a streamed choice and a
whole one always agree: the deltas of each part concatenate to the whole reply's part, and a
call's argument deltas to its `arguments`. The reasoning parser (if any) reads the text first;
what follows the thinking goes to the tool parser (if any), and what that leaves is content.

A reply cut short (`max_tokens`, an abort) keeps the calls it completed, and its finish reason
says it was cut. A call the cut ended is left out of a whole reply (its arguments are not JSON,
and a client could take a partial object for the call); a stream has already sent that call's
name and the arguments written so far, and sends nothing more of it. That is the one place a
stream and a whole reply differ. A forced reply (`tool_choice` required or a named function)
has no content: what its grammar wrote is calls, or nothing.
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
    new_memo,
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
    forced: bool = False

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
    done: bool = False
    source: Any = None  # the parsed arguments `arguments` was written from


class ChoiceText:
    def __init__(self, output: ChatOutput) -> None:
        self.output = output
        self.text = ""
        self.reasoning = ""
        self.content = ""
        self.calls: list[_SentCall] = []
        self.memo = new_memo()  # the tool parser's, kept from one piece to the next

    def feed(self, piece: str, final: bool = False, cut: bool = False) -> Piece:
        """What `piece` (the text's next part) adds; `final` with the text's last part, and
        `cut` when the text ended before the model did (its finish reason is not `stop`)."""
        self.text += piece
        if self.output.plain:
            self.content += piece
            return Piece(content=piece)
        out = Piece()
        answer = self.text
        if self.output.reasoning is not None:
            reasoning, answer, _ = self.output.reasoning.split(self.text, final)
            out.reasoning = self._grow("reasoning", reasoning)
        parsed = self._parse(answer, final, cut)
        content = "" if self.output.forced else parsed.content
        if self.output.tools is not None and (not final or parsed.calls):
            # whitespace may be what comes before a call, which the call's content drops
            content = content.rstrip()
        out.content = self._grow("content", content)
        out.calls = self._call_deltas(parsed.calls)
        return out

    def _parse(self, answer: str, final: bool, cut: bool) -> Parsed:
        parser = self.output.tools
        if parser is None:
            return Parsed(answer)
        self.memo.settled = final
        parsed = parser.parse(answer, final, self.memo)
        if not final or any(c.name is not None for c in parsed.calls):
            return parsed
        if cut or self.output.forced:
            # a whole-text parse fails on a call the end cut: read the text as one that goes
            # on, so the calls before it stay calls and the cut one keeps what it has
            grown = parser.parse(answer, False, self.memo)
            if self.output.forced or any(c.name is not None for c in grown.calls):
                return grown
        return parsed

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
            if sent.done or (call.arguments is sent.source and call.done == sent.done):
                continue  # all sent, or parsed from the same text as last time
            sent.done, sent.source = call.done, call.arguments
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
        if self.output.forced:
            out["content"] = None  # calls, or nothing
        calls = self.completed()
        if calls:
            out["content"] = self.content or None
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in calls
            ]
        return out

    def completed(self) -> list[_SentCall]:
        """The calls the text holds whole (a cut reply's last call may not be one)."""
        return [c for c in self.calls if c.done]

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's reason for a reply that called tools (a named call ends as `stop`)."""
        if reason == "stop" and self.completed() and self.output.named is None:
            return "tool_calls"
        return reason
