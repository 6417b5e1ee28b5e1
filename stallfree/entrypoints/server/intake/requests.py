"""From request bodies to engine inputs: prompt ids and `SamplingParams`.

Everything a client's values can raise on the way (a validation error, an engine check, an
overflow in arithmetic on a huge number) is the client's fault and becomes a 400 (`converting`).

Rendering a chat template (Jinja) and tokenizing are synchronous and take time in proportion to
the request: a 4 MB body of 120k messages renders for about a second. The `_async` forms run
them in a worker thread once a request weighs `OFF_LOOP_WEIGHT` or more (a character of text
weighs 1, a message, content part or tool call 64), so the event loop (and `/health`) keeps
answering meanwhile; lighter requests stay inline, where a thread would only add its hand-off.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request
from pydantic import ValidationError

from stallfree.entrypoints.server.base.errors import (
    CONVERSION_ERRORS,
    ApiError,
    from_conversion_error,
    from_validation,
)
from stallfree.entrypoints.server.base.generation_defaults import GenerationDefaults
from stallfree.entrypoints.server.base.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)
from stallfree.entrypoints.server.base.state import server_state
from stallfree.entrypoints.server.intake.screening import (
    OFF_LOOP_BODY_BYTES,
    BodyModel,
    Screen,
    is_dense,
    screen_elsewhere,
    validate_body,
)
from stallfree.entrypoints.server.intake.structured import native_structured, openai_structured
from stallfree.runtime.engine import Engine
from stallfree.runtime.request.sampling_params import INT64_MAX, SamplingParams
from stallfree.runtime.text.tokenizer import ChatTemplateError

T = TypeVar("T")

# requests at least this heavy render and tokenize off the event loop (module docstring)
OFF_LOOP_WEIGHT = 8192
_ITEM_WEIGHT = 64
# Jinja holds the GIL while it renders: more threads would only contend with the loop for it
_WORKERS = 2
_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _worker_pool() -> ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(_WORKERS, thread_name_prefix="stallfree-prompt")
        return _executor


async def _run(weight: int, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`: inline below `OFF_LOOP_WEIGHT`, else in the worker pool. Either way what it
    raises is raised here."""
    if weight < OFF_LOOP_WEIGHT:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(_worker_pool(), fn, *args)


async def read_body(request: Request, model: type[BodyModel]) -> BodyModel:
    """The request's body as `model`. A large one is parsed and validated off the event loop:
    in the worker pool, or, dense with JSON values, in the screening process, which also
    screens it (`screening`); the routes' own checks then pass it again at no cost."""
    raw = await request.body()
    if len(raw) < OFF_LOOP_BODY_BYTES:
        return validate_body(model, raw)
    if is_dense(raw):
        state = server_state(request)
        # with LoRA the route checks the name: the screening process does not know adapters
        served = None if state.engine.lora is not None else state.model_name
        screen = Screen(served, state.limits)
        return await screen_elsewhere(model, raw, screen, client_key(request))
    return await asyncio.get_running_loop().run_in_executor(
        _worker_pool(), validate_body, model, raw
    )


def client_key(request: Request) -> str:
    """Who sent `request`, for taking turns: the API key it was let in with where the server
    has keys (the guard checked it), else its peer's address (a client could name itself
    anything in a header, and take as many turns as names)."""
    if server_state(request).limits.api_keys:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and token:
            return "key:" + token
    peer = request.client
    return "peer:" + (peer.host if peer is not None else "unknown")


@contextlib.contextmanager
def converting(param: str | None = None) -> Iterator[None]:
    """Turn what converting a client's values may raise into a 400."""
    try:
        yield
    except CONVERSION_ERRORS as exc:
        raise from_conversion_error(exc, param) from exc


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias keys are token ids written as strings ("50256")."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit() and len(key) <= 19):
            shown = repr(key[:32]).encode("ascii", "backslashreplace").decode()
            raise ApiError(
                400, f"logit_bias: keys must be token ids (digits), not {shown}", param="logit_bias"
            )
        out[int(key)] = value
    return out


