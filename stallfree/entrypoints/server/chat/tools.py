"""A chat request's tools: what its template gets, and how its reply is read and constrained.

- `tools` (and `documents`, and `chat_template_kwargs` such as `enable_thinking`) reach the
  chat template as transformers' `apply_chat_template` passes them.
- `tool_choice` `auto` (OpenAI's default once tools are sent) lets the model decide, and needs
  `server.enable_auto_tool_choice` with a `server.tool_call_parser`, as in vLLM.
- `required` and a named function are enforced: the reply is constrained (structured outputs)
  to one or more calls of the given tools, each call's arguments to its function's
  `parameters` schema, so a call the model finishes parses and validates (one `max_tokens`
  cut is left out of a whole reply: `chat_output`). With a parser whose format a
  grammar can write (`hermes`, `llama3_json`) the reply is a call in the model's own format;
  otherwise it is vLLM's JSON array (`[{"name": ..., "parameters": {...}}]`).
- `none` passes the tools to the template but parses nothing.

A chat template that does not use `tools` leaves them out of the prompt: the model never reads
them (a forced call still constrains its reply to them). The server says so in its log, once
at start-up (a warning when a tool-call parser is set) and for each request that sends tools
(`template_ignores_tools`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from stallfree.config.settings import ServerConfig
from stallfree.entrypoints.server.base.errors import ApiError
from stallfree.entrypoints.server.base.protocol import ChatCompletionRequest, NamedToolChoice
from stallfree.entrypoints.server.chat.chat_output import ChatOutput
from stallfree.entrypoints.server.chat.reasoning import REASONING_PARSERS, after_thinking
from stallfree.entrypoints.server.chat.tool_parsers import (
    PARSERS,
    JsonArrayParser,
    json_array_schema,
)
from stallfree.entrypoints.server.intake.structured import openai_structured
from stallfree.runtime.request.structured import MAX_GRAMMAR_CHARS
from stallfree.runtime.text.tokenizer import ChatTemplateError, Tokenizer

# what the template's own arguments are called: chat_template_kwargs may not replace them
_TEMPLATE_NAMES = frozenset(
    {"messages", "tools", "documents", "bos_token", "eos_token", "add_generation_prompt"}
)
MAX_TEMPLATE_KWARGS = 64


@dataclass(slots=True)
class ChatPlan:
    """What `plan_chat` decided for one request."""

    template_kwargs: dict[str, Any] = field(default_factory=dict)
    output: ChatOutput = field(default_factory=ChatOutput)
    # the structured-output spec that replaces the body's: the one forcing the calls, or the
    # body's own wrapped to think first (None: the body's as it is)
    forced: dict[str, Any] | None = None
    # the reply's text keeps special tokens (the parser's marker is one)
    keep_special_tokens: bool = False

    def overrides(self) -> dict[str, Any]:
        """The `SamplingParams` fields this plan sets over the body's."""
        out: dict[str, Any] = {}
        if self.forced is not None:
            out["structured_outputs"] = self.forced
        if self.keep_special_tokens:
            out["skip_special_tokens"] = False
        return out


# a tool no template leaves unwritten if it writes tools at all
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe_tool",
        "description": "Probe.",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
    },
}
_PROBE_CHAT = [{"role": "user", "content": "Hi."}]
# (tokenizer, template) -> whether it leaves tools out: each template is rendered twice, once
_IGNORES_TOOLS: dict[tuple[int, str], bool] = {}


