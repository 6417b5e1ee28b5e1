"""Chat templates: a model's Jinja chat template compiled once and rendered for a conversation."""

from __future__ import annotations

import datetime
import json
from typing import Any


class ChatTemplateError(ValueError):
    """The model has no chat template, or rendering it failed."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


_TEMPLATE_CACHE: dict[str, Any] = {}


def compile_template(source: str) -> Any:
    cached = _TEMPLATE_CACHE.get(source)
    if cached is not None:
        return cached
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise ChatTemplateError(
            "chat templates need jinja2: pip install 'stallfree[server]' (or jinja2)"
        ) from e
    # same environment settings as transformers, so templates render identically
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now  # Llama 3.x templates date their system prompt
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    try:
        template = env.from_string(source)
    except Exception as e:
        raise ChatTemplateError(f"invalid chat template: {e}") from e
    _TEMPLATE_CACHE[source] = template
    return template


def render_chat_template(
    source: str,
    messages: list[dict[str, Any]],
    *,
    bos_token: str,
    eos_token: str,
    extra: dict[str, Any],
) -> str:
    """`source` rendered for `messages` with a generation prompt; `extra` are the template's
    other variables (`tools`, `documents`, a request's `chat_template_kwargs`)."""
    template = compile_template(source)
    try:
        rendered: str = template.render(
            **extra,
            messages=messages,
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=True,
        )
        return rendered
    except ChatTemplateError:
        raise
    except Exception as e:
        raise ChatTemplateError(f"chat template failed to render: {e}") from e