def _choice_seed(seed: int | None, choice: int) -> int | None:
    # choice i of n samples with seed + i, wrapped into the seed's range
    return None if seed is None else (seed + choice) % (INT64_MAX + 1)


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    defaults: GenerationDefaults | None = None,
    overrides: dict[str, Any] | None = None,
) -> list[SamplingParams]:
    """One `SamplingParams` per choice (`n`): they differ only in the seed. Fields the body
    leaves unset take the model's `defaults` (its generation_config.json), then the built-in
    ones; `overrides` (a chat's tool plan) replace the body's."""
    model = defaults or GenerationDefaults()
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    prompt_logprobs = body.prompt_logprobs
    if isinstance(body, CompletionRequest):
        logprobs = body.logprobs
        if body.echo and logprobs is not None:
            # the echoed prompt's logprobs: the engine computes the larger of the two asks
            prompt_logprobs = max(logprobs, prompt_logprobs or 0)
    else:
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    fields: dict[str, Any] = {
        "max_new_tokens": max_tokens,
        "temperature": model.value("temperature", body.temperature, 1.0),
        "top_p": model.value("top_p", body.top_p, 1.0),
        "min_p": model.value("min_p", body.min_p, 0.0),
        "top_k": model.value("top_k", body.top_k, -1),
        "stop": stop,
        "stop_token_ids": list(body.stop_token_ids or [])
        + ([] if body.ignore_eos else list(model.stop_token_ids)),
        "ignore_eos": body.ignore_eos,
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "allowed_token_ids": body.allowed_token_ids,
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
        "repetition_penalty": model.value("repetition_penalty", body.repetition_penalty, 1.0),
        "min_tokens": body.min_tokens,
        "logit_bias": _logit_bias(body.logit_bias),
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "bad_words": list(body.bad_words or []),
        "skip_special_tokens": body.skip_special_tokens,
        "spaces_between_special_tokens": body.spaces_between_special_tokens,
    }
    fields |= overrides or {}
    if "structured_outputs" not in fields:  # a chat's plan may have put its own
        fields["structured_outputs"] = openai_structured(body)
    try:
        first = SamplingParams(**fields, seed=body.seed)
        return [first] + [
            first.model_copy(update={"seed": _choice_seed(body.seed, i)}) for i in range(1, body.n)
        ]
    except ValidationError as exc:
        raise from_validation(exc) from exc


def truncated(ids: list[int], keep: int | None, max_context_len: int) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens (-1: the context's
    length); None leaves it whole."""
    if keep is None:
        return ids
    if keep == 0:
        raise ApiError(
            400,
            "truncate_prompt_tokens must be -1 (the context's length) or at least 1",
            param="truncate_prompt_tokens",
        )
    limit = max_context_len if keep == -1 else keep
    return ids[-limit:] if len(ids) > limit else ids


def native_sampling_params(fields: dict[str, Any]) -> SamplingParams:
    """`/generate`'s `sampling_params`, validated; errors name `sampling_params.<field>`.
    SGLang's `no_stop_trim` is `include_stop_str_in_output`."""
    fields = native_structured(fields)
    if "no_stop_trim" in fields:
        fields = dict(fields)
        fields.setdefault("include_stop_str_in_output", fields.pop("no_stop_trim"))
    try:
        return SamplingParams(**fields)
    except ValidationError as exc:
        err = from_validation(exc)
        err.info.param = f"sampling_params.{err.info.param}"
        err.info.message = f"sampling_params.{err.info.message}"
        raise err from exc


def prompt_ids(
    engine: Engine, prompt: str | list[str] | list[int] | list[list[int]], max_prompts: int
) -> list[list[int]]:
    if isinstance(prompt, str):
        return [engine.tokenizer.encode(prompt)]
    if not prompt:
        raise ApiError(400, "prompt is empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [[int(p) for p in prompt]]  # type: ignore[arg-type]
    if len(prompt) > max_prompts:
        raise ApiError(
            400,
            f"prompt: a request may batch at most {max_prompts} prompts, and this one has "
            f"{len(prompt)}",
            param="prompt",
            code="too_many_prompts",
        )
    return [
        engine.tokenizer.encode(p) if isinstance(p, str) else list(p)  # type: ignore[arg-type]
        for p in prompt
    ]


async def prompt_ids_async(
    engine: Engine, prompt: str | list[str] | list[int] | list[list[int]], max_prompts: int
) -> list[list[int]]:
    """`prompt_ids`, tokenizing off the event loop when the text is long."""
    if isinstance(prompt, str):
        weight = len(prompt)
    else:
        weight = sum(len(p) for p in prompt if isinstance(p, str))
    return await _run(weight, prompt_ids, engine, prompt, max_prompts)


async def encode_async(engine: Engine, text: str, add_special_tokens: bool = True) -> list[int]:
    """`engine.tokenizer.encode(text)`, off the event loop when the text is long."""
    encode = engine.tokenizer.encode
    if add_special_tokens:
        return await _run(len(text), encode, text)
    return await _run(len(text), lambda t: encode(t, add_special_tokens=False), text)


def _template_message(message: ChatMessage, index: int) -> dict[str, Any]:
    """One message as a chat template reads it (the fields transformers passes)."""
    if isinstance(message.content, list):
        if any(p.type != "text" for p in message.content):
            raise ApiError(400, "only text content parts are supported", param=f"messages.{index}")
        content = "".join(p.text or "" for p in message.content)
    else:
        content = message.content or ""
    out: dict[str, Any] = {"role": message.role, "content": content}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type,
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments(call.function.arguments),
                },
            }
            for call in message.tool_calls
        ]
    return out


