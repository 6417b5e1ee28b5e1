"""Chat templates, rendered as transformers renders them.

A model's chat template is Jinja run in a sandbox with a few additions of transformers' own,
and the same environment is built here: `trim_blocks` and `lstrip_blocks`, the `loopcontrols`
extension, the `{% generation %}` block tag (marks the assistant's text for training masks;
renders its body), `tojson` with `ensure_ascii`, `indent`, `separators` and `sort_keys`,
`raise_exception`, `strftime_now`, and the restricted `dict` and `namespace`. What the template
sees is prepared as transformers prepares it: keys whose value is None dropped from each
message, a message's reasoning under each name templates read (`reasoning_content`,
`thinking`), everything rebuilt from plain JSON types.

transformers' own renderer (`render_jinja_template`, which compiles with
`_compile_jinja_template`) is the tests' reference (`use_transformers=True`), not the serving
path: importing transformers took 0.87 s of a server's start-up, where the model's template is
checked, on a 2-core Zen 4. `tests/data/chat_templates/` holds real templates of popular model
families; a test renders each through both and compares.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Callable, Mapping
from typing import Any

# names the renderer sets itself; a caller's extra variables may not replace them
RESERVED = ("messages", "tools", "documents", "add_generation_prompt")
# the names a message's reasoning goes by; templates read the first
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The model has no chat template, or it failed to compile or to render."""


def render_chat_template(
    source: str,
    messages: list[dict[str, Any]],
    *,
    bos_token: str,
    eos_token: str,
    extra: dict[str, Any],
    add_generation_prompt: bool = True,
    use_transformers: bool = False,
) -> str:
    """`source` rendered for `messages`, ending by opening the assistant's turn unless
    `add_generation_prompt` is false; `extra` are the template's other variables (`tools`,
    `documents`, a request's `chat_template_kwargs`).

    `use_transformers`: transformers' renderer instead of this module's environment (the tests'
    reference; a ChatTemplateError where transformers is not installed)."""
    clash = [name for name in ("messages", "add_generation_prompt") if name in extra]
    if clash:
        raise ChatTemplateError(f"chat template arguments may not replace {clash[0]!r}")
    variables = dict(extra)
    tools = variables.pop("tools", None)
    documents = variables.pop("documents", None)
    variables = {"bos_token": bos_token, "eos_token": eos_token, **variables}
    variables["add_generation_prompt"] = add_generation_prompt
    conversation = [_without_none(m) for m in messages]
    render = _transformers_renderer() if use_transformers else None
    if use_transformers and render is None:
        raise ChatTemplateError("transformers' chat template renderer is not installed")
    if render is None:
        template = compile_template(source)
        run: Callable[[], str] = functools.partial(
            _render_here, template, conversation, tools, documents, variables
        )
    else:
        _compile_with_transformers(source)
        run = functools.partial(render, conversation, tools, documents, source, variables)
    try:
        return run()
    except ChatTemplateError:
        raise
    except Exception as e:
        raise ChatTemplateError(f"chat template failed to render: {e}") from e


def check_chat_template(source: str) -> None:
    """Compile `source` as a request would (raises `ChatTemplateError` naming the reason)."""
    compile_template(source)


def _without_none(message: Any) -> Any:
    # as `apply_chat_template`: a key whose value is None is left out (templates test for
    # a key, and would print "None")
    if not isinstance(message, Mapping):
        return message
    return {k: v for k, v in message.items() if v is not None}


# ------------------------------------------------------------- transformers' renderer (the tests')


@functools.cache
def _transformers_renderer() -> Callable[..., str] | None:
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except Exception:  # not installed, or too old to have it: this module's environment
        return None

    def render(
        conversation: list[Any],
        tools: Any,
        documents: Any,
        source: str,
        variables: dict[str, Any],
    ) -> str:
        # annotated `-> str`, it returns the renderings and the generation spans
        result: Any = render_jinja_template(
            conversations=[conversation],
            tools=tools,
            documents=documents,
            chat_template=source,
            **variables,
        )
        return str(result[0][0])

    return render


def _compile_with_transformers(source: str) -> None:
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(source)
    except Exception as e:
        raise ChatTemplateError(f"invalid chat template: {e}") from e


# ------------------------------------------------------------------ the environment


def _render_here(
    template: Any,
    conversation: list[Any],
    tools: Any,
    documents: Any,
    variables: dict[str, Any],
) -> str:
    for message in conversation:
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"chat messages must be objects, not {message!r}")
    if tools is not None and not all(isinstance(t, Mapping) for t in tools):
        raise ChatTemplateError("tools must be JSON schemas (objects)")
    if documents is not None and not all(isinstance(d, Mapping) for d in documents):
        raise ChatTemplateError("documents must be objects with 'title' and 'text' keys")
    chat = _with_reasoning_aliases(plain(conversation))
    rendered: str = template.render(
        messages=chat,
        tools=plain(tools),
        documents=plain(documents),
        **plain(variables),
    )
    return rendered


def plain(value: Any) -> Any:
    """`value` rebuilt from JSON types (str, int, float, bool, None, dict, list, tuple): the
    sandbox knows nothing of other objects' methods, so anything else becomes `<TypeName>`."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _with_reasoning_aliases(chat: list[Any]) -> list[Any]:
    out = []
    for message in chat:
        reasoning = next(
            (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


@functools.lru_cache(maxsize=64)
def compile_template(source: str) -> Any:
    """`source` compiled in the transformers-equivalent environment, once per source."""
    try:
        env = _environment()
    except ImportError as e:
        raise ChatTemplateError(
            "chat templates need jinja2: pip install 'stallfree[server]' (or jinja2)"
        ) from e
    try:
        return env.from_string(source)
    except Exception as e:
        raise ChatTemplateError(f"invalid chat template: {e}") from e


@functools.cache
def _environment() -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: the assistant's own text, marked for
        training masks; rendering it is rendering its body."""

        tags = {"generation"}  # noqa: RUF012 (jinja2 declares it so)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    class TemplateDict:
        """`dict(...)` and `dict.fromkeys(...)`, and nothing else of the type."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """`namespace(...)` that refuses names beginning with an underscore."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                TemplateNamespace.check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace.check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check_name(name: object) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a namespace cannot hold an attribute beginning with '_': {name!r}"
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    # Llama 3.x templates date their system prompt
    return datetime.datetime.now().strftime(fmt)
