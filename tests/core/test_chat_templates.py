"""Chat templates render as transformers renders them.

Every template of `tests/data/chat_templates/` (real templates of popular model families; the
README there names each one's model and licence), rendered for several conversations with and
without tools by stallfree's own environment (what serves them; `use_transformers=True` is
transformers' renderer, the reference), equals transformers' `apply_chat_template`; where transformers
refuses a conversation, ours refuses it too.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from stallfree.runtime.text.chat_template import (
    ChatTemplateError,
    check_chat_template,
    render_chat_template,
)
from stallfree.runtime.text.tokenizer import ByteTokenizer

CORPUS = Path(__file__).resolve().parent.parent / "data" / "chat_templates"
TEMPLATES = sorted(CORPUS.glob("*.jinja"))

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city's name"},
                "unit": {"type": "string", "enum": ["c", "f"], "description": "Unit"},
                "days": {"type": "array", "items": {"type": "integer"}, "description": "Days"},
            },
            "required": ["city"],
        },
    },
}
CALL = {
    "id": "call12345",  # Mistral's templates want nine characters
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "one_turn": [{"role": "user", "content": "Hello! What's 2+2?"}],
    "system_and_turns": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colours."},
        {"role": "assistant", "content": "Red, green, blue."},
        {"role": "user", "content": "  And three more?  "},
    ],
    "unicode_and_markup": [
        {"role": "user", "content": 'héllo — 日本語 "quotes" <b>tags</b> & {braces} \\n'}
    ],
    "tool_round_trip": [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call12345", "content": '{"temp": 21}'},
    ],
    "reasoning": [
        {"role": "user", "content": "What's 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "2 and 2 make 4."},
        {"role": "user", "content": "And 3+3?"},
    ],
    # the reasoning under another name templates do not read: transformers copies it over
    "reasoning_by_another_name": [
        {"role": "user", "content": "What's 2+2?"},
        {"role": "assistant", "content": "4", "reasoning": "2 and 2 make 4."},
    ],
}


def _hf_tokenizer() -> Any:
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2}
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>"
    )


def _transformers(
    source: str, messages: list[dict[str, Any]], extra: dict[str, Any], turn: bool = True
) -> str:
    tok = _hf_tokenizer()
    rendered: str = tok.apply_chat_template(
        copy.deepcopy(messages),
        chat_template=source,
        tokenize=False,
        add_generation_prompt=turn,
        **copy.deepcopy(extra),
    )
    return rendered


def _ours(
    source: str,
    messages: list[dict[str, Any]],
    extra: dict[str, Any],
    turn: bool = True,
    use_transformers: bool = False,
) -> str:
    return render_chat_template(
        source,
        copy.deepcopy(messages),
        bos_token="<s>",
        eos_token="</s>",
        extra=copy.deepcopy(extra),
        add_generation_prompt=turn,
        use_transformers=use_transformers,
    )


def test_the_corpus_has_twenty_real_templates_each_with_a_readme_row() -> None:
    assert len(TEMPLATES) >= 20
    readme = (CORPUS / "README.md").read_text(encoding="utf-8")
    for path in TEMPLATES:
        assert f"`{path.name}`" in readme, f"README.md has no row for {path.name}"


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.stem)
def test_each_template_renders_as_transformers_renders_it(path: Path) -> None:
    source = path.read_text(encoding="utf-8")
    rendered = 0
    for tools in (None, [WEATHER]):
        extra: dict[str, Any] = {} if tools is None else {"tools": tools}
        for name, messages in CONVERSATIONS.items():
            try:
                want = _transformers(source, messages, extra)
            except Exception as refused:
                with pytest.raises(ChatTemplateError):
                    _ours(source, messages, extra)
                if type(refused).__name__ == "TemplateError":  # the template's raise_exception
                    with pytest.raises(ChatTemplateError, match="failed to render"):
                        _ours(source, messages, extra)
                continue
            assert _ours(source, messages, extra) == want, (path.name, name, tools is not None)
            rendered += 1
    # every template renders at least the plain conversations (one needs tools to render)
    assert rendered >= 2, path.name


@pytest.mark.parametrize("name", ["qwen3.jinja", "qwen2.5.jinja", "llama3.1.jinja"])
def test_tools_and_template_arguments_reach_the_template(name: str) -> None:
    source = (CORPUS / name).read_text(encoding="utf-8")
    messages = CONVERSATIONS["one_turn"]
    plain = _ours(source, messages, {})
    with_tools = _ours(source, messages, {"tools": [WEATHER]})
    assert "get_weather" in with_tools and "get_weather" not in plain
    assert with_tools == _transformers(source, messages, {"tools": [WEATHER]})


def test_qwen3_thinking_switch_matches_transformers() -> None:
    source = (CORPUS / "qwen3.jinja").read_text(encoding="utf-8")
    extra = {"enable_thinking": False}
    rendered = _ours(source, CONVERSATIONS["reasoning"], extra)
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert rendered == _transformers(source, CONVERSATIONS["reasoning"], extra)


GENERATION = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|end|>"
    "{% endgeneration %}{% else %}{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.mark.parametrize("use_transformers", [False, True])
def test_the_generation_tag_renders_its_body(use_transformers: bool) -> None:
    messages = CONVERSATIONS["system_and_turns"]
    rendered = render_chat_template(
        GENERATION,
        messages,
        bos_token="",
        eos_token="",
        extra={},
        use_transformers=use_transformers,
    )
    assert rendered == (
        "<|system|>You are terse.<|end|><|user|>Name three colours.<|end|>"
        "<|assistant|>Red, green, blue.<|end|><|user|>  And three more?  <|end|><|assistant|>"
    )


TOJSON = (
    "{{ messages[0]['content'] | tojson(separators=(',', ':')) }}|"
    "{{ messages[0]['content'] | tojson(indent=2, sort_keys=true) }}|"
    "{{ messages[0]['content'] | tojson(ensure_ascii=true) }}|"
    "{{ messages[0]['content'] | tojson }}"
)


@pytest.mark.parametrize("use_transformers", [False, True])
def test_tojson_takes_json_dumps_keyword_arguments(use_transformers: bool) -> None:
    content = {"b": [1, 2], "a": "é<&>"}
    rendered = render_chat_template(
        TOJSON,
        [{"role": "user", "content": content}],
        bos_token="",
        eos_token="",
        extra={},
        use_transformers=use_transformers,
    )
    compact, indented, ascii_only, default = rendered.split("|")
    assert compact == '{"b":[1,2],"a":"é<&>"}'
    assert indented == '{\n  "a": "é<&>",\n  "b": [\n    1,\n    2\n  ]\n}'
    assert ascii_only == '{"b": [1, 2], "a": "\\u00e9<&>"}'
    assert default == '{"b": [1, 2], "a": "é<&>"}'  # no HTML escaping, unlike Jinja's own


def test_strftime_now_and_namespace_are_transformers_own() -> None:
    source = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% endfor %}{{ ns.n }} {{ strftime_now('%Y') | length }}"
    )
    messages = CONVERSATIONS["system_and_turns"]
    assert _ours(source, messages, {}) == "4 4" == _transformers(source, messages, {})
    hostile = "{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns._x }}"
    with pytest.raises(ChatTemplateError, match="_x"):
        _ours(hostile, messages, {})


@pytest.mark.parametrize("use_transformers", [False, True])
def test_a_template_that_does_not_compile_is_a_clear_error(use_transformers: bool) -> None:
    broken = "{% for m in messages %}{{ m['content'] }"
    with pytest.raises(ChatTemplateError, match="invalid chat template"):
        render_chat_template(
            broken,
            CONVERSATIONS["one_turn"],
            bos_token="",
            eos_token="",
            extra={},
            use_transformers=use_transformers,
        )
    with pytest.raises(ChatTemplateError, match="invalid chat template"):
        check_chat_template(broken)


@pytest.mark.parametrize("use_transformers", [False, True])
def test_a_template_that_raises_names_its_reason(use_transformers: bool) -> None:
    raising = "{{ raise_exception('only user turns, please') }}"
    with pytest.raises(ChatTemplateError, match="failed to render: only user turns, please"):
        render_chat_template(
            raising,
            CONVERSATIONS["one_turn"],
            bos_token="",
            eos_token="",
            extra={},
            use_transformers=use_transformers,
        )


@pytest.mark.parametrize("name", ["messages", "add_generation_prompt"])
def test_extra_arguments_may_not_replace_the_renderers_own(name: str) -> None:
    with pytest.raises(ChatTemplateError, match=f"may not replace '{name}'"):
        _ours(ByteTokenizer().chat_template or "", CONVERSATIONS["one_turn"], {name: []})


def test_none_valued_keys_are_left_out_as_apply_chat_template_does() -> None:
    source = "{% for m in messages %}{{ m | length }}{{ 'content' in m }}{% endfor %}"
    messages = [{"role": "assistant", "content": None, "tool_calls": [CALL]}]
    assert _ours(source, messages, {}) == "2False" == _transformers(source, messages, {})


def test_without_a_generation_prompt_each_template_renders_as_transformers_renders_it() -> None:
    """`add_generation_prompt: false`: no assistant header at the end, by both renderers."""
    without_header = 0
    for path in TEMPLATES:
        source = path.read_text(encoding="utf-8")
        for messages in (CONVERSATIONS["one_turn"], CONVERSATIONS["system_and_turns"]):
            try:
                want = _transformers(source, messages, {}, turn=False)
            except Exception:
                continue
            for use_transformers in (False, True):
                got = _ours(source, messages, {}, turn=False, use_transformers=use_transformers)
                assert got == want, path.name
            if want != _transformers(source, messages, {}, turn=True):
                without_header += 1
    assert without_header >= 20  # the flag reached the templates (most open a turn when asked)


def test_an_engine_serves_a_chat_without_importing_transformers(llama: str) -> None:
    """The serving path renders with this module's environment: importing transformers, which
    the engine's start-up check of the template did where it was installed, took 0.87 s of a
    server's start-up. A fresh process, since this one has transformers loaded already."""
    import subprocess
    import sys

    script = f"""
import asyncio, sys
from stallfree import Engine, load_config
async def main():
    async with Engine(load_config(model={{"path": {llama!r}}})) as engine:
        text = engine.tokenizer.apply_chat_template([{{"role": "user", "content": "hi"}}])
        assert "hi" in text, text
    print("transformers" in sys.modules)
asyncio.run(main())
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
