"""Request bodies of the HTTP API (the OpenAI-compatible routes and `/generate`) and the error
body; the response bodies are in `responses`."""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

logger = logging.getLogger("stallfree.server")

# the most choices one request may ask for (`n`); a batch of prompts times `n` is also
# bounded by `server.max_prompts_per_request`
MAX_N = 16
MAX_TOP_LOGPROBS = 20
# the most tools and documents one chat request may pass to the template
MAX_TOOLS = 128
MAX_DOCUMENTS = 256
# the most ignored field names one debug line lists
_MAX_LOGGED_FIELDS = 20
# the most entries a list-form bootstrap field may hold (one per prompt)
MAX_BOOTSTRAP_ENTRIES = 4096

_Host = Annotated[str, Field(min_length=1, max_length=253)]
_Port = Annotated[int, Field(ge=1, le=65535)]
_Room = Annotated[int, Field(ge=0, le=2**63 - 1)]
_T = TypeVar("_T")
_Each = Annotated[list[_T], Field(min_length=1, max_length=MAX_BOOTSTRAP_ENTRIES)]

# ---------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---------------------------------------------------------------- shared request fields


class _Request(BaseModel):
    """A part of an OpenAI request. Fields this server does not know are ignored (a debug line
    names them), as vLLM does: clients send many that do not change the output (`store`,
    `metadata`, `service_tier`, ...). The fields that would change it and are not supported
    are declared, and refused with a 400 naming them (`screening.reject_unsupported`)."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _log_ignored(cls, data: Any) -> Any:
        if isinstance(data, dict) and logger.isEnabledFor(logging.DEBUG):
            ignored = [k for k in data if k not in cls.model_fields]
            if ignored:
                names = ", ".join(
                    repr(str(k)[:64]).encode("ascii", "backslashreplace").decode()
                    for k in ignored[:_MAX_LOGGED_FIELDS]
                )
                more = len(ignored) - _MAX_LOGGED_FIELDS
                logger.debug(
                    "The following fields were present in the request but ignored (%s): {%s%s}",
                    cls.__name__,
                    names,
                    f", ... {more} more" if more > 0 else "",
                )
        return data


class _StrictRequest(BaseModel):
    # the native route's fields are all known: an unknown one is a 400 naming it
    model_config = ConfigDict(extra="forbid")


def lone_surrogate_at(value: Any) -> str | None:
    """The dotted path of the first string (or key) in `value` that holds a lone surrogate.

    JSON can carry one (`"\\ud800"`), but it is not Unicode text: it has no UTF-8 encoding, so
    the tokenizer, the stop-string matcher and the response encoder would all fail on it.
    """
    stack: list[tuple[Any, tuple[Any, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and not _is_unicode(item):
                return ".".join(map(str, path)) or "body"
        elif isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str) and not key.isascii() and not _is_unicode(key):
                    return ".".join(map(str, (*path, key)))
                if not isinstance(child, (int, float, bool)) and child is not None:
                    stack.append((child, (*path, key)))
        elif isinstance(item, list):
            stack.extend(
                (child, (*path, i))
                for i, child in enumerate(item)
                if isinstance(child, (str, list, dict))
            )
    return None


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _all_unicode(data: Any) -> bool:
    """Whether every string and key in a JSON value is Unicode text, at C speed: the JSON
    encoder writes them all, and UTF-8 refuses a lone surrogate. (A walk in Python took 0.7 s
    of the event loop for a 4 MB body; this takes a few ms.)"""
    try:
        json.dumps(data, ensure_ascii=False, check_circular=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    except (TypeError, ValueError):
        return False  # not plain JSON data: let the walk look at it
    return True


def _check_unicode(data: Any) -> Any:
    if _all_unicode(data):
        return data
    field = lone_surrogate_at(data)
    if field is not None:
        # a key may hold the surrogate itself; the name is given escaped (\\ud800)
        escaped = field.encode("utf-8", "backslashreplace").decode()
        raise PydanticCustomError(
            "invalid_unicode",
            "not valid Unicode text: it holds a lone surrogate code point (such as \\ud800)",
            {"field": escaped},
        )
    return data


class _Body(_Request):
    """A whole request body: before its fields are read, it is checked for text that is not
    Unicode (the error names the field), ignored fields included."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        return _check_unicode(data)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Body):
    """Fields both OpenAI routes share, plus the extras other engines accept (`extra_body`).

    Fields typed `Any` are ones this server does not support: they are read only to refuse a
    value that would change the output (`screening.reject_unsupported`).
    """

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extras (vLLM's names)
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    repetition_penalty: float | None = Field(None, allow_inf_nan=False)
    min_tokens: int = Field(0, ge=0)
    min_p: float | None = Field(None, allow_inf_nan=False)  # vLLM's; SamplingParams checks it
    include_stop_str_in_output: bool = False  # vLLM's
    allowed_token_ids: list[int] | None = None  # vLLM's; checked against the vocabulary
    # vLLM's: keep only the prompt's last k tokens (-1: as many as the context holds)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=2**31)
    # disaggregation (SGLang's names; the router sets them): the prefill's bootstrap endpoint
    # and the room id of choice 0 (choice i is room + i); or, as sglang-router sends them for
    # a list of prompts, one entry per prompt (prompt p's choice c is room[p] + c)
    bootstrap_host: _Host | _Each[_Host] | None = None
    bootstrap_port: _Port | _Each[_Port] | None = None
    bootstrap_room: _Room | _Each[_Room] | None = None
    # structured outputs, in OpenAI's and vLLM's spellings (server/intake/structured.py maps them)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: words never generated (SamplingParams bounds them), special tokens in the text,
    # and each prompt token's logprobs (not with stream)
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # extras that would change the output and are not supported
    use_beam_search: Any = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(None, ge=1)
    suffix: Any = None


class ContentPart(_Request):
    type: str
    text: str | None = None


class FunctionCall(_Request):
    name: str
    # OpenAI sends a JSON string; a template gets the object it holds (as vLLM does)
    arguments: str | dict[str, Any] = ""


class ToolCall(_Request):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # history of an earlier tool-calling turn: passed to the chat template as sent
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(_Request):
    # OpenAI's rule for a function's name (dots too, as tool libraries write namespaces)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # passed to the chat template as transformers' apply_chat_template passes them
    documents: list[dict[str, Any]] | None = Field(None, max_length=MAX_DOCUMENTS)
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's assistant prefill: the final message is continued, not answered
    # (`continue_final_message: true`, with `add_generation_prompt` false or unset); and
    # `add_generation_prompt: false` alone: the chat rendered without the assistant's header
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    # not supported beyond their defaults
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    chat_template: Any = None


class GenerateRequest(_StrictRequest):
    """`POST /generate`: `text` or `input_ids`, and `SamplingParams` fields."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    rid: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        return _check_unicode(data)
