"""From request bodies to engine inputs: prompt ids, `SamplingParams`, and the refusals of
what this server does not support.

Everything a client's values can raise on the way (a validation error, an engine check, an
overflow in arithmetic on a huge number) is the client's fault and becomes a 400 (`converting`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from pydantic import ValidationError

from stallfree.entrypoints.server.errors import (
    CONVERSION_ERRORS,
    ApiError,
    from_conversion_error,
    from_validation,
)
from stallfree.entrypoints.server.protocol import ChatCompletionRequest, CompletionRequest
from stallfree.entrypoints.server.state import ServerState
from stallfree.runtime.engine import Engine
from stallfree.runtime.sampling_params import SamplingParams
from stallfree.runtime.tokenizer import ChatTemplateError


@contextlib.contextmanager
def converting(param: str | None = None) -> Iterator[None]:
    """Turn what converting a client's values may raise into a 400."""
    try:
        yield
    except CONVERSION_ERRORS as exc:
        raise from_conversion_error(exc, param) from exc


def check_model(state: ServerState, name: str) -> None:
    # NOTE: only the served name: with --served-model-name set, the model's path stays private
    if name != state.model_name:
        raise ApiError(
            404,
            f"the model {name!r} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )


def reject_unsupported(body: CompletionRequest | ChatCompletionRequest) -> None:
    unsupported = {
        "n": body.n > 1,
        "presence_penalty": body.presence_penalty != 0.0,
        "frequency_penalty": body.frequency_penalty != 0.0,
        "logit_bias": bool(body.logit_bias),
    }
    if isinstance(body, CompletionRequest):
        unsupported |= {
            "echo": body.echo,
            "logprobs": body.logprobs is not None,
            "best_of": (body.best_of or 1) > 1,
            "suffix": body.suffix is not None,
        }
    else:
        unsupported |= {
            "logprobs": body.logprobs,
            "top_logprobs": body.top_logprobs is not None,
            "tools": bool(body.tools),
            "tool_choice": body.tool_choice not in (None, "none"),
            "response_format": (body.response_format or {}).get("type", "text") != "text",
        }
    for field, bad in unsupported.items():
        if bad:
            raise ApiError(400, f"{field} is not supported by this server", param=field)


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest, max_tokens: int
) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    try:
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=-1 if body.top_k is None else body.top_k,
            seed=body.seed,
            stop=stop,
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
        )
    except ValidationError as exc:
        raise from_validation(exc) from exc


def native_sampling_params(fields: dict[str, Any]) -> SamplingParams:
    """`/generate`'s `sampling_params`, validated; errors name `sampling_params.<field>`."""
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


def chat_prompt_ids(engine: Engine, body: ChatCompletionRequest) -> list[int]:
    messages = []
    for i, m in enumerate(body.messages):
        if isinstance(m.content, list):
            if any(p.type != "text" for p in m.content):
                raise ApiError(400, "only text content parts are supported", param=f"messages.{i}")
            content = "".join(p.text or "" for p in m.content)
        else:
            content = m.content or ""
        messages.append({"role": m.role, "content": content})
    try:
        text = engine.tokenizer.apply_chat_template(messages)
    except ChatTemplateError as exc:
        raise ApiError(
            400, f"chat is unavailable: {exc}", param="messages", code="no_chat_template"
        ) from exc
    # NOTE: the template writes its own BOS; adding special tokens would make a second one
    return engine.tokenizer.encode(text, add_special_tokens=False)