def template_ignores_tools(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer's chat template renders a chat the same with tools as without
    (False when it has none, or cannot render the probe chat: nothing is known then)."""
    source = tokenizer.chat_template
    if not source:
        return False
    key = (id(tokenizer), source)
    if key not in _IGNORES_TOOLS:
        try:
            bare = tokenizer.apply_chat_template(_PROBE_CHAT)
            with_tools = tokenizer.apply_chat_template(_PROBE_CHAT, tools=[_PROBE_TOOL])
        except ChatTemplateError:
            return False
        if len(_IGNORES_TOOLS) >= 16:
            _IGNORES_TOOLS.clear()
        _IGNORES_TOOLS[key] = bare == with_tools
    return _IGNORES_TOOLS[key]


def template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    """The chat template's variables besides the messages: tools, documents, and the
    request's `chat_template_kwargs` (which may not replace the request's own)."""
    kwargs = dict(body.chat_template_kwargs or {})
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise ApiError(
            400,
            f"chat_template_kwargs: at most {MAX_TEMPLATE_KWARGS} entries, not {len(kwargs)}",
            param="chat_template_kwargs",
        )
    for key in kwargs:
        if key in _TEMPLATE_NAMES:
            raise ApiError(
                400,
                f"chat_template_kwargs.{key}: set by the request itself, not here",
                param=f"chat_template_kwargs.{key}",
            )
    out: dict[str, Any] = {}
    if body.tools:
        out["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    if body.documents:
        out["documents"] = body.documents
    return out | kwargs


def _choice(body: ChatCompletionRequest) -> str:
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        return "named"
    if choice is None:
        return "auto" if body.tools else "none"
    return choice


def plan_chat(body: ChatCompletionRequest, server: ServerConfig) -> ChatPlan:
    """The template's arguments, the reply's parsers, and the spec forcing calls (if any).
    With a reasoning parser, a constrained reply (forced calls, or the body's structured
    output) thinks freely first: only what follows `</think>` is constrained."""
    plan = ChatPlan(template_kwargs(body))
    _plan_tools(body, server, plan)
    reasoning = None
    if server.reasoning_parser is not None:
        reasoning = plan.output.reasoning = REASONING_PARSERS[server.reasoning_parser]()
    spec = plan.forced if plan.forced is not None else openai_structured(body)
    if reasoning is not None and spec is not None:
        plan.forced = after_thinking(spec, reasoning)
    if plan.forced is not None:  # before anything is rendered: a 400 naming the client's field
        size = len(json.dumps(plan.forced, ensure_ascii=False))
        if size > MAX_GRAMMAR_CHARS:
            source = str(plan.forced.get("source", "structured_outputs"))
            raise ApiError(
                400,
                f"{source}: the constraint it makes is {size} characters, over the "
                f"{MAX_GRAMMAR_CHARS} one structured output may take",
                param=source,
            )
    return plan


def _plan_tools(body: ChatCompletionRequest, server: ServerConfig, plan: ChatPlan) -> None:
    choice = _choice(body)
    tools = body.tools or []
    if choice != "none" and not tools:
        raise ApiError(400, f"tool_choice: {choice!r} needs tools", param="tool_choice")
    configured = PARSERS[server.tool_call_parser]() if server.tool_call_parser else None
    if choice == "none":
        return
    if choice == "auto":
        if not server.enable_auto_tool_choice or configured is None:
            raise ApiError(
                400,
                'tool_choice: "auto" (the default when tools are sent) needs a server started '
                "with --enable-auto-tool-choice and --tool-call-parser; send tool_choice "
                '"required", a named function or "none" instead',
                param="tool_choice",
            )
        plan.output.tools = configured
        plan.keep_special_tokens = configured.keeps_special_tokens
        return
    if _structured(body):
        raise ApiError(
            400,
            "tool_choice: a forced tool call and a structured output (response_format or "
            "structured_outputs) cannot both constrain one reply",
            param="tool_choice",
        )
    functions = [(t.function.name, t.function.parameters or {}) for t in tools]
    if choice == "named":
        assert isinstance(body.tool_choice, NamedToolChoice)
        name = body.tool_choice.function.name
        functions = [f for f in functions if f[0] == name][:1]
        if not functions:
            raise ApiError(
                400,
                f"tool_choice.function.name: no tool named {name[:64]!r} in tools",
                param="tool_choice.function.name",
            )
        plan.output.named = name
    plan.output.forced = True
    many = choice == "required" and body.parallel_tool_calls is not False
    grammar = None if configured is None else configured.forced_grammar(functions, many)
    if grammar is not None:
        assert configured is not None
        plan.output.tools = configured
        plan.forced = {"grammar": grammar, "source": "tools"}
    else:
        plan.output.tools = JsonArrayParser()
        plan.forced = {"json": json_array_schema(functions, many), "source": "tools"}


def _structured(body: ChatCompletionRequest) -> bool:
    fields = ("structured_outputs", "guided_json", "guided_regex", "guided_choice")
    if any(getattr(body, f) is not None for f in (*fields, "guided_grammar")):
        return True
    fmt = body.response_format
    return isinstance(fmt, dict) and fmt.get("type", "text") != "text"