def _arguments(arguments: str | dict[str, Any]) -> Any:
    """A tool call's arguments as templates expect them: the object its JSON text holds (as
    vLLM passes them), or the text itself when it holds no object."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def chat_prompt_ids(
    engine: Engine,
    body: ChatCompletionRequest,
    add_special_tokens: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The chat's prompt: its messages, and `template_kwargs` (tools, documents, the request's
    chat_template_kwargs: `tools.plan_chat`), rendered by the chat template and tokenized.
    With `continue_final_message` the prompt ends inside the final message, where its text
    ends (assistant prefill); with `add_generation_prompt: false` alone it ends where the
    template leaves the chat, no assistant turn opened."""
    messages = [_template_message(m, i) for i, m in enumerate(body.messages)]
    if body.continue_final_message:
        last = messages[-1]
        if not last["content"]:
            raise ApiError(
                400,
                "continue_final_message: the final message has no text to continue",
                param="continue_final_message",
            )
        last["content"] += _CONTINUE_HERE
    # vLLM's default: open the assistant's turn unless the final message is continued
    opens_turn = body.add_generation_prompt
    if opens_turn is None:
        opens_turn = not body.continue_final_message
    try:
        text = engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=opens_turn, **(template_kwargs or {})
        )
    except ChatTemplateError as exc:
        raise ApiError(
            400, f"chat is unavailable: {exc}", param="messages", code="no_chat_template"
        ) from exc
    if body.continue_final_message:
        # NOTE: the template renders the whole chat; what follows the final message's text (its
        # end of turn) is cut off
        at = text.rfind(_CONTINUE_HERE)
        if at < 0:
            raise ApiError(
                400,
                "continue_final_message: this model's chat template does not write the final "
                "message's text as it is, so the prompt cannot end inside it",
                param="continue_final_message",
            )
        text = text[:at]
    # the template writes its own BOS; adding special tokens would make a second one (only
    # `/tokenize` asks for them, as vLLM lets it)
    return engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)


# appended to the final message's text before the chat is rendered, to find where that text ends
# (private-use characters: a tokenizer never sees them, the text is cut there first)
_CONTINUE_HERE = "\ue000stallfree:continue\ue001"


def _chat_weight(body: ChatCompletionRequest) -> int:
    """The request's weight, counted until it reaches `OFF_LOOP_WEIGHT`."""
    weight = 0
    for tool in body.tools or ():  # each tool's schema is rendered into the prompt
        weight += _ITEM_WEIGHT + len(json.dumps(tool.function.parameters or {}))
        if weight >= OFF_LOOP_WEIGHT:
            return weight
    weight += _ITEM_WEIGHT * len(body.documents or ())
    for message in body.messages:
        content = message.content
        weight += _ITEM_WEIGHT
        if isinstance(content, list):
            weight += sum(_ITEM_WEIGHT + len(p.text or "") for p in content)
        elif content:
            weight += len(content)
        for call in message.tool_calls or ():
            arguments = call.function.arguments
            weight += _ITEM_WEIGHT + (len(arguments) if isinstance(arguments, str) else 256)
        if weight >= OFF_LOOP_WEIGHT:
            break
    return weight


async def chat_prompt_ids_async(
    engine: Engine,
    body: ChatCompletionRequest,
    add_special_tokens: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """`chat_prompt_ids`, rendering and tokenizing off the event loop for a heavy request."""
    return await _run(
        _chat_weight(body), chat_prompt_ids, engine, body, add_special_tokens, template_kwargs
    )
